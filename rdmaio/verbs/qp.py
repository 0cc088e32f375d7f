"""Queue pairs: :class:`QueuePair` (posting sends, receives, one-sided and control work requests)."""

from __future__ import annotations

import functools
import os
import weakref
from typing import TYPE_CHECKING, Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import VerbsError
from rdmaio.verbs import _base
from rdmaio.verbs._base import _check, _Resource
from rdmaio.verbs.cq import CompletionQueue
from rdmaio.verbs.memory import MemoryRegion, ProtectionDomain

if TYPE_CHECKING:
    from rdmaio.verbs.cm import CMId
    from rdmaio.verbs.srq import SharedReceiveQueue


# --- QP --------------------------------------------------------------------------------------------


class QueuePair(_Resource):
    """The RC queue pair of a :class:`CMId` (created by ``CMId.create_qp``)."""

    _call_destroy = "rdma_destroy_qp"
    _close_rank = 0

    def __init__(
        self,
        cm_id: CMId,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        cap: Any,
        srq: SharedReceiveQueue | None = None,
    ) -> None:
        super().__init__(cm_id, pd, send_cq, recv_cq, srq)  # the SRQ closes its QPs first
        self.srq = srq
        self._cm_id = cm_id
        self._ptr = cm_id._ptr.qp
        self.qp_num: int = int(self._ptr.qp_num)
        self.max_send_wr: int = int(cap.max_send_wr)
        self.max_recv_wr: int = int(cap.max_recv_wr)
        self.max_inline_data: int = int(cap.max_inline_data)
        self._slots = ffi.new("uint32_t[]", max(self.max_recv_wr, 1))
        self._sends = ffi.new("struct rdmaio_send[]", max(self.max_send_wr, 1))
        self._bad = ffi.new("int *")
        # Its own one-entry array: the send engine stages frames in _sends and posts them later in the
        # loop iteration, so a probe written there could overwrite a staged frame.
        self._probe = ffi.new("struct rdmaio_send[1]")

    def post_recv_slots(
        self, mr: MemoryRegion, slot_size: int, slots: list[int], wr_id_base: int = 0
    ) -> None:
        """Post one receive per slot index (chained, one call) at ``mr.addr + slot * slot_size``; its
        ``wr_id`` is ``wr_id_base | slot`` (``wr_id_base``: ``make_wr_id(WR_KIND_RECV, tag, 0)``)."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        n = len(slots)
        if n > len(self._slots):
            raise ValueError(f"cannot post {n} receives on a queue of {len(self._slots)}")
        self._slots[0:n] = slots
        rc = lib.rdmaio_post_recv_slots(self._ptr, mr.lkey, mr.addr, slot_size, wr_id_base, self._slots, n)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_recv", -rc, f"{n} receives")

    def post_ring_slots(
        self, lkeys: Any, addr: int, slot_size: int, slots: list[int], wr_id_base: int = 0
    ) -> None:
        """Post one receive per slot of a ring registered chunk by chunk: slot ``s`` covers
        ``addr + s * slot_size`` with local key ``lkeys[s]`` (a ``uint32_t[]``); ``wr_id`` is
        ``wr_id_base | s`` (``wr_id_base``: ``make_wr_id(WR_KIND_RECV, tag, 0)``)."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        n = len(slots)
        if n > len(self._slots):
            raise ValueError(f"cannot post {n} receives on a queue of {len(self._slots)}")
        self._slots[0:n] = slots
        rc = lib.rdmaio_post_recv_ring(self._ptr, lkeys, addr, slot_size, wr_id_base, self._slots, n)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_recv", -rc, f"{n} receives")

    @property
    def send_array(self) -> Any:
        """Scratch ``struct rdmaio_send[max_send_wr]`` to fill before :meth:`post_sends`."""
        return self._sends

    def post_sends(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`send_array` as one chain."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        rc = lib.rdmaio_post_sends(self._ptr, self._sends, count, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, f"request {self._bad[0]} of {count}")

    # one-sided operations: a scratch array of their own, so that posting one never clobbers
    # the frames the send engine staged in send_array but has not posted yet.
    @property
    def rdma_array(self) -> Any:
        """Scratch ``struct rdmaio_rdma_op[16]`` to fill before :meth:`post_rdma`."""
        array = getattr(self, "_rdma_ops", None)
        if array is None:
            array = self._rdma_ops = ffi.new("struct rdmaio_rdma_op[]", 16)
        return array

    def post_rdma(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`rdma_array` (one-sided requests) as one chain."""
        self._check_usable()
        rc = lib.rdmaio_post_rdma(self._ptr, self.rdma_array, count, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, f"one-sided request {self._bad[0]} of {count}")

    def post_batch(
        self,
        wr_id: int,
        opcode: int,
        local_addr: int,
        lkey: int,
        rkey: int,
        remote_addr: Any,
        *,
        length: Any = None,
        local_offset: Any = None,
        compare_add: Any = None,
        swap: Any = None,
    ) -> None:
        """Post a batch of one-sided requests of one ``opcode`` on one remote key as one chain in which only
        the last request is signalled (``struct rdmaio_batch`` in helper.h). ``remote_addr``,
        ``local_offset``, ``compare_add`` and ``swap`` are buffers of ``uint64`` (``array('Q')``),
        ``length`` of ``uint32`` (``array('I')``), one entry per request; request ``i``'s local memory is
        ``local_addr + local_offset[i]`` (``8 * i`` without offsets) for ``length[i]`` bytes (8 without)."""
        self._check_usable()
        batch = getattr(self, "_batch", None)
        if batch is None:
            batch = self._batch = ffi.new("struct rdmaio_batch *")
        count = len(remote_addr)
        keep = _fill_batch(  # noqa: F841 - the arrays stay alive until the call returns
            batch, wr_id, opcode, local_addr, lkey, rkey, remote_addr, length, local_offset, compare_add, swap
        )
        rc = lib.rdmaio_post_batch(self._ptr, batch, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, f"batch request {self._bad[0]} of {count}")

    def remote_access(self) -> tuple[int, int, int]:
        """``(qp_access_flags, max_rd_atomic, max_dest_rd_atomic)`` as the device reports them."""
        self._check_usable()
        acc, rd, drd = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        _check(lib.rdmaio_qp_access(self._ptr, acc, rd, drd), "ibv_query_qp")
        return int(acc[0]), int(rd[0]), int(drd[0])

    def post_empty_write(self, wr_id: int) -> None:
        """Post one signalled zero-length RDMA WRITE (a liveness probe, see :mod:`rdmaio.keepalive`).

        It carries no data, needs no remote key (IBTA C9-88: a zero-length RDMA operation checks none),
        consumes no receive at the peer and produces no completion there. Its completion here is
        success once the peer's RC transport acknowledged it, or ``RETRY_EXC_ERR`` after the QP's ACK
        timeout and retry count ran out.
        """
        self._check_usable()
        wr = self._probe[0]
        wr.wr_id = wr_id
        wr.addr = 0
        wr.length = 0
        wr.lkey = 0
        wr.imm_data = 0
        wr.opcode = lib.IBV_WR_RDMA_WRITE
        wr.send_flags = lib.IBV_SEND_SIGNALED
        wr.rkey = 0
        wr.remote_addr = 0
        rc = lib.rdmaio_post_sends(self._ptr, self._probe, 1, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, "zero-length RDMA WRITE")

    def post_empty_read(self, wr_id: int) -> None:
        """Post one signalled zero-length RDMA READ (the liveness probe on iWARP, see
        :mod:`rdmaio.core.keepalive`).

        On iWARP a signalled WRITE completes once the local TCP stack took it, whatever became of the
        peer; a READ completes only when the peer's read response arrived, so only a live peer answers
        it. One scatter entry of length 0 (siw refuses a READ without one: EINVAL), no remote address or
        key (IBTA C9-88: a zero-length operation checks none), no local memory written, nothing consumed
        at the peer. Its completion here is success once the peer answered; a vanished peer never
        answers (iWARP has no RC retry counter: TCP retransmits for minutes), hence the keepalive's
        deadline.
        """
        self._check_usable()
        # Fresh structs, not a cached one: a probe goes out at most once per keepalive interval.
        sge = ffi.new("struct ibv_sge *")  # zeroed: address 0, length 0, key 0
        wr = ffi.new("struct ibv_send_wr *")  # zeroed: no chain, remote address and key 0
        wr.wr_id = wr_id
        wr.sg_list = sge
        wr.num_sge = 1
        wr.opcode = lib.IBV_WR_RDMA_READ
        wr.send_flags = lib.IBV_SEND_SIGNALED
        bad = ffi.new("struct ibv_send_wr **")
        rc = lib.ibv_post_send(self._ptr, wr, bad)
        if rc:  # libibverbs returns the errno itself (positive)
            raise VerbsError.from_errno("ibv_post_send", abs(rc), "zero-length RDMA READ")

    def query_timeouts(self) -> tuple[int, int]:
        """``(timeout, retry_cnt)`` of the QP as the device holds them (``ibv_query_qp``)."""
        self._check_usable()
        attr = ffi.new("struct ibv_qp_attr *")
        init = ffi.new("struct ibv_qp_init_attr *")
        _check(
            lib.ibv_query_qp(self._ptr, attr, lib.IBV_QP_TIMEOUT | lib.IBV_QP_RETRY_CNT, init),
            "ibv_query_qp",
        )
        return int(attr.timeout), int(attr.retry_cnt)

    def to_error(self) -> None:
        """Move the QP to the error state: outstanding work requests complete with WR_FLUSH_ERR."""
        self._check_usable()
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = lib.IBV_QPS_ERR
        _check(lib.ibv_modify_qp(self._ptr, attr, lib.IBV_QP_STATE), "ibv_modify_qp", "to ERR")

    def onesided_port(self, cq: CompletionQueue, wr_base: int, max_inline: int) -> OneSidedPort:
        """The :class:`OneSidedPort` of this QP and its completion queue ``cq`` (made once): serial one-sided
        requests with ``wr_id = wr_base | index`` are posted and polled through it in one C call."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        if cq.closed or cq._generation != _base._generation:  # inline: no call when usable
            cq._check_usable()
        port: OneSidedPort | None = getattr(self, "_port", None)
        if port is None:
            port = self._port = OneSidedPort(self, cq, wr_base, max_inline)
        return port

    def _destroy(self) -> None:
        port: OneSidedPort | None = getattr(self, "_port", None)
        if port is not None:
            port.disable()  # before the QP goes: the port's C call must never reach a destroyed QP
        lib.rdma_destroy_qp(self._cm_id._ptr)
        self._cm_id.qp = None


# --- one-sided port ---------------------------------------------------------------------------------

_live_ports: weakref.WeakSet[OneSidedPort] = weakref.WeakSet()


def _disable_ports_in_child() -> None:
    # A forked child must not post on its parent's queue pairs (ibv_fork_init(3)): the C call then
    # returns -EBADF, and the caller's checks raise ForkError.
    for port in list(_live_ports):
        port.disable()


os.register_at_fork(after_in_child=_disable_ports_in_child)


class OneSidedPort:
    """A serial one-sided request in ONE C call (``rdmaio_onesided_post_poll``): it fills the work request,
    posts it, and takes at most one record from the completion queue. :attr:`post_poll` is that C function
    bound to this port (a ``functools.partial`` of a cffi function: calling it runs no Python code), called
    as ``post_poll(index, local_addr, lkey, length, opcode, remote_addr, rkey, compare_add, swap)``; it
    returns ``-errno`` (nothing posted), or :data:`POSTED` (the CQ was empty), :data:`POSTED_DONE` (the
    request's own successful completion was taken), :data:`POSTED_OTHER` (another record was taken:
    :meth:`taken`, to dispatch) or
    :data:`POSTED_POLL_FAILED` (:meth:`poll_error`). Made by :meth:`QueuePair.onesided_port`; disabled
    (every call returns ``-EBADF``) when its QP is destroyed and in a forked child."""

    def __init__(self, qp: QueuePair, cq: CompletionQueue, wr_base: int, max_inline: int) -> None:
        self._qp = weakref.ref(qp)
        self._cq = weakref.ref(cq)
        self._port = port = ffi.new("struct rdmaio_onesided_port *")
        port.qp = qp._ptr
        port.cq = cq._ptr
        port.wr_base = wr_base
        port.max_inline = max(0, max_inline)
        self._batch = ffi.new("struct rdmaio_batch *")
        self.post_poll = functools.partial(lib.rdmaio_onesided_post_poll, port)
        """The C call (see the class docstring)."""
        _live_ports.add(self)

    @property
    def enabled(self) -> bool:
        """False once :meth:`disable` ran (the QP was destroyed, or this is a forked child)."""
        return bool(self._port.qp != ffi.NULL)

    @property
    def posted(self) -> int:
        """Requests posted through the port."""
        return int(self._port.posted)

    @property
    def polled(self) -> int:
        """Records taken from the completion queue."""
        return int(self._port.polled)

    def disable(self) -> None:
        """Make every later call return ``-EBADF`` without touching the QP or the CQ."""
        self._port.qp = ffi.NULL
        self._port.cq = ffi.NULL

    def taken(self) -> tuple[Any, int]:
        """A copy of the record a :data:`POSTED_OTHER` call took (a ``struct rdmaio_wc[1]``) and its
        dispatch key."""
        copy = ffi.new("struct rdmaio_wc[]", 1)
        copy[0] = self._port.record
        return copy, int(self._port.group.key)

    def post_batch_poll(
        self,
        wr_id: int,
        opcode: int,
        local_addr: int,
        lkey: int,
        rkey: int,
        remote_addr: Any,
        *,
        length: Any = None,
        local_offset: Any = None,
        compare_add: Any = None,
        swap: Any = None,
    ) -> int:
        """A wave of a batch (the arguments of :meth:`QueuePair.post_batch`), then one look at the CQ, in
        one C call (``rdmaio_onesided_post_batch_poll``): the results of :attr:`post_poll`, where
        :data:`POSTED_DONE` means the wave's own (last, signalled) request completed successfully."""
        batch = self._batch
        keep = _fill_batch(  # noqa: F841 - the arrays stay alive until the call returns
            batch, wr_id, opcode, local_addr, lkey, rkey, remote_addr, length, local_offset, compare_add, swap
        )
        return int(lib.rdmaio_onesided_post_batch_poll(self._port, batch))

    def poll_error(self) -> VerbsError:
        """The error of a :data:`POSTED_POLL_FAILED` call."""
        return VerbsError.from_errno("ibv_poll_cq", int(self._port.poll_errno))

    def post_error(self, result: int) -> Exception:
        """The error of a call that posted nothing (``result`` is ``-errno``): the queue pair's or the
        completion queue's own when one is closed or was created before a fork (ForkError), else the
        provider's errno."""
        for resource in (self._qp(), self._cq()):
            if resource is not None:
                try:
                    resource._check_usable()
                except Exception as exc:
                    return exc
        return VerbsError.from_errno("ibv_post_send", -result, "one-sided request")


POSTED: int = lib.RDMAIO_POSTED
"""``OneSidedPort.post_poll``: posted, the CQ was empty."""
POSTED_DONE: int = lib.RDMAIO_POSTED_DONE
"""``OneSidedPort.post_poll``: posted, and its own successful completion was taken from the CQ."""
POSTED_OTHER: int = lib.RDMAIO_POSTED_OTHER
"""``OneSidedPort.post_poll``: posted, and another record was taken (to dispatch)."""
POSTED_POLL_FAILED: int = lib.RDMAIO_POSTED_POLL_FAILED
"""``OneSidedPort.post_poll``: posted, and the poll failed."""


def _fill_batch(
    batch: Any,
    wr_id: int,
    opcode: int,
    local_addr: int,
    lkey: int,
    rkey: int,
    remote_addr: Any,
    length: Any,
    local_offset: Any,
    compare_add: Any,
    swap: Any,
) -> list[Any]:
    """Fill ``struct rdmaio_batch`` ``batch``; returns the C views of the arrays (keep them alive until
    the post returns)."""
    count = len(remote_addr)
    keep = [ffi.from_buffer("uint64_t[]", remote_addr)]
    batch.wr_id = wr_id
    batch.local_addr = local_addr
    batch.lkey = lkey
    batch.opcode = opcode
    batch.rkey = rkey
    batch.count = count
    batch.remote_addr = keep[0]
    for name, array, ctype in (
        ("length", length, "uint32_t[]"),
        ("local_offset", local_offset, "uint64_t[]"),
        ("compare_add", compare_add, "uint64_t[]"),
        ("swap", swap, "uint64_t[]"),
    ):
        if array is None:
            setattr(batch, name, ffi.NULL)
        else:
            if len(array) != count:
                raise ValueError(f"{name} has {len(array)} entries for {count} requests")
            keep.append(ffi.from_buffer(ctype, array))
            setattr(batch, name, keep[-1])
    return keep
