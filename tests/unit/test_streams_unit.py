"""Unit tests of rdmaio.streams without RDMA: the transport and server over an in-memory fake Endpoint.

``FakeEndpoint`` (from :mod:`rdmaio.testing.fakes`) mimics the parts of :class:`rdmaio.Endpoint` the streams
layer uses, with the documented semantics: stream reads see EOF once the peer wrote EOF, a peer that
disconnects without EOF makes reads raise ``ConnectionResetError``, writes after a disconnect raise it too,
``drain`` waits above the high mark until the low one, ``close`` flushes then EOF then disconnects (bounded
by ``close_timeout``), ``abort`` drops queued data. Its "NIC" posts queued bytes on the next loop iteration
unless a test turns ``auto_post`` off and posts by hand, which makes flow control observable.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

import rdmaio
import rdmaio.streams as streams
from rdmaio.errors import EndpointClosedError
from rdmaio.options import Options
from rdmaio.testing.fakes import FakeEndpoint, fake_pair

T = TypeVar("T")


def streams_over(
    ep: FakeEndpoint, limit: int = 2**16
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, streams.RdmaTransport]:
    """What open_connection() builds, over a fake endpoint."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport = streams.RdmaTransport(loop, ep, protocol)  # type: ignore[arg-type]
    transport._start()
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop), transport


async def settle(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# --- transport over a fake endpoint ------------------------------------------------------------------


def test_asyncio_classes_and_extra_info(arun: Any) -> None:
    async def main() -> None:
        a, _b = fake_pair()
        reader, writer, transport = streams_over(a)
        assert type(reader) is asyncio.StreamReader
        assert type(writer) is asyncio.StreamWriter
        assert isinstance(transport, asyncio.Transport)
        assert writer.transport is transport
        assert writer.get_extra_info("peername") == ("peer-of-a", 7471)
        assert writer.get_extra_info("sockname") == ("a", 7471)
        assert writer.get_extra_info("endpoint") is a
        assert writer.get_extra_info("socket") is None
        assert writer.get_extra_info("nonexistent", 42) == 42
        assert writer.can_write_eof()
        assert transport.is_reading() and not transport.is_closing()
        writer.close()
        await writer.wait_closed()

    arun(main())


def test_line_protocol_and_read_errors(arun: Any) -> None:
    async def main() -> None:
        a, b = fake_pair()
        r1, w1, _ = streams_over(a)
        r2, w2, _ = streams_over(b, limit=8)
        w1.write(b"hello\nwor")
        w1.writelines([b"ld\n", memoryview(b"12345"), bytearray(b"--END--tail")])
        await w1.drain()
        assert await r2.readline() == b"hello\n"
        assert await r2.readline() == b"world\n"
        assert await r2.readexactly(5) == b"12345"
        assert await r2.readuntil(b"--END--") == b"--END--"
        # line-length limit 8
        w1.write(b"0123456789abcdef\nok\n")
        with pytest.raises(asyncio.LimitOverrunError):
            await r2.readuntil(b"\n")
        assert await r2.readexactly(4) == b"tail"
        assert await r2.readexactly(17) == b"0123456789abcdef\n"
        assert await r2.readline() == b"ok\n"
        w1.write(b"abc")
        w1.write_eof()
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await r2.readexactly(5)
        assert info.value.partial == b"abc" and info.value.expected == 5
        assert r2.at_eof()
        assert await r2.read() == b""
        # half-close: b can still write to a
        w2.write(b"reply")
        w2.write_eof()
        assert await r1.read() == b"reply"
        w1.close()
        w2.close()
        await w1.wait_closed()
        await w2.wait_closed()

    arun(main())


def test_write_flow_control_pauses_and_resumes(arun: Any) -> None:
    async def main() -> None:
        a, b = fake_pair()
        _r1, w1, t1 = streams_over(a)
        r2, _w2, _ = streams_over(b)
        a.auto_post = False
        t1.set_write_buffer_limits(high=100, low=10)
        assert t1.get_write_buffer_limits() == (10, 100)
        assert a.options.write_high_water == 100 and a.options.write_low_water == 10
        w1.write(b"x" * 100)
        assert t1.get_write_buffer_size() == 100
        await w1.drain()  # not above the high mark: returns at once
        w1.write(b"y" * 50)
        assert t1.get_write_buffer_size() == 150
        drain = asyncio.create_task(w1.drain())
        await settle()
        assert not drain.done()
        a.post(120)  # 30 left: below high, above low
        await settle()
        assert not drain.done()
        a.post(25)  # 5 left
        await settle()
        assert drain.done() and drain.exception() is None
        a.post()
        assert await r2.readexactly(150) == b"x" * 100 + b"y" * 50
        # defaults as in asyncio: high 64 KiB, low = high // 4, or high = 4 * low
        t1.set_write_buffer_limits()
        assert t1.get_write_buffer_limits() == (16384, 65536)
        t1.set_write_buffer_limits(low=1000)
        assert t1.get_write_buffer_limits() == (1000, 4000)
        with pytest.raises(ValueError):
            t1.set_write_buffer_limits(high=10, low=20)
        # lowering the high mark below the buffered size pauses at once
        w1.write(b"z" * 10)
        t1.set_write_buffer_limits(high=5, low=0)
        drain = asyncio.create_task(w1.drain())
        await settle()
        assert not drain.done()
        a.post()
        await settle()
        assert drain.done()
        a.auto_post = True
        w1.close()
        await w1.wait_closed()

    arun(main())


def test_pause_reading_stops_reading_the_endpoint(arun: Any) -> None:
    async def main() -> None:
        a, b = fake_pair()
        _r1, w1, _ = streams_over(a)
        r2, _w2, t2 = streams_over(b, limit=100)
        for _ in range(10):
            w1.write(b"d" * 100)
            await settle(3)
        await settle()
        # StreamReader pauses the transport above 2 * limit; the rest stays in the endpoint
        assert not t2.is_reading()
        assert b.rx, "data should be left in the endpoint while reading is paused"
        reads_while_paused = b.reads
        await settle()
        assert b.reads == reads_while_paused
        assert await r2.readexactly(1000) == b"d" * 1000
        assert t2.is_reading()
        w1.close()
        assert await r2.read() == b""
        await w1.wait_closed()

    arun(main())


def test_peer_death_fails_pending_read_drain_and_wait_closed(arun: Any) -> None:
    async def main() -> None:
        a, _b = fake_pair()
        reader, writer, transport = streams_over(a)
        a.auto_post = False
        transport.set_write_buffer_limits(high=10, low=0)
        writer.write(b"q" * 100)
        pending_read = asyncio.create_task(reader.read(10))
        pending_drain = asyncio.create_task(writer.drain())
        await settle()
        assert not pending_read.done() and not pending_drain.done()
        a.kill_peer()
        await settle()
        assert pending_read.done() and pending_drain.done()
        assert isinstance(pending_read.exception(), ConnectionResetError)
        assert isinstance(pending_drain.exception(), ConnectionResetError)
        assert transport.is_closing()
        with pytest.raises(ConnectionResetError):
            await writer.wait_closed()
        with pytest.raises(ConnectionResetError):
            await reader.read(1)
        writer.write(b"dropped")  # as over TCP: silently dropped once the connection is lost
        writer.close()

    arun(main())


def test_peer_close_gives_eof_then_connection_lost(arun: Any) -> None:
    async def main() -> None:
        a, b = fake_pair()
        reader, writer, transport = streams_over(a)
        b.write(b"last words")
        b.close()  # graceful: data, EOF, disconnect
        assert await reader.read() == b"last words"
        assert reader.at_eof()
        await writer.wait_closed()  # the peer's disconnect after EOF ends the connection cleanly
        assert transport.is_closing()

    arun(main())


def test_close_and_abort_never_hang(arun: Any) -> None:
    async def main() -> None:
        # close() with a blocked reader in another task: the read sees EOF, wait_closed returns
        a, b = fake_pair()
        reader, writer, transport = streams_over(a)
        pending_read = asyncio.create_task(reader.read(100))
        await settle()
        writer.close()
        assert writer.is_closing()
        await writer.wait_closed()
        assert await pending_read == b""
        assert a.torn_down and b.disconnected
        transport.close()  # idempotent
        transport.abort()

        # close() with queued data the NIC never takes: bounded by close_timeout
        a, b = fake_pair(Options(close_timeout=0.2))
        reader, writer, transport = streams_over(a)
        a.auto_post = False
        writer.write(b"stuck")
        writer.close()
        await writer.wait_closed()
        assert a.torn_down

        # abort() drops queued data at once
        a, b = fake_pair()
        r2, _w2, _ = streams_over(b)
        reader, writer, transport = streams_over(a)
        a.auto_post = False
        writer.write(b"never sent")
        transport.abort()
        await writer.wait_closed()
        assert a.aborted and not a.pending
        with pytest.raises(ConnectionResetError):
            await r2.read()

        # a task cancelled in drain() does not keep close from finishing
        a, b = fake_pair()
        reader, writer, transport = streams_over(a)
        a.auto_post = False
        transport.set_write_buffer_limits(high=1, low=0)
        writer.write(b"12345")
        drain = asyncio.create_task(writer.drain())
        await settle()
        drain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await drain
        a.auto_post = True
        writer.close()
        await writer.wait_closed()

    arun(main())


def test_cancelled_read_consumes_nothing(arun: Any) -> None:
    async def main() -> None:
        a, b = fake_pair()
        reader, writer, _ = streams_over(a)
        _r2, w2, _ = streams_over(b)
        for _ in range(20):
            task = asyncio.create_task(reader.readexactly(4))
            await settle(2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        w2.write(b"abcd")
        assert await reader.readexactly(4) == b"abcd"
        writer.close()
        w2.close()
        await writer.wait_closed()

    arun(main())


def test_write_errors_like_asyncio(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        a, _b = fake_pair()
        _reader, writer, _transport = streams_over(a)
        with pytest.raises(TypeError):
            writer.write("text")  # type: ignore[arg-type]
        writer.write(b"")
        writer.write_eof()
        writer.write_eof()  # idempotent
        with pytest.raises(RuntimeError, match="write_eof"):
            writer.write(b"x")
        writer.close()
        await writer.wait_closed()

        a, _b = fake_pair()
        _reader, writer, _transport = streams_over(a)
        writer.close()
        with caplog.at_level(logging.WARNING, logger="rdmaio"):
            for _ in range(7):
                writer.write(b"after close")
        assert "closed RDMA transport" in caplog.text
        await writer.wait_closed()

    arun(main())


def test_protocol_errors_close_the_transport(arun: Any) -> None:
    class Boom(asyncio.Protocol):
        def __init__(self) -> None:
            self.lost: list[Exception | None] = []

        def data_received(self, data: bytes) -> None:
            raise RuntimeError("boom")

        def connection_lost(self, exc: Exception | None) -> None:
            self.lost.append(exc)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        a, b = fake_pair()
        protocol = Boom()
        transport = streams.RdmaTransport(loop, a, protocol)  # type: ignore[arg-type]
        transport._start()
        b.write(b"x")
        await transport._wait_lost()
        assert len(protocol.lost) == 1 and isinstance(protocol.lost[0], RuntimeError)
        assert reported and "data_received" in reported[0]["message"]
        assert a.torn_down

    arun(main())


# --- open_connection / start_server over fake connect/serve --------------------------------------


class FakeListener:
    """Stands in for the server core (rdmaio.StreamServer): runs the handler for each fake endpoint a test
    connects, holding connections back until start_serving() and aborting those still held at close()."""

    next_port = 40000

    def __init__(
        self, handler: Callable[[Any], Awaitable[None]], hosts: list[str], port: int, start_serving: bool
    ) -> None:
        if not port:
            port = FakeListener.next_port
            FakeListener.next_port += 1
        self.handler = handler
        self.addresses = [(host or "0.0.0.0", port) for host in hosts]
        self.listening = True
        self.serving = start_serving
        self.held: list[FakeEndpoint] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()

    def connect(self) -> FakeEndpoint:
        """A client connects: return its endpoint; the server side goes to the handler (or waits)."""
        assert self.listening, "connection refused"
        client, server_side = fake_pair()
        if self.serving:
            self._run(server_side)
        else:
            self.held.append(server_side)
        return client

    def _run(self, endpoint: FakeEndpoint) -> None:
        self.tasks.add(asyncio.get_running_loop().create_task(self.handler(endpoint)))

    def is_serving(self) -> bool:
        return self.serving

    async def start_serving(self) -> None:
        if self.listening and not self.serving:
            self.serving = True
            for endpoint in self.held:
                self._run(endpoint)
            self.held.clear()

    def close(self) -> None:
        self.listening = self.serving = False
        self.closed.set()
        for endpoint in self.held:
            endpoint.abort()
        self.held.clear()

    async def wait_closed(self) -> None:
        await self.closed.wait()
        await asyncio.gather(*self.tasks)


@pytest.fixture
def fake_rdma(monkeypatch: pytest.MonkeyPatch) -> list[FakeListener]:
    listeners: list[FakeListener] = []

    async def fake_serve(
        handler: Any, hosts: list[str], port: int, *, start_serving: bool = True, **kw: Any
    ) -> FakeListener:
        listener = FakeListener(handler, hosts, port, start_serving)
        listeners.append(listener)
        return listener

    async def fake_connect(host: str, port: int, **kw: Any) -> FakeEndpoint:
        assert set(kw) <= {"timeout", "local_addr", "options"}
        for listener in listeners:
            if listener.listening and listener.addresses[0][1] == port:
                return listener.connect()
        raise rdmaio.ConnectionRefusedError("no listener", errno=111)

    monkeypatch.setattr(streams, "serve", fake_serve)
    monkeypatch.setattr(streams, "connect", fake_connect)
    return listeners


def test_open_connection_and_start_server_echo(arun: Any, fake_rdma: list[FakeListener]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for line in reader:
            writer.write(line.upper())
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def main() -> None:
        server = await streams.start_server(handle, "10.0.0.1", 7000, options={"close_timeout": 1.0})
        assert isinstance(server, asyncio.AbstractServer)
        assert server.is_serving()
        assert server.get_loop() is asyncio.get_running_loop()
        assert server.sockets[0].getsockname() == ("10.0.0.1", 7000)
        assert server.addresses == [("10.0.0.1", 7000)]
        async with server:
            reader, writer = await streams.open_connection("10.0.0.1", 7000, timeout=5)
            writer.write(b"one\ntwo\n")
            assert await reader.readline() == b"ONE\n"
            assert await reader.readline() == b"TWO\n"
            writer.write_eof()
            assert await reader.read() == b""
            writer.close()
            await writer.wait_closed()
        assert not server.is_serving()
        assert server.sockets == ()
        with pytest.raises(ConnectionRefusedError):
            await streams.open_connection("10.0.0.1", 7001)

    arun(main())


def test_start_serving_false_holds_connections(arun: Any, fake_rdma: list[FakeListener]) -> None:
    async def main() -> None:
        seen: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.readexactly(2))
            writer.close()

        server = await streams.start_server(handle, None, 0, start_serving=False)
        assert not server.is_serving()
        assert server.sockets[0].getsockname()[0] == "0.0.0.0"
        client = fake_rdma[0].connect()
        client.write(b"hi")
        await settle()
        assert seen == []  # held back until start_serving()
        await server.start_serving()
        await server.start_serving()  # idempotent
        assert server.is_serving()
        await client.wait_closed()
        assert seen == [b"hi"]
        # a connection held back when the server closes is aborted
        server2 = await streams.start_server(handle, None, 9, start_serving=False)
        client2 = fake_rdma[1].connect()
        server2.close()
        await server2.wait_closed()
        await client2.wait_closed()
        assert client2.disconnected
        server.close()
        await server.wait_closed()

    arun(main())


def test_server_close_clients_abort_clients_wait_closed(arun: Any, fake_rdma: list[FakeListener]) -> None:
    async def idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # the connection outlives this callback

    async def main() -> None:
        server = await streams.start_server(idle, "10.0.0.1", 7100)
        clients = [streams_over(fake_rdma[0].connect()) for _ in range(3)]
        await settle()
        server.close()
        assert not server.is_serving()
        waiter = asyncio.create_task(server.wait_closed())
        await settle()
        assert not waiter.done()  # connections are still open (asyncio >= 3.12 semantics)
        server.close_clients()
        for reader, _writer, _t in clients:
            assert await reader.read() == b""  # graceful: EOF
        await waiter
        server.close()  # idempotent

        server = await streams.start_server(idle, "10.0.0.1", 7101)
        clients = [streams_over(fake_rdma[1].connect()) for _ in range(2)]
        await settle()
        server.abort_clients()
        for reader, _writer, _t in clients:
            with pytest.raises(ConnectionResetError):
                await reader.read()
        server.close()
        await server.wait_closed()

    arun(main())


def test_serve_forever_cancel_closes(arun: Any, fake_rdma: list[FakeListener]) -> None:
    async def main() -> None:
        server = await streams.start_server(lambda r, w: None, "10.0.0.1", 7200, start_serving=False)
        forever = asyncio.create_task(server.serve_forever())
        await settle()
        assert server.is_serving()
        with pytest.raises(RuntimeError, match="already"):
            await server.serve_forever()
        forever.cancel()
        with pytest.raises(asyncio.CancelledError):
            await forever
        assert not server.is_serving()
        with pytest.raises(RuntimeError, match="closed"):
            await server.serve_forever()

    arun(main())


def test_tls_and_socket_arguments_are_refused_clearly(arun: Any, fake_rdma: list[FakeListener]) -> None:
    async def main() -> None:
        context = ssl.create_default_context()
        with pytest.raises(NotImplementedError, match="TLS"):
            await streams.open_connection("10.0.0.1", 1, ssl=True)
        with pytest.raises(NotImplementedError, match="TLS"):
            await streams.open_connection("10.0.0.1", 1, ssl=context, server_hostname="x")
        with pytest.raises(NotImplementedError, match="TLS"):
            await streams.start_server(lambda r, w: None, "10.0.0.1", 1, ssl=context)
        with pytest.raises(ValueError, match="sock"):
            await streams.open_connection("10.0.0.1", 1, sock=object())
        with pytest.raises(ValueError, match="reuse_port"):
            await streams.start_server(lambda r, w: None, "10.0.0.1", 1, reuse_port=True)
        with pytest.raises(TypeError, match="bogus"):
            await streams.open_connection("10.0.0.1", 1, bogus=1)
        with pytest.raises(TypeError, match="timeout"):
            await streams.start_server(lambda r, w: None, "10.0.0.1", 1, timeout=3)
        assert fake_rdma == []  # nothing was attempted
        # neutral values are accepted, as asyncio's defaults
        server = await streams.start_server(
            lambda r, w: None, "10.0.0.1", 7300, ssl=None, reuse_address=True, family=0
        )
        _reader, writer = await streams.open_connection("10.0.0.1", 7300, ssl=None, family=0, sock=None)
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()

    arun(main())
