"""Failure semantics of Endpoint/StreamServer: dead peers, cancellation, leaks, fork, limits."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import logging
import os
import random
import signal
import struct
import time
from typing import Any

import pytest
from loops import Runner, arun
from peer_process import peer_process, wait_ready
from rdma_state import open_fds, rdma_resources

import rdmaio
import rdmaio.core.dial
from rdmaio.core.rings import POOL_LINGER
from rdmaio.protocol import Handshake

HEADER = struct.Struct("<IQ32s")  # seq, length, sha256 of the body


async def echo_handler(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


def test_peer_killed_client_side_survivor_server_keeps_serving(arun: Runner[Any], rdma_addr: str) -> None:
    """Server survives: a client process streaming to it is SIGKILLed mid-transfer."""
    client_code = """
        import asyncio, sys, rdmaio
        async def main():
            ep = await rdmaio.connect(sys.argv[1], int(sys.argv[2]), timeout=10)
            await ep.send(b"hello")
            print("READY", flush=True)
            while True:
                await ep.send(b"x" * 60000)
        asyncio.run(main())
    """

    async def main() -> None:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[tuple[BaseException | None, float]] = loop.create_future()
        killed_at: list[float] = []

        async def handler(ep: rdmaio.Endpoint) -> None:
            if outcome.done():  # second client: plain echo
                await echo_handler(ep)
                return
            try:
                while (await ep.recv()) is not None:
                    pass
                outcome.set_result((None, time.monotonic()))
            except Exception as exc:
                outcome.set_result((exc, time.monotonic()))

        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            proc = peer_process(client_code, rdma_addr, str(port))
            try:
                await asyncio.to_thread(wait_ready, proc)
                await asyncio.sleep(0.5)  # mid-transfer
                proc.send_signal(signal.SIGKILL)
                killed_at.append(time.monotonic())
                exc, when = await asyncio.wait_for(outcome, 30)
            finally:
                proc.kill()
                proc.wait()
            assert isinstance(exc, ConnectionResetError), exc
            assert when - killed_at[0] < 5.0, when - killed_at[0]
            # the server keeps serving
            ep = await rdmaio.connect(rdma_addr, port, timeout=10)
            async with ep:
                await ep.send(b"still here")
                assert await ep.recv() == b"still here"

    arun(main())


def test_peer_killed_server_side_pending_send_and_recv_fail(arun: Runner[Any], rdma_addr: str) -> None:
    """Client survives: the server process (which never reads) is SIGKILLed while we are blocked."""
    server_code = """
        import asyncio, sys, rdmaio
        async def handler(ep):
            await asyncio.Event().wait()   # never read: the client runs out of credits
        async def main():
            server = await rdmaio.serve(handler, sys.argv[1], 0,
                                        options={"recv_buffer_limit": 65536})
            print("READY", server.addresses[0][1], flush=True)
            await server.serve_forever()
        asyncio.run(main())
    """

    async def main() -> None:
        proc = peer_process(server_code, rdma_addr)
        try:
            port = int((await asyncio.to_thread(wait_ready, proc)).split()[1])
            ep = await rdmaio.connect(rdma_addr, port, timeout=10)

            async def flood() -> None:
                while True:
                    await ep.send(b"y" * 65536)

            sender = asyncio.create_task(flood())
            receiver = asyncio.create_task(ep.recv())
            await asyncio.sleep(1.0)
            assert not sender.done() and not receiver.done()  # blocked: no credits, no data
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            done, _ = await asyncio.wait({sender, receiver}, timeout=30)
            elapsed = time.monotonic() - killed
            assert done == {sender, receiver}, "pending calls hung after the peer died"
            assert elapsed < 5.0, elapsed
            assert isinstance(sender.exception(), ConnectionResetError), sender.exception()
            assert isinstance(receiver.exception(), ConnectionResetError), receiver.exception()
            with pytest.raises(ConnectionResetError):
                await ep.send(b"after death")
            await ep.aclose()
        finally:
            proc.kill()
            proc.wait()

    arun(main())


def test_peer_close_gives_eof_and_reset_on_write(arun: Runner[Any], rdma_addr: str) -> None:
    async def handler(ep: rdmaio.Endpoint) -> None:
        await ep.send(b"bye")
        await ep.aclose()

    async def main() -> None:
        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10)
            assert await ep.recv() == b"bye"
            assert await ep.recv() is None
            assert await ep.read() == b""
            with pytest.raises(ConnectionResetError):
                for _ in range(100):  # the disconnect may land a moment after EOF
                    await ep.send(b"x")
                    await asyncio.sleep(0.01)
            await ep.aclose()

    arun(main())


def test_500_connect_close_cycles_leak_nothing(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            # warm-up: librdmacm opens the device once per process and keeps it
            ep = await rdmaio.connect(rdma_addr, port, timeout=10)
            await ep.aclose()
            # ... and the domains' ring pools release a closed connection's memory once idle.
            await asyncio.sleep(POOL_LINGER + 1)
            # The previous test's loop, once collected, releases what lives as long as a loop (its event
            # channel, its domain's completion channel): collect it now, not in the middle of the count.
            gc.collect()
            fds, resources = open_fds(), rdma_resources()
            for i in range(500):
                ep = await rdmaio.connect(rdma_addr, port, timeout=10)
                if i % 50 == 0:
                    await ep.send(b"ping")
                    assert await ep.recv() == b"ping"
                await ep.aclose()
            for _ in range(100):  # the server side closes when it sees our disconnect
                if len(server._clients) == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(POOL_LINGER + 1)  # the ring pools, idle again, release their memory
            assert open_fds() == fds
            assert rdma_resources() == resources
            assert server.connections_accepted == 501

    arun(main())


def test_cancellation_200_times_no_corruption_no_leak(arun: Runner[Any], rdma_addr: str) -> None:
    rng = random.Random(42)

    def message(seq: int) -> bytes:
        body = random.Random(seq).randbytes(rng.choice([0, 10, 5000, 70000, 200000]))
        return HEADER.pack(seq, len(body), hashlib.sha256(body).digest()) + body

    def check(msg: bytes) -> int:
        seq, length, digest = HEADER.unpack_from(msg)
        body = msg[HEADER.size :]
        assert len(body) == length and hashlib.sha256(body).digest() == digest, f"corrupt message {seq}"
        return int(seq)

    async def stream_echo(ep: rdmaio.Endpoint) -> None:
        async with ep:
            while chunk := await ep.read(65536):
                ep.write(chunk)
                await ep.drain()
            ep.write_eof()

    async def main() -> None:
        resources = rdma_resources()
        server = await rdmaio.serve(echo_handler, rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10)
            sent: list[int] = []  # seqs whose send completed (must all come back)
            maybe: set[int] = set()  # cancelled sends: whole or not at all
            received: list[int] = []
            seq = 0
            for _ in range(200):
                op = rng.choice(["send", "recv", "recv"])
                delay = rng.choice([0, 0, 0.0005, 0.002, 0.01])
                if op == "send":
                    seq += 1
                    task = asyncio.create_task(ep.send(message(seq)))
                else:
                    task = asyncio.create_task(ep.recv())  # type: ignore[arg-type]
                if delay:
                    await asyncio.sleep(delay)
                task.cancel()
                try:
                    result = await task
                except asyncio.CancelledError:
                    if op == "send":
                        maybe.add(seq)
                    continue
                if op == "send":
                    sent.append(seq)
                else:
                    assert result is not None
                    received.append(check(result))
            # everything still in flight comes back; then the endpoint is still usable
            await ep.send(message(10_000))
            while (msg := await asyncio.wait_for(ep.recv(), 60)) is not None:
                s = check(msg)
                received.append(s)
                if s == 10_000:
                    break
            assert received == sorted(received), "messages out of order"
            assert set(sent) <= set(received), set(sent) - set(received)
            assert set(received) <= set(sent) | maybe | {10_000}
            await ep.aclose()

        # drain() cancelled at random points on a stream: the byte stream stays intact
        server = await rdmaio.serve(stream_echo, rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10)
            ep.set_write_buffer_limits(high=128 * 1024, low=32 * 1024)
            got = hashlib.sha256()
            want = hashlib.sha256()

            async def reader() -> int:
                n = 0
                while chunk := await ep.read(1 << 20):
                    got.update(chunk)
                    n += len(chunk)
                return n

            read_task = asyncio.create_task(reader())
            total = 0
            for i in range(200):
                chunk = random.Random(i).randbytes(rng.choice([1, 1000, 65536, 300000]))
                ep.write(chunk)
                want.update(chunk)
                total += len(chunk)
                task = asyncio.create_task(ep.drain())
                await asyncio.sleep(rng.choice([0, 0.0005, 0.003]))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await ep.drain()
            ep.write_eof()
            assert await asyncio.wait_for(read_task, 300) == total
            assert got.hexdigest() == want.hexdigest()
            await ep.aclose()
        await asyncio.sleep(POOL_LINGER + 1)  # the ring pools release closed connections' memory once idle
        # The loop's Domain (the device's protection domain and the first CQ of its shared pool, both shared
        # by its connections) lives as long as the loop: one PD and one CQ more than before the first
        # connection, nothing else.
        assert rdma_resources() == dict(resources, pd=resources["pd"] + 1, cq=resources["cq"] + 1)

    arun(main())


def test_fifty_concurrent_clients_4mib_each(arun: Runner[Any], rdma_addr: str) -> None:
    size = 4 << 20

    async def client(port: int, i: int) -> None:
        payload = random.Random(i).randbytes(size)
        ep = await rdmaio.connect(rdma_addr, port, timeout=60)
        async with ep:
            await ep.send(payload)
            echoed = await ep.recv()
            assert echoed == payload, f"client {i} got a corrupted echo"

    async def main() -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0, options={"recv_depth": 16, "send_depth": 16})
        async with server:
            port = server.addresses[0][1]
            await asyncio.gather(*(client(port, i) for i in range(50)))
            assert server.connections_accepted == 50

    arun(main())


def test_handler_error_is_logged_and_others_unaffected(
    arun: Runner[Any], rdma_addr: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(ep: rdmaio.Endpoint) -> None:
        msg = await ep.recv()
        if msg == b"boom":
            raise RuntimeError("handler exploded")
        await echo_handler_after(ep, msg)

    async def echo_handler_after(ep: rdmaio.Endpoint, first: bytes | None) -> None:
        await ep.send(first or b"")
        await echo_handler(ep)

    async def main() -> None:
        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            good = await rdmaio.connect(rdma_addr, port, timeout=10)
            bad = await rdmaio.connect(rdma_addr, port, timeout=10)
            await good.send(b"one")
            assert await good.recv() == b"one"
            await bad.send(b"boom")
            assert await asyncio.wait_for(bad.recv(), 10) is None  # closed by the server
            await good.send(b"two")
            assert await good.recv() == b"two"
            await good.aclose()
            await bad.aclose()

    with caplog.at_level(logging.ERROR, logger="rdmaio"):
        arun(main())
    assert any("handler failed" in r.message and r.exc_info for r in caplog.records)


def test_max_message_size_enforced_both_sides(
    arun: Runner[Any], rdma_addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0, options={"max_message_size": 100_000})
        async with server:
            port = server.addresses[0][1]
            ep = await rdmaio.connect(rdma_addr, port, timeout=10, options={"max_message_size": 50_000})
            async with ep:
                # sender side: the peer announced 100,000 as its maximum
                with pytest.raises(rdmaio.MessageTooLargeError):
                    await ep.send(b"z" * 100_001)
                await ep.send(b"z" * 50_000)
                assert await ep.recv() == b"z" * 50_000
                # the server's echo of 60,000 bytes exceeds what we announced: its send fails, its
                # handler fails, and it closes the connection
                await ep.send(b"z" * 60_000)
                assert await asyncio.wait_for(ep.recv(), 10) is None

            # receiver side: a sender that ignores the limit is cut off by the receiver
            class LyingHandshake(Handshake):
                """Makes the client believe the server accepts 1 TiB messages."""

                @classmethod
                def decode(cls, data: bytes | bytearray | memoryview) -> Handshake:
                    # everything the server announced (its capabilities too) but the message size limit
                    return dataclasses.replace(Handshake.decode(data), max_message_size=2**40)

            monkeypatch.setattr(rdmaio.core.dial, "Handshake", LyingHandshake)
            ep = await rdmaio.connect(rdma_addr, port, timeout=10)
            monkeypatch.undo()
            await ep.send(b"z" * 100_001)
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(ep.recv(), 10)
            await ep.aclose()

    arun(main())


def test_unresolvable_and_unreachable_are_typed_and_bounded(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        with pytest.raises(rdmaio.AddressError):
            await rdmaio.connect("no-such-host.invalid", 7471, timeout=5)
        start = time.monotonic()
        # 198.18.0.99: same subnet, nobody there (ARP never answers): address resolution fails/times out
        with pytest.raises((rdmaio.AddressError, rdmaio.UnreachableError, rdmaio.TimeoutError)):
            await rdmaio.connect("198.18.0.99", 7471, timeout=3)
        assert time.monotonic() - start < 3 + 2

    arun(main())


def test_fork_makes_endpoint_raise_in_child(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10)
            pid = os.fork()
            if pid == 0:
                code = 1
                coro = ep.send(b"from the child")
                try:
                    coro.send(None)
                except rdmaio.ForkError:
                    code = 0
                except BaseException:
                    code = 2
                os._exit(code)
            _, status = await asyncio.to_thread(os.waitpid, pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            await ep.send(b"parent still works")
            assert await ep.recv() == b"parent still works"
            await ep.aclose()

    arun(main())
