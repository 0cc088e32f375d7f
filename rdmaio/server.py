"""``rdmaio.serve()`` and :class:`StreamServer`: accept RDMA connections and run a handler for each."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self

from rdmaio.client import local_handshake, resolve_host
from rdmaio.core.backend import AsyncioBackend, Handle, Waiter
from rdmaio.core.onesided import rd_atomic_depth
from rdmaio.core.reactor import Reactor
from rdmaio.core.shared_receive import new_session
from rdmaio.core.transport import Transport
from rdmaio.endpoint import Endpoint
from rdmaio.errors import EndpointClosedError, HandshakeError, VerbsError
from rdmaio.options import Options
from rdmaio.protocol import FEATURE_GROW, FEATURE_RECLAIM, Handshake, Session
from rdmaio.protocol.reclaim import MIN_WINDOW
from rdmaio.verbs import CMEvent, CMEventType, CMId

__all__ = ["Handler", "StreamServer", "listen", "serve"]

log = logging.getLogger("rdmaio")

Handler = Callable[[Endpoint], Awaitable[None]]
"""A connection handler: called with each new :class:`Endpoint`, in its own task."""


class _Pending:
    """A connection accepted but not yet ESTABLISHED: its resources, its source address and its deadline."""

    __slots__ = ("cm_id", "deadline", "session", "source", "transport")

    def __init__(
        self, cm_id: CMId, transport: Transport, session: Session, source: str, deadline: Handle
    ) -> None:
        self.cm_id = cm_id
        self.transport = transport
        self.session = session
        self.source = source
        self.deadline = deadline


def accepting_handshake(handshake: Handshake, peer: Handshake, options: Options) -> Handshake:
    """``handshake`` (this side's, from :func:`~rdmaio.client.local_handshake`) with the receive window a
    server may grant ``peer``.

    The receives a peer may use must be posted before rdma_accept (it may send as soon as it is connected),
    so they are what an accepted but never established request holds. A peer that announced
    ``FEATURE_GROW`` starts with ``initial_depth`` and is grown once it is established and sends. A peer
    without it cannot be grown later (it reads only ``recv_depth``), so it gets a *fixed* window of
    ``initial_depth`` receives rather than ``recv_depth`` (announced as ``recv_depth``, without the bit):
    what a half-open request pins is then the same for every peer. On a shared receive queue a peer that
    does not answer RECLAIM keeps its lease for life, so it gets the reserve (:data:`MIN_WINDOW`): what
    the documented capacity (a quarter of ``srq_max_buffers`` connections) assumes.
    """
    if options.shared_receive_queue and not peer.features & FEATURE_RECLAIM:
        fixed = MIN_WINDOW
    elif not peer.features & FEATURE_GROW:
        fixed = options.initial_depth
    else:
        return handshake
    fixed = min(fixed, handshake.recv_depth)
    if handshake.recv_depth == fixed and not handshake.features & FEATURE_GROW:
        return handshake
    return dataclasses.replace(
        handshake, recv_depth=fixed, features=handshake.features & ~FEATURE_GROW, initial_depth=0
    )


class StreamServer:
    """A listening RDMA endpoint: runs ``handler(endpoint)`` per connection, or queues them for accept().

    Made by :func:`serve` (a handler runs in a new task for each connection) or by :func:`listen` (no
    handler: take connections with :meth:`accept`). Mirrors ``asyncio.Server``: :meth:`close`,
    :meth:`wait_closed`, :meth:`serve_forever`, :meth:`is_serving`, :meth:`close_clients`,
    :meth:`abort_clients`, ``async with``. A handler that raises is logged and its connection closed;
    other connections are not affected. Works on asyncio, uvloop and trio.

    ``backlog`` bounds the connections that hold resources without being served yet: those accepted at
    the rdma_cm level but not yet established, plus (for :func:`listen`) those established but not yet
    taken by :meth:`accept`. A connection request beyond it is rejected at once (the client gets
    :class:`~rdmaio.ConnectionRefusedError`), so a flood of requests pins at most ``backlog`` connections'
    registered memory.

    A connection accepted but not established within ``Options.establish_timeout`` is dropped (its
    receives, QP and shared-receive lease released, its cm id destroyed), and one peer address may hold
    at most ``Options.max_pending_per_source`` of them at once (further requests are rejected), so a
    client that never completes the exchange cannot keep the backlog, or the memory it pins, for itself.
    """

    def __init__(
        self, handler: Handler | None, options: Options, backlog: int, *, start_serving: bool = True
    ) -> None:
        self._handler = handler
        self._options = options
        self._backlog = backlog
        self._reactor = Reactor.current()
        self._io = self._reactor.backend
        self._listeners: list[CMId] = []
        self._open = False  # listening (until close())
        self._serving = False  # handing connections to the handler (start_serving(); False once closed)
        self._start_serving = start_serving
        self._pending: dict[int, _Pending] = {}
        self._pending_by_source: collections.Counter[str] = collections.Counter()
        self._clients: set[Endpoint] = set()
        self._handlers_running = 0
        self._accepted: collections.deque[Endpoint] = collections.deque()  # listen(): not yet accepted
        self._accept_waiter: Waiter | None = None
        self._state_waiters: dict[Waiter, None] = {}  # wait_closed() and serve_forever(); ordered set
        self._serve_forever_running = False
        #: The ``(host, port)`` the server listens on (the port chosen when 0 was asked).
        self.addresses: list[tuple[str, int]] = []
        #: Connections established and handed to the handler or to accept().
        self.connections_accepted = 0
        #: Connection requests rejected (server closed, bad handshake, no resources, backlog full).
        self.connections_rejected = 0
        #: Of those, rejected because the backlog was full.
        self.connections_refused_backlog = 0
        #: Of those, rejected because their source address had ``max_pending_per_source`` pending.
        self.connections_refused_source = 0
        #: Connections accepted but dropped for not being established within ``establish_timeout``.
        self.connections_timed_out = 0
        self._peak_waiting = 0

    def _listen(self, hosts: list[str], port: int) -> None:
        """Listen on every address of ``hosts`` (numeric) at ``port``; on failure none stays open."""
        try:
            for host in hosts:
                listener = self._reactor.create_id(self._on_listener_event)
                self._listeners.append(listener)
                listener.set_reuseaddr()
                listener.bind_addr(host, port)
                listener.listen(self._backlog)
                address = listener.local_address
                if address:
                    self.addresses.append(address)
        except BaseException:
            listeners, self._listeners = self._listeners, []
            for listener in listeners:
                self._reactor.release_id(listener)
            self.addresses = []
            raise
        self._open = True
        self._serving = self._start_serving

    def _state_changed(self) -> None:
        waiters, self._state_waiters = self._state_waiters, {}
        for waiter in waiters:
            waiter.set()

    async def _wait_state_change(self) -> None:
        waiter = self._io.waiter()
        self._state_waiters[waiter] = None
        try:
            await waiter.wait()
        finally:
            self._state_waiters.pop(waiter, None)  # cancelled: do not pile up until the next change

    def _waiting(self) -> int:
        """Connections holding resources without being served: pending, or established and not accepted."""
        return len(self._pending) + len(self._accepted)

    def statistics(self) -> dict[str, int]:
        """Counters: connections accepted and rejected (and how many for a full backlog, and for a source
        address at its ``max_pending_per_source``), those now pending (not yet established), what they
        hold (``pending_registered_bytes`` of receive slots, ``pending_shared_receives`` lent from the
        shared receive queue) and how many were dropped at ``establish_timeout``, those established but
        not yet taken by accept(), the most that ever waited at once, the backlog, and the clients open
        now."""
        registered = shared = 0
        for pending in self._pending.values():
            transport = pending.transport
            registered += transport.registered_bytes
            if transport.shared is not None:
                shared += transport.shared.pool.ledger.window(transport.shared.key)
        return {
            "accepted": self.connections_accepted,
            "rejected": self.connections_rejected,
            "rejected_backlog_full": self.connections_refused_backlog,
            "rejected_source_limit": self.connections_refused_source,
            "pending": len(self._pending),
            "pending_registered_bytes": registered,
            "pending_shared_receives": shared,
            "pending_timed_out": self.connections_timed_out,
            "unaccepted": len(self._accepted),
            "peak_waiting": self._peak_waiting,
            "backlog": self._backlog,
            "clients": len(self._clients),
        }

    # --- accepting --------------------------------------------------------------------------------

    def _on_listener_event(self, event: CMEvent) -> None:
        if event.event == CMEventType.CONNECT_REQUEST:
            self._on_connect_request(event)
        elif event.event == CMEventType.DEVICE_REMOVAL:
            log.error("rdmaio: RDMA device removed under the listener %s; closing it", self.addresses)
            self.close()
        else:
            log.debug("rdmaio: listener ignores %s", event.event.name)

    def _on_connect_request(self, event: CMEvent) -> None:
        cm_id = self._reactor.adopt_id(event, self._on_pending_event)
        if not self._open:
            self._reject(cm_id, "server is closed")
            return
        if self._waiting() >= self._backlog:
            # Before any resource is created: a flood costs a cm id and a REJ per request, nothing pinned.
            self.connections_refused_backlog += 1
            self._reject(cm_id, f"backlog of {self._backlog} connections is full")
            return
        peer_address = cm_id.peer_address
        source = peer_address[0] if peer_address else ""
        if self._pending_by_source[source] >= self._options.max_pending_per_source:
            self.connections_refused_source += 1
            self._reject(
                cm_id,
                f"{source} already has {self._pending_by_source[source]} connections pending "
                f"(Options.max_pending_per_source)",
            )
            return
        try:
            peer = Handshake.decode(event.private_data)
        except HandshakeError as exc:
            self._reject(cm_id, f"bad handshake: {exc}")
            return
        transport = None
        try:
            handshake = accepting_handshake(
                local_handshake(self._options, grow=bool(peer.features & FEATURE_GROW)), peer, self._options
            )
            transport = Transport(self._reactor, cm_id, self._options, handshake.initial_depth)
            # One-sided READs/atomics in flight: what we allow, capped by what the request offers (rdma_cm
            # reports the request's values from our side's point of view).
            depth = rd_atomic_depth(transport.device, self._options.max_rdma_ops)
            cm_id.accept(
                handshake.encode(),
                rnr_retry_count=self._options.rnr_retry_count,
                responder_resources=max(1, min(depth, event.responder_resources)),
                initiator_depth=max(1, min(depth, event.initiator_depth)),
            )
        except Exception as exc:
            log.warning("rdmaio: cannot accept a connection: %s", exc)
            if transport is not None:
                transport.close()
            self._reject(cm_id, str(exc))
            return
        handle = cm_id.handle
        deadline = self._io.call_later(
            self._options.establish_timeout, lambda: self._establish_timed_out(handle)
        )
        self._pending[handle] = _Pending(
            cm_id, transport, new_session(handshake, peer, transport), source, deadline
        )
        self._pending_by_source[source] += 1
        self._peak_waiting = max(self._peak_waiting, self._waiting())

    def _take_pending(self, handle: int) -> _Pending | None:
        """Remove a pending connection from the books (its deadline cancelled); None if it is not there."""
        pending = self._pending.pop(handle, None)
        if pending is not None:
            pending.deadline.cancel()
            count = self._pending_by_source[pending.source] - 1
            if count > 0:
                self._pending_by_source[pending.source] = count
            else:
                del self._pending_by_source[pending.source]
        return pending

    def _drop_pending(self, pending: _Pending) -> None:
        """Release what a pending connection holds: QP, receives (or shared-receive lease), cm id."""
        try:
            pending.transport.close()
        finally:
            self._reactor.release_id(pending.cm_id)

    def _establish_timed_out(self, handle: int) -> None:
        # A busy loop handles one rdma_cm event per wake-up: the ESTABLISHED event may be waiting in the
        # channel already (the client then believes it is connected). Handle what is there first.
        self._reactor.drain_cm_events()
        pending = self._take_pending(handle)
        if pending is None:
            return
        self.connections_timed_out += 1
        log.info(
            "rdmaio: dropping a connection from %s not established within %s s (Options.establish_timeout)",
            pending.source,
            self._options.establish_timeout,
        )
        self._drop_pending(pending)
        self._state_changed()

    def _reject(self, cm_id: CMId, why: str) -> None:
        self.connections_rejected += 1
        log.info("rdmaio: rejecting a connection request: %s", why)
        try:
            cm_id.reject()
        except VerbsError as exc:
            log.debug("rdmaio: rdma_reject failed: %s", exc)
        self._reactor.release_id(cm_id)

    def _on_pending_event(self, event: CMEvent) -> None:
        pending = self._take_pending(event.id_handle)
        if pending is None:
            return
        if event.event != CMEventType.ESTABLISHED:
            log.info("rdmaio: connection attempt failed before it was established: %s", event.event.name)
            self._drop_pending(pending)
            return
        endpoint = Endpoint(self._reactor, pending.cm_id, pending.transport, pending.session, self._options)
        self.connections_accepted += 1
        self._clients.add(endpoint)
        endpoint._add_close_callback(self._forget)
        if self._handler is None or not self._serving:
            # listen(), or serving not started yet: the connection waits (counted against the backlog).
            self._accepted.append(endpoint)
            if self._accept_waiter is not None:
                self._accept_waiter.set()
            return
        self._spawn_handler(self._handler, endpoint)

    def _spawn_handler(self, handler: Handler, endpoint: Endpoint) -> None:
        self._handlers_running += 1
        self._io.spawn(self._run_handler(handler, endpoint), name=f"rdmaio handler {endpoint!r}")

    def _forget(self, endpoint: Endpoint) -> None:
        self._clients.discard(endpoint)
        self._state_changed()

    async def _run_handler(self, handler: Handler, endpoint: Endpoint) -> None:
        try:
            await handler(endpoint)
        except Exception:
            log.exception(
                "rdmaio: connection handler failed for %s; closing that connection",
                endpoint.get_extra_info("peername"),
            )
            endpoint.close()
        except BaseException:  # cancelled: the connection cannot be finished cleanly
            endpoint.abort()
            raise
        finally:
            self._handlers_running -= 1
            self._state_changed()

    async def accept(self) -> Endpoint:
        """The next established connection of a server made by :func:`listen`.

        Raises :class:`~rdmaio.EndpointClosedError` once the server is closed. A cancelled ``accept()``
        loses no connection: it stays queued for the next call.
        """
        if self._handler is not None:
            raise RuntimeError("accept() is for servers made by rdmaio.listen(); this one runs a handler")
        while not self._accepted:
            if not self._open:
                raise EndpointClosedError(f"server {self!r} is closed")
            if self._accept_waiter is not None and not self._accept_waiter.is_set():
                raise RuntimeError("another task is already waiting in accept()")
            waiter = self._accept_waiter = self._io.waiter()
            try:
                await waiter.wait()
            finally:
                if self._accept_waiter is waiter:
                    self._accept_waiter = None
        return self._accepted.popleft()

    # --- asyncio.Server surface -------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        """True from the first listener until :meth:`close` (serving or not)."""
        return self._open

    def is_serving(self) -> bool:
        """True while the server hands new connections to its handler (or to accept()): from :func:`serve`
        (or :meth:`start_serving` when made with ``start_serving=False``) until :meth:`close`."""
        return self._serving

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The asyncio loop the server runs on (``RuntimeError`` on trio)."""
        if isinstance(self._io, AsyncioBackend):
            return self._io.loop
        raise RuntimeError("this server runs on trio, not on an asyncio loop")

    def close(self) -> None:
        """Stop listening. Existing connections stay open (close them with :meth:`close_clients`).

        Connections of a :func:`listen` server that were established but never accepted are aborted.
        """
        if not self._open:
            return
        self._open = self._serving = False
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            self._reactor.release_id(listener)
        for handle in list(self._pending):
            pending = self._take_pending(handle)
            if pending is not None:
                self._drop_pending(pending)
        while self._accepted:
            self._accepted.popleft().abort()
        if self._accept_waiter is not None:
            self._accept_waiter.set()
        self._state_changed()

    def close_clients(self) -> None:
        """Close every connection gracefully."""
        for endpoint in list(self._clients):
            endpoint.close()

    def abort_clients(self) -> None:
        """Abort every connection at once."""
        for endpoint in list(self._clients):
            endpoint.abort()

    async def wait_closed(self) -> None:
        """Wait until the server is closed and every connection and handler has finished."""
        while self._open or self._handlers_running or self._clients:
            await self._wait_state_change()

    async def start_serving(self) -> None:
        """Start handing connections to the handler (already done unless made with
        ``start_serving=False``): the connections that waited are handed over first, in arrival order.
        No effect once closed."""
        self._begin_serving()

    def _begin_serving(self) -> None:
        if self._serving or not self._open:
            return
        self._serving = True
        if self._handler is not None:
            while self._accepted:
                self._spawn_handler(self._handler, self._accepted.popleft())
        self._state_changed()

    async def serve_forever(self) -> None:
        """Serve until :meth:`close` is called (then return) or the caller is cancelled (then close)."""
        if self._serve_forever_running:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        if not self._open:
            raise EndpointClosedError(f"server {self!r} is closed")
        self._begin_serving()
        self._serve_forever_running = True
        try:
            while self._open:
                await self._wait_state_change()
        except BaseException:  # cancelled: close, and wait for the handlers where the backend allows it
            try:
                self.close()
                await self.wait_closed()
            finally:
                raise
        finally:
            self._serve_forever_running = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop listening, close the connections gracefully and wait for their handlers.

        A handler is not cancelled: one that never returns (say, waiting on something other than its
        endpoint) keeps this waiting. Handlers normally end on their own: every pending call on a closed
        endpoint fails.
        """
        self.close()
        self.close_clients()
        await self.wait_closed()

    def __repr__(self) -> str:
        state = "serving" if self._serving else "listening" if self._open else "closed"
        return f"<rdmaio.StreamServer {state} {self.addresses} clients={len(self._clients)}>"


async def _start(
    handler: Handler | None,
    host: str | Sequence[str] | None,
    port: int,
    backlog: int,
    options: Options | dict[str, Any] | None,
    start_serving: bool,
) -> StreamServer:
    opts = Options.coerce(options)
    hosts = [host or ""] if host is None or isinstance(host, str) else [h or "" for h in host]
    addresses = [await resolve_host(h, port, passive=True) for h in hosts]
    server = StreamServer(handler, opts, backlog, start_serving=start_serving)
    server._listen(addresses, port)
    return server


async def serve(
    handler: Handler,
    host: str | Sequence[str] | None,
    port: int,
    *,
    backlog: int = 128,
    options: Options | dict[str, Any] | None = None,
    start_serving: bool = True,
) -> StreamServer:
    """Listen on ``host``:``port`` and run ``handler(endpoint)`` for each connection; return the server.

    ``host`` is an address or name of an RDMA-capable interface, a sequence of them (one listener each,
    sharing the backlog), or ``None``/``""`` for all; ``port`` 0 picks a free port (see
    :attr:`StreamServer.addresses`). With ``start_serving=False`` the server listens at once, and the
    connections established before :meth:`StreamServer.start_serving` wait for it (at most ``backlog``;
    later requests are refused), as with :func:`asyncio.start_server`.
    """
    return await _start(handler, host, port, backlog, options, start_serving)


async def listen(
    host: str | Sequence[str] | None,
    port: int,
    *,
    backlog: int = 128,
    options: Options | dict[str, Any] | None = None,
) -> StreamServer:
    """Listen on ``host``:``port`` and return a server whose connections are taken with ``accept()``.

    The accept-loop form of :func:`serve`, for code that wants to run connections in its own tasks
    (a trio nursery, an anyio task group)::

        server = await rdmaio.listen(host, 0)
        while True:
            endpoint = await server.accept()
            task_group.start_soon(handle, endpoint)
    """
    return await _start(None, host, port, backlog, options, True)
