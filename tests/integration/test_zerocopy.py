"""Zero-copy large messages in the test host: rendezvous send/recv/recv_into, cancellation,
peer death, the registration bound and MR leaks."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import trio
from loops import Runner, arun  # arun is a fixture used by name
from peer_process import peer_process, wait_ready
from rdma_state import rdma_resources
from traffic import endpoint_pair

import rdmaio
from rdmaio._ffi import lib

MiB = 1 << 20
# A small threshold: most messages of the tests go by rendezvous, the smallest ones eagerly.
OPTIONS: dict[str, Any] = {"rndv_threshold": 64 * 1024, "max_message_size": 80 * MiB}
POOL = random.Random(12).randbytes(64 * MiB)  # random bytes, made once (os.urandom is slow in the VM)


def digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def pair(
    addr: str, server_options: dict[str, Any] | None = None, **options: Any
) -> AbstractAsyncContextManager[tuple[rdmaio.Endpoint, rdmaio.Endpoint]]:
    """(server side, client side) of one connection with this module's options (and ``options``)."""
    return endpoint_pair(addr, {**OPTIONS, **options}, server_options)


def sizes(rng: random.Random, count: int, largest: int) -> list[int]:
    """Log-uniform sizes from 1 B to ``largest`` (always including 1 B and ``largest``)."""
    out = [1, largest]
    out += [int(2 ** rng.uniform(0, largest.bit_length() - 1)) for _ in range(count - 2)]
    rng.shuffle(out)
    return out


async def exchange(sender: rdmaio.Endpoint, receiver: rdmaio.Endpoint, plan: list[int], seed: int) -> None:
    """Send messages of the sizes in ``plan`` (slices of POOL at random offsets); receive them alternately
    with recv(), recv_into() of a buffer large enough, and recv_into() of a reused 64 MiB buffer; compare
    SHA-256 digests."""
    rng = random.Random(seed)
    messages = []
    for size in plan:
        start = rng.randrange(0, len(POOL) - size + 1)
        messages.append(memoryview(POOL)[start : start + size])
    big = bytearray(64 * MiB)

    async def send_all() -> None:
        for message in messages:
            await sender.send(message)

    task = asyncio.ensure_future(send_all())
    for i, message in enumerate(messages):
        mode = i % 3
        if mode == 0:
            got: Any = await receiver.recv()
        elif mode == 1:
            buf = bytearray(len(message))
            n = await receiver.recv_into(buf)
            assert n == len(message)
            got = buf
        else:
            n = await receiver.recv_into(big)
            got = memoryview(big)[:n]
        assert len(got) == len(message), (i, len(got), len(message))
        assert digest(got) == digest(message), (i, len(message), mode)
    await asyncio.wait_for(task, 120)


def registrations_of(ep: rdmaio.Endpoint) -> Any:
    """The registration cache the endpoint's connection pins through: its own where it has a protection
    domain of its own (no memory windows), else its Domain's."""
    transport = ep._conn.transport
    if transport.private_pd:
        assert transport.private_registrations is not None
        return transport.private_registrations
    assert transport.private_registrations is None
    return transport.domain.registrations


def test_random_sizes_send_recv_recv_into(arun: Runner[Any], rdma_addr: str) -> None:
    """Random sizes 1 B - 64 MiB both ways; most go by rendezvous, some eagerly."""

    async def main() -> None:
        async with pair(rdma_addr) as (served, client):
            assert client._conn.rndv is not None and served._conn.rndv is not None  # negotiated
            plan = sizes(random.Random(1), 10, 64 * MiB)
            await exchange(client, served, plan, seed=2)
            await exchange(served, client, sizes(random.Random(3), 6, 8 * MiB), seed=4)
            sent = client.statistics()
            got = served.statistics()
            large = sum(size >= OPTIONS["rndv_threshold"] for size in plan)
            assert large >= 3 and sent["rndv_sent"] + sent.get("rndv_fallback_eager", 0) == large, sent
            assert got["rndv_received"] == sent["rndv_sent"] >= 1, (sent, got)
            assert got["rndv_zero_copy"] >= 1, got  # recv_into() read straight into the caller's buffer
            assert sent["rndv_sending"] == 0 and got["rndv_receiving"] == 0
            # Nothing remotely accessible is left registered once the sends returned: what is reserved
            # outside the cache is the bounce buffers of the endpoints that pin through it, nothing else.
            # A connection pins through its Domain's cache (both endpoints: one Domain), or through its
            # own where it has a protection domain of its own (a device without memory windows, siw).
            by_cache: dict[int, tuple[Any, list[Any]]] = {}
            for ep in (client, served):
                cache = registrations_of(ep)
                by_cache.setdefault(id(cache), (cache, []))[1].extend(ep._conn.rndv._bounces)
            remote = lib.IBV_ACCESS_REMOTE_READ | lib.IBV_ACCESS_REMOTE_WRITE
            for cache, bounces in by_cache.values():
                assert cache.reserved == sum(len(b.buf) for b in bounces)
                assert all(not b.region.access & lib.IBV_ACCESS_REMOTE_READ for b in bounces)
                assert all(not e.region.access & remote for e in cache._entries.values())

    arun(main())


def test_order_mixed_with_eager_and_stream_reads(arun: Runner[Any], rdma_addr: str) -> None:
    """Rendezvous messages keep their place among eager messages and batches; stream reads see them too."""

    async def main() -> None:
        async with pair(rdma_addr) as (served, client):
            plan = [10, 300_000, 5, 1 << 20, 64, 200_000, 0, 70_000]
            payloads = [POOL[i * 7 : i * 7 + n] for i, n in enumerate(plan)]
            for payload in payloads:
                await client.send(payload)
            for payload in payloads[:4]:
                assert await served.recv() == payload
            rest = b"".join(payloads[4:])
            assert await served.readexactly(len(rest)) == rest
            client.write_eof()
            assert await served.recv() is None

    arun(main())


def test_trio_random_sizes(rdma_addr: str) -> None:
    """The same on trio (1 B - 64 MiB), fewer samples."""

    async def main() -> None:
        with trio.fail_after(240):
            ready: list[rdmaio.Endpoint] = []
            accepted = trio.Event()
            done = trio.Event()

            async def handler(ep: rdmaio.Endpoint) -> None:
                ready.append(ep)
                accepted.set()
                await done.wait()

            server = await rdmaio.serve(handler, rdma_addr, 0, options=OPTIONS)
            async with server:
                client = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=30, options=OPTIONS)
                await accepted.wait()
                served = ready[0]
                plan = sizes(random.Random(5), 6, 64 * MiB)
                starts = [min(i, len(POOL) - size) for i, size in enumerate(plan)]
                big = bytearray(64 * MiB)
                async with trio.open_nursery() as nursery:

                    async def send_all() -> None:
                        for start, size in zip(starts, plan, strict=True):
                            await client.send(memoryview(POOL)[start : start + size])

                    nursery.start_soon(send_all)
                    for i, size in enumerate(plan):
                        expected = digest(memoryview(POOL)[starts[i] : starts[i] + size])
                        if i % 2:
                            got = await served.recv()
                            assert got is not None and digest(got) == expected
                        else:
                            n = await served.recv_into(big)
                            assert n == size and digest(memoryview(big)[:n]) == expected
                assert client.statistics()["rndv_sent"] >= 3
                client.abort()
                done.set()

    trio.run(main)


def test_cancellation_storm_never_reads_returned_memory(arun: Runner[Any], rdma_addr: str) -> None:
    """Sends cancelled at random moments; the caller overwrites its buffer right after the cancellation.
    The receiver must deliver every message whole (one fill byte) or not at all, never the overwrite or a
    mix, and the connection must survive."""
    poison = 0xEE
    FINAL = b"the end"

    async def main() -> None:
        # A small receive limit and a slow reader leave descriptors unpulled for a while, so cancellations
        # hit every state: queued, announced but not pulled, being pulled, pulled.
        async with pair(rdma_addr, server_options={"recv_buffer_limit": 256 * 1024}) as (served, client):
            rng = random.Random(7)
            received: list[int] = []

            async def reader() -> None:
                while True:
                    try:
                        message = await asyncio.wait_for(served.recv(), 2.0)
                    except TimeoutError:
                        continue  # a cancelled recv() takes nothing
                    assert message is not None
                    if message == FINAL:
                        return
                    first = message[0]
                    assert first != poison, "the receiver read memory given back to a cancelled sender"
                    assert message.count(first) == len(message), "a cancelled send delivered a mix"
                    received.append(first)
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.uniform(0, 0.05))

            reading = asyncio.ensure_future(reader())
            cancelled = completed = 0
            for i in range(120):
                fill = i % 200 + 1
                buf = bytearray([fill]) * rng.choice((100_000, 300_000, 1 << 20))
                try:
                    await asyncio.wait_for(client.send(buf), rng.uniform(0.0, 0.03))
                    completed += 1
                except TimeoutError:
                    cancelled += 1
                buf[:] = bytes([poison]) * len(buf)  # the caller reuses its buffer at once
            await client.send(FINAL)
            await asyncio.wait_for(reading, 120)
            stats = client.statistics()
            assert cancelled > 0 and completed > 0, (cancelled, completed)
            assert stats["rndv_cancels_sent"] + stats.get("rndv_withdrawn_before_post", 0) > 0, stats
            assert len(received) >= completed
            assert client.statistics()["rndv_sending"] == 0
            # still usable both ways
            await served.send(b"x" * 500_000)
            assert await client.recv() == b"x" * 500_000

    arun(main())


def test_peer_sigkill_mid_transfer_fails_pending_calls(arun: Runner[Any], rdma_addr: str) -> None:
    """The receiving peer never reads (its limit defers the pulls) and is SIGKILLed while our rendezvous
    send() waits for it: the send and a pending recv() fail with ConnectionResetError, promptly."""
    server_code = """
        import asyncio, sys, rdmaio
        async def handler(ep):
            await asyncio.Event().wait()   # never read
        async def main():
            server = await rdmaio.serve(handler, sys.argv[1], 0,
                options={"recv_buffer_limit": 65536, "rndv_threshold": 65536})
            print("READY", server.addresses[0][1], flush=True)
            await server.serve_forever()
        asyncio.run(main())
    """

    async def main() -> None:
        proc = peer_process(server_code, rdma_addr)
        try:
            port = int((await asyncio.to_thread(wait_ready, proc)).split()[1])
            ep = await rdmaio.connect(rdma_addr, port, timeout=10, options=OPTIONS)
            payload = bytearray(4 * MiB)

            async def flood() -> None:
                while True:
                    await ep.send(payload)

            sender = asyncio.ensure_future(flood())
            receiver = asyncio.ensure_future(ep.recv())
            await asyncio.sleep(2.0)
            assert not sender.done() and not receiver.done()
            assert ep.statistics()["rndv_sending"] == 1  # waiting for the peer's DONE
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            done, _ = await asyncio.wait({sender, receiver}, timeout=60)
            assert done == {sender, receiver}, "pending calls hung after the peer died"
            assert time.monotonic() - killed < 30
            assert isinstance(sender.exception(), ConnectionResetError), sender.exception()
            assert isinstance(receiver.exception(), ConnectionResetError), receiver.exception()
            assert ep._conn.transport.domain.registrations.reserved <= 16 * MiB  # the send's region is gone
            await ep.aclose()
        finally:
            proc.kill()
            proc.wait()

    arun(main())


def test_sender_sigkilled_while_we_pull(arun: Runner[Any], rdma_addr: str) -> None:
    """The sending peer is SIGKILLed while we pull its 32 MiB messages: our recv_into() either completes
    with the right bytes or fails with ConnectionResetError, never hangs or returns garbage."""
    client_code = """
        import asyncio, sys, rdmaio
        async def main():
            ep = await rdmaio.connect(sys.argv[1], int(sys.argv[2]), timeout=10,
                                      options={"rndv_threshold": 65536, "max_message_size": 80 << 20})
            data = bytes(range(256)) * (32 * 4096)
            print("READY", flush=True)
            while True:
                await ep.send(data)
        asyncio.run(main())
    """

    async def main() -> None:
        accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()

        async def handler(ep: rdmaio.Endpoint) -> None:
            await accepted.put(ep)
            await ep.wait_closed()  # the server's __aexit__ waits for its handlers

        server = await rdmaio.serve(handler, rdma_addr, 0, options=OPTIONS)
        async with server:
            proc = peer_process(client_code, rdma_addr, str(server.addresses[0][1]))
            try:
                ep = await asyncio.wait_for(accepted.get(), 60)
                await asyncio.to_thread(wait_ready, proc)
                expected = digest(bytes(range(256)) * (32 * 4096))
                buf = bytearray(32 * MiB)
                n = await ep.recv_into(buf)
                assert n == len(buf) and digest(buf) == expected
                pending = asyncio.ensure_future(ep.recv_into(buf))
                await asyncio.sleep(random.Random(9).uniform(0, 0.3))
                proc.send_signal(signal.SIGKILL)
                try:
                    while True:
                        n = await asyncio.wait_for(pending, 60)
                        assert n == len(buf) and digest(buf) == expected
                        pending = asyncio.ensure_future(ep.recv_into(buf))
                except ConnectionResetError:
                    pass
                ep.abort()
            finally:
                proc.kill()
                proc.wait()

    arun(main())


def test_registration_bound_is_never_exceeded(arun: Runner[Any], rdma_addr: str) -> None:
    """max_pinned = 8 MiB shared by both sides of the connection (one Domain): four concurrent senders of
    3 MiB messages; the pinned total never goes above the bound, sends over it fall back to copying. (The
    connection's own share, rndv_send_budget, is the whole bound here: the device's bound is under test.)"""
    bound = 8 * MiB

    async def main() -> None:
        async with pair(rdma_addr, max_pinned=bound, rndv_send_budget=bound) as (served, client):
            cache = client._conn.transport.domain.registrations
            assert cache.max_pinned == bound
            peak = 0
            stop = False

            async def sample() -> None:
                nonlocal peak
                while not stop:
                    peak = max(peak, cache.pinned)
                    await asyncio.sleep(0)

            sampler = asyncio.ensure_future(sample())
            payload = memoryview(POOL)[: 3 * MiB]

            async def sender(k: int) -> None:
                for _ in range(6):
                    await client.send(payload)

            senders = asyncio.gather(*(sender(k) for k in range(4)))
            buf = bytearray(3 * MiB)
            for _ in range(24):
                n = await served.recv_into(buf)
                assert n == len(payload) and buf == payload
                peak = max(peak, cache.pinned)
            await asyncio.wait_for(senders, 120)
            stop = True
            await sampler
            stats = client.statistics()
            assert peak <= bound, (peak, bound)
            assert stats["rndv_sent"] >= 1, stats
            assert stats.get("rndv_fallback_eager", 0) >= 1, stats  # four 3 MiB sends cannot all fit

    arun(main())


def test_no_mr_leak_after_1000_large_sends(rdma_addr: str) -> None:
    """1,000 rendezvous sends of 65 KiB: the kernel's MR count is the same before and after (asyncio only:
    150-180 s per loop in a loaded VM)."""

    async def main() -> None:
        async with pair(rdma_addr) as (served, client):
            payload = memoryview(POOL)[: 65 * 1024]
            buf = bytearray(len(payload))

            async def rounds(n: int) -> None:
                async def send_all() -> None:
                    for _ in range(n):
                        await client.send(payload)

                task = asyncio.ensure_future(send_all())
                for _ in range(n):
                    assert await served.recv_into(buf) == len(payload)
                await task

            await rounds(10)  # warm-up: the cache registers buf once, the bounce pool fills
            before = rdma_resources()["mr"]
            await rounds(1000)
            assert buf == payload
            assert rdma_resources()["mr"] == before
            assert client.statistics()["rndv_sent"] == 1010

    asyncio.run(main())


@pytest.mark.long
def test_random_sizes_long(arun: Runner[Any], rdma_addr: str) -> None:
    """More and larger samples (up to 64 MiB on both loops)."""

    async def main() -> None:
        async with pair(rdma_addr) as (served, client):
            await exchange(client, served, sizes(random.Random(11), 40, 64 * MiB), seed=12)
            await exchange(served, client, sizes(random.Random(13), 40, 64 * MiB), seed=14)

    arun(main())


def test_rendezvous_off_when_either_side_disables_it(rdma_addr: str) -> None:
    """rndv_threshold=0 on one side: not negotiated, large messages go eagerly and still arrive."""

    async def main() -> None:
        async with pair(rdma_addr, server_options={"rndv_threshold": 0}) as (served, client):
            assert client._conn.rndv is None and served._conn.rndv is None
            payload = os.urandom(300_000)
            await client.send(payload)
            assert await served.recv() == payload

    asyncio.run(main())
