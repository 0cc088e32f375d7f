"""A guard against Soft-iWARP's invalid queue key: one large CQ that covers the mmap key libsiw refuses.

siw (kernel 6.1) hands user space each queue (a QP's send and receive queues, a CQ, an SRQ) as an mmap
key that is the queue's page offset in the process's device context times the page size, allocated first
fit from offset 0 (``rdma_user_mmap_entry_insert``). libsiw (rdma-core 44 and later) takes the key
``0x90000`` (``SIW_INVAL_UOBJ_KEY`` of ``rdma/siw-abi.h``, a sentinel from when keys were small
integers) for "no key": the queue that starts at page 0x90 is destroyed and its creation fails with
errno 0. Every object created next on that context starts at the same page and fails the same way, so a
process with more than about 0x90 pages of queues (some 45 connections with rdmaio's default depths)
cannot create more once the first fit lands there.

While one object covers page 0x90 without starting on it, nothing else can start there. A CQ of
:data:`GUARD_CQE` entries (32 bytes each on siw: 1 MiB, 256 pages) created while the context's low pages
are free starts below page 0x90 and covers it. :func:`acquire` creates it for the first user of a siw
device context and :func:`release` destroys it after the last (a Domain holds it while it lives, so
nothing of it outlasts the loops that use the device). Other devices get nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.verbs._base import fork_generation
from rdmaio.verbs.device import DeviceContext

__all__ = ["GUARD_CQE", "SIW_VENDOR_ID", "acquire", "guarded", "is_siw", "release"]

log = logging.getLogger("rdmaio")

SIW_VENDOR_ID = 0x626D74
"""The vendor id siw reports (``SIW_VENDOR_ID``, ASCII ``bmt``), whatever the device is named."""

GUARD_CQE = 32768
"""Entries of the guard CQ: 32768 x 32 B = 256 pages, more than the 0x90 pages below the refused key."""


@dataclass
class _Guard:
    cq: Any  # struct ibv_cq *, or NULL when the guard itself could not be made
    users: int
    generation: int


_guards: dict[int, _Guard] = {}


def is_siw(context: DeviceContext) -> bool:
    """Whether ``context`` is a Soft-iWARP device (by its vendor id)."""
    attr = ffi.new("struct ibv_device_attr *")
    return lib.ibv_query_device(context._ptr, attr) == 0 and int(attr.vendor_id) == SIW_VENDOR_ID


def acquire(context: DeviceContext) -> None:
    """Hold the guard of ``context``'s device (created by the first holder; nothing on other devices)."""
    guard = _guards.get(context.handle)
    if guard is not None and guard.generation != fork_generation():
        del _guards[context.handle]  # the parent's: unusable in a forked child, and not ours to destroy
        guard = None
    if guard is None:
        if not is_siw(context):
            return
        cq = lib.ibv_create_cq(context._ptr, GUARD_CQE, ffi.NULL, ffi.NULL, 0)
        if cq == ffi.NULL:
            # Its first fit was page 0x90 itself, or the device refused the size: connections work as
            # before, and the key error, if it comes, is a ProviderError naming it.
            log.debug("rdmaio: siw key guard not created on %s (errno %d)", context.name, ffi.errno)
        guard = _guards[context.handle] = _Guard(cq, 0, fork_generation())
    guard.users += 1


def release(context: DeviceContext) -> None:
    """Give the guard of ``context``'s device back; the last holder destroys it."""
    guard = _guards.get(context.handle)
    if guard is None:
        return
    guard.users -= 1
    if guard.users > 0:
        return
    del _guards[context.handle]
    if guard.cq != ffi.NULL and guard.generation == fork_generation():
        lib.ibv_destroy_cq(guard.cq)


def guarded(context: DeviceContext) -> bool:
    """Whether a guard CQ exists for ``context`` now (for tests and diagnostics)."""
    guard = _guards.get(context.handle)
    return guard is not None and guard.cq != ffi.NULL
