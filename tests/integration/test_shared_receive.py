"""Options(shared_receive_queue=True): every connection of a device and loop takes its receives
from one SRQ, with credits lent from the shared pool (rdmaio.core.shared_receive). Both ends of each
connection run in this process, so both draw from the same pool: 100 endpoints on one SRQ.

rdmaio's QPs use rnr_retry_count 1 (Options.rnr_retry_count, not 7 = infinite): a SEND that met an empty
SRQ would fail its connection with RNR_RETRY_EXC_ERR (test_srq.py shows it does), so every exchange that
completes here is also a check that no credit overran the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
from typing import Any

import traffic
from loops import Runner, arun

import rdmaio
from rdmaio.core.rings import POOL_LINGER

__all__ = ["arun"]

OPTIONS = rdmaio.Options(
    slot_size=8192,
    recv_depth=16,
    send_depth=16,
    signal_interval=4,
    shared_receive_queue=True,
    srq_max_buffers=1024,
)
CONNECTIONS = 50
MESSAGES = 40


async def echo(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


async def exchange(ep: rdmaio.Endpoint, seed: int, count: int = MESSAGES) -> tuple[str, str]:
    return await traffic.exchange(ep, seed, count)


def pool_of(ep: rdmaio.Endpoint) -> Any:
    pool = ep._conn.transport.domain.shared_receive
    assert pool is not None
    return pool


def test_echo_over_50_connections_on_one_shared_receive_queue(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> dict[str, Any]:
        server = await rdmaio.serve(echo, rdma_addr, 0, options=OPTIONS)
        async with server:
            port = server.addresses[0][1]
            clients = await asyncio.gather(
                *(rdmaio.connect(rdma_addr, port, options=OPTIONS, timeout=60) for _ in range(CONNECTIONS))
            )
            pool = pool_of(clients[0])
            assert all(pool_of(ep) is pool for ep in clients)
            during = pool.statistics()
            pool.ledger.check()
            results = await asyncio.gather(*(exchange(ep, i) for i, ep in enumerate(clients)))
            for sent, received in results:
                assert sent == received
            pool.ledger.check()
            busy = pool.statistics()
            windows = [ep._conn.session.recv_depth for ep in clients]
            returned = sum(ep._conn.session.statistics()["credits_returned_received"] for ep in clients)
            for ep in clients:
                await ep.aclose()
            for _ in range(200):
                if pool.statistics()["connections"] == 0:
                    break
                await asyncio.sleep(0.05)
            after = pool.statistics()
            pool.ledger.check()
        return {"during": during, "busy": busy, "after": after, "windows": windows, "returned": returned}

    result = arun(main())
    print(result)
    during, busy, after = result["during"], result["busy"], result["after"]
    assert during["connections"] == 2 * CONNECTIONS  # both ends of every connection
    assert during["buffers"] >= 4 * 2 * CONNECTIONS  # every reserve is really posted
    assert busy["buffers"] <= OPTIONS.srq_max_buffers
    assert after["connections"] == 0
    assert after["posted"] == after["buffers"] == after["free"]  # every buffer back on the SRQ, none lent


def test_registered_bytes_per_idle_connection_with_and_without_the_srq(rdma_addr: str) -> None:
    """Connections that were busy one after the other, then idle: per-connection rings keep what they grew
    to; the shared pool keeps the reserves plus what one busy connection at a time needed."""

    async def run(options: rdmaio.Options) -> float:
        server = await rdmaio.serve(echo, rdma_addr, 0, options=options)
        async with server:
            port = server.addresses[0][1]
            clients = [await rdmaio.connect(rdma_addr, port, options=options, timeout=60) for _ in range(12)]
            for i, ep in enumerate(clients):  # one busy connection at a time: windows grow
                sent, received = await exchange(ep, i, 150)
                assert sent == received
                await asyncio.sleep(2.5 if options.shared_receive_queue else 0)  # idle ticks shrink windows
            await asyncio.sleep(POOL_LINGER + 1)
            total = sum(ep.statistics()["registered_bytes"] for ep in clients)
            total += sum(ep.statistics()["registered_bytes"] for ep in server._clients)
            if options.shared_receive_queue:
                total += pool_of(clients[0]).registered_bytes
            for ep in clients:
                await ep.aclose()
            return total / len(clients)

    base = rdmaio.Options(slot_size=8192, recv_depth=64, send_depth=16, signal_interval=4)
    without = asyncio.run(run(base))
    shared = asyncio.run(run(dataclasses.replace(base, shared_receive_queue=True)))
    print(
        "registered bytes per idle connection (both ends): "
        f"rings {without:.0f}, shared receive queue {shared:.0f}"
    )
    assert shared < without


def test_plain_client_large_messages_and_back_pressure_on_a_shared_receive_queue(rdma_addr: str) -> None:
    """The server uses the SRQ, the client does not (no FEATURE_RECLAIM: its window on the pool stays as
    opened); a rendezvous message, then a slow reader holding SRQ buffers for back-pressure, then close:
    every buffer goes back to the SRQ."""
    server_options = dataclasses.replace(OPTIONS, recv_buffer_limit=16 * 1024)
    client_options = rdmaio.Options(slot_size=8192, recv_depth=16, send_depth=16, signal_interval=4)
    big = random.Random(7).randbytes(1 << 20)
    held: list[float] = []

    async def slow_echo(ep: rdmaio.Endpoint) -> None:
        async with ep:
            first = await ep.recv()
            assert first == big
            await ep.send(hashlib.sha256(first).digest())
            await asyncio.sleep(1.0)  # the client keeps writing: our buffer fills, SRQ buffers are held
            held.append(ep.statistics()["recv_held_slots"])
            total = 0
            while chunk := await ep.read(65536):
                total += len(chunk)
            await ep.send(total.to_bytes(8, "little"))

    async def main() -> tuple[dict[str, int], dict[str, int], int]:
        server = await rdmaio.serve(slow_echo, rdma_addr, 0, options=server_options)
        async with server:
            port = server.addresses[0][1]
            ep = await rdmaio.connect(rdma_addr, port, options=client_options, timeout=60)
            await ep.send(big)
            assert await ep.recv() == hashlib.sha256(big).digest()
            (served,) = server._clients
            pool = pool_of(served)
            assert not served._conn.session.reclaim  # the client did not announce FEATURE_RECLAIM
            for _ in range(200):
                ep.write(b"x" * 5000)
                await ep.drain()
            during = pool.statistics()
            ep.write_eof()
            count = int.from_bytes(await ep.recv() or b"", "little")
            await ep.aclose()
            for _ in range(200):
                if pool.statistics()["connections"] == 0:
                    break
                await asyncio.sleep(0.05)
            pool.ledger.check()
            return during, pool.statistics(), count

    during, after, count = asyncio.run(main())
    print(during, after, "held", held)
    assert count == 200 * 5000
    assert held and held[0] > 0  # back-pressure really held shared buffers
    assert during["connections"] == 1
    assert after["connections"] == 0 and after["posted"] == after["buffers"] == after["free"]
