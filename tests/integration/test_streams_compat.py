"""asyncio-streams compatibility of rdmaio.streams (test host, asyncio and uvloop).

The first part is one small asyncio-streams test program (an echo/line protocol) written against a pair
``(open_connection, start_server)``. It runs unmodified twice: with ``asyncio.open_connection`` /
``asyncio.start_server`` over TCP on 127.0.0.1, and with ``rdmaio.streams.open_connection`` /
``rdmaio.streams.start_server`` over RDMA on the test address. Only those two functions (and the host)
differ. The second part tests what only RDMA has or does differently: peer death, ``close_clients`` /
``abort_clients`` (asyncio.Server has them from 3.13 only), the transport's extra information, options.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest
from loops import Runner, arun
from peer_process import peer_process, wait_ready

import rdmaio
import rdmaio.streams

OpenConnection = Callable[..., Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
StartServer = Callable[..., Awaitable[Any]]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class Net:
    open_connection: OpenConnection
    start_server: StartServer
    host: str


@pytest.fixture(params=["tcp", "rdma"])
def net(request: pytest.FixtureRequest, rdma_addr: str) -> Net:
    """The two functions under test: asyncio's over TCP, or rdmaio's over RDMA."""
    if request.param == "tcp":
        return Net(asyncio.open_connection, asyncio.start_server, "127.0.0.1")
    return Net(rdmaio.streams.open_connection, rdmaio.streams.start_server, rdma_addr)


def bounded(arun: Runner[Any], coro: Coroutine[Any, Any, None], seconds: float = 300) -> None:
    """Run ``coro`` on the parametrized loop; a hang fails the test instead of stalling the suite."""

    async def main() -> None:
        async with asyncio.timeout(seconds):
            await coro

    arun(main())


# ===== BEGIN the asyncio-streams test program (identical for TCP and RDMA) =============================


class LineServer:
    """A line protocol server; errors are recorded in ``errors``.

    ``ECHO text`` -> ``text``; ``BLOB n`` + n bytes -> ``n`` + the bytes; ``UNTIL`` + data up to a blank
    line -> that data; ``PEER`` -> repr(peername); ``SAY text`` -> text (``\\n`` escapes become newlines)
    without a final newline, then close. At EOF it answers ``BYE`` and closes.
    """

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.peers: list[Any] = []

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.append(writer.get_extra_info("peername"))
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # the line is longer than the reader's limit
                    writer.write(b"ERR too long\n")
                    await writer.drain()
                    continue
                if not line:  # EOF: the client called write_eof()
                    break
                cmd, _, arg = line.rstrip(b"\n").partition(b" ")
                if cmd == b"ECHO":
                    writer.write(arg + b"\n")
                elif cmd == b"BLOB":
                    data = await reader.readexactly(int(arg))
                    writer.write(b"%d\n" % len(data))
                    writer.write(data)
                elif cmd == b"UNTIL":
                    writer.write(await reader.readuntil(b"\r\n\r\n"))
                elif cmd == b"PEER":
                    writer.write(repr(writer.get_extra_info("peername")).encode() + b"\n")
                elif cmd == b"SAY":
                    writer.write(arg.replace(b"\\n", b"\n"))
                    await writer.drain()
                    return
                else:
                    writer.write(b"ERR unknown command\n")
                await writer.drain()
            writer.write(b"BYE\n")
            await writer.drain()
        except ConnectionError:
            pass  # the client went away without waiting for the answer
        except BaseException as exc:
            self.errors.append(exc)
            raise
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def port_of(server: Any) -> int:
    port = server.sockets[0].getsockname()[1]
    assert isinstance(port, int) and port > 0
    return port


async def check_line_protocol(open_connection: OpenConnection, start_server: StartServer, host: str) -> None:
    handler = LineServer()
    server = await start_server(handler, host, 0)
    port = port_of(server)
    async with server:
        reader, writer = await open_connection(host, port)
        assert writer.get_extra_info("peername") == (host, port)
        assert writer.can_write_eof()

        writer.write(b"ECHO hello\n")
        await writer.drain()
        assert await reader.readline() == b"hello\n"
        writer.writelines([b"ECHO a\n", b"EC", b"HO b\n"])
        assert await reader.readline() == b"a\n"
        assert await reader.readline() == b"b\n"

        payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4: more than any buffer's high mark
        writer.write(b"BLOB %d\n" % len(payload))
        writer.write(payload)
        await writer.drain()
        assert await reader.readuntil(b"\n") == b"%d\n" % len(payload)
        assert await reader.readexactly(len(payload)) == payload

        writer.write(b"UNTIL\nline1\r\nline2\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"line1\r\nline2\r\n\r\n"

        writer.write(b"PEER\n")
        assert await reader.readline() == repr(writer.get_extra_info("sockname")).encode() + b"\n"

        writer.write(b"NOPE\n")
        assert await reader.readline() == b"ERR unknown command\n"

        # half-close: the server sees EOF, answers and closes; we read to the end
        writer.write_eof()
        assert await reader.readline() == b"BYE\n"
        assert await reader.read() == b""
        assert reader.at_eof()
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readexactly(1)
        assert info.value.partial == b"" and info.value.expected == 1
        writer.close()
        assert writer.is_closing()
        await writer.wait_closed()
    assert handler.errors == []
    assert handler.peers == [writer.get_extra_info("sockname")]


async def check_eof_errors(open_connection: OpenConnection, start_server: StartServer, host: str) -> None:
    handler = LineServer()
    server = await start_server(handler, host, 0)
    port = port_of(server)
    async with server:
        # readexactly at EOF: IncompleteReadError with the partial data
        reader, writer = await open_connection(host, port)
        writer.write(b"SAY partial\n")
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readexactly(100)
        assert info.value.partial == b"partial" and info.value.expected == 100
        writer.close()
        await writer.wait_closed()

        # readuntil at EOF: IncompleteReadError(partial, expected=None); then readline returns b""
        reader, writer = await open_connection(host, port)
        writer.write(b"SAY no newline\n")
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readuntil(b"\n")
        assert info.value.partial == b"no newline" and info.value.expected is None
        assert await reader.readline() == b""
        writer.close()
        await writer.wait_closed()

        # readline at EOF returns the partial line, then b""; async for stops at EOF
        reader, writer = await open_connection(host, port)
        writer.write(b"SAY one\\ntwo\\nthree\n")
        assert [line async for line in reader] == [b"one\n", b"two\n", b"three"]
        assert await reader.readline() == b""
        writer.close()
        await writer.wait_closed()
    assert handler.errors == []


async def check_limits(open_connection: OpenConnection, start_server: StartServer, host: str) -> None:
    handler = LineServer()
    server = await start_server(handler, host, 0, limit=64)
    port = port_of(server)
    async with server:
        reader, writer = await open_connection(host, port, limit=64)
        # the server's readline() exceeds its limit: ValueError, which it answers with ERR
        writer.write(b"ECHO " + b"x" * 200 + b"\n")
        assert await reader.readline() == b"ERR too long\n"
        writer.write(b"ECHO short\n")
        assert await reader.readline() == b"short\n"

        # our readuntil() exceeds our limit: LimitOverrunError, and the data stays in the buffer
        line = b"z" * 99 + b"\n"
        writer.write(b"BLOB 100\n" + line)
        assert await reader.readline() == b"100\n"
        with pytest.raises(asyncio.LimitOverrunError) as overrun:
            await reader.readuntil(b"\n")
        assert overrun.value.consumed > 64
        assert await reader.readexactly(100) == line

        # readline() turns the overrun into ValueError and drops the long line
        writer.write(b"BLOB 100\n" + line)
        assert await reader.readline() == b"100\n"
        with pytest.raises(ValueError):
            await reader.readline()
        writer.write(b"ECHO ok\n")
        assert await reader.readline() == b"ok\n"

        # the limit bounds lines, not data: 1 MiB passes both small-limit readers (pause/resume reading)
        payload = hashlib.sha256(b"seed").digest() * 32768
        writer.write(b"BLOB %d\n" % len(payload) + payload)
        assert await reader.readline() == b"%d\n" % len(payload)
        assert await reader.readexactly(len(payload)) == payload

        writer.write_eof()
        assert await reader.read() == b"BYE\n"
        writer.close()
        await writer.wait_closed()
    assert handler.errors == []


async def check_drain_backpressure(
    open_connection: OpenConnection, start_server: StartServer, host: str
) -> None:
    total = 32 << 20
    chunk = bytes(range(256)) * 1024  # 256 KiB
    release = asyncio.Event()
    result: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    async def slow_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # read nothing until released
        digest = hashlib.sha256()
        n = 0
        while data := await reader.read(1 << 20):
            digest.update(data)
            n += len(data)
        result.set_result((n, digest.hexdigest()))
        writer.write(b"%d\n" % n)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await start_server(slow_sink, host, 0)
    async with server:
        reader, writer = await open_connection(host, port_of(server))
        transport = writer.transport
        transport.set_write_buffer_limits(high=256 * 1024, low=64 * 1024)
        assert transport.get_write_buffer_limits() == (64 * 1024, 256 * 1024)
        written = 0

        async def pump() -> None:
            nonlocal written
            while written < total:
                writer.write(chunk)
                written += len(chunk)
                await writer.drain()
                assert transport.get_write_buffer_size() <= 256 * 1024

        pumping = asyncio.create_task(pump())
        # Wait until the writer stalls: the peer reads nothing, so drain() must block at some point.
        last, still = -1, 0
        while still < 4:
            await asyncio.sleep(0.5)
            still = still + 1 if written == last else 0
            last = written
            assert not pumping.done(), "drain() never blocked although the peer reads nothing"
        assert written < total
        assert transport.get_write_buffer_size() > 64 * 1024  # paused: above the low-water mark
        release.set()
        await pumping
        writer.write_eof()
        assert await reader.readline() == b"%d\n" % total
        expected = hashlib.sha256(chunk * (total // len(chunk))).hexdigest()
        assert await result == (total, expected)
        writer.close()
        await writer.wait_closed()


async def check_server_surface(open_connection: OpenConnection, start_server: StartServer, host: str) -> None:
    handler = LineServer()
    server = await start_server(handler, host, 0, start_serving=False)
    assert not server.is_serving()
    assert server.get_loop() is asyncio.get_running_loop()
    port = port_of(server)
    assert server.sockets[0].family == socket.AF_INET
    await server.start_serving()
    assert server.is_serving()
    forever = asyncio.create_task(server.serve_forever())
    await asyncio.sleep(0)

    async def client(i: int) -> None:
        reader, writer = await open_connection(host, port)
        data = bytes([i]) * (4096 * i + 1)
        writer.write(b"ECHO client %d\n" % i)
        writer.write(b"BLOB %d\n" % len(data) + data)
        await writer.drain()
        assert await reader.readline() == b"client %d\n" % i
        assert await reader.readline() == b"%d\n" % len(data)
        assert await reader.readexactly(len(data)) == data
        writer.write_eof()
        assert await reader.readline() == b"BYE\n"
        writer.close()
        await writer.wait_closed()

    await asyncio.gather(*(client(i) for i in range(1, 9)))
    assert len(handler.peers) == 8
    forever.cancel()
    with pytest.raises(asyncio.CancelledError):
        await forever
    assert not server.is_serving()
    assert list(server.sockets) == []
    await server.wait_closed()
    with pytest.raises(ConnectionRefusedError):
        await open_connection(host, port)
    assert handler.errors == []


async def check_client_close(open_connection: OpenConnection, start_server: StartServer, host: str) -> None:
    handler = LineServer()
    server = await start_server(handler, host, 0)
    async with server:
        reader, writer = await open_connection(host, port_of(server))
        writer.write(b"ECHO before close\n")
        assert await reader.readline() == b"before close\n"
        pending = asyncio.create_task(reader.read(100))
        await asyncio.sleep(0)
        writer.close()
        assert writer.is_closing()
        await writer.wait_closed()
        assert await pending == b""  # closing the writer ends a read in progress with EOF
        writer.close()  # idempotent
        await writer.wait_closed()
    assert handler.errors == []


# ===== END of the test program ==========================================================================


def test_line_protocol(arun: Runner[Any], net: Net) -> None:
    bounded(arun, check_line_protocol(net.open_connection, net.start_server, net.host))


def test_eof_errors(arun: Runner[Any], net: Net) -> None:
    bounded(arun, check_eof_errors(net.open_connection, net.start_server, net.host))


def test_limits(arun: Runner[Any], net: Net) -> None:
    bounded(arun, check_limits(net.open_connection, net.start_server, net.host))


def test_drain_backpressure(arun: Runner[Any], net: Net) -> None:
    bounded(arun, check_drain_backpressure(net.open_connection, net.start_server, net.host))


def test_server_surface(arun: Runner[Any], net: Net) -> None:
    bounded(arun, check_server_surface(net.open_connection, net.start_server, net.host))


def test_client_close(arun: Runner[Any], net: Net) -> None:
    bounded(arun, check_client_close(net.open_connection, net.start_server, net.host))


# ===== RDMA only ========================================================================================


def test_rdma_objects_and_extra_info(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        seen: list[asyncio.StreamWriter] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer)
            await reader.read()
            writer.close()

        server = await rdmaio.streams.start_server(handler, rdma_addr, 0, options={"slot_size": 8192})
        assert isinstance(server, asyncio.AbstractServer)
        info = server.sockets[0]
        assert isinstance(info, rdmaio.streams.ListenerInfo)
        assert info.getsockname() == (rdma_addr, server.addresses[0][1])
        async with server:
            reader, writer = await rdmaio.streams.open_connection(
                rdma_addr, info.getsockname()[1], timeout=30, options={"slot_size": 16384}
            )
            assert type(reader) is asyncio.StreamReader and type(writer) is asyncio.StreamWriter
            transport = writer.transport
            assert isinstance(transport, asyncio.Transport)
            assert isinstance(transport, rdmaio.streams.RdmaTransport)
            endpoint = writer.get_extra_info("endpoint")
            assert isinstance(endpoint, rdmaio.Endpoint)
            assert writer.get_extra_info("options").slot_size == 16384
            assert isinstance(writer.get_extra_info("device"), str)
            assert isinstance(writer.get_extra_info("qp_num"), int)
            assert writer.get_extra_info("socket") is None
            # default water marks come from rdmaio.Options
            assert transport.get_write_buffer_limits() == (256 * 1024, 1024 * 1024)
            writer.write(b"x" * 100_000)
            writer.write_eof()
            await writer.drain()
            assert await reader.read() == b""
            await writer.wait_closed()
            assert endpoint.statistics()["bytes_sent"] == 100_000
            assert seen[0].get_extra_info("options").slot_size == 8192
        with pytest.raises(NotImplementedError, match="TLS"):
            await rdmaio.streams.open_connection(rdma_addr, 1, ssl=True)

    bounded(arun, main())


def test_rdma_close_clients_and_abort_clients(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        accepted: list[asyncio.StreamWriter] = []
        expected = 3
        all_accepted = asyncio.Event()

        async def idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)
            if len(accepted) == expected:
                all_accepted.set()
            with contextlib.suppress(ConnectionError):
                await reader.read()  # the connection outlives this callback

        server = await rdmaio.streams.start_server(idle, rdma_addr, 0)
        port = server.addresses[0][1]
        clients = [await rdmaio.streams.open_connection(rdma_addr, port, timeout=30) for _ in range(3)]
        for _reader, writer in clients:
            writer.write(b"hello")
            await writer.drain()
        # Closing a listener drops connections it has not handed over yet (as a TCP listen backlog).
        await all_accepted.wait()
        server.close()
        waiting = asyncio.create_task(server.wait_closed())
        await asyncio.sleep(0.5)
        assert not waiting.done()  # connections are open: wait_closed waits for them
        server.close_clients()
        for reader, writer in clients:
            assert await reader.read() == b""  # closed gracefully: EOF
            writer.close()
            await writer.wait_closed()
        await waiting

        accepted.clear()
        all_accepted.clear()
        expected = 2
        server = await rdmaio.streams.start_server(idle, rdma_addr, 0)
        port = server.addresses[0][1]
        clients = [await rdmaio.streams.open_connection(rdma_addr, port, timeout=30) for _ in range(2)]
        for _reader, writer in clients:
            writer.write(b"hello")
            await writer.drain()
        await all_accepted.wait()
        server.abort_clients()
        for reader, writer in clients:
            with pytest.raises(ConnectionResetError):
                await reader.read()
            with pytest.raises(ConnectionResetError):
                await writer.wait_closed()
        server.close()
        await server.wait_closed()

    bounded(arun, main())


def test_rdma_peer_death_resets_server_side_reader(arun: Runner[Any], rdma_addr: str) -> None:
    client_code = """
        import asyncio, sys, rdmaio.streams
        async def main():
            reader, writer = await rdmaio.streams.open_connection(sys.argv[1], int(sys.argv[2]), timeout=30)
            writer.write(b"hello")
            await writer.drain()
            print("READY", flush=True)
            await asyncio.Event().wait()
        asyncio.run(main())
    """

    async def main() -> None:
        outcome: asyncio.Future[BaseException | bytes] = asyncio.get_running_loop().create_future()
        closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert await reader.readexactly(5) == b"hello"
            try:
                outcome.set_result(await reader.read(100))  # pending when the peer dies
            except Exception as exc:
                outcome.set_result(exc)
            try:
                await writer.wait_closed()
                closed.set_result(None)
            except Exception as exc:
                closed.set_result(exc)

        server = await rdmaio.streams.start_server(handler, rdma_addr, 0)
        async with server:
            proc = peer_process(client_code, rdma_addr, str(server.addresses[0][1]))
            try:
                await asyncio.to_thread(wait_ready, proc)
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGKILL)
                result = await asyncio.wait_for(outcome, 60)
            finally:
                proc.kill()
                proc.wait()
            assert isinstance(result, ConnectionResetError), result
            assert isinstance(result, rdmaio.ConnectionResetError)
            assert isinstance(await closed, ConnectionResetError)

    bounded(arun, main())


def test_rdma_peer_death_fails_client_read_and_drain(arun: Runner[Any], rdma_addr: str) -> None:
    server_code = """
        import asyncio, sys, rdmaio.streams
        async def handler(reader, writer):
            await asyncio.Event().wait()   # never read: the client's drain() blocks
        async def main():
            server = await rdmaio.streams.start_server(
                handler, sys.argv[1], 0, options={"recv_buffer_limit": 65536})
            print("READY", server.addresses[0][1], flush=True)
            await server.serve_forever()
        asyncio.run(main())
    """

    async def main() -> None:
        proc = peer_process(server_code, rdma_addr)
        try:
            port = int((await asyncio.to_thread(wait_ready, proc)).split()[1])
            reader, writer = await rdmaio.streams.open_connection(rdma_addr, port, timeout=30)

            async def flood() -> None:
                while True:
                    writer.write(b"y" * 65536)
                    await writer.drain()

            sender = asyncio.create_task(flood())
            receiver = asyncio.create_task(reader.read(100))
            await asyncio.sleep(1.0)
            assert not sender.done() and not receiver.done()  # blocked: no credits, no data
            proc.send_signal(signal.SIGKILL)
            done, _ = await asyncio.wait({sender, receiver}, timeout=60)
            assert done == {sender, receiver}, "pending calls hung after the peer died"
            assert isinstance(sender.exception(), ConnectionResetError), sender.exception()
            assert isinstance(receiver.exception(), ConnectionResetError), receiver.exception()
            assert writer.is_closing()
            with pytest.raises(ConnectionResetError):
                await writer.drain()
            writer.close()
            with pytest.raises(ConnectionResetError):
                await writer.wait_closed()
        finally:
            proc.kill()
            proc.wait()

    bounded(arun, main())


def test_rdma_cancel_then_close_never_hangs(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await release.wait()  # neither reads nor writes until released
            writer.close()

        server = await rdmaio.streams.start_server(stuck, rdma_addr, 0, options={"recv_buffer_limit": 65536})
        reader, writer = await rdmaio.streams.open_connection(
            rdma_addr, server.addresses[0][1], timeout=30, options={"close_timeout": 1.0}
        )

        async def flood() -> None:
            while True:
                writer.write(b"z" * 65536)
                await writer.drain()

        sender = asyncio.create_task(flood())
        receiver = asyncio.create_task(reader.readexactly(10))
        await asyncio.sleep(1.0)
        assert not sender.done() and not receiver.done()
        for task in (sender, receiver):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # queued data the peer never takes: close() gives up after close_timeout and tears down
        pending = asyncio.create_task(reader.read())
        writer.close()
        await writer.wait_closed()
        assert await pending == b""
        release.set()
        server.close()
        server.abort_clients()
        await server.wait_closed()

    bounded(arun, main())
