"""Shared receive queues: :class:`SharedReceiveQueue` (``ibv_create_srq``, ``ibv_post_srq_recv``,
``ibv_modify_srq``, ``ibv_query_srq``, ``ibv_destroy_srq``).

Queue pairs created with ``srq=`` (``CMId.create_qp``) take their receives from the SRQ instead of a receive
queue of their own; a receive completion then arrives on the QP's receive CQ with the QP's number
(``wc.qp_num``) and the ``wr_id`` the SRQ receive was posted with. Closing an SRQ closes the queue pairs using
it first (a QP may not outlive its SRQ); the protection domain closes it after its QPs and before its memory
regions. How many receives may be lent to peers as credits is :mod:`rdmaio.protocol.credit_ledger`'s business.
"""

from __future__ import annotations

import errno
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import VerbsError
from rdmaio.verbs._base import _check, _check_ptr, _Resource
from rdmaio.verbs.memory import ProtectionDomain

__all__ = ["QUERY_UNSUPPORTED_ERRNOS", "SharedReceiveQueue"]

QUERY_UNSUPPORTED_ERRNOS: frozenset[int] = frozenset({errno.EOPNOTSUPP, errno.ENOSYS})
"""What ``ibv_query_srq`` returns on a device that does not implement it (Soft-iWARP: ``EOPNOTSUPP``):
:meth:`SharedReceiveQueue.query` then answers from what the queue was created and armed with."""


class SharedReceiveQueue(_Resource):
    """A shared receive queue of ``max_wr`` receives (one scatter entry each) on ``pd``.

    ``limit`` (0: none) arms the low-watermark event at creation, like :meth:`arm_limit`. The device may round
    ``max_wr`` up; :attr:`max_wr` is what it granted.
    """

    _call_destroy = "ibv_destroy_srq"
    _close_rank = 1  # after the QPs that use it (rank 0), before the memory regions its receives point into

    def __init__(self, pd: ProtectionDomain, max_wr: int, *, limit: int = 0) -> None:
        if max_wr < 1:
            raise ValueError(f"an SRQ holds at least one receive, not {max_wr}")
        super().__init__(pd)
        self.pd = pd
        init = ffi.new("struct ibv_srq_init_attr *")
        init.attr.max_wr = max_wr
        init.attr.max_sge = 1
        init.attr.srq_limit = limit
        self._ptr = _check_ptr(lib.ibv_create_srq(pd._ptr, init), "ibv_create_srq", f"max_wr={max_wr}")
        self.handle: int = int(ffi.cast("uintptr_t", self._ptr))
        """The SRQ's address: ``AsyncEvent.obj`` of its events (``IBV_EVENT_SRQ_LIMIT_REACHED``)."""
        self.max_wr: int = int(init.attr.max_wr)
        self._slots = ffi.new("uint32_t[]", max(self.max_wr, 1))
        self.max_sge: int = int(init.attr.max_sge)
        """Scatter entries per receive, as granted at creation."""
        self.armed_limit: int = limit
        """The low watermark last armed through this object (at creation or :meth:`arm_limit`); the device
        disarms it when ``IBV_EVENT_SRQ_LIMIT_REACHED`` fires, which only :meth:`query` on a device that
        implements ``ibv_query_srq`` sees."""
        self.query_supported: bool | None = None
        """Whether the device answers ``ibv_query_srq`` (None: not asked yet)."""

    def post_ring_slots(
        self, lkeys: Any, addr: int, slot_size: int, slots: list[int], wr_id_base: int = 0
    ) -> None:
        """Post one receive per slot (chained, one call): slot ``s`` covers ``addr + s * slot_size`` with
        local key ``lkeys[s]`` (a ``uint32_t[]``, as a :class:`~rdmaio.core.rings.SlotRing` keeps them);
        its ``wr_id`` is ``wr_id_base | s``."""
        self._check_usable()
        n = len(slots)
        if n > len(self._slots):
            raise ValueError(f"cannot post {n} receives on an SRQ of {len(self._slots)}")
        self._slots[0:n] = slots
        rc = lib.rdmaio_post_srq_recv_ring(self._ptr, lkeys, addr, slot_size, wr_id_base, self._slots, n)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_srq_recv", -rc, f"{n} receives")

    def arm_limit(self, limit: int) -> None:
        """Arm the low watermark (``ibv_modify_srq`` with ``IBV_SRQ_LIMIT``): the device raises
        ``IBV_EVENT_SRQ_LIMIT_REACHED`` on its async fd once the SRQ holds fewer than ``limit`` receives,
        then disarms it (the limit reads 0 again); arm it again after refilling."""
        self._check_usable()
        if not 0 < limit <= self.max_wr:
            raise ValueError(f"SRQ limit {limit} out of range 1..{self.max_wr}")
        attr = ffi.new("struct ibv_srq_attr *")
        attr.srq_limit = limit
        _check(lib.ibv_modify_srq(self._ptr, attr, lib.IBV_SRQ_LIMIT), "ibv_modify_srq", f"limit {limit}")
        self.armed_limit = limit

    def query(self) -> tuple[int, int, int]:
        """``(max_wr, max_sge, srq_limit)`` as the device holds them (``srq_limit`` 0: not armed).

        A device that does not implement ``ibv_query_srq`` (:data:`QUERY_UNSUPPORTED_ERRNOS`; Soft-iWARP)
        gets the values the queue was created with and the limit last armed through this object
        (:attr:`armed_limit`), and :attr:`query_supported` turns False; any other failure raises
        :class:`~rdmaio.errors.VerbsError`."""
        self._check_usable()
        if self.query_supported is False:  # asked before: the device answers nothing, no call
            return self.max_wr, self.max_sge, self.armed_limit
        attr = ffi.new("struct ibv_srq_attr *")
        try:
            _check(lib.ibv_query_srq(self._ptr, attr), "ibv_query_srq")
        except VerbsError as exc:
            if exc.errno not in QUERY_UNSUPPORTED_ERRNOS:
                raise
            self.query_supported = False
            return self.max_wr, self.max_sge, self.armed_limit
        self.query_supported = True
        return int(attr.max_wr), int(attr.max_sge), int(attr.srq_limit)

    def _destroy(self) -> None:
        lib.ibv_destroy_srq(self._ptr)
