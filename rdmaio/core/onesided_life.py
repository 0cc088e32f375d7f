"""The life cycle of a one-sided op: slots, local memory, posting (doorbells, the look at the CQ after a
serial post, credit-bound requests), completion and release. A part of the one-sided engine, below the
calls of :mod:`rdmaio.core.onesided_ops` and :mod:`rdmaio.core.onesided_batch`.

An op takes ``count`` of ``max_ops`` slots (one per work request: the send queue has room for that many)
and local memory (a staging slot, a pooled large buffer, or the caller's buffer registered through the
Domain's cache), is posted with others of the same loop iteration in one doorbell (writes with immediate
data and control messages after a send credit), and completes through :meth:`OpLifecycle.on_completion`.
A cancelled call leaves its op orphaned: the completion frees it.
"""

from __future__ import annotations

import errno
from typing import Any

from rdmaio import verbs
from rdmaio._ffi import lib
from rdmaio.core.backend import Waiter
from rdmaio.core.onesided_base import EngineCore, Region
from rdmaio.core.onesided_grants import _CONTROL
from rdmaio.core.remotekey import KEY_VERSION, RemoteKey
from rdmaio.errors import EndpointClosedError, RemoteAccessRefusedError, RemoteKeyRevokedError

__all__ = ["OpLifecycle"]

_INDEX_MASK = verbs.WR_INDEX_MASK  # bits 32..55 are the connection's tag (shared-CQ dispatch)
_STAGING_SLOT = 64 * 1024  # bytes of rdmaio-owned registered memory per op; larger ops get their own MR
# Larger ops' MRs are kept for reuse, in power-of-two size classes, up to this many bytes per connection:
# registering (pinning) 1 MiB per op cost more than the op itself (docs/benchmarks.md, "One-sided").
_LARGE_POOL_BYTES = 32 << 20


_WR_READ: int = lib.IBV_WR_RDMA_READ
_WR_WRITE: int = lib.IBV_WR_RDMA_WRITE
_WR_WRITE_IMM: int = lib.IBV_WR_RDMA_WRITE_WITH_IMM
_WR_SEND: int = lib.IBV_WR_SEND
_WR_FADD: int = lib.IBV_WR_ATOMIC_FETCH_AND_ADD
_WR_CSWAP: int = lib.IBV_WR_ATOMIC_CMP_AND_SWP
_SEND_SIGNALED: int = lib.IBV_SEND_SIGNALED
_SEND_INLINE: int = lib.IBV_SEND_INLINE
_WC_REM_ACCESS_ERR = int(verbs.WcStatus.REM_ACCESS_ERR)
_WC_FLUSH = int(verbs.WcStatus.WR_FLUSH_ERR)
_WC_RECV_RDMA_WITH_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)
_U64 = (1 << 64) - 1
_PACK_OP = verbs.RDMA_OP.pack_into
_OP_SIZE = verbs.RDMA_OP.size
_INLINE_OPCODES = frozenset((_WR_WRITE, _WR_WRITE_IMM, _WR_SEND))
_DOORBELL = 16  # requests per ibv_post_send at most (the QP's scratch array has 16 entries)
# Calls completed at their post that may return in a row without yielding to the loop (see _wait).
_AT_POST_BUDGET = 16


class _Op:
    __slots__ = (
        "buffer",
        "count",
        "done",
        "error",
        "index",
        "key_id",
        "length",
        "mr",
        "opcode",
        "orphan",
        "pooled",
        "posted",
        "result",
        "staging",
        "waiter",
        "wr",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.count = 1  # work requests (send queue entries) it stands for: a batch has several
        # Made when a caller has to wait (most serial calls complete at their post and never need one).
        self.waiter: Waiter | None = None
        self.done = False
        self.posted = False
        self.orphan = False  # nobody waits for it any more: its completion releases its memory
        self.error: BaseException | None = None
        self.result: Any = None
        self.staging: int | None = None  # staging slot index, or None
        self.mr: Any = None  # a Registration (rdma_read_into)
        self.pooled: _Large | None = None  # a large op's registered memory, from the pool
        self.buffer: Any = None  # memoryview of the local memory the NIC reads or writes
        self.key_id: int | None = None
        self.length = 0
        self.opcode = 0
        self.wr: tuple[int, ...] = ()


class _Large:
    """A registered rdmaio-owned buffer for ops above the staging slot (reused through the pool)."""

    __slots__ = ("region", "size", "view")

    def __init__(self, region: Region, view: memoryview) -> None:
        self.region = region
        self.view = view
        self.size = view.nbytes


class OpLifecycle(EngineCore):
    """Slots, memory, posting and completion of the one-sided engine's ops (the calls are above it)."""

    async def _start(
        self, key: RemoteKey, opcode: int, length: int, *, staging: bool = True, count: int = 1
    ) -> _Op:
        """Wait for ``count`` op slots (at most ``max_ops`` work requests in flight: the send queue has
        room for that many), then give the op its local memory."""
        self._raise_if_failed()
        while self._in_flight + count > self.max_ops or self._slot_waiters:
            waiter = self._io.waiter()
            self._slot_waiters.append(waiter)
            try:
                await waiter.wait()
            except BaseException:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
                else:
                    self._wake_slot_waiter()  # we were woken but give up: pass the wake-up on
                raise
            self._raise_if_failed()
            if self._in_flight + count <= self.max_ops:
                break
        # Re-checked after the wait: a REVOKE may have arrived meanwhile.
        if key.key_id in self.revoked_ids:
            self._wake_slot_waiter()
            raise RemoteKeyRevokedError(f"{key!r} was revoked by the peer")
        return self._new_op(key.key_id, opcode, length, staging, count)

    def _start_now(self, key: RemoteKey, opcode: int, length: int) -> _Op | None:
        """The op of a single request at once when a slot is free and nobody waits for one (the common
        case, without the cost of awaiting :meth:`_start`); None when the caller must await ``_start``."""
        if self._in_flight >= self.max_ops or self._slot_waiters:
            return None
        self._raise_if_failed()
        return self._new_op(key.key_id, opcode, length, True, 1)

    def _new_op(self, key_id: int | None, opcode: int, length: int, staging: bool, count: int) -> _Op:
        """A new op in :attr:`ops`, taking ``count`` slots (:meth:`_forget` gives them back)."""
        op = _Op(next(self._index) & _INDEX_MASK)
        op.key_id = key_id
        op.length = length
        op.opcode = opcode
        op.count = count
        if staging and length:
            self._give_memory(op, length)
        self.ops[op.index] = op
        self._in_flight += count
        return op

    def _give_memory(self, op: _Op, length: int) -> None:
        if length <= _STAGING_SLOT:
            if self._staging is None:
                buf = bytearray(_STAGING_SLOT * self.max_ops)
                self._staging = self._register_local(buf)
                self._staging_view = memoryview(buf)
            slot = self._free_staging.pop()
            op.staging = slot
            assert self._staging_view is not None
            op.buffer = self._staging_view[slot * _STAGING_SLOT : slot * _STAGING_SLOT + length]
        else:
            size = 1 << (length - 1).bit_length()  # size class: the next power of two
            free = self._large_pool.get(size)
            if free:
                large = free.pop()
                self._large_pooled -= size
                self._stats["rdma_large_reused"] += 1
            else:
                buf = bytearray(size)
                large = _Large(self._register_local(buf), memoryview(buf))
                self._stats["rdma_large_registered"] += 1
            op.pooled = large
            op.buffer = large.view[:length]

    def _local_of(self, op: _Op) -> tuple[int, int]:
        if op.staging is not None:
            return self._staging.addr + op.staging * _STAGING_SLOT, self._staging.lkey
        if op.pooled is not None:
            return op.pooled.region.addr, op.pooled.region.lkey
        if op.mr is not None:
            return op.mr.addr, op.mr.lkey
        return 0, 0

    def _post(
        self,
        op: _Op,
        remote_addr: int,
        rkey: int,
        *,
        imm: int = 0,
        compare_add: int = 0,
        swap: int = 0,
        local: tuple[int, int] | None = None,
    ) -> None:
        addr, lkey = local if local is not None else self._local_of(op)
        op.wr = (addr, lkey, remote_addr, rkey, imm, compare_add, swap)
        if op.opcode == _WR_WRITE_IMM:
            self._credit_queue.append(op)  # consumes a peer receive: needs a credit
            self.pump()
        elif len(self.ops) == 1 and not self._doorbell:
            # Alone in flight: post at once (nothing to share a doorbell with).
            poster = id(self._io.current_task())
            serial = poster == self._last_poster
            self._last_poster = poster
            if not serial or self._post_polled is None:
                self._post_now(op)
            else:
                # One task calling one request at a time: look once before sleeping, as asyncio's
                # sock_recv tries the call before it waits for the fd. A device may have completed the
                # request before ibv_post_send returned (rxe runs a whole loopback READ inside the call),
                # and then the caller resumes without a sleep in epoll and a wake-up of the completion
                # channel (which still fires later and finds the CQ empty). One non-blocking poll of the
                # shared CQ, no spinning: on a NIC that has not finished yet it costs one look at the CQ.
                # Not when another task posted the previous request: several tasks calling concurrently
                # are served better by waiting, so that their requests share doorbells (one system call
                # for up to 16 on rxe) and one wake-up, than by completing one by one.
                # The post and the look are one C call; when the request's own completion is all there
                # was, it is completed right here rather than through the dispatcher and the
                # connection's completion processing.
                self._post_now(op, polled=True)
        else:
            # Others are in flight: more calls are likely in this same loop iteration (tasks woken by
            # one batch of completions). Post them together at its end: one ibv_post_send (on rxe one
            # system call that runs the requester) for up to _DOORBELL requests.
            self._last_poster = id(self._io.current_task())
            self._doorbell.append(op)
            if len(self._doorbell) >= _DOORBELL:
                self._ring()
            elif self._ring_handle is None:
                self._ring_handle = self._io.call_soon(self._ring)

    def _ring(self) -> None:
        """Post the requests collected for one doorbell, as one chain."""
        if self._ring_handle is not None:
            self._ring_handle.cancel()
            self._ring_handle = None
        ops = [op for op in self._doorbell if not op.done]
        self._doorbell.clear()
        if not ops or self._error is not None or self.closed:
            return
        revoked = self.revoked_ids
        if len(revoked) or revoked.floor > 1:
            # A REVOKE may have arrived since these calls checked their key (its ACK is already queued or
            # posted): a request posted after the ACK would meet a deallocated window, a remote access
            # error that ends the connection. Fail such calls as if they had found the key revoked.
            kept = []
            for op in ops:
                if op.key_id is not None and op.key_id in revoked:
                    self._stats["rdma_revoked_at_post"] += 1
                    self._complete(op, RemoteKeyRevokedError("the key was revoked by the peer"))
                else:
                    kept.append(op)
            ops = kept
            if not ops:
                return
        for i, op in enumerate(ops):
            self._fill(i, op)
        try:
            self._qp.post_rdma(len(ops))
        except Exception as exc:
            # Requests before the failing one may have been posted; the connection fails either way
            # (its QP is destroyed), which completes every op.
            self._fail_connection(exc)
            for op in ops:
                self._complete(op, exc)
            return
        for op in ops:
            op.posted = True
        self._stats["rdma_ops_posted"] += len(ops)
        self._stats["rdma_doorbells"] += 1

    def _post_now(self, op: _Op, *, polled: bool = False) -> None:
        """Post ``op`` alone; ``polled``: and look at the CQ in the same C call (a serial call, see
        :meth:`_post`), completing ``op`` here when its own completion is all the look found."""
        self._fill(0, op)
        own = False
        try:
            if polled:
                assert self._post_polled is not None
                own = self._post_polled(1, self._wr_base | op.index)
            else:
                self._qp.post_rdma(1)
        except Exception as exc:
            self._complete(op, exc)
            self._fail_connection(exc)
            return
        op.posted = True
        self._stats["rdma_ops_posted"] += 1
        self._stats["rdma_doorbells"] += 1
        if not polled:
            return
        if own:
            self._complete(op, None)
        if op.done:
            self._stats["rdma_completed_at_post"] += 1
            self._at_post_streak += 1
        else:
            self._at_post_streak = 0

    def _fill(self, index: int, op: _Op) -> None:
        """Write ``op``'s work request into entry ``index`` of the QP's scratch array (one ``pack_into``)."""
        addr, lkey, remote_addr, rkey, imm, compare_add, swap = op.wr
        opcode = op.opcode
        flags = _SEND_SIGNALED
        if opcode in _INLINE_OPCODES and 0 < op.length <= self._max_inline:
            flags |= _SEND_INLINE
        _PACK_OP(
            self._wr_entries,
            index * _OP_SIZE,
            self._wr_base | op.index,
            addr,
            op.length,
            lkey,
            opcode,
            flags,
            imm,
            rkey,
            remote_addr,
            compare_add,
            swap,
        )

    def pump(self) -> None:
        """Post what waits for a credit: control messages first, then writes with immediate data.

        Called after every batch of completions (credits may have arrived) and when something is queued.
        """
        if self._error is not None or self.closed:
            return
        credits = self._credits
        while self._pending_acks and self._in_flight < self.max_ops and credits.can_take_slot():
            word = self._pending_acks.popleft()
            op = self._new_op(None, _WR_SEND, _CONTROL.size, True, 1)
            op.orphan = True
            assert op.buffer is not None
            op.buffer[:] = _CONTROL.pack(KEY_VERSION, word >> 64, word & _U64)
            addr, lkey = self._local_of(op)
            op.wr = (addr, lkey, 0, 0, 0, 0, 0)
            credits.take_slot()
            self._post_now(op)
            self._stats["control_sent"] += 1
        while self._credit_queue and credits.can_take_slot():
            op = self._credit_queue.popleft()
            if op.done:
                continue
            if op.key_id in self.revoked_ids:
                self._complete(op, RemoteKeyRevokedError("the key was revoked by the peer"))
                continue
            credits.take_slot()
            self._post_now(op)

    def _must_await(self, op: _Op) -> bool:
        """False for a call that completed successfully at its post within the budget (see :meth:`_wait`):
        it returns without awaiting :meth:`_finish` (whose coroutine would only return at once)."""
        return not op.done or op.error is not None or self._at_post_streak >= _AT_POST_BUDGET

    async def _finish(self, op: _Op) -> None:
        """Wait for the op's completion. A cancelled wait leaves the op to complete on its own: its memory
        is rdmaio's (staging or a private MR) and is released only by the completion."""
        try:
            await self._wait(op)
        except BaseException:
            if op.done:
                self._release(op)
            else:
                op.orphan = True
            raise
        if op.error is not None:
            self._release(op)
            raise op.error

    async def _wait(self, op: _Op) -> None:
        """Wait for the op's completion. An op that completed at its post returns at once, without a
        waiter (on any loop), so a task calling in a loop would never let the event loop run: after
        ``_AT_POST_BUDGET`` such calls in a row on this engine, one yields to the loop first (a
        cooperative budget, as Tokio gives each task)."""
        if op.done:
            if self._at_post_streak >= _AT_POST_BUDGET:
                self._at_post_streak = 0
                await self._io.sleep(0)
            return
        waiter = op.waiter = self._io.waiter()
        await waiter.wait()

    def on_completion(self, wr_id: int, status: int, vendor_err: int = 0) -> None:
        """A completion of one of our work requests (``wr_id >> 56 == 2``), successful or not: an op's,
        or a memory-window bind's (:meth:`~rdmaio.core.onesided_grants.Exports.on_bind_completion`)."""
        op = self.ops.get(wr_id & _INDEX_MASK)
        if op is None:
            self.on_bind_completion(wr_id & _INDEX_MASK, status, vendor_err)
            return
        if status == 0:
            self._complete(op, None)
            return
        if status == _WC_REM_ACCESS_ERR:
            error: BaseException = RemoteAccessRefusedError(
                "the peer's NIC refused the request (remote access error: a stale or forged key, or a "
                "peer that is dying); the connection is lost",
                errno=errno.ECONNRESET,
                call="ibv_poll_cq",
            )
        elif status == _WC_FLUSH:
            error = self._error or EndpointClosedError("the request was flushed: the connection is closing")
        else:
            error = EndpointClosedError(
                f"one-sided request failed: {verbs.wc_status_str(status)} (vendor {vendor_err})",
                call="ibv_poll_cq",
            )
        self._complete(op, error)

    def _complete(self, op: _Op, error: BaseException | None) -> None:
        if op.done:
            return
        op.done = True
        op.error = error
        self._forget(op)
        if op.orphan:  # a cancelled call or a control message: nobody will release its memory
            self._release(op)
        if op.waiter is not None:
            op.waiter.set()
        self._wake_slot_waiter()

    def _wake_slot_waiter(self) -> None:
        if self._slot_waiters and self._in_flight < self.max_ops:
            self._slot_waiters.popleft().set()
        if self._pending_acks:
            self.pump()

    def _release(self, op: _Op) -> None:
        """Give back the op's local memory (only once the NIC is done with it)."""
        if op.staging is not None:
            self._free_staging.append(op.staging)
            op.staging = None
        if op.pooled is not None:
            large, op.pooled = op.pooled, None
            if not self.closed and self._large_pooled + large.size <= _LARGE_POOL_BYTES:
                self._large_pool.setdefault(large.size, []).append(large)
                self._large_pooled += large.size
            else:
                large.region.close()
        if op.mr is not None:
            mr, op.mr = op.mr, None
            if hasattr(mr, "release"):
                mr.release()
            else:
                mr.close()
        op.buffer = None

    def _forget(self, op: _Op) -> None:
        """Take ``op`` out of :attr:`ops` and give back its slots (once: a second call does nothing)."""
        if self.ops.pop(op.index, None) is not None:
            self._in_flight -= op.count

    def _abandon(self, op: _Op) -> None:
        self._forget(op)
        self._release(op)
        self._wake_slot_waiter()
