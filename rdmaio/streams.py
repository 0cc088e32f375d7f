"""asyncio streams over RDMA: :func:`open_connection` and :func:`start_server`.

These are drop-in replacements for :func:`asyncio.open_connection` and :func:`asyncio.start_server`. The
objects you get are asyncio's own: an :class:`asyncio.StreamReader`, an :class:`asyncio.StreamWriter` and
an :class:`asyncio.StreamReaderProtocol`, built exactly as CPython's ``asyncio/streams.py`` builds them.
Only the transport underneath differs: :class:`RdmaTransport`, an :class:`asyncio.Transport` over an
:class:`~rdmaio.Endpoint`. So ``readline``/``readexactly``/``readuntil``, ``IncompleteReadError``,
``LimitOverrunError``, the line-length ``limit``, ``drain`` with water marks, ``write_eof``,
``wait_closed`` and ``get_extra_info`` behave as they do over TCP, because they *are* asyncio's code.

How the transport maps onto the endpoint:

* ``write``/``writelines`` → :meth:`Endpoint.write` (the data is copied at once); when
  :meth:`Endpoint.get_write_buffer_size` rises above the high-water mark the protocol is paused
  (``pause_writing``), a task awaits :meth:`Endpoint.drain` and then resumes it (``resume_writing``).
* A reader task pulls data with :meth:`Endpoint.read` and feeds ``protocol.data_received``; at the end of
  the stream it calls ``eof_received`` and, when the connection ends, ``connection_lost``.
  ``pause_reading`` stops the task from reading: the endpoint then buffers up to
  ``Options.recv_buffer_limit`` and withholds credits, which stops the sending peer.
* ``close`` → :meth:`Endpoint.close` (queued data, EOF, disconnect; bounded by ``Options.close_timeout``),
  then ``connection_lost(None)``. ``abort`` → :meth:`Endpoint.abort`. A connection that fails (the peer
  died, a transport error) calls ``connection_lost(exc)``, so pending ``StreamReader`` calls raise that
  exception (:class:`rdmaio.ConnectionResetError`, a builtin ``ConnectionResetError``).

Differences from TCP are listed in ``docs/porting.md``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from rdmaio.client import connect
from rdmaio.endpoint import Endpoint
from rdmaio.options import Options
from rdmaio.server import StreamServer, serve

__all__ = ["ListenerInfo", "RdmaTransport", "Server", "open_connection", "start_server"]

log = logging.getLogger("rdmaio")

_DEFAULT_LIMIT = 2**16  # as asyncio.streams._DEFAULT_LIMIT
_READ_SIZE = 256 * 1024  # most bytes handed to data_received() at once
_LOG_THRESHOLD_FOR_CONNLOST_WRITES = 5  # as asyncio.constants

ClientConnectedCallback = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]
"""``client_connected_cb(reader, writer)`` of :func:`start_server`: a function or a coroutine function."""

_TLS_ERROR = (
    "rdmaio streams do not support TLS ({name}={value!r}): RDMA moves data between registered memory "
    "regions without a kernel socket for TLS to wrap. Use asyncio.open_connection/start_server over TCP "
    "when you need TLS, or protect the payload at the application layer."
)
_TLS_ARGS = ("ssl", "server_hostname", "ssl_handshake_timeout", "ssl_shutdown_timeout")
# Socket-level arguments of loop.create_connection/create_server, accepted only at a value that means
# "nothing special" (the host string alone decides the address family).
_SOCKET_ARGS: dict[str, tuple[object, ...]] = {
    "family": (0, socket.AF_INET, socket.AF_INET6),
    "proto": (0, socket.IPPROTO_TCP),
    "flags": (0, socket.AI_PASSIVE),
    "sock": (None,),
    "happy_eyeballs_delay": (None,),
    "interleave": (None,),
    "all_errors": (False,),
    "reuse_address": (None, True),  # rdmaio always sets SO_REUSEADDR's rdma_cm equivalent
    "reuse_port": (None, False),
    "keep_alive": (None, False),
}


def _check_tcp_only(opts: dict[str, Any], allowed: Iterable[str], where: str) -> None:
    """Reject TLS and socket-only arguments with a clear error; accept them at their neutral values."""
    for name in _TLS_ARGS:
        value = opts.pop(name, None)
        if value is not None and value is not False:
            raise NotImplementedError(_TLS_ERROR.format(name=name, value=value))
    for name, neutral in _SOCKET_ARGS.items():
        if name in opts:
            value = opts.pop(name)
            if value not in neutral:
                raise ValueError(f"rdmaio.{where}(): {name}={value!r} is not supported over RDMA")
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise TypeError(
            f"rdmaio.{where}() got unexpected keyword argument(s) {', '.join(unknown)}; "
            f"rdmaio accepts {', '.join(sorted(allowed))}"
        )


class RdmaTransport(asyncio.Transport):
    """An :class:`asyncio.Transport` over a connected :class:`~rdmaio.Endpoint`.

    It owns the endpoint: closing the transport closes the endpoint. Do not use the endpoint's own read or
    drain calls while a transport runs over it (``get_extra_info("endpoint")`` is for introspection, such
    as :meth:`Endpoint.statistics`).

    The write buffer is the endpoint's: data accepted by :meth:`write` and not yet posted to the NIC.
    Its default water marks are ``Options.write_high_water`` / ``write_low_water`` (1 MiB / 256 KiB).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        endpoint: Endpoint,
        protocol: asyncio.Protocol,
        *,
        server: Server | None = None,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._ep = endpoint
        self._protocol = protocol
        self._server = server
        self._closing = False  # close()/abort() was called or the connection ended
        self._eof_written = False
        self._reading_paused = False
        self._resume_waiter: asyncio.Future[None] | None = None
        self._protocol_paused = False
        options = endpoint.options
        self._high = options.write_high_water
        self._low = options.write_low_water
        self._conn_lost_writes = 0
        self._lost: asyncio.Future[None] = loop.create_future()  # done once connection_lost() was called
        self._reader_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._finish_task: asyncio.Task[None] | None = None
        if server is not None:
            server._attach(self)

    def _start(self) -> None:
        """Call ``protocol.connection_made`` and start reading."""
        self._protocol.connection_made(self)
        if not self._closing:
            self._reader_task = self._loop.create_task(self._read_loop())

    def __repr__(self) -> str:
        state = "closed" if self._lost.done() else "closing" if self._closing else "open"
        return f"<rdmaio.streams.RdmaTransport {state} {self._ep!r}>"

    # --- BaseTransport ----------------------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The endpoint's information (``peername``, ``sockname``, ``device``, ``qp_num``, ...; ``"rdma"``:
        the path record, a :class:`rdmaio.PathInfo`, see :meth:`rdmaio.Endpoint.get_extra_info`).

        ``"endpoint"`` returns the :class:`~rdmaio.Endpoint` itself. There is no ``"socket"``.
        """
        if name == "endpoint":
            return self._ep
        return self._ep.get_extra_info(name, default)

    def is_closing(self) -> bool:
        """True once the transport is closing or closed."""
        return self._closing

    def close(self) -> None:
        """Close gracefully: queued data is sent, then EOF; ``connection_lost(None)`` follows."""
        if self._closing:
            return
        self._closing = True
        self._cancel_tasks()
        self._ep.close()
        self._schedule_connection_lost(None)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Replace the protocol (it must be an :class:`asyncio.Protocol`)."""
        if not isinstance(protocol, asyncio.Protocol):
            raise TypeError(f"RdmaTransport needs an asyncio.Protocol, got {protocol!r}")
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The current protocol."""
        return self._protocol

    # --- ReadTransport ----------------------------------------------------------------------------------

    def is_reading(self) -> bool:
        """True unless reading is paused or the transport is closing."""
        return not self._reading_paused and not self._closing

    def pause_reading(self) -> None:
        """Stop delivering data; the endpoint buffers, then holds back the peer through credits."""
        if self._closing or self._reading_paused:
            return
        self._reading_paused = True

    def resume_reading(self) -> None:
        """Deliver data again."""
        if self._closing or not self._reading_paused:
            return
        self._reading_paused = False
        waiter = self._resume_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- WriteTransport ---------------------------------------------------------------------------------

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Set the high- and low-water marks of write flow control (``WriteTransport`` semantics)."""
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._ep.set_write_buffer_limits(high, low)
        self._maybe_pause_protocol()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        """``(low, high)`` water marks."""
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        """Bytes accepted by :meth:`write` and not yet posted to the NIC."""
        return self._ep.get_write_buffer_size()

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        """Queue ``data`` (copied at once); never blocks. Pauses the protocol above the high-water mark."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__!r}")
        if self._eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if self._closing:
            # As asyncio's socket transports: writes after the connection is gone are dropped.
            if self._conn_lost_writes >= _LOG_THRESHOLD_FOR_CONNLOST_WRITES:
                log.warning("rdmaio: write() on a closed RDMA transport; the data is dropped")
            self._conn_lost_writes += 1
            return
        try:
            self._ep.write(data)
        except Exception as exc:
            self._fatal_error(exc, "Fatal write error on RDMA transport")
            return
        self._maybe_pause_protocol()

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview[Any]]) -> None:
        """Write every bytes-like object of an iterable."""
        for data in list_of_data:
            self.write(data)

    def write_eof(self) -> None:
        """Half-close: the peer reads EOF after the queued data; this side can still read."""
        if self._closing or self._eof_written:
            return
        self._eof_written = True
        try:
            self._ep.write_eof()
        except Exception as exc:
            self._fatal_error(exc, "Fatal error on RDMA transport: write_eof() failed")

    def can_write_eof(self) -> bool:
        """True: RDMA connections support half-close."""
        return True

    def abort(self) -> None:
        """Close at once, dropping queued data; ``connection_lost(None)`` follows."""
        self._force_close(None)

    # --- internals --------------------------------------------------------------------------------------

    async def _wait_lost(self) -> None:
        """Wait until ``connection_lost`` was called."""
        await asyncio.shield(self._lost)

    def _cancel_tasks(self) -> None:
        current = asyncio.current_task(self._loop)
        for task in (self._reader_task, self._drain_task):
            if task is not None and task is not current:
                task.cancel()
        self._reader_task = self._drain_task = None

    def _fatal_error(self, exc: Exception, message: str) -> None:
        if isinstance(exc, OSError):
            if self._loop.get_debug():
                log.debug("%r: %s", self, message, exc_info=True)
        else:
            self._loop.call_exception_handler(
                {"message": message, "exception": exc, "transport": self, "protocol": self._protocol}
            )
        self._force_close(exc)

    def _force_close(self, exc: Exception | None) -> None:
        if self._closing:
            self._ep.abort()  # a graceful close in progress becomes an abort; connection_lost is due
            return
        self._closing = True
        self._cancel_tasks()
        self._ep.abort()
        self._schedule_connection_lost(exc)

    def _schedule_connection_lost(self, exc: Exception | None) -> None:
        if self._finish_task is None:
            self._finish_task = self._loop.create_task(self._finish(exc))

    async def _finish(self, exc: Exception | None) -> None:
        try:
            await self._ep.wait_closed()  # bounded by Options.close_timeout
        finally:
            self._call_connection_lost(exc)

    def _call_connection_lost(self, exc: Exception | None) -> None:
        if self._lost.done():
            return
        try:
            self._protocol.connection_lost(exc)
        except Exception as error:
            self._loop.call_exception_handler(
                {
                    "message": "protocol.connection_lost() call failed",
                    "exception": error,
                    "transport": self,
                    "protocol": self._protocol,
                }
            )
        finally:
            self._lost.set_result(None)
            server, self._server = self._server, None
            if server is not None:
                server._detach(self)

    def _call_protocol(self, method: Callable[[], object], what: str) -> None:
        try:
            method()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop.call_exception_handler(
                {
                    "message": f"protocol.{what}() failed",
                    "exception": exc,
                    "transport": self,
                    "protocol": self._protocol,
                }
            )

    # reading

    async def _wait_resumed(self) -> None:
        while self._reading_paused:
            waiter = self._loop.create_future()
            self._resume_waiter = waiter
            try:
                await waiter
            finally:
                self._resume_waiter = None

    async def _read_loop(self) -> None:
        ep = self._ep
        while True:
            await self._wait_resumed()
            try:
                data = await ep.read(_READ_SIZE)
            except Exception as exc:
                if not self._closing:
                    self._fatal_error(exc, "Fatal read error on RDMA transport")
                return
            # A read that was already under way when reading was paused: hold its data until resumed.
            await self._wait_resumed()
            if self._closing:
                return
            if not data:
                break
            try:
                self._protocol.data_received(data)
            except Exception as exc:
                self._fatal_error(exc, "Fatal error: protocol.data_received() call failed.")
                return
            except BaseException:
                self.abort()
                raise
            if self._closing:
                return
        try:
            keep_open = self._protocol.eof_received()
        except Exception as exc:
            self._fatal_error(exc, "Fatal error: protocol.eof_received() call failed.")
            return
        except BaseException:
            self.abort()
            raise
        if self._closing:
            return
        if not keep_open:
            self.close()
            return
        # Half-closed by the peer: we may still write. The connection ends when the peer disconnects
        # or we close; after the peer's EOF that is a normal end.
        await ep.wait_closed()
        if not self._closing:
            self._closing = True
            self._cancel_tasks()
            self._schedule_connection_lost(None)

    # writing (flow control)

    def _maybe_pause_protocol(self) -> None:
        if self._protocol_paused or self._closing:
            return
        if self._ep.get_write_buffer_size() <= self._high:
            return
        self._protocol_paused = True
        self._call_protocol(self._protocol.pause_writing, "pause_writing")
        if not self._closing:
            self._drain_task = self._loop.create_task(self._drain_loop())

    async def _drain_loop(self) -> None:
        ep = self._ep
        try:
            # Endpoint.drain() waits, when the buffer is above the high mark, until it is at the low one.
            while ep.get_write_buffer_size() > self._high:
                await ep.drain()
        except Exception as exc:
            if not self._closing:
                self._fatal_error(exc, "Fatal write error on RDMA transport")
            return
        self._drain_task = None
        if self._protocol_paused and not self._closing:
            self._protocol_paused = False
            self._call_protocol(self._protocol.resume_writing, "resume_writing")


class ListenerInfo:
    """What :attr:`Server.sockets` holds: a listening RDMA address, not a socket.

    An rdma_cm listener has no file descriptor; this offers the parts of a listening socket that make
    sense for it, so ``server.sockets[0].getsockname()`` works as with TCP.
    """

    __slots__ = ("_address", "family", "proto", "type")

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = address
        self.family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.type = socket.SOCK_STREAM
        self.proto = 0

    def getsockname(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on."""
        return self._address

    def __repr__(self) -> str:
        return f"<rdmaio.ListenerInfo family={self.family.name} laddr={self._address}>"


class Server(asyncio.AbstractServer):
    """What :func:`start_server` returns; the interface of :class:`asyncio.Server`.

    A thin adapter over the server core (:class:`~rdmaio.StreamServer`, which listens, applies the
    backlog, holds connections back until serving starts and tracks handlers): it runs an
    :class:`RdmaTransport` and the protocol for each connection. ``close()`` stops listening and leaves
    connections open; ``wait_closed()`` waits until the server is closed and every connection has ended
    (asyncio 3.12+ semantics); ``close_clients()`` / ``abort_clients()`` (asyncio 3.13) close or abort
    the connections' transports; ``async with`` closes the server and waits. :attr:`sockets` holds
    :class:`ListenerInfo` objects; :attr:`addresses` the ``(host, port)`` pairs.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol_factory: Callable[[], asyncio.Protocol],
    ) -> None:
        self._loop = loop
        self._protocol_factory = protocol_factory
        self._core: StreamServer | None = None
        self._transports: set[RdmaTransport] = set()
        self._serving_forever_fut: asyncio.Future[None] | None = None

    async def _listen(
        self,
        hosts: Sequence[str | None],
        port: int,
        backlog: int,
        options: Options | dict[str, Any] | None,
        start_serving: bool,
    ) -> None:
        self._core = await serve(
            self._on_endpoint,
            [host or "" for host in hosts],
            port,
            backlog=backlog,
            options=options,
            start_serving=start_serving,
        )

    @property
    def _server(self) -> StreamServer:
        assert self._core is not None, "start_server() sets the core up before returning"
        return self._core

    async def _on_endpoint(self, endpoint: Endpoint) -> None:
        """The core's handler: run one connection's transport and protocol until the connection ends."""
        try:
            protocol = self._protocol_factory()
        except Exception as exc:
            self._loop.call_exception_handler({"message": "protocol factory failed", "exception": exc})
            endpoint.abort()
            return
        transport = RdmaTransport(self._loop, endpoint, protocol, server=self)
        try:
            transport._start()
        except Exception as exc:
            self._loop.call_exception_handler(
                {"message": "protocol.connection_made() failed", "exception": exc, "transport": transport}
            )
            transport.abort()
        await transport._wait_lost()

    def _attach(self, transport: RdmaTransport) -> None:
        self._transports.add(transport)

    def _detach(self, transport: RdmaTransport) -> None:
        self._transports.discard(transport)

    # --- asyncio.Server surface -------------------------------------------------------------------------

    @property
    def sockets(self) -> tuple[ListenerInfo, ...]:
        """The listening addresses as :class:`ListenerInfo` (``getsockname()``); empty once closed."""
        if self._core is None or not self._core.listening:
            return ()
        return tuple(ListenerInfo(address) for address in self._core.addresses)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every listener; empty once closed."""
        return [info.getsockname() for info in self.sockets]

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the server runs on."""
        return self._loop

    def is_serving(self) -> bool:
        """True while the server accepts connections."""
        return self._core is not None and self._core.is_serving()

    def close(self) -> None:
        """Stop listening. Existing connections stay open (see :meth:`close_clients`); connections still
        waiting for :meth:`start_serving` are dropped."""
        if self._core is not None:
            self._core.close()
        if self._serving_forever_fut is not None and not self._serving_forever_fut.done():
            self._serving_forever_fut.cancel()
            self._serving_forever_fut = None

    def close_clients(self) -> None:
        """Close every connection gracefully (``transport.close()``)."""
        for transport in list(self._transports):
            transport.close()

    def abort_clients(self) -> None:
        """Abort every connection (``transport.abort()``)."""
        for transport in list(self._transports):
            transport.abort()

    async def start_serving(self) -> None:
        """Start accepting connections (idempotent)."""
        await self._server.start_serving()
        await asyncio.sleep(0)

    async def serve_forever(self) -> None:
        """Accept connections until cancelled; then close the server and wait for it."""
        if self._serving_forever_fut is not None:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        if self._core is None or not self._core.listening:
            raise RuntimeError(f"server {self!r} is closed")
        await self._server.start_serving()
        self._serving_forever_fut = self._loop.create_future()
        try:
            await self._serving_forever_fut
        except asyncio.CancelledError:
            try:
                self.close()
                await self.wait_closed()
            finally:
                raise
        finally:
            self._serving_forever_fut = None

    async def wait_closed(self) -> None:
        """Wait until :meth:`close` was called and every connection has ended."""
        if self._core is not None:
            await self._core.wait_closed()

    def __repr__(self) -> str:
        return f"<rdmaio.streams.Server sockets={self.sockets!r}>"


async def open_connection(
    host: str, port: int, *, limit: int = _DEFAULT_LIMIT, **opts: Any
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect over RDMA and return asyncio's ``(StreamReader, StreamWriter)`` pair.

    As :func:`asyncio.open_connection`: ``limit`` is the StreamReader's buffer and line-length limit.
    ``opts`` are :func:`rdmaio.connect`'s: ``timeout``, ``local_addr``, ``options`` (an
    :class:`~rdmaio.Options` or a dict of overrides). TLS arguments (``ssl``, ``server_hostname``, ...)
    raise :class:`NotImplementedError`; socket-only arguments (``sock``, ``family``, ...) are accepted
    only at neutral values. Errors are rdmaio's (:class:`rdmaio.ConnectionRefusedError` is a builtin
    ``ConnectionRefusedError``, and so on).
    """
    _check_tcp_only(opts, ("local_addr", "options", "timeout"), "open_connection")
    loop = asyncio.get_running_loop()
    endpoint = await connect(host, port, **opts)
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport = RdmaTransport(loop, endpoint, protocol)
    try:
        transport._start()
    except BaseException:
        transport.abort()
        raise
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return reader, writer


async def start_server(
    client_connected_cb: ClientConnectedCallback,
    host: str | Sequence[str] | None = None,
    port: int | None = None,
    *,
    limit: int = _DEFAULT_LIMIT,
    backlog: int = 100,
    start_serving: bool = True,
    **opts: Any,
) -> Server:
    """Listen over RDMA and call ``client_connected_cb(reader, writer)`` for each connection.

    As :func:`asyncio.start_server`: the callback gets asyncio's ``StreamReader``/``StreamWriter``; a
    coroutine callback runs as a task. ``host`` is an address or name of an RDMA-capable interface, a
    sequence of them, or ``None``/``""`` for all; ``port`` 0 or ``None`` picks a free port (see
    ``server.sockets[0].getsockname()``). ``opts``: ``options`` (an :class:`~rdmaio.Options` or a dict).
    With ``start_serving=False`` the listener is created at once, and connections that arrive before
    :meth:`Server.start_serving` wait (established, not yet handed to the callback; at most ``backlog``
    of them, later ones are refused as a full listen backlog would). TLS arguments raise
    :class:`NotImplementedError`.
    """
    _check_tcp_only(opts, ("options",), "start_server")
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.StreamReaderProtocol:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        return asyncio.StreamReaderProtocol(reader, client_connected_cb, loop=loop)

    hosts: list[str | None] = [host] if host is None or isinstance(host, str) else list(host)
    server = Server(loop, factory)
    await server._listen(hosts, port or 0, backlog, opts.get("options"), start_serving)
    if start_serving:
        await asyncio.sleep(0)
    return server
