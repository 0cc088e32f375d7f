"""Endpoint: one RDMA connection with a message API and an asyncio-streams-style byte API.

Data path. Every frame travels as one SEND-with-immediate from a registered send slot into a registered
receive slot of the peer; the immediate value carries the frame kind and piggybacked credits
(:mod:`rdmaio.protocol`). Completions come from the domain's shared CQs (:mod:`rdmaio.core.completions`): one
wake-up of its completion channel polls a whole batch through the C helper, grouped by connection, and
this endpoint's handler gets its own group of it; receive completions are copied out of their slot (one
copy) and the slot is re-posted at once, in one chained post per batch, unless the receive buffer
(:mod:`rdmaio.protocol.rxbuffer`) holds it back for back-pressure: then the peer gets no credit for it,
and the sender waits. A send never meets an empty receive queue. The send side's queue, coalescing, slots and
posting are :mod:`rdmaio.core.txengine`'s; this class decides when to stage and post, who waits, and the
connection's lifetime.

Sends copy the caller's data into send slots before they are posted, so the caller's buffer is free the
moment ``send()`` returns or is cancelled; a send slot is reused only after its completion (selective
signalling: one signalled completion releases every earlier slot, because an RC queue completes in order).

How the two APIs meet: the peer's messages form an ordered sequence; ``recv()`` returns the next one and
the stream calls (``read*``) see the same data as one byte stream, so ``write()`` on one side pairs with
``read*()`` on the other and ``send()`` with ``recv()``. Stream writes are coalesced into frames of up to
``slot_size`` bytes, so ``recv()`` on stream data returns chunks whose boundaries carry no meaning. A
``recv()`` after a partial stream read returns the rest of that message.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

from rdmaio import verbs
from rdmaio.core.backend import Event, Handle, Waiter
from rdmaio.core.keepalive import KEEPALIVE_WR_KIND, Keepalive
from rdmaio.core.onesided import WR_KIND_ONESIDED, OneSidedEngine, RemoteKey, WriteNotice
from rdmaio.core.reactor import Reactor
from rdmaio.core.rndv_engine import RendezvousEngine
from rdmaio.core.transport import Transport
from rdmaio.core.txengine import SendEngine
from rdmaio.errors import (
    ConnectionAbortedError,
    ConnectionResetError,
    EndpointClosedError,
    ForkError,
    ProtocolError,
    VerbsError,
)
from rdmaio.options import Options
from rdmaio.protocol import EOF, FrameKind, Session
from rdmaio.protocol.rxbuffer import ReceiveBuffer
from rdmaio.verbs import WR_INDEX_MASK, WR_KIND_SHIFT, CMEvent, CMEventType, CMId, WcStatus, make_wr_id

__all__ = ["Endpoint"]

log = logging.getLogger("rdmaio")

_RECV_FLAG = 0x80  # IBV_WC_RECV bit of a completion opcode
_FLUSH = int(WcStatus.WR_FLUSH_ERR)
_DATA_MORE = FrameKind.DATA_MORE
_DATA_END = FrameKind.DATA_END
_DATA_BATCH = FrameKind.DATA_BATCH
_EOF = FrameKind.EOF
_RNDV = FrameKind.RNDV  # zero-copy (issue 12): a rendezvous descriptor, handled by rdmaio.core.rndv_engine
_RECV_RDMA_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)  # one-sided (issue 11): a write notice
_WC_WITH_IMM = verbs.WC_WITH_IMM  # one-sided (issue 11): a receive without it is a control message


def _weak_call(method: Callable[[BaseException], None]) -> Callable[[BaseException], None]:
    """``method`` through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(exc: BaseException) -> None:
        bound = ref()
        if bound is not None:
            bound(exc)

    return call


class Endpoint:
    """A connected RDMA endpoint. Create one with :func:`rdmaio.connect` or receive one in a server handler.

    Message API: :meth:`send`, :meth:`recv`, :meth:`recv_into`. Stream API (as ``asyncio.StreamReader`` /
    ``StreamWriter``): :meth:`write`, :meth:`writelines`, :meth:`drain`, :meth:`write_eof`, :meth:`read`,
    :meth:`readexactly`, :meth:`readuntil`, :meth:`readline`, :meth:`at_eof`, ``async for line in ep``.
    Lifetime: :meth:`close`, :meth:`wait_closed`, :meth:`aclose`, :meth:`abort`, ``async with``.

    One task may wait in a read call and one in a send/drain call at a time; concurrent sends from several
    tasks are allowed and are queued in call order.
    """

    def __init__(
        self, reactor: Reactor, cm_id: CMId, transport: Transport, session: Session, options: Options
    ) -> None:
        self._io = reactor.backend
        self._reactor = reactor
        self._cm_id = cm_id
        self._transport = transport
        self._session = session
        self._options = options
        self._generation = verbs.fork_generation()
        qp = transport.qp
        self._qp = qp
        self._slot_size = transport.slot_size
        self._max_inline = min(transport.max_inline, options.max_inline)
        self._recv_view = transport.recv_ring.view
        self._extra: dict[str, Any] = {
            "peername": cm_id.peer_address,
            "sockname": cm_id.local_address,
            "device": transport.device.name,
            "port": cm_id.port_num,
            "qp_num": qp.qp_num,
            "max_inline": self._max_inline,
            "options": options,
            # The largest message the peer accepts (its handshake): what send() checks against.
            "peer_max_message_size": session.peer.max_message_size,
        }
        # receive side
        self._rxbuf = ReceiveBuffer(options.recv_buffer_limit)
        self._rx_waiter: Waiter | None = None
        # send side: the engine does the work; the endpoint decides when, and who waits
        self._stats = collections.Counter[str]()
        self._tx = SendEngine(
            session,
            qp,
            transport.send_ring,
            transport.slot_size,
            initial=options.initial_depth,
            max_inline=self._max_inline,
            signal_interval=options.signal_interval,
            batch_limit=options.batch_limit,
            stats=self._stats,
            tag=transport.tag or 0,  # sharedcq: the connection tag of the send wr_ids
        )
        self._onesided = OneSidedEngine.for_endpoint(self, transport, session, options)  # issue 11
        self._rndv = RendezvousEngine.for_endpoint(self, transport, options)  # issue 12 (None: not used)
        self._flush_handle: Handle | None = None
        self._post_handle: Handle | None = None
        self._in_callback = False  # in _pump_and_post(): it posts right after _pump, so _pump must not
        self._tx_waiters: dict[Waiter, None] = {}  # an ordered set: a cancelled wait removes its own
        # lifetime
        self._closing = False
        self._torn_down = False
        self._closed: Event = self._io.event()
        self._close_callbacks: list[Callable[[Endpoint], None]] = []

        reactor.set_handler(cm_id, self._on_cm_event)
        self._async_key = (transport.device.handle, qp.qp_num, transport.cq.handle)
        reactor.watch_qp(*self._async_key, self._on_async_event)
        # sharedcq: completions come from the domain's dispatcher (those kept since the QP was registered
        # go first).
        transport.set_completion_handler(self._on_completions)
        # Completions may already be waiting (the peer can send as soon as it is established).
        self._io.call_soon(self._poll_completions)
        # keepalive (rdmaio.core.keepalive): probes the peer when idle, so a vanished peer fails the
        # connection
        stats = self._stats
        # The tag routes the probe's completion back here through the shared CQ.
        keepalive_wr_id = make_wr_id(KEEPALIVE_WR_KIND, transport.tag or 0, 0)
        self._keepalive = Keepalive(
            self._io,
            options.keepalive_interval,
            lambda: stats["completions"] + stats["frames_posted"],
            lambda: qp.post_empty_write(keepalive_wr_id),
            _weak_call(self._fail),  # no endpoint <-> keepalive cycle: a closed endpoint is freed at once
            name=f"rdmaio keepalive qp {qp.qp_num}",
        )
        self._keepalive.start()
        reactor.watch_port(transport.device.handle, cm_id.port_num, qp.qp_num, self._on_port_event)

    # --- information -------------------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """Return ``peername``, ``sockname``, ``device``, ``port``, ``qp_num``, ``mtu``, ``max_inline``,
        ``options`` or ``peer_max_message_size`` (the largest message the peer accepts) by name."""
        if name == "mtu" and "mtu" not in self._extra:
            # Queried on first use, not in every connection's setup (ibv_query_port is a system call; the
            # device context is rdma_cm's, open as long as the process).
            try:
                self._extra["mtu"] = self._transport.device.query_port(self._extra["port"]).active_mtu
            except VerbsError:
                return default
        return self._extra.get(name, default)

    def statistics(self) -> dict[str, float]:
        """Counters of this connection: bytes/messages sent and received, wake-ups, batches, credits."""
        stats: dict[str, float] = dict(self._stats)
        for key in (
            "bytes_sent",
            "bytes_received",
            "messages_sent",
            "messages_received",
            "wakeups",
            "completions",
            "frames_posted",
            "post_calls",
            "recv_ring_grown",
            "send_ring_grown",
        ):
            stats.setdefault(key, 0)
        stats["registered_bytes"] = self._transport.registered_bytes if not self._torn_down else 0
        stats["mean_batch"] = stats["completions"] / stats["wakeups"] if stats["wakeups"] else 0.0
        stats["send_credits"] = self._session.send_credits
        stats["credits_ungranted"] = self._session.ungranted
        stats["recv_buffered"] = self._rxbuf.buffered
        stats["recv_held_slots"] = self._rxbuf.held
        stats["send_waiters"] = len(self._tx_waiters)
        stats["send_buffered"] = self.get_write_buffer_size()
        stats["keepalive_probes"] = self._keepalive.probes_sent
        stats.update(self._onesided.statistics())  # issue 11: pending ops, grants, queued notices
        for key, value in self._session.statistics().items():
            stats[f"protocol_{key}"] = value
        if self._rndv is not None:  # zero-copy (issue 12)
            stats.update(self._rndv.statistics())
        return stats

    def is_closing(self) -> bool:
        """True once close() or abort() was called or the connection failed."""
        return self._closing or self._torn_down

    @property
    def options(self) -> Options:
        """The options this endpoint was created with."""
        return self._options

    # --- completion processing (reactor callback) ---------------------------------------------------

    def _poll_completions(self) -> None:
        """Poll the shared CQs now (sharedcq: replaces calling ``_on_completions`` directly)."""
        if not self._torn_down:
            self._transport.poll_completions()

    def _on_completions(self, records: Any, start: int, count: int) -> None:
        """The dispatcher's handler: ``records[start:start + count]`` are this connection's, in CQ order."""
        if self._torn_down:
            return
        try:
            self._process_completions(records, start, count)
        except ProtocolError as exc:
            log.warning("rdmaio: protocol violation by %s: %s", self._extra["peername"], exc)
            self._fail(exc)
        except Exception as exc:
            log.exception("rdmaio: completion processing failed")
            self._fail(exc)

    def _process_completions(self, records: Any, start: int, count: int) -> None:
        session = self._session
        recv_view = self._recv_view
        slot_size = self._slot_size
        rxbuf = self._rxbuf
        repost: list[int] = []
        got_data = False
        data_frames = 0
        stats = self._stats
        stats["wakeups"] += 1
        # sharedcq: the dispatcher calls once per group and re-polls while batches come back full.
        stats["completions"] += count
        for i in range(start, start + count):
            wc = records[i]
            if wc.status:
                if wc.wr_id >> WR_KIND_SHIFT == WR_KIND_ONESIDED:  # one-sided (issue 11)
                    self._onesided.on_completion(int(wc.wr_id), int(wc.status), int(wc.vendor_err))
                self._on_wc_error(int(wc.status), int(wc.opcode), int(wc.vendor_err))
                if self._torn_down:
                    return
                continue
            if wc.opcode & _RECV_FLAG:
                slot = wc.wr_id & WR_INDEX_MASK
                length = wc.byte_len
                off = slot * slot_size
                if wc.opcode == _RECV_RDMA_IMM or not wc.flags & _WC_WITH_IMM:  # one-sided (issue 11)
                    view = recv_view[off : off + length]
                    if self._onesided.on_recv(wc.opcode, wc.imm_data, length, view, slot):
                        repost.append(slot)  # else held: write-notice back-pressure
                    continue
                kind = session.on_frame(wc.imm_data, length)
                if kind == _DATA_END:
                    data = rxbuf.add_message(bytes(recv_view[off : off + length]))
                    stats["messages_received"] += 1
                    stats["bytes_received"] += len(data)
                    got_data = True
                elif kind == _DATA_BATCH:
                    messages = session.on_batch(recv_view[off : off + length])
                    size = rxbuf.add_messages(messages)
                    stats["messages_received"] += len(messages)
                    stats["bytes_received"] += size
                    got_data = True
                elif kind == _DATA_MORE:
                    rxbuf.add_fragment(bytes(recv_view[off : off + length]))
                elif kind == _RNDV:  # zero-copy (issue 12): a placeholder now, the data is pulled later
                    assert self._rndv is not None  # on_frame refuses RNDV frames unless negotiated
                    self._rndv.on_request(recv_view[off : off + length])
                    got_data = True
                    repost.append(slot)
                    continue
                else:
                    # CREDIT and EOF carry no payload and never hold their slot: holding it would
                    # withhold the credit the peer needs to keep granting ours (two-way liveness).
                    if kind == _EOF:
                        got_data = True
                    repost.append(slot)
                    continue
                data_frames += 1
                if rxbuf.admit(slot):  # else held: back-pressure, no credit for it yet
                    repost.append(slot)
            else:
                op_kind = wc.wr_id >> WR_KIND_SHIFT
                if op_kind == WR_KIND_ONESIDED:  # one-sided (issue 11)
                    self._onesided.on_completion(int(wc.wr_id), 0)
                elif op_kind == KEEPALIVE_WR_KIND:  # keepalive probe acknowledged
                    self._keepalive.on_completion()
                else:
                    self._tx.on_send_completion(wc.wr_id & WR_INDEX_MASK)
        if repost:
            self._transport.post_receives(repost)
            session.on_recv_reposted(len(repost))
        self._onesided.pump()  # one-sided (issue 11): credits may have arrived
        if data_frames > session.credit_threshold and session.can_grow and not rxbuf.held:
            self._grow_receives()
        self._pump_and_post()
        if got_data:
            self._wake_reader()
        if self._tx_waiters:
            self._wake_writers()

    def _grow_receives(self) -> None:
        """One wake-up brought more than half a window of data frames: the peer is sending as fast as our
        credits let it, so double the receive window (the next frame or a CREDIT frame grants the new
        slots). Not while slots are held: then the application, not the window, is the limit."""
        added = self._transport.grow_receives(max(self._session.recv_depth, 1))
        if added:
            self._session.grow_receives(added)
            self._stats["recv_ring_grown"] += 1

    def _on_wc_error(self, status: int, opcode: int, vendor_err: int) -> None:
        if status == _FLUSH and (self._closing or self._session.peer_eof or self._disconnected):
            return  # the QP was moved to error by a disconnect: outstanding requests are cancelled
        message = (
            f"work completion failed: {verbs.wc_status_str(status)} (opcode {opcode}, vendor {vendor_err})"
        )
        error = ConnectionResetError(message, errno=104, call="ibv_poll_cq")
        self._fail(error)

    _disconnected = False

    # --- posting ------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Stage queued frames (and due EOF/credit frames) as far as credits and send slots allow.

        Frames are copied into send slots at once (so callers' buffers are free) but posted to the NIC
        together by :meth:`_post_staged` at the end of the loop iteration: one doorbell for every frame
        of the iteration, which on rxe saves a system call per frame.
        """
        if self._torn_down:
            return
        if self._tx.stage() and self._post_handle is None and not self._in_callback:
            self._post_handle = self._io.call_soon(self._post_staged_soon)

    def _pump_and_post(self) -> None:
        """Stage what credits and send slots allow and post it now, in one doorbell with anything staged
        earlier in this iteration, instead of at the end of the iteration."""
        self._in_callback = True  # _pump must not schedule the post: it happens right here
        try:
            self._pump()
        finally:
            self._in_callback = False
        if self._post_handle is not None:
            self._post_handle.cancel()  # it would find nothing left to post
        self._post_staged()

    def _post_staged_soon(self) -> None:
        """The end-of-iteration post (a loop callback): a failure fails the endpoint, nothing escapes."""
        try:
            self._post_staged()
        except Exception as exc:
            log.exception("rdmaio: posting sends failed")
            self._fail(exc)

    def _post_staged(self) -> None:
        """Post every staged frame with one chained ibv_post_send."""
        self._post_handle = None
        if not self._torn_down:
            self._tx.post()

    def _flush_and_pump(self) -> None:
        """End of a loop iteration's writes (a loop callback): queue what was coalesced, stage it and
        post it at once. A failure fails the endpoint: nothing escapes into the loop's error log."""
        self._flush_handle = None
        try:
            self._tx.flush_buffers()
            self._pump_and_post()
        except Exception as exc:
            log.exception("rdmaio: sending coalesced writes failed")
            self._fail(exc)
        if self._tx_waiters:
            self._wake_writers()

    # --- waiting ------------------------------------------------------------------------------------

    def _wake_reader(self) -> None:
        waiter = self._rx_waiter
        if waiter is not None:
            self._rx_waiter = None
            waiter.set()

    def _wake_writers(self) -> None:
        waiters, self._tx_waiters = self._tx_waiters, {}
        for waiter in waiters:
            waiter.set()

    async def _wait_readable(self) -> None:
        """Wait for received data or a state change. A reader that waits needs more than is buffered, so
        held slots are released while it waits (as asyncio's StreamReader resumes reading)."""
        if self._rx_waiter is not None and not self._rx_waiter.is_set():
            raise RuntimeError("another task is already waiting to read from this endpoint")
        waiter = self._io.waiter()
        self._rx_waiter = waiter
        self._rxbuf.reader_waiting = True
        self._repost_released()
        try:
            await waiter.wait()
        finally:
            self._rxbuf.reader_waiting = False
            if self._rx_waiter is waiter:
                self._rx_waiter = None

    async def _wait_writable(self) -> None:
        waiter = self._io.waiter()
        self._tx_waiters[waiter] = None
        try:
            await waiter.wait()
        finally:
            self._tx_waiters.pop(waiter, None)  # cancelled: do not pile up until the next wake-up

    def _check_fork(self) -> None:
        if self._generation != verbs.fork_generation():
            raise ForkError(
                "this Endpoint was created before fork(); RDMA connections cannot be used in "
                "the child process: connect again there"
            )

    def _raise_send_error(self) -> None:
        self._check_fork()
        error = self._session.send_error()
        if error is not None:
            raise error
        if self._closing:
            raise EndpointClosedError("endpoint is closing")

    def _raise_flush_error(self) -> None:
        """What waiting for data already accepted raises: not a requested EOF, which comes after it."""
        self._check_fork()
        error = self._session.flush_error()
        if error is not None:
            raise error
        if self._closing:
            raise EndpointClosedError("endpoint is closing")

    # --- message API --------------------------------------------------------------------------------

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` as one message (any bytes-like object, up to the peer's ``max_message_size``).

        ``data`` is copied, so the caller may reuse it at once - except a message of at least
        ``Options.rndv_threshold`` bytes to a peer that supports rendezvous: it is registered and pulled by
        the peer (zero-copy, :mod:`rdmaio.core.rndv_engine`), and ``send()`` returns once the peer has it (a
        cancelled one waits until the peer withdrew or finished reading it); the buffer is free when
        ``send()`` returns or raises. A message up to ``Options.batch_limit``
        (8 KiB) is packed with the other small messages of the same loop iteration into one frame, and
        ``send()`` returns once it is queued, waiting only while more than ``write_high_water`` bytes are
        queued (as ``write()`` + ``drain()``); a larger message returns once every fragment is posted to
        the NIC. Either way a failure of the connection is raised by the next call. A cancelled
        ``send()`` may still deliver the whole message (never a part of it) and leaves the endpoint
        usable.
        """
        self._raise_send_error()
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = view.nbytes
        self._session.check_message_size(size)
        if self._rndv is not None and size >= self._rndv.threshold and await self._rndv.send(view):
            return  # zero-copy (issue 12): the peer pulled it; False: no room to pin it, sent eagerly
        tx = self._tx
        if size <= tx.batch_limit:
            await self._send_batched(view, size)
            return
        tx.flush_buffers()  # keep the order of earlier stream writes and batched messages
        added = tx.queue_message(view)
        target = tx.queued_frames
        self._pump()
        if tx.txq:
            tx.own_queued(added)
        while tx.posted_frames < target:
            self._raise_send_error()
            await self._wait_writable()

    async def _send_batched(self, view: memoryview, size: int) -> None:
        """Append one small message to the batch of this loop iteration; wait only above high water.

        The first message of an iteration on an idle endpoint is posted at once instead (as a request
        or a reply usually is): waiting for the end of the iteration would cost a round trip one more
        loop iteration on each side, and there is nothing yet to batch it with.
        """
        tx = self._tx
        if tx.wbuf:
            tx.flush_wbuf()
        if (
            self._flush_handle is None
            and not tx.mbuf_count
            and not tx.txq
            and tx.free_slots
            and self._session.can_send_data()
        ):
            tx.queue_message(view)
            self._pump_and_post()
            if tx.txq:
                tx.own_queued(1)
            # Later sends of this iteration are batched, and flushed at its end.
            self._flush_handle = self._io.call_soon(self._flush_and_pump)
            return
        tx.queue_small(view, size)
        if self._flush_handle is None:
            self._flush_handle = self._io.call_soon(self._flush_and_pump)
        if tx.buffered > self._options.write_high_water:
            await self.drain()

    async def recv(self) -> bytes | None:
        """Return the next message, or ``None`` at a clean end of stream (the peer closed or wrote EOF).

        Raises :class:`~rdmaio.ConnectionResetError` if the peer went away without closing cleanly. A
        cancelled ``recv()`` takes nothing: the message stays for the next read.
        """
        rxbuf = self._rxbuf
        while True:
            while not rxbuf.has_message():
                if not await self._wait_more():
                    return None
            if not rxbuf.pending or isinstance(rxbuf.head(), bytes):
                break
            assert self._rndv is not None
            await self._rndv.take_head(None)  # zero-copy (issue 12): pulled, then popped as any message
        data = rxbuf.pop_message()
        self._after_read()
        return data

    async def recv_into(self, buffer: bytearray | memoryview) -> int:
        """Copy the next message into ``buffer`` and return its size (0 at end of stream).

        A rendezvous message that fits is read by the NIC straight into ``buffer`` (no copy; ``buffer`` is
        registered through the Domain's cache, local access only). A cancelled call takes nothing.

        A message larger than ``buffer`` fills it; the rest is returned by the next read call.
        """
        target = memoryview(buffer).cast("B")
        rxbuf = self._rxbuf
        while True:
            while not rxbuf.has_message():
                if not await self._wait_more():
                    return 0
            if not rxbuf.pending or isinstance(rxbuf.head(), bytes):
                break
            assert self._rndv is not None
            n = await self._rndv.take_head(target)  # zero-copy (issue 12): READ straight into target
            if n is not None:
                self._after_read()
                return n
        n = rxbuf.read_message_into(target)
        self._after_read()
        return n

    async def _wait_more(self) -> bool:
        """Wait for more received data; False if none will ever come (the peer's EOF); raise if the
        connection failed or was closed here."""
        self._check_fork()
        outcome = self._session.recv_outcome()
        if outcome is EOF:
            return False
        if isinstance(outcome, BaseException):
            raise outcome
        if self._torn_down:
            raise EndpointClosedError("endpoint is closed")
        await self._wait_readable()
        return True

    async def _wait_more_bytes(self) -> bool:
        """:meth:`_wait_more` for the stream reads: rendezvous messages that came meanwhile are pulled."""
        more = await self._wait_more()
        await self._settle()
        return more

    async def _settle(self) -> None:
        """Stream reads see bytes only: pull every rendezvous message still announced (issue 12)."""
        if self._rxbuf.pending:
            assert self._rndv is not None
            await self._rndv.settle()

    def _after_read(self) -> None:
        """The application took data: post the held slots again once the buffer allows it."""
        if self._rxbuf.held:
            self._repost_released()
        if self._rxbuf.pending and self._rndv is not None:
            self._rndv.kick()  # zero-copy (issue 12): pulls held back by the buffer's limit may go now

    def _repost_released(self) -> None:
        slots = self._rxbuf.releasable()
        if slots and not self._torn_down:
            self._transport.post_receives(slots)
            self._session.on_recv_reposted(len(slots))
            self._pump()

    # --- stream API: writing ------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data`` on the byte stream; small writes are coalesced into large frames."""
        self._raise_send_error()
        if self._session.eof_pending() or self._session.eof_sent:
            raise EndpointClosedError("write() after write_eof()")
        if not data:
            return
        added, coalescing = self._tx.queue_stream(data)
        if added or not coalescing:
            self._pump()
            self._tx.own_queued(added)
        if coalescing and self._flush_handle is None:
            self._flush_handle = self._io.call_soon(self._flush_and_pump)

    def writelines(self, data: Any) -> None:
        """Write every bytes-like object of an iterable."""
        for chunk in data:
            self.write(chunk)

    async def drain(self) -> None:
        """Wait until the send buffer is at or below the low-water mark, if it is above the high one.

        Below the high-water mark this returns at once and leaves small writes to be coalesced. After
        :meth:`write_eof` it still waits for the data written before (as asyncio's ``drain()``): only new
        writes are refused.
        """
        self._raise_flush_error()
        tx = self._tx
        if tx.buffered <= self._options.write_high_water:
            return
        tx.flush_buffers()
        self._pump()
        while tx.txq_bytes > self._options.write_low_water:
            self._raise_flush_error()
            await self._wait_writable()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Set the high- and low-water marks of :meth:`drain`, with ``WriteTransport``'s defaults.

        No arguments: 64 KiB and 16 KiB; only ``low``: high is ``4 * low``; only ``high``: low is
        ``high // 4``.
        """
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not 0 <= low <= high:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._options = dataclasses.replace(self._options, write_high_water=high, write_low_water=low)

    def get_write_buffer_size(self) -> int:
        """Bytes queued for sending and not yet posted to the NIC."""
        return self._tx.buffered

    def can_write_eof(self) -> bool:
        """Always True: half-close is supported."""
        return True

    def write_eof(self) -> None:
        """Close the sending direction after the queued data; the peer reads EOF, we can still read."""
        if self._torn_down:
            return
        self._tx.flush_buffers()
        self._session.write_eof()
        self._pump()

    # --- stream API: reading ------------------------------------------------------------------------
    # Every read call takes its data only once it can return: a cancelled read consumes nothing.

    async def _read_some(self, n: int) -> bytes:
        """Up to ``n`` bytes (n > 0) of the stream; b"" at EOF. Skips empty messages."""
        rxbuf = self._rxbuf
        await self._settle()
        while not rxbuf.unread:
            rxbuf.skip_empty()
            if not await self._wait_more_bytes():
                return b""
        data = rxbuf.take(n)
        self._after_read()
        return data

    async def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (``n < 0``: until EOF). Returns b"" at EOF."""
        if n == 0:
            return b""
        if n > 0:
            return await self._read_some(n)
        await self._settle()
        while await self._wait_more_bytes():
            pass
        data = self._rxbuf.take_all()
        self._after_read()
        return data

    async def readexactly(self, n: int) -> bytes:
        """Read exactly ``n`` bytes; raise ``asyncio.IncompleteReadError`` if EOF comes first.

        As asyncio's: nothing is consumed until ``n`` bytes are there (a cancelled call loses nothing);
        at EOF the partial data is consumed and carried by the error.
        """
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        if n == 0:
            return b""
        rxbuf = self._rxbuf
        await self._settle()
        while rxbuf.unread < n:
            if not await self._wait_more_bytes():
                partial = rxbuf.take_all()
                self._after_read()
                raise asyncio.IncompleteReadError(partial, n)
        data = rxbuf.take(n)
        self._after_read()
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        """Read up to and including ``separator`` (asyncio semantics, including ``LimitOverrunError``)."""
        if not separator:
            raise ValueError("Separator should be at least one-byte string")
        limit = self._options.read_limit
        seplen = len(separator)
        rxbuf = self._rxbuf
        await self._settle()
        while True:
            index = rxbuf.find(separator)
            if index >= 0:
                end = index + seplen
                if end > limit:
                    raise asyncio.LimitOverrunError(
                        "Separator is found, but chunk is longer than limit", index
                    )
                data = rxbuf.take(end)
                self._after_read()
                return data
            if rxbuf.unread > limit:
                raise asyncio.LimitOverrunError(
                    "Separator is not found, and chunk exceed the limit", rxbuf.unread - seplen + 1
                )
            if not await self._wait_more_bytes():
                partial = rxbuf.take_all()
                self._after_read()
                raise asyncio.IncompleteReadError(partial, None)

    async def readline(self) -> bytes:
        """Read one line (asyncio semantics: at EOF the partial line; b"" when nothing is left)."""
        try:
            return await self.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial
        except asyncio.LimitOverrunError as exc:
            if self._rxbuf.startswith(b"\n", exc.consumed):
                self._rxbuf.take(exc.consumed + 1)
            else:
                self._rxbuf.clear()
            self._after_read()
            raise ValueError(exc.args[0]) from exc

    def at_eof(self) -> bool:
        """True when the buffer is empty and the peer sent EOF (or the connection ended)."""
        return (
            self._rxbuf.unread == 0
            and not self._rxbuf.pending
            and (self._session.peer_eof or self._torn_down)
        )

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[bytes]:
        while line := await self.readline():
            yield line

    # --- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Start a graceful close: queued data is sent, then EOF, then the connection is released.

        Returns immediately; await :meth:`wait_closed` (or use :meth:`aclose`) to wait for the end.
        """
        if self._closing or self._torn_down:
            return
        self._closing = True
        if self._generation != verbs.fork_generation():
            self._teardown()
            return
        self._session.close()
        try:
            self._tx.flush_buffers()
            self._pump()
        except Exception as exc:  # never leave a close half done: release everything instead
            log.exception("rdmaio: flushing on close failed; aborting the connection")
            self._fail(exc)
            return
        self._io.spawn(self._graceful_close(), name=f"rdmaio close qp {self._qp.qp_num}")

    async def _graceful_close(self) -> None:
        try:
            async with self._io.timeout(self._options.close_timeout):
                while not self._torn_down and (
                    self._tx.txq or not self._tx.eof_done or (self._rndv is not None and self._rndv.sending)
                ):
                    await self._wait_writable()
        except TimeoutError:
            log.debug("rdmaio: close timed out with %d bytes unsent; aborting", self._tx.buffered)
        finally:
            self._teardown()

    async def wait_closed(self) -> None:
        """Wait until the connection is fully released."""
        await self._closed.wait()

    async def aclose(self) -> None:
        """Close gracefully and wait until released."""
        self.close()
        await self.wait_closed()

    def abort(self) -> None:
        """Close at once: queued data is dropped and pending calls fail with ConnectionAbortedError."""
        if self._torn_down:
            return
        self._closing = True
        self._session.abort()
        self._tx.clear()
        self._teardown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _add_close_callback(self, callback: Callable[[Endpoint], None]) -> None:
        """Call ``callback(self)`` once every resource is released (at once if that already happened)."""
        if self._torn_down:
            callback(self)
        else:
            self._close_callbacks.append(callback)

    def _fail(self, exc: BaseException) -> None:
        """A transport or protocol failure: every pending and later operation fails."""
        if self._torn_down:
            return
        if isinstance(exc, ProtocolError):
            self._session.abort(exc)
        else:
            self._session.on_transport_error(exc)
        self._teardown()

    def _teardown(self) -> None:
        """Release every verbs resource (QP first) and wake every waiter. Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        self._closing = True
        self._keepalive.stop()
        for handle in (self._flush_handle, self._post_handle):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._post_handle = None
        forked = self._generation != verbs.fork_generation()
        if not forked:
            self._reactor.unwatch_qp(*self._async_key)
            self._reactor.unwatch_port(self._async_key[0], self._extra["port"], self._extra["qp_num"])
            if not self._disconnected:
                with contextlib.suppress(VerbsError):  # the peer may have disconnected already
                    self._cm_id.disconnect()
            try:
                self._transport.close()
            finally:
                self._reactor.release_id(self._cm_id)
        self._session.mark_closed()
        self._onesided.close(self._session.flush_error())  # one-sided (issue 11): the QP is gone now
        if self._rndv is not None:  # zero-copy (issue 12): after the QP, so no READ runs any more
            self._rndv.close(self._session.flush_error())
        self._wake_reader()
        self._wake_writers()
        self._closed.set()
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("rdmaio: close callback %r failed", callback)

    def _on_cm_event(self, event: CMEvent) -> None:
        if event.event == CMEventType.DISCONNECTED:
            # Completions that raced the disconnect (the peer's last frames, its EOF) come first; the
            # flag makes the flush completions that follow a disconnect count as cancellations.
            self._disconnected = True
            self._poll_completions()
            self._session.on_disconnected()
            self._teardown()
        elif event.event == CMEventType.DEVICE_REMOVAL:
            self._fail(ConnectionResetError("RDMA device removed", call="rdma_get_cm_event"))
        else:
            log.debug("rdmaio: ignoring %s on an established connection", event.event.name)

    def _on_port_event(self, event: verbs.AsyncEvent) -> None:
        """PORT_ERR: probe the peer at once (keepalive), so a port that stays down fails this connection
        within the retry budget, busy or idle; a port back within the budget lets the probe complete.
        PORT_ACTIVE is only counted."""
        if event.event_type == verbs.EVENT_PORT_ERR:
            self._stats["port_errors"] += 1
            self._keepalive.probe_now()
        else:
            self._stats["port_active"] += 1

    def _on_async_event(self, event: verbs.AsyncEvent) -> None:
        if event.event_type == verbs.EVENT_DEVICE_FATAL:  # also the reactor's word for a removed device
            self._fail(ConnectionResetError(event.description, call="ibv_get_async_event"))
            return
        self._fail(ConnectionAbortedError(f"device reported {event.description}", call="ibv_get_async_event"))

    # --- one-sided RDMA (issue 11; the work is rdmaio.core.onesided.OneSidedEngine's) -----------------

    def export(
        self, buffer: Any, offset: int = 0, length: int | None = None, access: str = "rw"
    ) -> RemoteKey:
        """Let the peer access ``buffer[offset:offset+length]`` with one-sided operations; return the key.

        ``buffer`` is any writable buffer (bytearray, memoryview, mmap, numpy array); ``length=None`` means
        to its end. ``access`` is a string of ``"r"`` (RDMA READ), ``"w"`` (RDMA WRITE) and ``"a"``
        (atomics). Exactly that range is registered (its own memory region, with only those remote access
        flags) and stays registered, with ``buffer`` kept alive, until :meth:`revoke` or the end of the
        connection. Send ``bytes(key)`` (at most 64 bytes) to the peer, which rebuilds the key with
        :meth:`RemoteKey.from_bytes`.
        """
        self._check_fork()
        return self._onesided.export(buffer, offset, length, access)

    async def revoke(self, key: RemoteKey) -> None:
        """Revoke a key this side exported: when this returns, the peer can no longer touch that memory.

        The peer is told first (its later calls on the key raise :class:`~rdmaio.RemoteKeyRevokedError`
        without posting) and answers once the requests it posted before have run; then the memory is
        deregistered, so the NIC refuses the key even to a peer that ignores the message. Waits at most
        ``Options.close_timeout`` for the answer; cancelled or failed, it still deregisters.
        """
        self._check_fork()
        await self._onesided.revoke(key)

    async def wait_write_notice(self) -> WriteNotice:
        """Wait for the next :class:`~rdmaio.WriteNotice`: the peer did ``rdma_write(..., imm=...)`` into
        memory we exported (the data is in place when the notice arrives)."""
        self._check_fork()
        return await self._onesided.wait_write_notice()

    async def rdma_read(self, key: RemoteKey, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset`` of the peer's exported memory (RDMA READ).

        Raises :class:`~rdmaio.RemoteAccessError` before posting if the range is outside the key or the key
        lacks ``"r"``. The NIC writes into rdmaio-owned registered memory, so a cancelled call is safe and
        leaves the endpoint usable.
        """
        self._check_fork()
        return await self._onesided.read(key, offset, length)

    async def rdma_read_into(self, key: RemoteKey, offset: int, buffer: Any) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` of the peer's memory straight into ``buffer``.

        Zero-copy: ``buffer`` is registered (local access only, cached in the Domain). **Cancellation fails
        the endpoint**: if the call is cancelled while the READ is in flight, the connection is aborted
        (its queue pair destroyed, so the NIC can no longer write into ``buffer``) before the cancellation
        propagates; use :meth:`rdma_read` where cancellation must leave the connection usable.
        """
        self._check_fork()
        return await self._onesided.read_into(key, offset, buffer)

    async def rdma_write(self, key: RemoteKey, offset: int, data: Any, imm: int | None = None) -> None:
        """Write ``data`` at ``offset`` of the peer's exported memory (RDMA WRITE); returns once it is done.

        ``data`` is copied first, so it may be reused at once. With ``imm`` (an unsigned 32-bit value) the
        write carries immediate data and the peer gets a :class:`~rdmaio.WriteNotice` from
        :meth:`wait_write_notice`; such a write uses a send credit, like a message. A cancelled call may
        still perform the write.
        """
        self._check_fork()
        await self._onesided.write(key, offset, data, imm)

    async def fetch_add(self, key: RemoteKey, offset: int, add: int) -> int:
        """Atomically add ``add`` (modulo 2**64) to the u64 at ``offset`` (8-byte aligned, in the
        exporter's byte order); return the old value. The key needs ``"a"``."""
        self._check_fork()
        return await self._onesided.fetch_add(key, offset, add)

    async def compare_swap(self, key: RemoteKey, offset: int, expected: int, desired: int) -> int:
        """Atomically store ``desired`` in the u64 at ``offset`` if it equals ``expected``; return the old
        value (the swap happened if it equals ``expected``). 8-byte aligned; the key needs ``"a"``."""
        self._check_fork()
        return await self._onesided.compare_swap(key, offset, expected, desired)

    def __repr__(self) -> str:
        state = "closed" if self._torn_down else "closing" if self._closing else "open"
        return (
            f"<rdmaio.Endpoint {state} {self._extra['sockname']} -> {self._extra['peername']} "
            f"qp={self._extra['qp_num']}>"
        )
