"""Connection: the core of one :class:`~rdmaio.Endpoint` - its resources, completions, posting and lifetime.

Data path. Every frame travels as one SEND-with-immediate from a registered send slot into a registered
receive slot of the peer; the immediate value carries the frame kind and piggybacked credits
(:mod:`rdmaio.protocol`). Completions come from the domain's shared CQs (:mod:`rdmaio.core.completions`): one
wake-up of its completion channel polls a whole batch through the C helper, grouped by connection, and
this connection's :class:`~rdmaio.core.processing.CompletionProcessor` gets its own group of it. A send
never meets an empty receive queue. The send side's queue, coalescing, slots and
posting are :mod:`rdmaio.core.txengine`'s; this class decides when to stage and post, wakes who waits, and
owns the connection's lifetime (close, failure, teardown, rdma_cm and async events, keepalive).

The public front is :class:`rdmaio.Endpoint`; the reads are :mod:`rdmaio.core.reader`'s and the sends
:mod:`rdmaio.core.writer`'s, both on top of this class. Internal: its attributes and methods are shared by
those modules and the one-sided and rendezvous engines, not a public API.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

from rdmaio import verbs
from rdmaio.core.backend import Event, Handle, Waiter
from rdmaio.core.keepalive import KEEPALIVE_WR_KIND, Keepalive
from rdmaio.core.onesided import OneSidedEngine
from rdmaio.core.processing import CompletionProcessor
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
from rdmaio.protocol import Session
from rdmaio.protocol.rxbuffer import ReceiveBuffer
from rdmaio.verbs import CMEvent, CMEventType, CMId, make_wr_id
from rdmaio.verbs import _base as _fork_state  # its _generation is read on every send: no call

__all__ = ["Connection"]

log = logging.getLogger("rdmaio")

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


def _weak_call(method: Callable[[BaseException], None]) -> Callable[[BaseException], None]:
    """``method`` through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(exc: BaseException) -> None:
        bound = ref()
        if bound is not None:
            bound(exc)

    return call


class Connection:
    """One established connection's resources and machinery (see the module docstring).

    It owns the transport (verbs resources), the session (sans-IO protocol state), the send engine, the
    receive buffer, the one-sided and rendezvous engines and the keepalive; it processes this connection's
    completions, stages and posts frames, wakes the waiting reader and writers, and tears everything down.
    """

    def __init__(
        self, reactor: Reactor, cm_id: CMId, transport: Transport, session: Session, options: Options
    ) -> None:
        self.io = reactor.backend
        self._reactor = reactor
        self._cm_id = cm_id
        self.transport = transport
        self.session = session
        self.options = options  # replaced by Endpoint.set_write_buffer_limits()
        self.generation = verbs.fork_generation()
        qp = transport.qp
        self.qp = qp
        self.max_inline = min(transport.max_inline, options.max_inline)
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
        }
        # receive side
        self.rxbuf = ReceiveBuffer(options.recv_buffer_limit)
        self._rx_waiter: Waiter | None = None
        # send side: the engine does the work; the connection decides when, and wakes who waits
        self.stats = collections.Counter[str]()
        self.tx = SendEngine(
            session,
            qp,
            transport.send_ring,
            transport.slot_size,
            initial=options.initial_depth,
            max_inline=self.max_inline,
            signal_interval=options.signal_interval,
            batch_limit=options.batch_limit,
            stats=self.stats,
            tag=transport.tag or 0,  # sharedcq: the connection tag of the send wr_ids
        )
        self.onesided = OneSidedEngine.for_connection(self, transport, session, options)  # one-sided RDMA
        self.rndv = RendezvousEngine.for_connection(self, transport, options)  # zero-copy (None: not used)
        self.flush_handle: Handle | None = None  # the end-of-iteration flush of coalesced writes
        self._post_handle: Handle | None = None
        self._close_timer: Handle | None = None  # bounds a graceful close (Options.close_timeout)
        self._in_callback = False  # in pump_and_post(): it posts right after pump, so pump must not
        self.tx_waiters: dict[Waiter, None] = {}  # an ordered set: a cancelled wait removes its own
        # lifetime
        self.closing = False
        self.torn_down = False
        self.closed: Event = self.io.event()
        self._close_callbacks: list[Callable[[], None]] = []
        self._start(reactor, cm_id, transport)

    def _start(self, reactor: Reactor, cm_id: CMId, transport: Transport) -> None:
        """Route this connection's events and completions here and start the keepalive."""
        qp = self.qp
        # keepalive (rdmaio.core.keepalive): probes the peer when idle, so a vanished peer fails the
        # connection. Made first: the completion processor routes the probes' completions to it.
        stats = self.stats
        # The tag routes the probe's completion back here through the shared CQ.
        keepalive_wr_id = make_wr_id(KEEPALIVE_WR_KIND, transport.tag or 0, 0)
        self._keepalive = Keepalive(
            reactor.keepalive_timers,
            self.options.keepalive_interval,
            lambda: stats["completions"] + stats["frames_posted"],
            lambda: qp.post_empty_write(keepalive_wr_id),
            _weak_call(self.fail),  # no connection <-> keepalive cycle: a closed one is freed at once
            name=f"rdmaio keepalive qp {qp.qp_num}",
        )
        reactor.set_handler(cm_id, self._on_cm_event)
        self._async_key = (transport.device.handle, qp.qp_num, transport.cq.handle)
        reactor.watch_qp(*self._async_key, self._on_async_event)
        # sharedcq: completions come from the domain's dispatcher (those kept since the QP was registered
        # go first).
        transport.set_completion_handler(CompletionProcessor(self, self._keepalive).on_completions)
        shared = transport.shared
        if shared is not None:  # the shared receive pool fails us for an overrun or a silent peer
            shared.on_failure = _weak_call(self.fail)
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
        stats["registered_bytes"] = self.transport.registered_bytes if not self.torn_down else 0
        stats["mean_batch"] = stats["completions"] / stats["wakeups"] if stats["wakeups"] else 0.0
        stats["send_credits"] = self.session.send_credits
        stats["credits_ungranted"] = self.session.ungranted
        stats["recv_buffered"] = self.rxbuf.buffered
        stats["recv_held_slots"] = self.rxbuf.held
        stats["send_waiters"] = len(self.tx_waiters)
        stats["send_buffered"] = self.tx.buffered
        stats["keepalive_probes"] = self._keepalive.probes_sent
        stats.update(self.onesided.statistics())  # one-sided: pending ops, grants, queued notices
        for key, value in self.session.statistics().items():
            stats[f"protocol_{key}"] = value
        if self.rndv is not None:  # zero-copy
            stats.update(self.rndv.statistics())
        return stats

    # --- completion processing (dispatcher callback) ------------------------------------------------

    def poll_completions(self) -> None:
        """Poll the shared CQs now: this connection's completions go to its
        :class:`~rdmaio.core.processing.CompletionProcessor`."""
        if not self.torn_down:
            self.transport.poll_completions()

    disconnected = False  # rdma_cm said DISCONNECTED: flush completions are cancellations

    # --- posting ------------------------------------------------------------------------------------

    def pump(self) -> None:
        """Stage queued frames (and due EOF/credit frames) as far as credits and send slots allow.

        Frames are copied into send slots at once (so callers' buffers are free) but posted to the NIC
        together by :meth:`post_staged` at the end of the loop iteration: one doorbell for every frame
        of the iteration, which on rxe saves a system call per frame.
        """
        if self.torn_down:
            return
        if self.tx.stage() and self._post_handle is None and not self._in_callback:
            self._post_handle = self.io.call_soon(self._post_staged_soon)

    def pump_and_post(self) -> None:
        """Stage what credits and send slots allow and post it now, in one doorbell with anything staged
        earlier in this iteration, instead of at the end of the iteration."""
        if not self.tx.has_work():
            return  # the common case after a completion batch or a flush: nothing queued, nothing due
        self._in_callback = True  # pump must not schedule the post: it happens right here
        try:
            self.pump()
        finally:
            self._in_callback = False
        if self._post_handle is not None:
            self._post_handle.cancel()  # it would find nothing left to post
        self.post_staged()

    def _post_staged_soon(self) -> None:
        """The end-of-iteration post (a loop callback): a failure fails the connection, nothing escapes."""
        try:
            self.post_staged()
        except Exception as exc:
            log.exception("rdmaio: posting sends failed")
            self.fail(exc)

    def post_staged(self) -> None:
        """Post every staged frame with one chained ibv_post_send."""
        self._post_handle = None
        if not self.torn_down:
            self.tx.post()

    def schedule_flush(self) -> None:
        """Queue, stage and post what was coalesced at the end of this loop iteration (once)."""
        if self.flush_handle is None:
            self.flush_handle = self.io.call_soon(self._flush_and_pump)

    def _flush_and_pump(self) -> None:
        """End of a loop iteration's writes (a loop callback): queue what was coalesced, stage it and
        post it at once. A failure fails the connection: nothing escapes into the loop's error log."""
        self.flush_handle = None
        self.tx.coalesce_next = False
        try:
            self.tx.flush_buffers()
            self.pump_and_post()
        except Exception as exc:
            log.exception("rdmaio: sending coalesced writes failed")
            self.fail(exc)
        if self.tx_waiters:
            self.wake_writers()

    def repost_released(self) -> None:
        """Post the receive slots the buffer no longer holds (their credits go to the peer)."""
        slots = self.rxbuf.releasable()
        if slots and not self.torn_down:
            self.transport.post_receives(slots)
            self.session.on_recv_reposted(len(slots))
            self.pump()

    # --- waiting ------------------------------------------------------------------------------------

    def wake_reader(self) -> None:
        waiter = self._rx_waiter
        if waiter is not None:
            self._rx_waiter = None
            waiter.set()

    def wake_writers(self) -> None:
        waiters, self.tx_waiters = self.tx_waiters, {}
        for waiter in waiters:
            waiter.set()

    async def wait_readable(self) -> None:
        """Wait for received data or a state change. A reader that waits needs more than is buffered, so
        held slots are released while it waits (as asyncio's StreamReader resumes reading)."""
        if self._rx_waiter is not None and not self._rx_waiter.is_set():
            raise RuntimeError("another task is already waiting to read from this endpoint")
        waiter = self.io.waiter()
        self._rx_waiter = waiter
        self.rxbuf.reader_waiting = True
        self.repost_released()
        try:
            await waiter.wait()
        finally:
            self.rxbuf.reader_waiting = False
            if self._rx_waiter is waiter:
                self._rx_waiter = None

    async def wait_writable(self) -> None:
        waiter = self.io.waiter()
        self.tx_waiters[waiter] = None
        try:
            await waiter.wait()
        finally:
            self.tx_waiters.pop(waiter, None)  # cancelled: do not pile up until the next wake-up

    def check_fork(self) -> None:
        if self.generation != _fork_state._generation:
            raise ForkError(
                "this Endpoint was created before fork(); RDMA connections cannot be used in "
                "the child process: connect again there"
            )

    # The two checks below run on every send/write/drain: the common case (same process, open, no error)
    # costs attribute reads and the session's own fast path, not a chain of calls.

    def raise_send_error(self) -> None:
        if self.generation != _fork_state._generation:
            self.check_fork()
        error = self.session.send_error()
        if error is not None:
            raise error
        if self.closing:
            raise EndpointClosedError("endpoint is closing")

    def raise_flush_error(self) -> None:
        """What waiting for data already accepted raises: not a requested EOF, which comes after it."""
        if self.generation != _fork_state._generation:
            self.check_fork()
        error = self.session.flush_error()
        if error is not None:
            raise error
        if self.closing:
            raise EndpointClosedError("endpoint is closing")

    # --- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Start a graceful close (see :meth:`rdmaio.Endpoint.close`)."""
        if self.closing or self.torn_down:
            return
        self.closing = True
        if self.generation != verbs.fork_generation():
            self.teardown()
            return
        self.session.close()
        try:
            self.tx.flush_buffers()
            self.pump()
        except Exception as exc:  # never leave a close half done: release everything instead
            log.exception("rdmaio: flushing on close failed; aborting the connection")
            self.fail(exc)
            return
        # No task waits for the close to finish: completion processing calls finish_close() after every
        # batch while closing (the EOF's completion is the usual last step), and a timer bounds it.
        timeout = self.options.close_timeout
        if timeout is not None:
            self._close_timer = self.io.call_later(timeout, self._close_timed_out)
        self.io.call_soon(self.finish_close)  # nothing left to wait for (EOF done before): next iteration

    def finish_close(self) -> None:
        """Tear down a graceful close once the queued data, the EOF and any zero-copy send are done."""
        if self.torn_down or not self.closing:
            return
        tx = self.tx
        if tx.txq or not tx.eof_done or (self.rndv is not None and self.rndv.sending):
            return
        self.teardown()

    def _close_timed_out(self) -> None:
        if not self.torn_down:
            log.debug("rdmaio: close timed out with %d bytes unsent; aborting", self.tx.buffered)
            self.teardown()

    def abort(self) -> None:
        """Close at once (see :meth:`rdmaio.Endpoint.abort`)."""
        if self.torn_down:
            return
        self.closing = True
        self.session.abort()
        self.tx.clear()
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
        for handle in (self.flush_handle, self._post_handle, self._close_timer):
            if handle is not None:
                handle.cancel()
        self.flush_handle = self._post_handle = self._close_timer = None
        if self.generation == verbs.fork_generation():  # not forked
            self._release_verbs()
        self.session.mark_closed()
        self.onesided.close(self.session.flush_error())  # one-sided: the QP is gone now
        if self.rndv is not None:  # zero-copy: after the QP, so no READ runs any more
            self.rndv.close(self.session.flush_error())
        self.wake_reader()
        self.wake_writers()
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
