"""Unit tests of rdmaio.anyio without RDMA: error and attribute mapping over an in-memory fake Endpoint.

``FakeEndpoint`` (from :mod:`rdmaio.testing.fakes`) has the parts of :class:`rdmaio.Endpoint` the anyio
layer uses, with the real one's documented semantics: reads return buffered data first, then raise the
failure, ``EndpointClosedError`` after our close, ``b""``/``None`` at the peer's EOF; a blocked read is
woken only when the endpoint is torn down (``close()`` itself does not wake it, as in the real endpoint,
where the teardown ends the graceful close); writes after ``write_eof`` raise ``EndpointClosedError``.
Everything waits on the running library's Event, so the tests run on asyncio, uvloop and trio through
anyio's pytest plugin.
"""

from __future__ import annotations

import collections
import socket
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteStream

import rdmaio
import rdmaio.anyio as rdma_anyio
from rdmaio.anyio import RdmaAttribute, RdmaByteStream, RdmaConnectable, RdmaListener, RdmaMessageStream
from rdmaio.errors import EndpointClosedError
from rdmaio.testing.fakes import FakeEndpoint

pytestmark = pytest.mark.anyio


@pytest.fixture(
    params=[("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param


EXTRA = {
    "sockname": ("198.18.0.1", 7471),
    "peername": ("198.18.0.2", 40001),
    "device": "rxe0",
    "port": 1,
    "qp_num": 17,
    "mtu": 1024,
    "max_inline": 64,
}


def fake_endpoint(extra: dict[str, Any] | None = None, max_message_size: int = 1 << 20) -> FakeEndpoint:
    """A lone fake endpoint (the test plays the peer) with the attributes of an rxe connection."""
    return FakeEndpoint(extra=EXTRA if extra is None else extra, max_message_size=max_message_size)


async def blocked(task_group: anyio.abc.TaskGroup, func: Any, *args: Any) -> list[Any]:
    """Start ``func(*args)`` in ``task_group``, wait until it blocks; the list gets its result or error."""
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append(await func(*args))
        except Exception as exc:
            outcome.append(exc)

    task_group.start_soon(run)
    await anyio.wait_all_tasks_blocked()
    assert not outcome, outcome
    return outcome


# --- receiving ---------------------------------------------------------------------------------------


async def test_receive_returns_data_respecting_max_bytes() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.feed(b"hello world")
    assert await stream.receive(5) == b"hello"
    assert await stream.receive() == b" world"
    with pytest.raises(ValueError):
        await stream.receive(0)


async def test_end_of_stream_is_raised_every_time() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.feed(b"last")
    ep.feed_eof()
    assert await stream.receive() == b"last"
    for _ in range(3):
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()
    assert [chunk async for chunk in stream] == []  # async for ends quietly


@pytest.mark.parametrize(
    "cause",
    [
        rdmaio.ConnectionResetError("peer died", errno=104),
        rdmaio.ConnectionAbortedError("protocol violation"),
        rdmaio.VerbsError("ibv_post_recv failed", errno=12, call="ibv_post_recv"),
        rdmaio.ProtocolError("bad frame"),
        rdmaio.ForkError("used after fork"),
    ],
    ids=lambda exc: type(exc).__name__,
)
async def test_transport_failures_become_broken_resource(cause: Exception) -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.fail(cause)
    with pytest.raises(anyio.BrokenResourceError) as receive_error:
        await stream.receive()
    assert receive_error.value.__cause__ is cause
    with pytest.raises(anyio.BrokenResourceError) as send_error:
        await stream.send(b"x")
    assert send_error.value.__cause__ is cause


async def test_failure_while_blocked_in_receive_is_broken_resource() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    async with anyio.create_task_group() as tg:
        outcome = await blocked(tg, stream.receive)
        ep.fail(rdmaio.ConnectionResetError("the peer disconnected without sending EOF"))
    [error] = outcome
    assert isinstance(error, anyio.BrokenResourceError)
    assert isinstance(error.__cause__, rdmaio.ConnectionResetError)


async def test_endpoint_closed_underneath_is_closed_resource() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.abort()  # closed on this side, but not through the stream (e.g. StreamServer.abort_clients())
    with pytest.raises(anyio.ClosedResourceError) as error:
        await stream.receive()
    assert isinstance(error.value.__cause__, EndpointClosedError)
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"x")


# --- sending -----------------------------------------------------------------------------------------


async def test_send_writes_and_drains() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    await stream.send(b"abc")
    await stream.send(memoryview(b"def"))
    assert bytes(ep.written) == b"abcdef"


async def test_send_cancelled_before_it_starts_sends_nothing() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await stream.send(b"never")
    assert scope.cancelled_caught
    assert ep.written == b""


async def test_send_is_a_checkpoint_even_when_nothing_waits() -> None:
    """A send that needs no flow-control wait still yields, so a second sender sees BusyResourceError."""
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    outcomes: list[BaseException | None] = []

    async def send(data: bytes) -> None:
        try:
            await stream.send(data)
            outcomes.append(None)
        except anyio.BusyResourceError as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send, b"a" * 10)
        tg.start_soon(send, b"b" * 10)
    assert sum(isinstance(o, anyio.BusyResourceError) for o in outcomes) == 1
    assert bytes(ep.written) in (b"a" * 10, b"b" * 10)  # one whole send, nothing interleaved


async def test_send_after_send_eof_is_closed_resource() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    await stream.send_eof()
    await stream.send_eof()  # idempotent
    assert ep.write_eof_calls == 1
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"x")
    ep.feed(b"still readable")
    assert await stream.receive() == b"still readable"


# --- closing -----------------------------------------------------------------------------------------


async def test_use_after_aclose_is_closed_resource() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.feed(b"unread")
    await stream.aclose()
    await stream.aclose()  # idempotent
    assert ep.torn_down and ep.abort_calls == 0
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"x")
    await stream.send_eof()  # a no-op once closed
    assert ep.write_eof_calls == 0


async def test_aclose_wakes_a_blocked_receive_with_closed_resource() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    async with anyio.create_task_group() as tg:
        outcome = await blocked(tg, stream.receive)
        await stream.aclose()
    [error] = outcome
    assert isinstance(error, anyio.ClosedResourceError)


async def test_aclose_wakes_a_send_blocked_in_drain_with_closed_resource() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.drain_gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        outcome = await blocked(tg, stream.send, b"queued")
        await stream.aclose()
        ep.drain_gate.set()  # the real endpoint wakes drain() on its send completions
    [error] = outcome
    assert isinstance(error, anyio.ClosedResourceError)
    assert bytes(ep.written) == b"queued"  # queued before the close: the graceful close sends it


async def test_cancelled_aclose_aborts_the_endpoint() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.close_gate = anyio.Event()  # the peer takes nothing: the graceful close would wait
    with anyio.move_on_after(0):
        await stream.aclose()
    assert ep.abort_calls == 1 and ep.torn_down
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()


async def test_aclose_forcefully_aborts() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    ep.close_gate = anyio.Event()
    await anyio.aclose_forcefully(stream)
    assert ep.abort_calls == 1 and ep.torn_down


async def test_aclose_swallows_a_broken_connection() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)

    async def failing_aclose() -> None:
        raise rdmaio.ConnectionResetError("peer died while we closed")

    ep.aclose = failing_aclose
    await stream.aclose()
    assert ep.abort_calls == 1


async def test_async_with_closes() -> None:
    ep = fake_endpoint()
    async with RdmaByteStream.from_endpoint(ep) as stream:
        assert isinstance(stream, RdmaByteStream)
    assert ep.aclose_calls == 1 and ep.torn_down


# --- concurrency -------------------------------------------------------------------------------------


async def test_second_receiver_is_busy() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    async with anyio.create_task_group() as tg:
        outcome = await blocked(tg, stream.receive)
        with pytest.raises(anyio.BusyResourceError):
            await stream.receive()
        ep.feed(b"for the first")
    assert outcome == [b"for the first"]
    assert ep.reads == 1  # the busy call never reached the endpoint


async def test_cancelled_receive_consumes_nothing() -> None:
    ep = fake_endpoint()
    stream = RdmaByteStream(ep)
    scope = anyio.CancelScope()

    async def receive() -> None:
        with scope:
            await stream.receive()

    async with anyio.create_task_group() as tg:
        tg.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
    assert scope.cancelled_caught
    ep.feed(b"after")
    assert await stream.receive() == b"after"


# --- BufferedByteStream ------------------------------------------------------------------------------


async def test_buffered_byte_stream() -> None:
    ep = fake_endpoint()
    buffered = BufferedByteStream(RdmaByteStream(ep))
    ep.feed(b"GET / HT", b"TP/1.1\r\nbo", b"dy56789")
    ep.feed_eof()
    assert await buffered.receive_until(b"\r\n", 100) == b"GET / HTTP/1.1"
    assert await buffered.receive_exactly(4) == b"body"
    with pytest.raises(anyio.IncompleteRead):
        await buffered.receive_exactly(10)


# --- message mode ------------------------------------------------------------------------------------


async def test_message_stream_keeps_boundaries() -> None:
    ep = fake_endpoint()
    stream = RdmaMessageStream(ep)
    ep.feed(b"one", b"", b"three")
    ep.feed_eof()
    assert [await stream.receive() for _ in range(3)] == [b"one", b"", b"three"]
    with pytest.raises(anyio.EndOfStream):
        await stream.receive()
    await stream.send(b"")
    await stream.send(b"x" * 1000)
    assert ep.sent == [b"", b"x" * 1000]


async def test_message_too_large_passes_through() -> None:
    ep = fake_endpoint(max_message_size=10)
    stream = RdmaMessageStream(ep)
    with pytest.raises(rdmaio.MessageTooLargeError):
        await stream.send(b"x" * 11)
    await stream.send(b"x" * 10)  # the stream is still usable
    assert ep.sent == [b"x" * 10]


async def test_message_stream_errors() -> None:
    ep = fake_endpoint()
    stream = RdmaMessageStream(ep)
    cause = rdmaio.ConnectionResetError("peer died")
    ep.fail(cause)
    with pytest.raises(anyio.BrokenResourceError) as error:
        await stream.receive()
    assert error.value.__cause__ is cause
    await stream.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"x")


# --- typed attributes --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RdmaByteStream, RdmaMessageStream])
async def test_typed_attributes(cls: type[RdmaByteStream]) -> None:
    ep = fake_endpoint()
    stream = cls(ep)
    assert stream.extra(SocketAttribute.local_address) == ("198.18.0.1", 7471)
    assert stream.extra(SocketAttribute.local_port) == 7471
    assert stream.extra(SocketAttribute.remote_address) == ("198.18.0.2", 40001)
    assert stream.extra(SocketAttribute.remote_port) == 40001
    assert stream.extra(SocketAttribute.family) == socket.AF_INET
    assert stream.extra(RdmaAttribute.device) == "rxe0"
    assert stream.extra(RdmaAttribute.port_num) == 1
    assert stream.extra(RdmaAttribute.qp_num) == 17
    assert stream.extra(RdmaAttribute.mtu) == 1024
    assert stream.extra(RdmaAttribute.max_inline) == 64
    assert stream.extra(RdmaAttribute.endpoint) is ep
    assert stream.endpoint is ep
    with pytest.raises(anyio.TypedAttributeLookupError):
        stream.extra(SocketAttribute.raw_socket)  # there is no socket
    assert stream.extra(SocketAttribute.raw_socket, None) is None


async def test_typed_attributes_ipv6_and_missing() -> None:
    stream = RdmaByteStream(fake_endpoint({"sockname": ("fe80::1%rxe0", 5), "peername": None}))
    assert stream.extra(SocketAttribute.family) == socket.AF_INET6
    assert stream.extra(SocketAttribute.local_port) == 5
    with pytest.raises(anyio.TypedAttributeLookupError):
        stream.extra(SocketAttribute.remote_address)
    with pytest.raises(anyio.TypedAttributeLookupError):
        stream.extra(RdmaAttribute.qp_num)


# --- connect and the listener ------------------------------------------------------------------------


async def test_connect_passes_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    ep = fake_endpoint()

    async def fake_connect(host: str, port: int, **kwargs: Any) -> FakeEndpoint:
        calls.append((host, port, kwargs))
        return ep

    monkeypatch.setattr(rdmaio, "connect", fake_connect)
    stream = await rdma_anyio.connect("h", 1, timeout=3, local_addr=("l", 0), options={"slot_size": 4096})
    assert isinstance(stream, RdmaByteStream) and stream.endpoint is ep
    messages = await rdma_anyio.connect_messages("h", 2)
    assert isinstance(messages, RdmaMessageStream)
    assert calls == [
        ("h", 1, {"timeout": 3, "local_addr": ("l", 0), "options": {"slot_size": 4096}}),
        ("h", 2, {"timeout": None, "local_addr": None, "options": None}),
    ]


async def test_connectable_raises_connection_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    cause = rdmaio.ConnectionRefusedError("no listener", errno=111)

    async def refused(host: str, port: int, **kwargs: Any) -> FakeEndpoint:
        raise cause

    monkeypatch.setattr(rdmaio, "connect", refused)
    with pytest.raises(anyio.ConnectionFailed) as error:
        await RdmaConnectable("198.18.0.1", 7471).connect()
    assert error.value.__cause__ is cause


class FakeServer:
    """The accept-mode surface of rdmaio.StreamServer: accept(), close(), wait_closed(), addresses."""

    def __init__(self, addresses: list[tuple[str, int]]) -> None:
        self.addresses = addresses
        self.queue: collections.deque[FakeEndpoint] = collections.deque()
        self.closed = False
        self.failure: Exception | None = None
        self._event = anyio.Event()

    def push(self, ep: FakeEndpoint) -> None:
        self.queue.append(ep)
        self._event.set()

    def close(self) -> None:
        self.closed = True
        self._event.set()

    async def wait_closed(self) -> None:
        raise AssertionError("the listener must not wait for the accepted connections")

    async def accept(self) -> FakeEndpoint:
        while not self.queue:
            if self.failure is not None:
                raise self.failure
            if self.closed:
                raise EndpointClosedError("server is closed")
            self._event = anyio.Event()
            await self._event.wait()
        return self.queue.popleft()


@pytest.fixture
def fake_listen(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    made: list[Any] = []

    async def listen(host: str | None, port: int, **kwargs: Any) -> FakeServer:
        server = FakeServer([("198.18.0.1", 7471)])
        made.append((host, port, kwargs, server))
        return server

    monkeypatch.setattr(rdmaio, "listen", listen, raising=False)
    return made


async def test_create_listener_and_accept(fake_listen: list[Any]) -> None:
    listener = await rdma_anyio.create_listener("198.18.0.1", 0, backlog=5, options={"recv_depth": 8})
    [(host, port, kwargs, server)] = fake_listen
    assert (host, port, kwargs) == ("198.18.0.1", 0, {"backlog": 5, "options": {"recv_depth": 8}})
    assert isinstance(listener, RdmaListener) and listener.server is server
    assert listener.extra(SocketAttribute.local_port) == 7471
    assert listener.extra(SocketAttribute.local_address) == ("198.18.0.1", 7471)
    assert listener.extra(SocketAttribute.family) == socket.AF_INET
    ep = fake_endpoint()
    server.push(ep)
    stream = await listener.accept()
    assert isinstance(stream, RdmaByteStream) and stream.endpoint is ep
    await listener.aclose()
    await listener.aclose()  # idempotent
    assert server.closed
    with pytest.raises(anyio.ClosedResourceError):
        await listener.accept()
    ep.feed(b"accepted streams stay open")
    assert await stream.receive() == b"accepted streams stay open"


async def test_listener_in_message_mode(fake_listen: list[Any]) -> None:
    listener = await rdma_anyio.create_listener(None, 0, messages=True)
    fake_listen[0][3].push(fake_endpoint())
    assert isinstance(await listener.accept(), RdmaMessageStream)


async def test_aclose_wakes_a_blocked_accept(fake_listen: list[Any]) -> None:
    listener = await rdma_anyio.create_listener("198.18.0.1", 0)
    async with anyio.create_task_group() as tg:
        outcome = await blocked(tg, listener.accept)
        with pytest.raises(anyio.BusyResourceError):
            await listener.accept()
        await listener.aclose()
    [error] = outcome
    assert isinstance(error, anyio.ClosedResourceError)


async def test_listener_failure_is_broken_resource(fake_listen: list[Any]) -> None:
    listener = await rdma_anyio.create_listener("198.18.0.1", 0)
    server = fake_listen[0][3]
    server.failure = rdmaio.DeviceError("RDMA device removed")
    with pytest.raises(anyio.BrokenResourceError) as error:
        await listener.accept()
    assert error.value.__cause__ is server.failure


async def test_serve_runs_handlers_in_a_task_group(fake_listen: list[Any]) -> None:
    listener = await rdma_anyio.create_listener("198.18.0.1", 0)
    server = fake_listen[0][3]
    handled: list[bytes] = []

    async def handler(stream: RdmaByteStream) -> None:
        async with stream:
            handled.append(await stream.receive())

    for payload in (b"first", b"second"):
        ep = fake_endpoint()
        ep.feed(payload)
        server.push(ep)
    async with anyio.create_task_group() as tg:

        async def serve() -> None:
            with pytest.raises(anyio.ClosedResourceError):
                await listener.serve(handler, tg)

        tg.start_soon(serve)
        await anyio.wait_all_tasks_blocked()
        await listener.aclose()
    assert sorted(handled) == [b"first", b"second"]


async def test_serve_with_its_own_task_group(fake_listen: list[Any]) -> None:
    listener = await rdma_anyio.create_listener("198.18.0.1", 0)
    server = fake_listen[0][3]
    handled: list[bytes] = []
    done = anyio.Event()

    async def handler(stream: RdmaByteStream) -> None:
        async with stream:
            handled.append(await stream.receive())
        done.set()

    ep = fake_endpoint()
    ep.feed(b"from the client")
    server.push(ep)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            await done.wait()
            tg.cancel_scope.cancel()  # the way to stop serve() without closing the listener
    assert handled == [b"from the client"]
    assert ep.torn_down
    assert not server.closed
