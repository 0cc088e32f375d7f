"""A guard against Soft-iWARP's invalid queue key: a first CQ large enough to cover the key libsiw refuses.

siw (kernel 6.1) hands user space each queue (a QP's send and receive queues, a CQ, an SRQ) as an mmap
key that is the queue's page offset in the process's device context times the page size, allocated first
fit from offset 0 (``rdma_user_mmap_entry_insert``). libsiw (rdma-core 44 and later) takes the key
``0x90000`` (``SIW_INVAL_UOBJ_KEY`` of ``rdma/siw-abi.h``, a sentinel from when keys were small
integers) for "no key": the queue that starts at page 0x90 is destroyed and its creation fails with
errno 0. Every object created next on that context starts at the same page and fails the same way, so a
process with more than 0x90 pages of queues (a few dozen connections: the shared CQ test met it at its
27th QP) cannot create more once the first fit lands there.

While one object covers page 0x90 without starting on it, nothing else can start there. The Domain's
first CQ (made before its first QP, kept as long as the Domain) is given :data:`GUARD_CQE` entries on a
siw device (32 bytes each: 1 MiB, 256 pages): made while the context's low pages are free, it starts
below page 0x90 and covers it. Other devices get the usual size.
"""

from __future__ import annotations

from rdmaio._ffi import ffi, lib
from rdmaio.verbs.device import DeviceContext

__all__ = ["GUARD_CQE", "SIW_VENDOR_ID", "is_siw"]

SIW_VENDOR_ID = 0x626D74
"""The vendor id siw reports (``SIW_VENDOR_ID``, ASCII ``bmt``), whatever the device is named."""

GUARD_CQE = 32768
"""Entries of the guard CQ: 32768 x 32 B = 256 pages, more than the 0x90 pages below the refused key."""


def is_siw(context: DeviceContext) -> bool:
    """Whether ``context`` is a Soft-iWARP device (by its vendor id, whatever the device is named)."""
    attr = ffi.new("struct ibv_device_attr *")
    return lib.ibv_query_device(context._ptr, attr) == 0 and int(attr.vendor_id) == SIW_VENDOR_ID
