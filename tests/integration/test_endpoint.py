"""Endpoint/StreamServer integration tests (test host, asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from typing import Any

import pytest
from loops import Runner, arun

import rdmaio

SIZES = [0, 1, 4095, 4096, 4097, 65536, 1 << 20, 4 << 20]


async def echo_handler(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


async def stream_echo_handler(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while chunk := await ep.read(1 << 20):
            ep.write(chunk)
            await ep.drain()
        ep.write_eof()


def test_message_echo_sizes(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(echo_handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            ep = await rdmaio.connect(rdma_addr, port, timeout=10)
            async with ep:
                for size in SIZES:
                    payload = os.urandom(size)
                    await ep.send(payload)
                    assert await ep.recv() == payload, size
                # bytearray / memoryview inputs too
                await ep.send(bytearray(b"abc"))
                assert await ep.recv() == b"abc"
                await ep.send(memoryview(b"xyz123")[2:])
                assert await ep.recv() == b"z123"
                stats = ep.statistics()
                assert stats["messages_sent"] == len(SIZES) + 2
                assert stats["bytes_received"] == sum(SIZES) + 7

    arun(main())


def test_stream_echo_sizes(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(stream_echo_handler, rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10)
            async with ep:
                for size in SIZES:
                    payload = os.urandom(size)
                    ep.write(payload)
                    await ep.drain()
                    assert await ep.readexactly(size) == payload, size
                ep.write(b"line one\nline two\n")
                assert await ep.readline() == b"line one\n"
                assert await ep.readuntil(b"two\n") == b"line two\n"
                ep.write_eof()
                assert await ep.read() == b""
                assert ep.at_eof()

    arun(main())


def test_connect_refused_fast(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> float:
        start = time.monotonic()
        with pytest.raises(ConnectionRefusedError) as info:
            await rdmaio.connect(rdma_addr, 1, timeout=10)
        assert isinstance(info.value, rdmaio.ConnectionRefusedError)
        return time.monotonic() - start

    elapsed = arun(main())
    assert elapsed < 1.0, elapsed


def test_stream_256mib_sha256(arun: Runner[Any], rdma_addr: str) -> None:
    total = 256 << 20
    rng = random.Random(7)
    doubled = rng.randbytes(1 << 20) * 2  # any window of up to 1 MiB is a slice of this

    async def receiver(ep: rdmaio.Endpoint, result: asyncio.Future[tuple[int, str]]) -> None:
        digest = hashlib.sha256()
        n = 0
        while chunk := await ep.read(1 << 20):
            digest.update(chunk)
            n += len(chunk)
        result.set_result((n, digest.hexdigest()))
        await ep.aclose()

    async def main() -> None:
        result: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        server = await rdmaio.serve(lambda ep: receiver(ep, result), rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10)
            sent = hashlib.sha256()
            offset = 0
            started = time.monotonic()
            while offset < total:
                size = min(total - offset, rng.choice([1, 7, 100, 4096, 65536, 300_000, 1 << 20]))
                start = offset % (1 << 20)
                chunk = doubled[start : start + size]
                ep.write(chunk)
                sent.update(chunk)
                offset += size
                await ep.drain()
            ep.write_eof()
            n, digest = await asyncio.wait_for(result, 600)
            elapsed = time.monotonic() - started
            print(f"256 MiB in {elapsed:.1f}s = {total / elapsed / 1e6:.1f} MB/s; {ep.statistics()}")
            assert n == total
            assert digest == sent.hexdigest()
            await ep.aclose()

    arun(main())


def test_small_messages_are_batched_and_keep_boundaries_and_order(arun: Runner[Any], rdma_addr: str) -> None:
    """Pipelined small sends travel several to a frame (DATA_BATCH); every boundary, byte and the order
    across stream writes and large messages survive; batch_limit=0 turns batching off."""
    rng = random.Random(7)
    plan: list[tuple[str, bytes]] = []
    for i in range(3000):
        roll = rng.random()
        if roll < 0.90:
            plan.append(("send", rng.randbytes(rng.choice([0, 1, 17, 64, 500, 8192]))))
        elif roll < 0.97:
            plan.append(("send", rng.randbytes(rng.choice([8193, 70_000]))))  # not batched
        else:
            plan.append(("write", b"stream-%d;" % i))

    async def collect(ep: rdmaio.Endpoint, sink: list[bytes]) -> None:
        async with ep:
            while (msg := await ep.recv()) is not None:
                sink.append(msg)

    async def run(options: dict[str, Any]) -> dict[str, float]:
        received: list[bytes] = []
        done = asyncio.Event()

        async def handler(ep: rdmaio.Endpoint) -> None:
            await collect(ep, received)
            done.set()

        server = await rdmaio.serve(handler, rdma_addr, 0, options=options)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=10, options=options)
            async with ep:
                for op, data in plan:
                    if op == "send":
                        await ep.send(data)
                    else:
                        ep.write(data)  # adjacent stream writes are coalesced into one frame
            stats = ep.statistics()
            await asyncio.wait_for(done.wait(), 120)
        expected: list[bytes] = []
        for i, (op, data) in enumerate(plan):
            if op == "write" and i and plan[i - 1][0] == "write":
                expected[-1] += data
            else:
                expected.append(data)
        assert len(received) == len(expected)
        assert received == expected
        return stats

    async def main() -> None:
        batched = await run({})
        assert batched["protocol_batching"] == 1
        assert batched["protocol_batch_frames_sent"] > 0
        # far fewer frames than messages: many messages shared a frame
        assert batched["frames_posted"] < 0.5 * len(plan)
        plain = await run({"batch_limit": 0})
        assert plain["protocol_batching"] == 0
        assert plain["protocol_batch_frames_sent"] == 0
        assert plain["frames_posted"] >= sum(1 for op, _ in plan if op == "send")

    arun(main())
