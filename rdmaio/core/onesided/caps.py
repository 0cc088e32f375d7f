"""What a device offers one-sided RDMA: atomics, READ/atomic depth, memory windows (``ibv_query_device``).

Queried once per device and process (:func:`cached_caps`): the engine asks whether it can bind windows and
grant atomics, connection setup asks for the RDMA READ / atomic depth to negotiate (:func:`rd_atomic_depth`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rdmaio import verbs
from rdmaio.errors import VerbsError
from rdmaio.verbs.native import ffi, lib

__all__ = ["OneSidedCaps", "cached_caps", "query_caps", "rd_atomic_depth"]


@dataclass(frozen=True, slots=True)
class OneSidedCaps:
    """What a device offers one-sided operations (``ibv_query_device``)."""

    atomic_cap: str
    """``"NONE"``, ``"HCA"`` (atomic among this device's requests) or ``"GLOB"``."""
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    max_mw: int
    mw_type1: bool
    mw_type2: bool


def query_caps(device: verbs.DeviceContext) -> OneSidedCaps:
    """Query the one-sided capabilities of a device."""
    caps = ffi.new("struct rdmaio_onesided_caps *")
    rc = lib.rdmaio_query_onesided_caps(device._ptr, caps)
    if rc < 0:
        raise VerbsError.from_errno("ibv_query_device", -rc)
    names = {lib.IBV_ATOMIC_NONE: "NONE", lib.IBV_ATOMIC_HCA: "HCA", lib.IBV_ATOMIC_GLOB: "GLOB"}
    flags = int(caps.device_cap_flags)
    return OneSidedCaps(
        atomic_cap=names.get(int(caps.atomic_cap), str(caps.atomic_cap)),
        max_qp_rd_atom=int(caps.max_qp_rd_atom),
        max_qp_init_rd_atom=int(caps.max_qp_init_rd_atom),
        max_mw=int(caps.max_mw),
        mw_type1=bool(flags & lib.IBV_DEVICE_MEM_WINDOW),
        mw_type2=bool(flags & (lib.IBV_DEVICE_MEM_WINDOW_TYPE_2A | lib.IBV_DEVICE_MEM_WINDOW_TYPE_2B)),
    )


_CAPS: dict[tuple[int, str], OneSidedCaps] = {}
"""Per device (context handle, name): its capabilities, queried once per process (device attributes do not
change, and ``ibv_query_device`` is a system call in every connection's setup path, on both sides)."""


def cached_caps(device: verbs.DeviceContext) -> OneSidedCaps:
    """:func:`query_caps` of ``device``, queried once per process."""
    key = (device.handle, device.name)
    caps = _CAPS.get(key)
    if caps is None:
        caps = _CAPS[key] = query_caps(device)
    return caps


def rd_atomic_depth(device: verbs.DeviceContext, wanted: int) -> int:
    """The READ/atomic depth to negotiate (``responder_resources``/``initiator_depth``): ``wanted``, capped
    by the device's limits. rdma_cm grants the QP remote READ/atomic access only when it is above 0."""
    try:
        caps = cached_caps(device)
    except VerbsError:
        return 1
    limit = min(caps.max_qp_rd_atom, caps.max_qp_init_rd_atom, 255)
    return max(1, min(wanted, limit))
