"""Connection: the core of one :class:`~rdmaio.Endpoint` - its parts, its completions and its lifetime.

Data path. Every frame travels as one SEND-with-immediate from a registered send slot into a registered
receive slot of the peer; the immediate value carries the frame kind and piggybacked credits
(:mod:`rdmaio.protocol`). The send side is one :class:`~rdmaio.core.send.Sender` (the send calls, the send
queue, every post of a frame); the receive side one :class:`~rdmaio.core.receive.Receiver` (received
frames, the read calls, every re-post of a receive slot). One-sided operations are the
:class:`~rdmaio.core.onesided.OneSidedEngine`'s, zero-copy messages the
:class:`~rdmaio.core.rendezvous.RendezvousEngine`'s, idle probes the
:class:`~rdmaio.core.keepalive.Keepalive`'s.

This class builds those parts (each gets what it needs in its constructor: no part imports this module),
demultiplexes this connection's group of each completion batch from the domain's dispatcher
(:mod:`rdmaio.core.dispatch`) to them, and owns the connection's lifetime: close, failure, teardown,
rdma_cm and async events. Internal: the public front is :class:`rdmaio.Endpoint`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

from rdmaio import verbs
from rdmaio.core.backend import Event, Handle
from rdmaio.core.keepalive import KEEPALIVE_WR_KIND, RDMA_CM_ACK_TIMEOUT, Keepalive, retry_budget
from rdmaio.core.metrics import connection_failed, fold_connection, register_connection
from rdmaio.core.onesided import UNUSED_STATISTICS, WR_KIND_ONESIDED, OneSidedEngine
from rdmaio.core.reactor import Reactor
from rdmaio.core.receive import Receiver
from rdmaio.core.rendezvous import RendezvousEngine
from rdmaio.core.send import Sender, check_fork
from rdmaio.core.transport import Transport
from rdmaio.errors import (
    ConnectionAbortedError,
    ConnectionResetError,
    ProtocolError,
    VerbsError,
)
from rdmaio.options import Options
from rdmaio.protocol import Session
from rdmaio.protocol.framing import CONTROL_WORD, encode_frame_header
from rdmaio.verbs import WR_INDEX_MASK, WR_KIND_SHIFT, CMEvent, CMEventType, CMId, WcStatus, make_wr_id
from rdmaio.verbs import _base as _fork_state
from rdmaio.verbs.native import lib

__all__ = ["Connection"]

log = logging.getLogger("rdmaio")

_RECV_FLAG = 0x80  # IBV_WC_RECV bit of a completion opcode
_FLUSH = int(WcStatus.WR_FLUSH_ERR)
_control_frame_due = lib.rdmaio_session_control_frame_due  # one C call: is an EOF or CREDIT frame due?
_txring_complete = lib.rdmaio_txring_complete  # one C call: a signalled send's entries are released

_STAT_KEYS = (
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
)


def _activity(ref: weakref.ReferenceType[Connection]) -> int:
    """The keepalive's activity count of the connection behind ``ref``: completions plus frames posted
    (0 once it is gone)."""
    conn = ref()
    return conn.completions + conn.sender.frames_posted if conn is not None else 0


def _weak_call(method: Callable[[BaseException], None]) -> Callable[[BaseException], None]:
    """``method`` through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(exc: BaseException) -> None:
        bound = ref()
        if bound is not None:
            bound(exc)

    return call


class _OneSidedOnDemand:
    """The receiver's one-sided handler until the connection's engine exists: the peer's first control
    message or write notice builds it (:attr:`Connection.onesided`), which takes this object's place and
    handles that message. Made without an ``__init__`` (connection setup's Python calls are budgeted)."""

    __slots__ = ("connection",)

    connection: weakref.ReferenceType[Connection]

    def on_recv(self, opcode: int, imm: int, length: int, view: memoryview, slot: int) -> bool:
        """Build the engine and hand it the message (True: repost the slot now, False: held)."""
        conn = self.connection()
        if conn is None:  # the connection is gone: nothing holds the slot
            return True
        return conn.onesided.on_recv(opcode, imm, length, view, slot)


class Connection:
    """One established connection's parts and lifetime (see the module docstring).

    It owns the transport (verbs resources), the session (sans-IO protocol state), the sender, the
    receiver, the one-sided and rendezvous engines and the keepalive; it hands each completion batch to
    them and tears everything down.
    """

    def __init__(
        self, reactor: Reactor, cm_id: CMId, transport: Transport, session: Session, options: Options
    ) -> None:
        self.io = reactor.backend
        self._reactor = reactor
        self._cm_id = cm_id
        self.transport = transport
        self.session = session
        # The verbs layer's fork count, read inline here and at close and teardown (as check_fork does):
        # verbs.fork_generation() without its call.
        self.generation = _fork_state._generation
        qp = transport.qp
        self.qp = qp
        self.max_inline = min(transport.max_inline, options.max_inline)
        #: The negotiated framing (rdmaio.protocol.framing): ``framing.immediate`` is false in the header
        #: framing (a device without immediate data, or ``Options.framing = "header"`` on either side).
        self.framing = session.framing
        self.extra: dict[str, Any] = {
            "peername": cm_id.peer_address,
            "sockname": cm_id.local_address,
            "device": transport.device.name,
            "port": cm_id.port_num,
            "qp_num": qp.qp_num,
            "max_inline": self.max_inline,
            "options": options,
            # The largest message the peer accepts (its handshake): what send() checks against.
            "peer_max_message_size": session.peer.max_message_size,
            "framing": session.framing.name,
        }
        # The rarer counters (and the rendezvous and one-sided engines' own); the per-message ones are
        # plain int attributes of their owner (this connection's wakeups and completions, the sender's and
        # the receiver's), which statistics() adds in: a Counter's ``+=`` costs several times an int
        # attribute's, and those run many times per message.
        self.stats = collections.Counter[str]()
        self.wakeups = 0
        self.completions = 0
        fail = _weak_call(self.fail)  # no part -> connection cycle: a closed connection is freed at once
        self.sender = Sender(
            session,
            qp,
            transport.send_ring,
            transport.slot_size,
            io=self.io,
            options=options,
            initial=options.initial_depth,
            max_inline=self.max_inline,
            signal_interval=options.signal_interval,
            batch_limit=options.batch_limit,
            stats=self.stats,
            tag=transport.tag or 0,  # sharedcq: the connection tag of the send wr_ids
            fail=fail,
            generation=self.generation,
        )
        self.receiver = Receiver(
            session,
            transport,
            transport.recv_ring.view,
            io=self.io,
            options=options,
            stats=self.stats,
            stage=self.sender.stage,
            generation=self.generation,
        )
        self.rxbuf = self.receiver.rxbuf
        self._options = options
        # one-sided RDMA: built on first use (the onesided property), by this side's first one-sided call
        # or export or the peer's first control message or write notice; most connections never use it.
        # Until then the receiver's one-sided handler is the stand-in that builds it.
        self._onesided: OneSidedEngine | None = None
        on_demand = _OneSidedOnDemand()
        on_demand.connection = weakref.ref(self)
        self.receiver.onesided = on_demand
        self.rndv = RendezvousEngine.for_connection(self, transport, options)  # zero-copy (None: not used)
        self.receiver.rndv = self.rndv
        self.sender.rndv = self.rndv
        self._close_timer: Handle | None = None  # bounds a graceful close (Options.close_timeout)
        # lifetime
        self.closing = False
        self.torn_down = False
        self.closed: Event = self.io.event()
        self._close_callbacks: list[Callable[[], None]] = []
        self._start(reactor, cm_id, transport, fail)
        register_connection(self)  # process metrics: read from this connection's counters, folded at teardown

    @property
    def onesided(self) -> OneSidedEngine:
        """The connection's one-sided engine (:class:`~rdmaio.core.onesided.OneSidedEngine`), built on the
        first use: an engine built after teardown is closed at once, as teardown closes one."""
        engine = self._onesided
        return engine if engine is not None else self._build_onesided()

    def _build_onesided(self) -> OneSidedEngine:
        """Build the one-sided engine and wire it in (once: :attr:`onesided`)."""
        session = self.session
        engine = OneSidedEngine.for_connection(self, self.transport, session, self._options)
        if not session.framing.immediate:
            # The header framing: control messages are plain SENDs told apart by their header's kind, and a
            # write notice is a plain WRITE followed by a control message (no WRITE with immediate).
            engine.operations.control_header = encode_frame_header(CONTROL_WORD)
            engine.write_notice_by_message = True
        if self.rndv is not None:  # the rendezvous engine's control messages (ACK, cancellation)
            engine.control_handler = self.rndv.on_control
        self._onesided = engine
        self.receiver.onesided = engine  # its held write-notice slots go back through the receiver
        if self.torn_down:  # a late first use: the QP is gone, so is every op (as teardown closes it)
            engine.close(session.flush_error())
        return engine

    @property
    def options(self) -> Options:
        """The connection's options (replaced by :meth:`rdmaio.Endpoint.set_write_buffer_limits`)."""
        return self._options

    @options.setter
    def options(self, options: Options) -> None:
        self._options = self.sender.options = self.receiver.options = options

    def _start(
        self, reactor: Reactor, cm_id: CMId, transport: Transport, fail: Callable[[BaseException], None]
    ) -> None:
        """Route this connection's events and completions here and start the keepalive; ``fail`` is
        :meth:`fail` through a weak reference (the parts' one)."""
        qp = self.qp
        post_probe = self.sender.post_probe
        # keepalive (rdmaio.core.keepalive): probes the peer when idle, so a vanished peer fails the
        # connection. Its probes' completions are routed to it by on_completions.
        this = weakref.ref(self)  # no connection <-> keepalive cycle (the keepalive is ours)
        # The tag routes the probe's completion back here through the shared CQ.
        keepalive_wr_id = make_wr_id(KEEPALIVE_WR_KIND, transport.tag or 0, 0)
        # iWARP (what this side announced: no immediate data is the iWARP transport's mark) completes a
        # WRITE without the peer and has no retry counter: probe with a READ, under the retry budget as
        # deadline (rdmaio.core.keepalive). Elsewhere the WRITE probe, failed by the QP's retry counter.
        local_caps = self.session.local.caps
        iwarp = local_caps is not None and not local_caps.immediate
        options = self._options
        ack_timeout = options.ack_timeout or RDMA_CM_ACK_TIMEOUT  # None: rdma_cm's default
        probe_deadline = retry_budget(ack_timeout, options.retry_count) if iwarp else None
        self._keepalive = Keepalive(
            reactor.keepalive_timers,
            options.keepalive_interval,
            lambda: _activity(this),
            lambda: post_probe(keepalive_wr_id, iwarp),  # through the sender, which owns posting on the SQ
            fail,  # weak: no connection <-> keepalive cycle, a closed one is freed at once
            name=f"rdmaio keepalive qp {qp.qp_num}",
            probe_deadline=probe_deadline,
        )
        reactor.set_handler(cm_id, self._on_cm_event)
        self._async_key = (transport.device.handle, qp.qp_num, transport.cq.handle)
        reactor.watch_qp(*self._async_key, self._on_async_event)
        # sharedcq: completions come from the domain's dispatcher (those kept since the QP was registered
        # go first).
        transport.set_completion_handler(self.on_completions)
        shared = transport.shared
        if shared is not None:  # the shared receive pool fails us for an overrun or a silent peer
            shared.on_failure = fail
        # Completions may already be waiting (the peer can send as soon as it is established).
        self.io.call_soon(self.poll_completions)
        self._keepalive.start()
        reactor.watch_port(transport.device.handle, cm_id.port_num, qp.qp_num, self._on_port_event)

    # --- information -------------------------------------------------------------------------------

    def statistics(self) -> dict[str, float]:
        """The counters :meth:`rdmaio.Endpoint.statistics` returns."""
        stats: dict[str, float] = dict(self.stats)
        for key in _STAT_KEYS:
            stats.setdefault(key, 0)
        # The per-message counters kept as attributes; added, not set: the rendezvous engine counts its
        # messages and bytes in the Counter.
        sender = self.sender
        receiver = self.receiver
        stats["wakeups"] += self.wakeups
        stats["completions"] += self.completions
        stats["messages_sent"] += sender.messages_sent
        stats["bytes_sent"] += sender.bytes_sent
        stats["frames_posted"] += sender.frames_posted
        stats["post_calls"] += sender.post_calls
        stats["messages_received"] += receiver.messages_received
        stats["bytes_received"] += receiver.bytes_received
        stats["registered_bytes"] = self.transport.registered_bytes if not self.torn_down else 0
        stats["mean_batch"] = stats["completions"] / stats["wakeups"] if stats["wakeups"] else 0.0
        stats["send_credits"] = self.session.send_credits
        stats["credits_ungranted"] = self.session.ungranted
        stats["recv_buffered"] = self.rxbuf.buffered
        stats["recv_held_slots"] = self.rxbuf.held
        stats["send_waiters"] = len(self.sender.waiters)
        stats["send_buffered"] = self.sender.buffered
        stats["keepalive_probes"] = self._keepalive.probes_sent
        # one-sided: pending ops, grants, queued notices (all 0 while the engine was never built)
        onesided = self._onesided
        stats.update(onesided.statistics() if onesided is not None else UNUSED_STATISTICS)
        for key, value in self.session.statistics().items():
            stats[f"protocol_{key}"] = value
        if self.rndv is not None:  # zero-copy
            stats.update(self.rndv.statistics())
        return stats

    # --- completions: each batch's group, demultiplexed ---------------------------------------------

    def poll_completions(self) -> None:
        """Poll the shared CQs now: this connection's completions come to :meth:`on_completions`."""
        if not self.torn_down:
            self.transport.poll_completions()

    disconnected = False  # rdma_cm said DISCONNECTED: flush completions are cancellations

    def on_completions(self, records: Any, start: int, count: int) -> None:
        """The dispatcher's handler: ``records[start:start + count]`` are this connection's, in CQ order.

        Receives go to the receiver in one call per run of completions (:meth:`Receiver.on_batch`), send
        completions to the sender, one-sided ones to the one-sided engine, a keepalive probe's to the
        keepalive; a failed completion fails the connection unless it is a flush after a close or
        disconnect (the receives before it in CQ order are processed first). Then the sender transmits
        what the batch made possible."""
        if self.torn_down:
            return
        try:
            self.wakeups += 1
            # sharedcq: the dispatcher calls once per group and re-polls while batches come back full.
            self.completions += count
            wc = records[start] if count == 1 else None
            if wc is not None and not wc.status and wc.opcode & _RECV_FLAG:
                # One successful receive, a request/reply connection's usual wake-up: the loop below for it
                # alone, without its bookkeeping (keep the two the same).
                self.receiver.on_batch(records, start, 1)
            else:
                run = start  # the receives from here on are not processed yet
                receives = False
                only_onesided = True  # every completion was a successful one-sided request of ours
                for i in range(start, start + count):
                    wc = records[i]
                    if wc.status:
                        only_onesided = False
                        if receives:
                            receives = False
                            self.receiver.on_batch(records, run, i - run)
                        run = i + 1
                        if wc.wr_id >> WR_KIND_SHIFT == WR_KIND_ONESIDED:  # one-sided
                            self.onesided.on_completion(int(wc.wr_id), int(wc.status), int(wc.vendor_err))
                        self._on_wc_error(int(wc.status), int(wc.opcode), int(wc.vendor_err))
                        if self.torn_down:
                            return
                    elif wc.opcode & _RECV_FLAG:
                        receives = True
                    else:
                        op_kind = wc.wr_id >> WR_KIND_SHIFT
                        if op_kind == WR_KIND_ONESIDED:  # one-sided (the engine exists: it posted it)
                            onesided = self._onesided
                            assert onesided is not None
                            onesided.on_completion(int(wc.wr_id), 0)
                            continue
                        only_onesided = False
                        if op_kind == KEEPALIVE_WR_KIND:  # keepalive probe acknowledged
                            self._keepalive.on_completion()
                        elif _txring_complete(self.sender.tx, wc.wr_id & WR_INDEX_MASK):
                            # Sender.on_send_completion(), inline: the entries up to it are released in C.
                            self.sender.eof_done = True  # it was the EOF frame
                if receives:
                    only_onesided = False
                    self.receiver.on_batch(records, run, start + count - run)
                if only_onesided:
                    # READ/WRITE/atomic completions free no send slot, bring no credit and no data: the sender
                    # and the reader have nothing new (a serial one-sided caller polls after every post, so
                    # this is its per-request path). What waits for a free op slot was woken by on_completion.
                    onesided = self._onesided
                    if onesided is not None and onesided.operations.waiting_for_credit:
                        onesided.pump()
                    return
            onesided = self._onesided  # None: never used, nothing waits
            if onesided is not None and onesided.operations.waiting_for_credit:  # else nothing to post
                onesided.pump()  # one-sided: credits may have arrived
            # on_batch_end() only when it has something to do (its own test, inline): else the batch just
            # lets the next small message go at once.
            sender = self.sender
            state = sender.plain_state
            if (
                state is None
                or sender.queue.txq
                or sender.staged
                or sender.waiters
                or _control_frame_due(state)
            ):
                sender.on_batch_end()
            else:
                sender.coalesce_next = False
            if self.closing:
                self.finish_close()  # a graceful close ends when its last send completes
        except ProtocolError as exc:
            log.warning("rdmaio: protocol violation by %s: %s", self.extra["peername"], exc)
            self.fail(exc)
        except Exception as exc:
            log.exception("rdmaio: completion processing failed")
            self.fail(exc)

    def _on_wc_error(self, status: int, opcode: int, vendor_err: int) -> None:
        if status == _FLUSH and (self.closing or self.session.peer_eof or self.disconnected):
            return  # the QP was moved to error by a disconnect: outstanding requests are cancelled
        message = (
            f"work completion failed: {verbs.wc_status_str(status)} (opcode {opcode}, vendor {vendor_err})"
        )
        self.fail(ConnectionResetError(message, errno=104, call="ibv_poll_cq"))

    def check_fork(self) -> None:
        """Raise :class:`~rdmaio.errors.ForkError` in a child process (the verbs objects are unusable)."""
        check_fork(self.generation)

    # --- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Start a graceful close (see :meth:`rdmaio.Endpoint.close`)."""
        if self.closing or self.torn_down:
            return
        self.closing = True
        if self.generation != _fork_state._generation:
            self.teardown()
            return
        self.session.close()
        try:
            self.sender.close()
        except Exception as exc:  # never leave a close half done: release everything instead
            log.exception("rdmaio: flushing on close failed; aborting the connection")
            self.fail(exc)
            return
        # No task waits for the close to finish: completion processing calls finish_close() after every
        # batch while closing (the EOF's completion is the usual last step), and a timer bounds it.
        timeout = self._options.close_timeout
        if timeout is not None:
            self._close_timer = self.io.call_later(timeout, self._close_timed_out)
        self.io.call_soon(self.finish_close)  # nothing left to wait for (EOF done before): next iteration

    def finish_close(self) -> None:
        """Tear down a graceful close once the queued data, the EOF and any zero-copy send are done."""
        if self.torn_down or not self.closing:
            return
        if not self.sender.done or (self.rndv is not None and self.rndv.sending):
            return
        self.teardown()

    def _close_timed_out(self) -> None:
        if not self.torn_down:
            log.debug("rdmaio: close timed out with %d bytes unsent; aborting", self.sender.buffered)
            self.teardown()

    def abort(self) -> None:
        """Close at once (see :meth:`rdmaio.Endpoint.abort`)."""
        if self.torn_down:
            return
        self.closing = True
        self.session.abort()
        self.sender.abort()
        self.teardown()

    def add_close_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once every resource is released (at once if that already happened)."""
        if self.torn_down:
            callback()
        else:
            self._close_callbacks.append(callback)

    def fail(self, exc: BaseException) -> None:
        """A transport or protocol failure: every pending and later operation fails."""
        if self.torn_down:
            return
        connection_failed(self, exc, self._keepalive.outstanding)  # process metrics: once per connection
        if isinstance(exc, ProtocolError):
            self.session.abort(exc)
        else:
            self.session.on_transport_error(exc)
        self.teardown()

    def teardown(self) -> None:
        """Release every verbs resource (QP first) and wake every waiter. Idempotent."""
        if self.torn_down:
            return
        self.torn_down = True
        self.closing = True
        self._keepalive.stop()
        # Both stop at once (no more posts or re-posts); the waiters they wake run after this returns.
        self.sender.stop()
        self.receiver.stop()
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        if self.generation == _fork_state._generation:  # not forked
            self._release_verbs()
        self.session.mark_closed()
        if self._onesided is not None:  # one-sided (if ever used): the QP is gone now
            self._onesided.close(self.session.flush_error())
        if self.rndv is not None:  # zero-copy: after the QP, so no READ runs any more
            self.rndv.close(self.session.flush_error())
        fold_connection(self)  # its final counters into the process metrics
        self.closed.set()
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("rdmaio: close callback %r failed", callback)

    def _release_verbs(self) -> None:
        """Stop the event routing, disconnect, and release the transport and the CM id (teardown's part)."""
        self._reactor.unwatch_qp(*self._async_key)
        self._reactor.unwatch_port(self._async_key[0], self.extra["port"], self.extra["qp_num"])
        if not self.disconnected:
            with contextlib.suppress(VerbsError):  # the peer may have disconnected already
                self._cm_id.disconnect()
        try:
            self.transport.close()
        finally:
            self._reactor.release_id(self._cm_id)

    # --- rdma_cm and async events -------------------------------------------------------------------

    def _on_cm_event(self, event: CMEvent) -> None:
        if event.event == CMEventType.DISCONNECTED:
            # Completions that raced the disconnect (the peer's last frames, its EOF) come first; the
            # flag makes the flush completions that follow a disconnect count as cancellations.
            self.disconnected = True
            self.poll_completions()
            self.session.on_disconnected()
            self.teardown()
        elif event.event == CMEventType.DEVICE_REMOVAL:
            self.fail(ConnectionResetError("RDMA device removed", call="rdma_get_cm_event"))
        else:
            log.debug("rdmaio: ignoring %s on an established connection", event.event.name)

    def _on_port_event(self, event: verbs.AsyncEvent) -> None:
        """PORT_ERR: probe the peer at once (keepalive), so a port that stays down fails this connection
        within the retry budget, busy or idle; a port back within the budget lets the probe complete.
        PORT_ACTIVE is only counted."""
        if event.event_type == verbs.EVENT_PORT_ERR:
            self.stats["port_errors"] += 1
            self._keepalive.probe_now()
        else:
            self.stats["port_active"] += 1

    def _on_async_event(self, event: verbs.AsyncEvent) -> None:
        if event.event_type == verbs.EVENT_DEVICE_FATAL:  # also the reactor's word for a removed device
            self.fail(ConnectionResetError(event.description, call="ibv_get_async_event"))
            return
        self.fail(ConnectionAbortedError(f"device reported {event.description}", call="ibv_get_async_event"))
