"""The core API (connect, serve, listen/accept, Endpoint) on trio, without anyio in between (test host)."""

from __future__ import annotations

import hashlib
import os
import random

import pytest
import trio
from rdma_state import open_fds, rdma_resources

import rdmaio

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # a never-awaited coroutine is a bug


async def echo_handler(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


def test_message_and_stream_echo_on_trio(rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            async with await rdmaio.connect(rdma_addr, port, timeout=30) as ep:
                for size in (0, 1, 4096, 65537, 1 << 20):
                    payload = os.urandom(size)
                    await ep.send(payload)
                    assert await ep.recv() == payload, size
                ep.write(b"line one\nline two\n")
                await ep.drain()
                assert await ep.readline() == b"line one\n"
                assert await ep.readexactly(9) == b"line two\n"
        assert server.connections_accepted == 1
        assert not server.is_serving()

    trio.run(main)


def test_listen_accept_in_a_nursery(rdma_addr: str) -> None:
    """Ten concurrent clients, served from an accept loop in a nursery; every byte checked."""
    clients = 10

    async def serve_one(ep: rdmaio.Endpoint) -> None:
        async with ep:
            while chunk := await ep.read(1 << 16):
                ep.write(chunk)
                await ep.drain()
            ep.write_eof()

    async def client(port: int, seed: int, results: dict[int, bool]) -> None:
        rng = random.Random(seed)
        payload = rng.randbytes(rng.randrange(1, 300_000))
        async with await rdmaio.connect(rdma_addr, port, timeout=60) as ep:
            ep.write(payload)
            ep.write_eof()
            echoed = await ep.read()
        results[seed] = hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()

    async def main() -> None:
        server = await rdmaio.listen(rdma_addr, 0)
        port = server.addresses[0][1]
        results: dict[int, bool] = {}
        with trio.fail_after(300):
            async with trio.open_nursery() as servers:

                async def accept_loop() -> None:
                    for _ in range(clients):
                        servers.start_soon(serve_one, await server.accept())

                servers.start_soon(accept_loop)
                async with trio.open_nursery() as nursery:
                    for seed in range(clients):
                        nursery.start_soon(client, port, seed, results)
        assert results == dict.fromkeys(range(clients), True)
        server.close()
        with pytest.raises(rdmaio.EndpointClosedError):
            await server.accept()
        await server.wait_closed()

    trio.run(main)


def test_refused_and_peer_close_on_trio(rdma_addr: str) -> None:
    async def main() -> None:
        # Nobody listens on this port (the server below is closed first): refused, not a hang.
        server = await rdmaio.listen(rdma_addr, 0)
        port = server.addresses[0][1]
        server.close()
        await server.wait_closed()
        with pytest.raises(rdmaio.ConnectionRefusedError) as refused:
            await rdmaio.connect(rdma_addr, port, timeout=30)
        assert isinstance(refused.value, ConnectionRefusedError)

        server = await rdmaio.listen(rdma_addr, 0)
        port = server.addresses[0][1]
        with trio.fail_after(120):
            ep = await rdmaio.connect(rdma_addr, port, timeout=30)
            peer = await server.accept()
            got: list[bytes | None] = []
            async with trio.open_nursery() as nursery:

                async def blocked_recv() -> None:
                    got.append(await ep.recv())  # blocked until the peer closes

                nursery.start_soon(blocked_recv)
                await trio.sleep(0.2)
                await peer.aclose()
            assert got == [None]  # a clean close is a clean end of stream
            await ep.aclose()
        server.close()
        await server.wait_closed()

    trio.run(main)


def test_cancelled_recv_and_abort_on_trio(rdma_addr: str) -> None:
    """A cancelled recv loses nothing; abort() fails a blocked call with a typed error, never a hang."""

    async def main() -> None:
        server = await rdmaio.listen(rdma_addr, 0)
        port = server.addresses[0][1]
        with trio.fail_after(120):
            ep = await rdmaio.connect(rdma_addr, port, timeout=30)
            peer = await server.accept()
            with trio.move_on_after(0.2) as scope:
                await ep.recv()
            assert scope.cancelled_caught
            await peer.send(b"after the cancel")
            assert await ep.recv() == b"after the cancel"

            errors: list[BaseException] = []
            async with trio.open_nursery() as nursery:

                async def blocked_recv() -> None:
                    try:
                        await ep.recv()
                    except rdmaio.RdmaError as exc:
                        errors.append(exc)

                nursery.start_soon(blocked_recv)
                await trio.sleep(0.2)
                ep.abort()
            assert len(errors) == 1
            assert isinstance(errors[0], (rdmaio.ConnectionAbortedError, rdmaio.EndpointClosedError))
            with pytest.raises(rdmaio.RdmaError):
                await ep.send(b"x")
            with pytest.raises(rdmaio.ConnectionResetError):  # an abort is not a clean close
                await peer.recv()
            await peer.aclose()
        server.close()
        await server.wait_closed()

    trio.run(main)


def test_no_leaks_across_trio_runs(rdma_addr: str) -> None:
    """Connections made and closed in separate trio runs leave no fds and no RDMA resources behind."""

    async def cycle(rounds: int) -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            for i in range(rounds):
                async with await rdmaio.connect(rdma_addr, port, timeout=30) as ep:
                    await ep.send(b"%d" % i)
                    assert await ep.recv() == b"%d" % i

    trio.run(cycle, 2)  # warm-up: imports, first device open
    fds, resources = open_fds(), rdma_resources()
    for _ in range(3):
        trio.run(cycle, 5)
    assert open_fds() == fds
    assert rdma_resources() == resources
