"""What a device offers, as this side announces it in the handshake (:class:`rdmaio.protocol.Capabilities`):
immediate data (not on iWARP), atomics, memory windows, READ scatter entries and the queue pair's inline
size, queried once per device (:func:`device_capabilities`, cached in :data:`DEVICE_CAPS`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rdmaio.errors import VerbsError
from rdmaio.options import Options
from rdmaio.protocol import Capabilities
from rdmaio.verbs.native import ffi, lib

__all__ = ["DEVICE_CAPS", "SIW_VENDOR_ID", "connect_blocks", "device_capabilities"]

DEVICE_CAPS: dict[tuple[int, int, str], Capabilities] = {}
"""What :func:`device_capabilities` found, by (device handle, inline size, ``Options.framing``): a device's
never change, and connection setup's Python calls are budgeted, so setup reads this with ``.get()`` (no
Python call) and calls :func:`device_capabilities` only when it misses."""


def device_capabilities(device: Any, max_inline: int, options: Options) -> Capabilities:
    """What ``device`` (a :class:`~rdmaio.verbs.DeviceContext`, or a test's fake with a ``capabilities``
    attribute) offers, as this side announces it: immediate data unless its transport is iWARP, atomics,
    memory windows, READ scatter entries, the queue pair's ``max_inline``; and whether ``options`` force
    the header framing. Queried once per device."""
    forced = options.framing == "header"
    key = (device.handle, max_inline, options.framing)
    caps = DEVICE_CAPS.get(key)
    if caps is None:
        fake = getattr(device, "capabilities", None)
        if fake is not None:
            caps = dataclasses.replace(fake, max_inline=max_inline, header_framing=forced)
        else:
            raw = ffi.new("struct rdmaio_framing_caps *")
            rc = lib.rdmaio_query_framing_caps(device._ptr, raw)
            if rc < 0:
                raise VerbsError.from_errno("ibv_query_device", -rc)
            caps = Capabilities(
                immediate=raw.transport_type != lib.IBV_TRANSPORT_IWARP,
                atomics=raw.atomic_cap != lib.IBV_ATOMIC_NONE,
                memory_windows=raw.max_mw > 0,
                max_inline=max_inline,
                max_read_sge=raw.max_sge_rd,
                header_framing=forced,
            )
        DEVICE_CAPS[key] = caps
    return caps


SIW_VENDOR_ID = 0x626D74
"""Soft-iWARP's ``vendor_id`` (ASCII "bmt": ``SIW_VENDOR_ID`` in the kernel's
drivers/infiniband/sw/siw/siw.h)."""

_CONNECT_BLOCKS: dict[int, bool] = {}


def connect_blocks(device: Any) -> bool:
    """Whether ``rdma_connect`` on ``device`` blocks the calling thread until the peer's TCP answers.

    Soft-iWARP's does: siw_cm.c connects its kernel TCP socket with a blocking ``connect()`` inside the
    ``rdma_connect`` system call, so to an address nobody answers the call holds the event loop until the
    kernel's SYN retries give up (about 130 s with ``tcp_syn_retries`` 6). RoCE and InfiniBand resolve the
    peer before (address and route events) and hardware iWARP connects asynchronously. Queried once per
    device (a test's fake says so with a ``connect_blocks`` attribute)."""
    blocks = _CONNECT_BLOCKS.get(device.handle)
    if blocks is None:
        fake = getattr(device, "connect_blocks", None)
        if fake is not None:
            blocks = bool(fake)
        else:
            attr = ffi.new("struct ibv_device_attr *")
            rc = lib.ibv_query_device(device._ptr, attr)
            if rc:
                raise VerbsError.from_errno("ibv_query_device", abs(rc))
            raw = ffi.new("struct rdmaio_framing_caps *")
            rc = lib.rdmaio_query_framing_caps(device._ptr, raw)
            if rc < 0:
                raise VerbsError.from_errno("ibv_query_device", -rc)
            blocks = raw.transport_type == lib.IBV_TRANSPORT_IWARP and attr.vendor_id == SIW_VENDOR_ID
        _CONNECT_BLOCKS[device.handle] = blocks
    return blocks
