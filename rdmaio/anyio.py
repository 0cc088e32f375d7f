"""anyio streams over RDMA: :func:`connect`, :func:`connect_messages` and :func:`create_listener`.

These stand in for :func:`anyio.connect_tcp` and :func:`anyio.create_tcp_listener`. The streams are
:class:`anyio.abc.ByteStream` (:class:`RdmaByteStream`) or, in message mode,
:class:`anyio.abc.ObjectStream` of ``bytes`` (:class:`RdmaMessageStream`), over an
:class:`rdmaio.Endpoint`; the listener is an :class:`anyio.abc.Listener`. Code written against anyio's
stream interfaces (``receive``/``send``/``send_eof``/``aclose``, ``async for``, ``async with``,
:class:`~anyio.streams.buffered.BufferedByteStream`, ``Listener.serve``) runs over RDMA unchanged.

How a byte stream maps onto the endpoint:

* ``receive(max_bytes)`` → :meth:`Endpoint.read` (whatever is buffered, up to ``max_bytes``); the end of
  the stream (``b""``) raises :exc:`anyio.EndOfStream`, on every later call too.
* ``send(item)`` → :meth:`Endpoint.write` (the data is copied at once) and :meth:`Endpoint.drain`, which
  waits only while more than ``Options.write_high_water`` bytes are queued.
* ``send_eof()`` → :meth:`Endpoint.write_eof` (half-close); ``aclose()`` → :meth:`Endpoint.aclose`
  (queued data, EOF, disconnect); a cancelled ``aclose()`` aborts the endpoint instead.

Errors use anyio's vocabulary, as anyio's TCP streams do:

* :exc:`anyio.EndOfStream`: the peer sent EOF or closed (``read()`` gave ``b""``, ``recv()`` gave
  ``None``).
* :exc:`anyio.ClosedResourceError`: we closed the stream (``aclose()``), also for a call blocked at the
  time (it raises when the graceful close ends); ``send()`` after our own ``send_eof()``; the endpoint
  was closed underneath the stream (:exc:`rdmaio.EndpointClosedError`).
* :exc:`anyio.BrokenResourceError`: :exc:`rdmaio.ConnectionResetError` (the peer died or disconnected
  without EOF), :exc:`rdmaio.ConnectionAbortedError` and every other :exc:`rdmaio.RdmaError` or
  ``OSError`` of the data path; the original is the ``__cause__``.
* :exc:`anyio.BusyResourceError`: a second task in ``receive()``, or in ``send()``, while one is in it.

:exc:`rdmaio.MessageTooLargeError` (a ``ValueError``: the caller's mistake, nothing is sent) passes
through unchanged. Differences from TCP are listed in ``docs/porting.md``.

Typed attributes: :class:`anyio.abc.SocketAttribute` (``local_address``, ``local_port``,
``remote_address``, ``remote_port``, ``family``; no ``raw_socket``: there is no socket) and
:class:`RdmaAttribute` (``device``, ``port_num``, ``qp_num``, ``mtu``, ``max_inline``, ``endpoint``).

Which async library runs underneath is up to :mod:`rdmaio`'s core: this module uses only anyio's
portable primitives.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Self, TypeVar, overload

import anyio
import anyio.lowlevel
from anyio import (
    BrokenResourceError,
    ClosedResourceError,
    ConnectionFailed,
    EndOfStream,
    ResourceGuard,
    TypedAttributeProvider,
    TypedAttributeSet,
    typed_attribute,
)
from anyio.abc import (
    ByteStream,
    ByteStreamConnectable,
    Listener,
    ObjectStream,
    SocketAttribute,
    TaskGroup,
)

import rdmaio
from rdmaio.endpoint import Endpoint
from rdmaio.errors import EndpointClosedError, MessageTooLargeError, RdmaError
from rdmaio.options import Options
from rdmaio.path import PathInfo

__all__ = [
    "RdmaAttribute",
    "RdmaByteStream",
    "RdmaConnectable",
    "RdmaListener",
    "RdmaMessageStream",
    "connect",
    "connect_messages",
    "create_listener",
]

OptionsArg = Options | dict[str, Any] | None
"""What ``options=`` accepts: an :class:`rdmaio.Options`, a dict of overrides, or ``None``."""


class RdmaAttribute(TypedAttributeSet):
    """Typed attributes of an RDMA stream, in addition to :class:`anyio.abc.SocketAttribute`'s.

    ``stream.extra(RdmaAttribute.qp_num)`` and so on; from :meth:`rdmaio.Endpoint.get_extra_info`.
    """

    #: name of the RDMA device carrying the connection (e.g. ``"rxe0"``, ``"mlx5_0"``)
    device: str = typed_attribute()
    #: port number of that device
    port_num: int = typed_attribute()
    #: number of the local queue pair
    qp_num: int = typed_attribute()
    #: active MTU of the port, in bytes
    mtu: int = typed_attribute()
    #: largest send that is posted inline (copied into the work request), in bytes
    max_inline: int = typed_attribute()
    #: the :class:`rdmaio.Endpoint` under the stream (for ``statistics()``; do not read or write it
    #: while the stream is in use)
    endpoint: Endpoint = typed_attribute()
    #: the connection's path record, a :class:`rdmaio.PathInfo` (device, transport, GIDs, MTU, features,
    #: the peer's version), as ``Endpoint.get_extra_info("rdma")``: read from the device when first asked
    #: (None if the connection closed before that)
    path: PathInfo = typed_attribute()


def _family(address: tuple[str, int] | None) -> socket.AddressFamily:
    """The address family of a (host, port) pair: IPv6 if the host is an IPv6 address, else IPv4."""
    if address is None:
        return socket.AF_INET
    try:
        version = ipaddress.ip_address(address[0]).version
    except ValueError:
        version = 6 if ":" in address[0] else 4
    return socket.AF_INET6 if version == 6 else socket.AF_INET


def _constant(value: object) -> Callable[[], Any]:
    return lambda: value


def _address_attributes(
    local: tuple[str, int] | None, remote: tuple[str, int] | None
) -> dict[Any, Callable[[], Any]]:
    """:class:`SocketAttribute` entries for the given (host, port) pairs (only those that are known)."""
    attributes: dict[Any, Callable[[], Any]] = {SocketAttribute.family: _constant(_family(local or remote))}
    if local is not None:
        attributes[SocketAttribute.local_address] = _constant(tuple(local))
        attributes[SocketAttribute.local_port] = _constant(local[1])
    if remote is not None:
        attributes[SocketAttribute.remote_address] = _constant(tuple(remote))
        attributes[SocketAttribute.remote_port] = _constant(remote[1])
    return attributes


class _EndpointStream(TypedAttributeProvider):
    """What the byte and message streams share: the endpoint, the guards, closing, errors, attributes."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._receive_guard = ResourceGuard("reading from")
        self._send_guard = ResourceGuard("writing to")
        self._closed = False
        self._eof_sent = False
        self._attributes = self._build_attributes()

    @classmethod
    def from_endpoint(cls, endpoint: Endpoint) -> Self:
        """Wrap an established :class:`rdmaio.Endpoint` (e.g. one a :func:`rdmaio.serve` handler got).

        The same as ``cls(endpoint)``. The stream takes ownership: closing it closes the endpoint. Do not
        use the endpoint directly while the stream is in use.
        """
        return cls(endpoint)

    @property
    def endpoint(self) -> Endpoint:
        """The :class:`rdmaio.Endpoint` under this stream."""
        return self._endpoint

    def _build_attributes(self) -> dict[Any, Callable[[], Any]]:
        info = self._endpoint.get_extra_info
        attributes = _address_attributes(info("sockname"), info("peername"))
        for attribute, key in (
            (RdmaAttribute.device, "device"),
            (RdmaAttribute.port_num, "port"),
            (RdmaAttribute.qp_num, "qp_num"),
            (RdmaAttribute.mtu, "mtu"),
            (RdmaAttribute.max_inline, "max_inline"),
        ):
            value = info(key)
            if value is not None:
                attributes[attribute] = _constant(value)
        attributes[RdmaAttribute.endpoint] = _constant(self._endpoint)
        # Not read here: the path record costs system calls, made only if someone asks for it.
        attributes[RdmaAttribute.path] = functools.partial(self._endpoint.get_extra_info, "rdma")
        return attributes

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        """:class:`SocketAttribute` (without ``raw_socket``) and :class:`RdmaAttribute` entries."""
        return self._attributes

    def _translate(self, exc: Exception) -> Exception:
        """The anyio exception to raise for an rdmaio error of the data path (see the module docstring)."""
        if self._closed or isinstance(exc, EndpointClosedError):
            return ClosedResourceError()
        return BrokenResourceError()

    def _check_send(self) -> None:
        if self._closed:
            raise ClosedResourceError
        if self._eof_sent:
            raise ClosedResourceError("cannot send after send_eof()")

    async def send_eof(self) -> None:
        """Half-close: the peer receives the end of the stream after the data sent so far.

        Receiving still works. Idempotent, and a no-op once the stream is closed.
        """
        if self._closed or self._eof_sent:
            return
        self._eof_sent = True
        try:
            self._endpoint.write_eof()
        except (RdmaError, OSError) as exc:
            raise self._translate(exc) from exc

    async def aclose(self) -> None:
        """Close gracefully: queued data is sent, then EOF, then the connection is released.

        Idempotent. Later ``receive``/``send`` calls raise :exc:`anyio.ClosedResourceError`, and so do
        calls blocked in other tasks, once the endpoint is released. If this call is cancelled (e.g. by
        :func:`anyio.aclose_forcefully`), the endpoint is aborted: queued data is dropped and the
        resources are released at once.
        """
        self._closed = True
        try:
            await self._endpoint.aclose()
        except (RdmaError, OSError):
            # The connection broke while closing: nothing is left to flush, it is released all the same.
            self._endpoint.abort()
        except BaseException:
            self._endpoint.abort()
            raise


class RdmaByteStream(_EndpointStream, ByteStream):
    """An :class:`anyio.abc.ByteStream` over an :class:`rdmaio.Endpoint` (its stream API).

    Create one with :func:`connect`, get one from :func:`create_listener`, or wrap an endpoint with
    ``RdmaByteStream(endpoint)`` / :meth:`from_endpoint`. Message boundaries carry no meaning here: one
    ``send()`` may arrive as several ``receive()`` results and several as one, as over TCP.
    """

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """Receive between 1 and ``max_bytes`` bytes.

        Raises :exc:`anyio.EndOfStream` at the end of the stream (every time), and the errors listed in the
        module docstring.
        """
        if max_bytes < 1:
            raise ValueError("max_bytes must be a positive integer")
        with self._receive_guard:
            if self._closed:
                raise ClosedResourceError
            await anyio.lowlevel.checkpoint()
            try:
                data = await self._endpoint.read(max_bytes)
            except (RdmaError, OSError) as exc:
                raise self._translate(exc) from exc
        if not data:
            if self._closed:
                raise ClosedResourceError
            raise EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        """Send ``item`` (any bytes-like object; copied before this returns).

        Waits while more than ``Options.write_high_water`` bytes are queued. Cancelled before the data was
        queued, nothing is sent; cancelled while waiting, the data is still sent.
        """
        with self._send_guard:
            await anyio.lowlevel.checkpoint_if_cancelled()
            self._check_send()
            try:
                self._endpoint.write(item)
                await self._endpoint.drain()
            except (RdmaError, OSError) as exc:
                raise self._translate(exc) from exc
            await anyio.lowlevel.cancel_shielded_checkpoint()


class RdmaMessageStream(_EndpointStream, ObjectStream[bytes]):
    """An :class:`anyio.abc.ObjectStream` of ``bytes`` over an :class:`rdmaio.Endpoint`'s message API.

    One ``send(item)`` is one message, received whole by one ``receive()`` on the other side (an empty
    ``item`` included), up to the peer's ``Options.max_message_size``.
    """

    async def receive(self) -> bytes:
        """Receive the next message.

        Raises :exc:`anyio.EndOfStream` at the end of the stream (every time), and the errors listed in the
        module docstring.
        """
        with self._receive_guard:
            if self._closed:
                raise ClosedResourceError
            await anyio.lowlevel.checkpoint()
            try:
                message = await self._endpoint.recv()
            except (RdmaError, OSError) as exc:
                raise self._translate(exc) from exc
        if message is None:
            if self._closed:
                raise ClosedResourceError
            raise EndOfStream
        return message

    async def send(self, item: bytes) -> None:
        """Send ``item`` as one message; returns once it is posted (the data is copied).

        Raises :exc:`rdmaio.MessageTooLargeError` (a ``ValueError``) if ``item`` exceeds the peer's
        maximum message size. A send cancelled while it waits for credits may still deliver the whole
        message, never a part of it.
        """
        with self._send_guard:
            await anyio.lowlevel.checkpoint_if_cancelled()
            self._check_send()
            try:
                await self._endpoint.send(item)
            except MessageTooLargeError:
                raise
            except (RdmaError, OSError) as exc:
                raise self._translate(exc) from exc
            await anyio.lowlevel.cancel_shielded_checkpoint()


T_Stream = TypeVar("T_Stream", RdmaByteStream, RdmaMessageStream)


class RdmaListener(Listener[T_Stream], Generic[T_Stream]):
    """An :class:`anyio.abc.Listener` of RDMA connections, over an :class:`rdmaio.StreamServer`.

    Create one with :func:`create_listener`. :meth:`serve` runs ``handler(stream)`` for each connection in
    a task group, as anyio's TCP listener does; :meth:`accept` returns the next connection. The handler
    owns its stream: close it when done (``async with stream:``). Closing the listener stops listening
    and leaves the accepted streams open.
    """

    def __init__(self, server: rdmaio.StreamServer, wrap: Callable[[Endpoint], T_Stream]) -> None:
        self._server = server
        self._wrap: Callable[[Endpoint], T_Stream] = wrap
        self._accept_guard = ResourceGuard("accepting connections from")
        self._closed = False

    @property
    def server(self) -> rdmaio.StreamServer:
        """The :class:`rdmaio.StreamServer` (in accept mode) under this listener."""
        return self._server

    async def accept(self) -> T_Stream:
        """Wait for the next established connection and return it as a stream.

        Raises :exc:`anyio.ClosedResourceError` once the listener is closed (also in a task blocked here),
        :exc:`anyio.BrokenResourceError` if the listener failed (e.g. its RDMA device went away).
        """
        if self._closed:
            raise ClosedResourceError
        with self._accept_guard:
            await anyio.lowlevel.checkpoint()
            try:
                endpoint = await self._server.accept()
            except (RdmaError, OSError) as exc:
                if self._closed:
                    raise ClosedResourceError from exc
                raise BrokenResourceError from exc
        return self._wrap(endpoint)

    async def serve(self, handler: Callable[[T_Stream], Any], task_group: TaskGroup | None = None) -> None:
        """Accept connections until the listener is closed; run ``handler(stream)`` for each in a task.

        The tasks run in ``task_group``, or in a task group of this call that waits for them. Ends with
        :exc:`anyio.ClosedResourceError` when the listener is closed, as anyio's TCP listener does.
        """
        async with AsyncExitStack() as stack:
            if task_group is None:
                task_group = await stack.enter_async_context(anyio.create_task_group())
            while True:
                stream = await self.accept()
                task_group.start_soon(handler, stream)

    async def aclose(self) -> None:
        """Stop listening; accepted streams stay open. Idempotent.

        A task blocked in :meth:`accept` (or :meth:`serve`) gets :exc:`anyio.ClosedResourceError`.
        Connections that were established but not accepted yet are aborted, like the un-accepted
        connections of a TCP listen backlog.
        """
        self._closed = True
        # StreamServer.close() releases the listener at once. Not server.wait_closed(): that also waits
        # for every accepted connection to end, and those belong to their streams, not to the listener.
        self._server.close()
        await anyio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        """``SocketAttribute.local_address``, ``local_port`` and ``family`` of the (first) address."""
        addresses = self._server.addresses
        return _address_attributes(addresses[0] if addresses else None, None)


async def connect(
    host: str,
    port: int,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - rdmaio.connect's connect timeout
    local_addr: tuple[str, int] | None = None,
    options: OptionsArg = None,
) -> RdmaByteStream:
    """Connect to an rdmaio server at ``host``:``port`` and return a byte stream.

    The RDMA counterpart of :func:`anyio.connect_tcp`. The arguments are :func:`rdmaio.connect`'s, and so
    are the errors (:exc:`rdmaio.ConnectionRefusedError`, :exc:`rdmaio.TimeoutError`, ...: ``OSError``
    subclasses like the ones ``connect_tcp`` raises, except :exc:`rdmaio.HandshakeError`, a
    ``ValueError``).
    """
    endpoint = await rdmaio.connect(host, port, timeout=timeout, local_addr=local_addr, options=options)
    return RdmaByteStream(endpoint)


async def connect_messages(
    host: str,
    port: int,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - rdmaio.connect's connect timeout
    local_addr: tuple[str, int] | None = None,
    options: OptionsArg = None,
) -> RdmaMessageStream:
    """Like :func:`connect`, but return a message stream: one ``send()`` is one ``receive()`` there.

    Both ends must use message mode (``create_listener(..., messages=True)`` on the server).
    """
    endpoint = await rdmaio.connect(host, port, timeout=timeout, local_addr=local_addr, options=options)
    return RdmaMessageStream(endpoint)


@overload
async def create_listener(
    host: str | None,
    port: int,
    *,
    backlog: int = ...,
    options: OptionsArg = ...,
    messages: Literal[False] = ...,
) -> RdmaListener[RdmaByteStream]: ...


@overload
async def create_listener(
    host: str | None,
    port: int,
    *,
    backlog: int = ...,
    options: OptionsArg = ...,
    messages: Literal[True],
) -> RdmaListener[RdmaMessageStream]: ...


async def create_listener(
    host: str | None,
    port: int,
    *,
    backlog: int = 128,
    options: OptionsArg = None,
    messages: bool = False,
) -> RdmaListener[RdmaByteStream] | RdmaListener[RdmaMessageStream]:
    """Listen on ``host``:``port`` and return a listener of byte streams (of message streams with
    ``messages=True``).

    The RDMA counterpart of :func:`anyio.create_tcp_listener`. ``host`` is an address or name of an
    RDMA-capable interface (``None``: all), ``port`` 0 picks a free port
    (``listener.extra(SocketAttribute.local_port)``). ``options`` applies to every accepted connection.
    """
    server = await rdmaio.listen(host, port, backlog=backlog, options=options)
    if messages:
        return RdmaListener(server, RdmaMessageStream)
    return RdmaListener(server, RdmaByteStream)


@dataclass
class RdmaConnectable(ByteStreamConnectable):
    """Connects to an rdmaio server: the RDMA counterpart of :class:`anyio.TCPConnectable`.

    ``connect()`` returns an :class:`RdmaByteStream` and raises :exc:`anyio.ConnectionFailed` (chaining
    rdmaio's error) when the connection cannot be made.
    """

    host: str
    port: int
    options: Options | dict[str, Any] | None = field(default=None, kw_only=True)

    async def connect(self) -> RdmaByteStream:
        """Open a connection and return it as a byte stream."""
        try:
            return await connect(self.host, self.port, options=self.options)
        except (RdmaError, OSError) as exc:
            raise ConnectionFailed(f"error connecting to {self.host}:{self.port} over RDMA: {exc}") from exc
