"""``rdmaio.serve()``, ``rdmaio.listen()`` and :class:`StreamServer`: the ``asyncio.Server``-like surface
of a listening RDMA endpoint, which runs a handler for each connection or hands them to ``accept()``.

Connection setup (listeners, admission, pending connections, handshake) is
:class:`rdmaio.core.acceptor.Acceptor`'s; this module serves the connections it establishes."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self

from rdmaio.core.acceptor import Acceptor
from rdmaio.core.backend import AsyncioBackend, Waiter
from rdmaio.core.connection import Connection
from rdmaio.core.metrics import fold_acceptor, register_acceptor
from rdmaio.core.reactor import Reactor
from rdmaio.core.resolver import resolve_host
from rdmaio.endpoint import Endpoint
from rdmaio.errors import EndpointClosedError
from rdmaio.options import Options

__all__ = ["Handler", "StreamServer", "listen", "serve"]

log = logging.getLogger("rdmaio")

Handler = Callable[[Endpoint], Awaitable[None]]
"""A connection handler: called with each new :class:`Endpoint`, in its own task."""


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

    The connection setup itself (listeners, admission, pending connections and their deadline, the
    handshake) is :class:`rdmaio.core.acceptor.Acceptor`'s; this class serves what it establishes.
    """

    def __init__(
        self, handler: Handler | None, options: Options, backlog: int, *, start_serving: bool = True
    ) -> None:
        self._handler = handler
        reactor = Reactor.current()
        self._io = reactor.backend
        self._serving = False  # handing connections to the handler (start_serving(); False once closed)
        self._start_serving = start_serving
        self._clients: set[Endpoint] = set()
        self._handlers_running = 0
        self._accepted: collections.deque[Endpoint] = collections.deque()  # listen(): not yet accepted
        self._accept_waiter: Waiter | None = None
        self._state_waiters: dict[Waiter, None] = {}  # wait_closed() and serve_forever(); ordered set
        self._serve_forever_running = False
        self._acceptor = Acceptor(
            reactor,
            options,
            backlog,
            queued=self._accepted,
            on_connection=self._on_connection,
            on_device_removal=self.close,
            on_timed_out=self._state_changed,
        )
        register_acceptor(self._acceptor, self._io)  # process metrics: its rejections, read on demand

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The ``(host, port)`` the server listens on (the port chosen when 0 was asked)."""
        return self._acceptor.addresses

    @property
    def connections_accepted(self) -> int:
        """Connections established and handed to the handler or to accept()."""
        return self._acceptor.accepted

    @property
    def connections_rejected(self) -> int:
        """Connection requests rejected (server closed, bad handshake, no resources, backlog full)."""
        return self._acceptor.rejected

    @property
    def connections_refused_backlog(self) -> int:
        """Of those, rejected because the backlog was full."""
        return self._acceptor.refused_backlog

    @property
    def connections_refused_source(self) -> int:
        """Of those, rejected because their source address had ``max_pending_per_source`` pending."""
        return self._acceptor.refused_source

    @property
    def connections_timed_out(self) -> int:
        """Connections accepted but dropped for not being established within ``establish_timeout``."""
        return self._acceptor.timed_out

    def _listen(self, hosts: list[str], port: int) -> None:
        """Listen on every address of ``hosts`` (numeric) at ``port``; on failure none stays open."""
        self._acceptor.listen(hosts, port)
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

    def statistics(self) -> dict[str, int]:
        """Counters: connections accepted and rejected (and how many for a full backlog, and for a source
        address at its ``max_pending_per_source``), those now pending (not yet established), what they
        hold (``pending_registered_bytes`` of receive slots, ``pending_shared_receives`` lent from the
        shared receive queue) and how many were dropped at ``establish_timeout``, those established but
        not yet taken by accept(), the most that ever waited at once, the backlog, and the clients open
        now."""
        acceptor = self._acceptor
        registered, shared = acceptor.pending_held()
        return {
            "accepted": acceptor.accepted,
            "rejected": acceptor.rejected,
            "rejected_backlog_full": acceptor.refused_backlog,
            "rejected_source_limit": acceptor.refused_source,
            "pending": acceptor.pending,
            "pending_registered_bytes": registered,
            "pending_shared_receives": shared,
            "pending_timed_out": acceptor.timed_out,
            "unaccepted": len(self._accepted),
            "peak_waiting": acceptor.peak_waiting,
            "backlog": acceptor.backlog,
            "clients": len(self._clients),
        }

    # --- serving ----------------------------------------------------------------------------------

    def _on_connection(self, connection: Connection) -> None:
        endpoint = Endpoint(connection)
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
            if not self._acceptor.listening:
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
        return self._acceptor.listening

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
        if not self._acceptor.listening:
            return
        self._serving = False
        self._acceptor.close()  # the listeners and the pending connections
        fold_acceptor(self._acceptor)
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
        while self._acceptor.listening or self._handlers_running or self._clients:
            await self._wait_state_change()

    async def start_serving(self) -> None:
        """Start handing connections to the handler (already done unless made with
        ``start_serving=False``): the connections that waited are handed over first, in arrival order.
        No effect once closed."""
        self._begin_serving()

    def _begin_serving(self) -> None:
        if self._serving or not self._acceptor.listening:
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
        if not self._acceptor.listening:
            raise EndpointClosedError(f"server {self!r} is closed")
        self._begin_serving()
        self._serve_forever_running = True
        try:
            while self._acceptor.listening:
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
        state = "serving" if self._serving else "listening" if self._acceptor.listening else "closed"
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
