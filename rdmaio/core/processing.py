"""The completion processing of one connection: what each of its work completions means.

The domain's dispatcher (:mod:`rdmaio.core.completions`) polls the shared CQs and hands each connection its
group of a batch, in CQ order. Receive completions are copied out of their slot (one copy) into the receive
buffer (:mod:`rdmaio.protocol.rxbuffer`) and the slot is re-posted at once, in one chained post per batch,
unless the buffer holds it back for back-pressure: then the peer gets no credit for it, and the sender
waits. Send completions release send slots (:mod:`rdmaio.core.txengine`); one-sided and keepalive
completions go to their engines; a failed completion fails the connection unless it is a flush after a
close or disconnect. Internal to :class:`rdmaio.core.connection.Connection`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rdmaio import verbs
from rdmaio.core.keepalive import KEEPALIVE_WR_KIND, Keepalive
from rdmaio.core.onesided import WR_KIND_ONESIDED
from rdmaio.errors import ConnectionResetError, ProtocolError
from rdmaio.protocol import FrameKind
from rdmaio.verbs import WR_INDEX_MASK, WR_KIND_SHIFT, WcStatus

if TYPE_CHECKING:
    from rdmaio.core.connection import Connection

__all__ = ["CompletionProcessor"]

log = logging.getLogger("rdmaio")

_RECV_FLAG = 0x80  # IBV_WC_RECV bit of a completion opcode
_FLUSH = int(WcStatus.WR_FLUSH_ERR)
_DATA_MORE = FrameKind.DATA_MORE
_DATA_END = FrameKind.DATA_END
_DATA_BATCH = FrameKind.DATA_BATCH
_EOF = FrameKind.EOF
_RNDV = FrameKind.RNDV  # zero-copy: a rendezvous descriptor, handled by rdmaio.core.rndv_engine
_RECV_RDMA_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)  # one-sided: a write notice
_WC_WITH_IMM = verbs.WC_WITH_IMM  # one-sided: a receive without it is a control message
# What _on_receive() reports about one receive completion (bits).
_GOT_DATA = 1  # a reader may have something new: wake it
_DATA_FRAME = 2  # a data frame consumed a credit (counts towards growing the receive window)


class CompletionProcessor:
    """Processes the completions of one :class:`~rdmaio.core.connection.Connection` (its dispatcher handler
    is :meth:`on_completions`). The connection's parts are cached here: this is the hot path."""

    def __init__(self, conn: Connection, keepalive: Keepalive) -> None:
        self._conn = conn
        transport = conn.transport
        self._transport = transport
        self._session = conn.session
        self._rxbuf = conn.rxbuf
        self._tx = conn.tx
        self._onesided = conn.onesided
        self._rndv = conn.rndv
        self._stats = conn.stats
        self._keepalive = keepalive
        self._slot_size = transport.slot_size
        self._big_frame = transport.slot_size // 2  # frames at least this long count towards growth
        self._big_frames = 0  # such frames received since the receive window last grew
        self._recv_view = transport.recv_ring.view

    def on_completions(self, records: Any, start: int, count: int) -> None:
        """The dispatcher's handler: ``records[start:start + count]`` are this connection's, in CQ order."""
        if self._conn.torn_down:
            return
        try:
            self._process_completions(records, start, count)
        except ProtocolError as exc:
            log.warning("rdmaio: protocol violation by %s: %s", self._conn.extra["peername"], exc)
            self._conn.fail(exc)
        except Exception as exc:
            log.exception("rdmaio: completion processing failed")
            self._conn.fail(exc)

    def _process_completions(self, records: Any, start: int, count: int) -> None:
        repost: list[int] = []
        got_data = False
        data_frames = 0
        only_onesided = True  # every completion was a successful one-sided request of ours
        stats = self._stats
        stats["wakeups"] += 1
        # sharedcq: the dispatcher calls once per group and re-polls while batches come back full.
        stats["completions"] += count
        for i in range(start, start + count):
            wc = records[i]
            if wc.status:
                only_onesided = False
                if wc.wr_id >> WR_KIND_SHIFT == WR_KIND_ONESIDED:  # one-sided
                    self._onesided.on_completion(int(wc.wr_id), int(wc.status), int(wc.vendor_err))
                self._on_wc_error(int(wc.status), int(wc.opcode), int(wc.vendor_err))
                if self._conn.torn_down:
                    return
                continue
            if wc.opcode & _RECV_FLAG:
                only_onesided = False
                outcome = self._on_receive(wc, repost)
                if outcome & _GOT_DATA:
                    got_data = True
                if outcome & _DATA_FRAME:
                    data_frames += 1
            else:
                op_kind = wc.wr_id >> WR_KIND_SHIFT
                if op_kind == WR_KIND_ONESIDED:  # one-sided
                    self._onesided.on_completion(int(wc.wr_id), 0)
                    continue
                only_onesided = False
                if op_kind == KEEPALIVE_WR_KIND:  # keepalive probe acknowledged
                    self._keepalive.on_completion()
                else:
                    self._tx.on_send_completion(wc.wr_id & WR_INDEX_MASK)
        if only_onesided:
            # READ/WRITE/atomic completions free no send slot, bring no credit and no data: the send
            # engine and the readers have nothing new (a serial one-sided caller polls after every post,
            # so this is its per-request path). What waits for a free op slot was woken by on_completion.
            self._onesided.pump()
            return
        self._after_completions(repost, got_data, data_frames)

    def _on_receive(self, wc: Any, repost: list[int]) -> int:
        """One successful receive completion: its frame goes to the receive buffer (or an engine); its slot
        goes to ``repost`` unless held. Returns ``_GOT_DATA`` / ``_DATA_FRAME`` bits."""
        slot = wc.wr_id & WR_INDEX_MASK
        length = wc.byte_len
        off = slot * self._slot_size
        recv_view = self._recv_view
        if wc.opcode == _RECV_RDMA_IMM or not wc.flags & _WC_WITH_IMM:  # one-sided
            view = recv_view[off : off + length]
            if self._onesided.on_recv(wc.opcode, wc.imm_data, length, view, slot):
                repost.append(slot)  # else held: write-notice back-pressure
            return 0
        kind = self._session.on_frame(wc.imm_data, length)
        if length >= self._big_frame:
            self._big_frames += 1
        rxbuf = self._rxbuf
        stats = self._stats
        outcome = _DATA_FRAME
        if kind == _DATA_END:
            data = rxbuf.add_message(bytes(recv_view[off : off + length]))
            stats["messages_received"] += 1
            stats["bytes_received"] += len(data)
            outcome |= _GOT_DATA
        elif kind == _DATA_BATCH:
            messages = self._session.on_batch(recv_view[off : off + length])
            size = rxbuf.add_messages(messages)
            stats["messages_received"] += len(messages)
            stats["bytes_received"] += size
            outcome |= _GOT_DATA
        elif kind == _DATA_MORE:
            rxbuf.add_fragment(bytes(recv_view[off : off + length]))
        elif kind == _RNDV:  # zero-copy: a placeholder now, the data is pulled later
            assert self._rndv is not None  # on_frame refuses RNDV frames unless negotiated
            self._rndv.on_request(recv_view[off : off + length])
            # The announced bytes count against the limit: past it the slot is held as a data frame's
            # is, so a peer cannot queue announcements faster than the application reads.
            if rxbuf.admit(slot):
                repost.append(slot)
            return _GOT_DATA
        else:
            # CREDIT and EOF carry no payload and never hold their slot: holding it would
            # withhold the credit the peer needs to keep granting ours (two-way liveness).
            repost.append(slot)
            return _GOT_DATA if kind == _EOF else 0
        if rxbuf.admit(slot):  # else held: back-pressure, no credit for it yet
            repost.append(slot)
        return outcome

    def _after_completions(self, repost: list[int], got_data: bool, data_frames: int) -> None:
        """End of a batch: re-post receives, maybe grow the window, post what credits allow, wake."""
        session = self._session
        self._tx.coalesce_next = False  # something came back: the next small message may go at once
        if repost:
            self._transport.post_receives(repost)
            session.on_recv_reposted(len(repost))
        self._onesided.pump()  # one-sided: credits may have arrived
        if (
            data_frames
            and session.can_grow
            and not self._rxbuf.held
            and (data_frames > session.credit_threshold or self._big_frames >= 2 * session.recv_depth)
        ):
            self._grow_receives()
        self._conn.pump_and_post()
        conn = self._conn
        if got_data:
            conn.wake_reader()
        if conn.tx_waiters:
            conn.wake_writers()
        if conn.closing:
            conn.finish_close()  # a graceful close ends when its last send completes

    def _grow_receives(self) -> None:
        """Double the receive window (the next frame or a CREDIT frame grants the new slots) when the peer is
        sending as fast as our credits let it: one wake-up brought more than half a window of data frames, or
        two windows of big frames (at least half a slot) arrived since the window last grew. The second rule
        is for a loop that wakes for every frame (a VM, a busy host): it never sees half a 4-slot window at
        once, and a bulk sender stayed at 3 frames per round trip. Small messages never add up to it, so a
        request/reply connection keeps its small window. Not while slots are held: then the application, not
        the window, is the limit."""
        self._big_frames = 0
        added = self._transport.grow_receives(max(self._session.recv_depth, 1))
        if added:
            self._session.grow_receives(added)
            self._stats["recv_ring_grown"] += 1

    def _on_wc_error(self, status: int, opcode: int, vendor_err: int) -> None:
        if status == _FLUSH and (self._conn.closing or self._session.peer_eof or self._conn.disconnected):
            return  # the QP was moved to error by a disconnect: outstanding requests are cancelled
        message = (
            f"work completion failed: {verbs.wc_status_str(status)} (opcode {opcode}, vendor {vendor_err})"
        )
        error = ConnectionResetError(message, errno=104, call="ibv_poll_cq")
        self._conn.fail(error)
