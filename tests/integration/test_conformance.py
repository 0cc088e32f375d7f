"""One stream conformance suite, run against anyio's TCP streams and against rdmaio.anyio.

Every check runs on both transports ("tcp": ``anyio.connect_tcp`` / ``anyio.create_tcp_listener`` on
127.0.0.1; "rdma": ``rdmaio.anyio.connect`` / ``create_listener`` on the test device's address) and on
three backends (asyncio, uvloop, trio) through anyio's pytest plugin. TCP is the reference: what passes
there is what anyio code expects of a byte stream. The checks follow trio.testing's
``check_two_way_stream`` / ``check_half_closeable_stream``: ordering both ways, EOF, half-close, closing
while a call is blocked, concurrent use, cancellation. Where RDMA differs on purpose, the test asserts
each transport's behaviour and says why.

The TCP parametrisations run anywhere (``-k tcp``); the RDMA ones need a device like every integration
test (the conftest's ``require_device``, which this module applies to them only). No test measures time;
``anyio.fail_after(TIMEOUT)`` only turns a hang into a failure.
"""

from __future__ import annotations

import hashlib
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.buffered import BufferedByteStream

import rdmaio
import rdmaio.anyio
from rdmaio.anyio import RdmaAttribute

pytestmark = pytest.mark.anyio

TIMEOUT = 60  # seconds; generous, the test VM is 20-40x slower than a native machine
TCP_HOST = "127.0.0.1"


@pytest.fixture(
    params=[("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """anyio's pytest plugin runs each test on asyncio, uvloop and trio."""
    return request.param


@dataclass
class Net:
    """How one transport listens and connects: the only lines that differ between TCP and RDMA."""

    name: str
    host: str

    async def listen(self) -> Any:
        """A listener with ``accept()``, ``serve()``, ``aclose()`` and ``SocketAttribute.local_port``."""
        if self.name == "rdma":
            return await rdmaio.anyio.create_listener(self.host, 0)
        multi = await anyio.create_tcp_listener(local_host=self.host)
        [listener] = multi.listeners
        return listener

    async def connect(self, port: int) -> ByteStream:
        """A client stream to ``port``."""
        if self.name == "rdma":
            return await rdmaio.anyio.connect(self.host, port)
        return await anyio.connect_tcp(self.host, port)


@pytest.fixture(params=["tcp", "rdma"])
def transport(request: pytest.FixtureRequest) -> str:
    """The transport under test."""
    return str(request.param)


@pytest.fixture
def net(transport: str, request: pytest.FixtureRequest) -> Net:
    """The transport's :class:`Net` (RDMA on the device address of the ``rdma_addr`` fixture)."""
    if transport == "rdma":
        return Net("rdma", request.getfixturevalue("rdma_addr"))
    return Net("tcp", TCP_HOST)


async def accept_one(net: Net, listener: Any) -> tuple[ByteStream, ByteStream]:
    """Connect to ``listener`` and accept that connection: (client stream, server stream)."""
    port = listener.extra(SocketAttribute.local_port)
    accepted: list[ByteStream] = []

    async def accept() -> None:
        accepted.append(await listener.accept())

    async with anyio.create_task_group() as tg:
        tg.start_soon(accept)
        client = await net.connect(port)
    return client, accepted[0]


@asynccontextmanager
async def connected(net: Net) -> AsyncIterator[tuple[ByteStream, ByteStream]]:
    """A connected (client, server) pair; closed on exit.

    The listener is closed before the pair is used: accepted streams do not depend on their listener,
    so every test also checks that.
    """
    async with await net.listen() as listener:
        client, server = await accept_one(net, listener)
    async with client, server:
        yield client, server


async def receive_all(stream: ByteStream) -> bytes:
    """Everything until the end of the stream."""
    chunks = [chunk async for chunk in stream]
    return b"".join(chunks)


async def blocked_call(tg: anyio.abc.TaskGroup, func: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Start ``func()`` in ``tg`` and wait until every task is blocked; the list gets its outcome."""
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append(await func())
        except Exception as exc:
            outcome.append(exc)

    tg.start_soon(run)
    await anyio.wait_all_tasks_blocked()
    assert not outcome, f"the call did not block: {outcome}"
    return outcome


def random_chunks(seed: int, total: int, largest: int) -> list[bytes]:
    """Random data of ``total`` bytes cut into pieces of 1..``largest`` bytes (reproducible)."""
    rng = random.Random(seed)
    data = rng.randbytes(total)
    chunks = []
    start = 0
    while start < total:
        size = rng.randint(1, largest)
        chunks.append(data[start : start + size])
        start += size
    return chunks


# --- data ---------------------------------------------------------------------------------------------


async def test_many_sends_of_random_sizes_both_ways(net: Net) -> None:
    """Both sides send at once, in random sizes from 1 byte to 128 KiB; every byte arrives in order."""
    outgoing = {
        "client": random_chunks(1, 2 << 20, 128 << 10),
        "server": random_chunks(2, 2 << 20, 128 << 10),
    }
    received: dict[str, bytes] = {}
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            streams = {"client": client, "server": server}

            async def send(side: str) -> None:
                for chunk in outgoing[side]:
                    await streams[side].send(chunk)
                await streams[side].send_eof()

            async def receive(side: str) -> None:
                received[side] = await receive_all(streams[side])

            async with anyio.create_task_group() as tg:
                for side in streams:
                    tg.start_soon(send, side)
                    tg.start_soon(receive, side)
    for sender, receiver in (("client", "server"), ("server", "client")):
        sent = b"".join(outgoing[sender])
        assert len(received[receiver]) == len(sent)
        assert hashlib.sha256(received[receiver]).digest() == hashlib.sha256(sent).digest()


async def test_receive_respects_max_bytes(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            await client.send(b"x" * 1000)
            await client.send_eof()
            sizes = []
            while True:
                try:
                    chunk = await server.receive(7)
                except anyio.EndOfStream:
                    break
                assert 1 <= len(chunk) <= 7
                sizes.append(len(chunk))
            assert sum(sizes) == 1000
            with pytest.raises(ValueError):
                await server.receive(0)


# --- EOF and half-close -------------------------------------------------------------------------------


async def test_end_of_stream_every_time(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            await client.send(b"last words")
            await client.send_eof()
            await client.send_eof()  # idempotent
            assert await receive_all(server) == b"last words"
            for _ in range(3):
                with pytest.raises(anyio.EndOfStream):
                    await server.receive()


async def test_half_close_then_reply(net: Net) -> None:
    """The client sends a request and EOF; the server reads to the end and still answers."""
    request = random.Random(3).randbytes(300_000)
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):

            async def answer() -> None:
                data = await receive_all(server)
                await server.send(hashlib.sha256(data).hexdigest().encode())
                await server.aclose()

            async with anyio.create_task_group() as tg:
                tg.start_soon(answer)
                await client.send(request)
                await client.send_eof()
                reply = await receive_all(client)
    assert reply == hashlib.sha256(request).hexdigest().encode()


async def test_send_after_send_eof(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            await client.send_eof()
            if net.name == "rdma":
                # Deliberate: the sending direction is closed on our side, which is ClosedResourceError
                # (trio's own SocketStream says the same). anyio's TCP stream has no single answer.
                with pytest.raises(anyio.ClosedResourceError):
                    await client.send(b"too late")
            else:
                # asyncio's transport refuses with RuntimeError; on trio the socket gives EPIPE.
                with pytest.raises((RuntimeError, anyio.BrokenResourceError)):
                    await client.send(b"too late")
            with pytest.raises(anyio.EndOfStream):
                await server.receive()
            await server.send(b"the other direction still works")
            assert await client.receive() == b"the other direction still works"


async def test_peer_aclose_while_receiving_is_end_of_stream(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            async with anyio.create_task_group() as tg:
                outcome = await blocked_call(tg, client.receive)
                await server.aclose()
            [result] = outcome
            assert isinstance(result, anyio.EndOfStream)
            with pytest.raises(anyio.EndOfStream):
                await client.receive()


async def test_send_after_peer_closed_breaks(net: Net) -> None:
    """Once the peer has closed completely, sending fails with BrokenResourceError.

    Over TCP the first send after the peer's FIN always succeeds: the kernel takes the data and learns
    of the peer's RST only afterwards. RDMA learns of the disconnect from the connection manager without
    sending anything, so the failure can come at the first send already; either way it does come.
    """
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            await server.aclose()
            with pytest.raises(anyio.EndOfStream):
                await client.receive()
            if net.name == "tcp":
                await client.send(b"accepted by the kernel")
            with pytest.raises(anyio.BrokenResourceError) as error:
                while True:
                    await client.send(b"into the void")
                    await anyio.sleep(0.01)
            assert isinstance(error.value.__cause__, ConnectionError)


# --- closing ------------------------------------------------------------------------------------------


async def test_aclose_while_receive_blocked(net: Net) -> None:
    """Our own aclose() makes a receive blocked in another task raise ClosedResourceError.

    Over TCP it raises at once. rdmaio closes gracefully (queued data, EOF, disconnect) and the blocked
    receive raises when that ends: at once with a live peer, after ``Options.close_timeout`` at the latest.
    """
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, _server):
            async with anyio.create_task_group() as tg:
                outcome = await blocked_call(tg, client.receive)
                await client.aclose()
            [result] = outcome
            assert isinstance(result, anyio.ClosedResourceError)


async def test_use_after_aclose(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            await client.aclose()
            await client.aclose()  # idempotent
            with pytest.raises(anyio.ClosedResourceError):
                await client.receive()
            with pytest.raises(anyio.ClosedResourceError):
                await client.send(b"x")
            # the peer sees a clean end of stream
            with pytest.raises(anyio.EndOfStream):
                await server.receive()


async def test_aclose_sends_what_was_sent_before(net: Net) -> None:
    """Data whose send() returned is delivered even if the stream is closed right after."""
    payload = random.Random(4).randbytes(1 << 20)
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server), anyio.create_task_group() as tg:

            async def send_and_close() -> None:
                await client.send(payload)
                await client.aclose()

            tg.start_soon(send_and_close)
            received = await receive_all(server)
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


# --- concurrency and cancellation ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [100, 4 << 20], ids=["small", "4MiB"])
async def test_concurrent_send_is_busy(net: Net, size: int) -> None:
    """Two tasks sending at once: one gets BusyResourceError, the other's data arrives whole."""
    payloads = {b"a": b"a" * size, b"b": b"b" * size}
    outcomes: dict[bytes, BaseException | None] = {}
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            received: list[bytes] = []

            async def send(key: bytes) -> None:
                try:
                    await client.send(payloads[key])
                    outcomes[key] = None
                except anyio.BusyResourceError as exc:
                    outcomes[key] = exc

            async def receive() -> None:
                received.append(await receive_all(server))

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                async with anyio.create_task_group() as senders:
                    senders.start_soon(send, b"a")
                    senders.start_soon(send, b"b")
                await client.send_eof()
    busy = [key for key, outcome in outcomes.items() if isinstance(outcome, anyio.BusyResourceError)]
    succeeded = [key for key, outcome in outcomes.items() if outcome is None]
    assert len(busy) == 1 and len(succeeded) == 1, outcomes
    assert received == [payloads[succeeded[0]]]  # nothing of the refused send, nothing interleaved


async def test_concurrent_receive_is_busy(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            async with anyio.create_task_group() as tg:
                outcome = await blocked_call(tg, client.receive)
                with pytest.raises(anyio.BusyResourceError):
                    await client.receive()
                await server.send(b"for the first receiver")
            assert outcome == [b"for the first receiver"]


async def test_cancelled_receive_loses_nothing(net: Net) -> None:
    """Cancelling blocked receives leaves the stream usable; data sent afterwards arrives whole."""
    payload = random.Random(5).randbytes(500_000)
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            for _ in range(3):
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(client.receive)
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()
                assert scope.cancelled_caught
            await server.send(payload)
            await server.send_eof()
            assert await receive_all(client) == payload


async def test_cancelled_send_before_it_starts_sends_nothing(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await client.send(b"never")
            assert scope.cancelled_caught
            await client.send(b"only this")
            await client.send_eof()
            assert await receive_all(server) == b"only this"


# --- listeners ----------------------------------------------------------------------------------------


async def test_serve_echoes_for_several_clients(net: Net) -> None:
    async def echo(stream: ByteStream) -> None:
        async with stream:
            async for chunk in stream:
                await stream.send(chunk)

    with anyio.fail_after(TIMEOUT):
        listener = await net.listen()
        port = listener.extra(SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:

            async def serve() -> None:
                # closing the listener ends serve() with ClosedResourceError, as anyio's TCP listener does
                with pytest.raises(anyio.ClosedResourceError):
                    await listener.serve(echo, tg)

            tg.start_soon(serve)

            async def client(n: int) -> None:
                payload = random.Random(n).randbytes(100_000 * n)
                async with await net.connect(port) as stream, anyio.create_task_group() as io:
                    io.start_soon(stream.send, payload)
                    echoed = b""
                    while len(echoed) < len(payload):
                        echoed += await stream.receive()
                assert echoed == payload

            async with anyio.create_task_group() as clients:
                for n in (1, 2, 3):
                    clients.start_soon(client, n)
            await listener.aclose()


async def test_listener_aclose_while_accept_blocked(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        listener = await net.listen()
        async with anyio.create_task_group() as tg:
            outcome = await blocked_call(tg, listener.accept)
            await listener.aclose()
        [result] = outcome
        assert isinstance(result, anyio.ClosedResourceError)
        with pytest.raises(anyio.ClosedResourceError):
            await listener.accept()


async def test_connect_to_a_closed_port_is_oserror(net: Net) -> None:
    """Refused connections raise OSError on both (anyio wraps the cause, rdmaio raises its own)."""
    with anyio.fail_after(TIMEOUT):
        async with await net.listen() as listener:
            port = listener.extra(SocketAttribute.local_port)
        with pytest.raises(OSError) as error:
            await net.connect(port)
    if net.name == "rdma":
        assert isinstance(error.value, rdmaio.ConnectionRefusedError)


# --- anyio utilities on top ---------------------------------------------------------------------------


async def test_buffered_byte_stream(net: Net) -> None:
    """receive_until/receive_exactly over pieces of any size, IncompleteRead at a premature end."""
    body = random.Random(6).randbytes(200_000)
    message = b"Content-Length: %d\r\n\r\n" % len(body) + body + b"tail"
    rng = random.Random(7)
    pieces, start = [], 0
    while start < len(message):
        size = rng.choice([1, 2, 3, 17, 1000, 65536])  # separators split across sends, and whole ones
        pieces.append(message[start : start + size])
        start += size
    with anyio.fail_after(TIMEOUT):
        async with connected(net) as (client, server):
            buffered = BufferedByteStream(client)

            async def send_pieces() -> None:
                for piece in pieces:
                    await server.send(piece)
                await server.aclose()

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_pieces)
                header = await buffered.receive_until(b"\r\n", 100)
                assert header == b"Content-Length: %d" % len(body)
                assert await buffered.receive_until(b"\r\n", 100) == b""
                assert await buffered.receive_exactly(len(body)) == body
                with pytest.raises(anyio.IncompleteRead):
                    await buffered.receive_exactly(10)
            assert buffered.buffer == b"tail"


# --- typed attributes ---------------------------------------------------------------------------------


async def test_typed_attributes(net: Net) -> None:
    with anyio.fail_after(TIMEOUT):
        listener = await net.listen()
        async with listener:
            port = listener.extra(SocketAttribute.local_port)
            assert listener.extra(SocketAttribute.local_address) == (net.host, port)
            assert listener.extra(SocketAttribute.family) == socket.AF_INET
            client, server = await accept_one(net, listener)
        async with client, server:
            assert client.extra(SocketAttribute.remote_address) == (net.host, port)
            assert client.extra(SocketAttribute.remote_port) == port
            assert server.extra(SocketAttribute.local_port) == port
            assert client.extra(SocketAttribute.local_address) == server.extra(SocketAttribute.remote_address)
            assert client.extra(SocketAttribute.local_port) == server.extra(SocketAttribute.remote_port)
            for stream in (client, server):
                assert stream.extra(SocketAttribute.family) == socket.AF_INET
            if net.name == "tcp":
                assert client.extra(SocketAttribute.raw_socket).fileno() >= 0  # a socket-like object
                return
            # Deliberate: an RDMA connection has no socket; RdmaAttribute describes what it has instead.
            with pytest.raises(anyio.TypedAttributeLookupError):
                client.extra(SocketAttribute.raw_socket)
            qps = set()
            for stream in (client, server):
                assert isinstance(stream.extra(RdmaAttribute.device), str)
                assert stream.extra(RdmaAttribute.device)
                assert stream.extra(RdmaAttribute.port_num) >= 1
                assert stream.extra(RdmaAttribute.mtu) in (256, 512, 1024, 2048, 4096)
                assert stream.extra(RdmaAttribute.max_inline) >= 0
                assert isinstance(stream.extra(RdmaAttribute.endpoint), rdmaio.Endpoint)
                qps.add(stream.extra(RdmaAttribute.qp_num))
            assert len(qps) == 2 and all(qp > 0 for qp in qps)
            assert client.extra(RdmaAttribute.device) == server.extra(RdmaAttribute.device)


# --- message mode (RDMA only: TCP has no message boundaries) ------------------------------------------

MESSAGE_SIZES = [0, 1, 100, 0, 65535, 65536, 65537, 300_000, 1 << 20, 0, 5]


async def test_message_mode_keeps_boundaries(rdma_addr: str) -> None:
    messages = [random.Random(size).randbytes(size) for size in MESSAGE_SIZES]
    with anyio.fail_after(TIMEOUT):
        async with await rdmaio.anyio.create_listener(rdma_addr, 0, messages=True) as listener:
            port = listener.extra(SocketAttribute.local_port)

            async def echo(stream: rdmaio.anyio.RdmaMessageStream) -> None:
                async with stream:
                    async for message in stream:
                        await stream.send(message)

            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, echo, tg)
                async with await rdmaio.anyio.connect_messages(rdma_addr, port) as client:
                    assert client.extra(RdmaAttribute.qp_num) > 0
                    assert client.extra(SocketAttribute.remote_port) == port
                    echoed = []
                    async with anyio.create_task_group() as io:

                        async def send_all() -> None:
                            for message in messages:
                                await client.send(message)
                            await client.send_eof()

                        io.start_soon(send_all)
                        async for message in client:
                            echoed.append(message)
                tg.cancel_scope.cancel()
    assert [len(m) for m in echoed] == MESSAGE_SIZES  # one receive per send, empty ones included
    assert echoed == messages


async def test_message_mode_end_of_stream_and_close(rdma_addr: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with await rdmaio.anyio.create_listener(rdma_addr, 0, messages=True) as listener:
            port = listener.extra(SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                accepted: list[rdmaio.anyio.RdmaMessageStream] = []

                async def accept() -> None:
                    accepted.append(await listener.accept())

                tg.start_soon(accept)
                client = await rdmaio.anyio.connect_messages(rdma_addr, port)
        server = accepted[0]
        async with client, server:
            await client.send(b"")
            await client.send_eof()
            assert await server.receive() == b""
            for _ in range(2):
                with pytest.raises(anyio.EndOfStream):
                    await server.receive()
            async with anyio.create_task_group() as tg:
                outcome = await blocked_call(tg, client.receive)
                with pytest.raises(anyio.BusyResourceError):
                    await client.receive()
                await client.aclose()
            [result] = outcome
            assert isinstance(result, anyio.ClosedResourceError)
            with pytest.raises(anyio.ClosedResourceError):
                await client.send(b"x")
