"""Memory: :class:`ProtectionDomain` (the hub of its MRs and QPs), :class:`MemoryRegion` and
:class:`MemoryWindow` (a type 2 window: remote access to a region through one queue pair only)."""

from __future__ import annotations

import errno
import os
import resource
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import FeatureNotSupportedError, MemoryRegistrationError, VerbsError
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
    """A registered buffer. The Python buffer is kept alive (and pinned) until ``close()``.

    ``mw_bind``: memory windows may be bound over it (``IBV_ACCESS_MW_BIND``); with no remote flags of its
    own, such a region is remotely accessible only through its windows. ``close()`` closes its windows
    first (a region cannot be deregistered while a window is bound to it) and raises
    :class:`~rdmaio.errors.VerbsError` when ``ibv_dereg_mr`` fails: the memory is then still registered
    and the buffer stays referenced.
    """

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
        mw_bind: bool = False,
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
        if mw_bind:
            access |= lib.IBV_ACCESS_MW_BIND
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
        rc = lib.ibv_dereg_mr(self._ptr)
        if rc:
            # Still registered: the NIC may still use the memory, so the buffer stays referenced (pinned)
            # and the caller learns that a revocation did not happen.
            err = rc if rc > 0 else (-rc if rc < -1 else (ffi.errno or 5))
            raise VerbsError.from_errno("ibv_dereg_mr", err, f"{self.length} bytes stay registered")
        self._cbuf = None
        # self.buffer is released by the owner; keeping it here costs nothing until the MR is dropped.


class MemoryWindow(_Resource):
    """A type 2 memory window over all of ``region`` (registered with ``mw_bind=True``), for ``qp``.

    :meth:`bind` posts the bind on that queue pair: from the moment the NIC executes it (in that send
    queue's order) the window's rkey gives ``access`` to the region through that queue pair only; every
    other queue pair of the protection domain is refused. ``close()`` deallocates the window: the NIC
    refuses its rkey from then on. A device without windows (``max_mw`` 0, e.g. siw) raises
    :class:`~rdmaio.errors.FeatureNotSupportedError`.
    """

    _call_destroy = "ibv_dealloc_mw"
    _close_rank = 1  # before the regions they lie on

    def __init__(self, pd: ProtectionDomain, region: MemoryRegion, qp: Any = None) -> None:
        # The region closes its windows before it deregisters (it cannot while a window is bound to it),
        # and so does the queue pair ``qp`` the window is bound on before it is destroyed: a bound type 2
        # window holds its QP, and rxe's QP destroy then waits for that hold (seconds per window).
        super().__init__(pd, region, qp)
        self.region = region
        self.qp = qp
        out = ffi.new("struct ibv_mw **")
        rc = lib.rdmaio_alloc_mw(pd._ptr, out)
        if rc < 0:
            self._forget()  # nothing to destroy: the parents must not close it later
            if -rc in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EPROTONOSUPPORT):
                raise FeatureNotSupportedError(
                    "this device has no memory windows (ibv_alloc_mw: "
                    f"{os.strerror(-rc)}): a grant cannot be scoped to one connection",
                    errno=-rc,
                    call="ibv_alloc_mw",
                )
            raise VerbsError.from_errno("ibv_alloc_mw", -rc, "type 2")
        self._ptr = out[0]
        self.rkey: int = 0  # set by bind()
        self._rkey_out = ffi.new("uint32_t *")

    def _forget(self) -> None:
        self.closed = True
        for parent in self._parents:
            parent._dependents.pop(id(self), None)
        self._parents = []

    def bind(self, wr_id: int, access: int) -> int:
        """Post the signalled bind work request (``wr_id``) on the window's queue pair (a
        :class:`~rdmaio.verbs.QueuePair`) over the whole region with ``access`` (``IBV_ACCESS_REMOTE_*``);
        return the rkey to give the peer. Raises :class:`~rdmaio.errors.VerbsError` with the provider's
        errno when the post fails."""
        self._check_usable()
        qp = self.qp
        if qp is None:
            raise ValueError("a window is bound on the queue pair given when it was made")
        qp._check_usable()
        region = self.region
        rc = lib.rdmaio_post_bind_mw(
            qp._ptr, self._ptr, region._ptr, region.addr, region.length, access, wr_id, self._rkey_out
        )
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, "IBV_WR_BIND_MW")
        self.rkey = int(self._rkey_out[0])
        return self.rkey

    def _destroy(self) -> None:
        rc = lib.rdmaio_dealloc_mw(self._ptr)
        if rc < 0:
            raise VerbsError.from_errno("ibv_dealloc_mw", -rc, "the window may still be valid")
