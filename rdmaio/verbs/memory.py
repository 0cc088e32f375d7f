"""Memory: :class:`ProtectionDomain` (the hub of its MRs and QPs) and :class:`MemoryRegion`."""

from __future__ import annotations

import os
import resource
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import MemoryRegistrationError
from rdmaio.verbs._base import _check_ptr, _Resource
from rdmaio.verbs.device import DeviceContext

# --- PD, MR ----------------------------------------------------------------------------------------


class ProtectionDomain(_Resource):
    """A protection domain on a device context."""

    _call_destroy = "ibv_dealloc_pd"

    def __init__(self, context: DeviceContext) -> None:
        super().__init__()
        self.context = context
        self._ptr = _check_ptr(lib.ibv_alloc_pd(context._ptr), "ibv_alloc_pd")

    def _destroy(self) -> None:
        lib.ibv_dealloc_pd(self._ptr)


class MemoryRegion(_Resource):
    """A registered buffer. The Python buffer is kept alive (and pinned) until ``close()``."""

    _call_destroy = "ibv_dereg_mr"
    _close_rank = 2

    def __init__(
        self,
        pd: ProtectionDomain,
        buffer: Any,
        *,
        remote_write: bool = False,
        remote_read: bool = False,
        remote_atomic: bool = False,
        readonly: bool = False,
    ) -> None:
        super().__init__(pd)
        self.buffer = buffer
        # readonly (zero-copy sends of bytes): the NIC only reads it, so no LOCAL_WRITE, and a read-only
        # buffer is accepted; REMOTE_WRITE/ATOMIC need LOCAL_WRITE and are refused by the device then.
        self._cbuf = ffi.from_buffer(buffer, require_writable=not readonly)
        access = 0 if readonly else lib.IBV_ACCESS_LOCAL_WRITE
        if remote_write:
            access |= lib.IBV_ACCESS_REMOTE_WRITE
        if remote_read:
            access |= lib.IBV_ACCESS_REMOTE_READ
        if remote_atomic:
            access |= lib.IBV_ACCESS_REMOTE_ATOMIC
        self.access: int = access
        self.length = len(self._cbuf)
        ptr = lib.ibv_reg_mr(pd._ptr, self._cbuf, self.length, access)
        if ptr == ffi.NULL:
            err = ffi.errno or 12
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
            raise MemoryRegistrationError(
                f"{os.strerror(err)} registering {self.length} bytes; RLIMIT_MEMLOCK (ulimit -l) is {limit}",
                errno=err,
                call="ibv_reg_mr",
            )
        self._ptr = ptr
        self.addr: int = int(ffi.cast("uintptr_t", self._cbuf))
        self.lkey: int = int(ptr.lkey)
        self.rkey: int = int(ptr.rkey)

    def _destroy(self) -> None:
        lib.ibv_dereg_mr(self._ptr)
        self._cbuf = None
        # self.buffer is released by the owner; keeping it here costs nothing until the MR is dropped.
