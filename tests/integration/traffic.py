"""Traffic helpers: one connected pair of endpoints, and mixed-size message traffic both ways on one endpoint,
checked by digest (shared CQ and SRQ tests)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import rdmaio


@asynccontextmanager
async def endpoint_pair(
    addr: str, options: dict[str, Any], server_options: dict[str, Any] | None = None
) -> AsyncIterator[tuple[rdmaio.Endpoint, rdmaio.Endpoint]]:
    """(server side, client side) of one connection on this asyncio loop; the server side also gets
    ``server_options`` over ``options``. Both are aborted on exit."""
    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: rdmaio.Endpoint) -> None:
        await accepted.put(ep)
        await done.wait()

    server = await rdmaio.serve(handler, addr, 0, options={**options, **(server_options or {})})
    async with server:
        client = await rdmaio.connect(addr, server.addresses[0][1], timeout=30, options=options)
        served = await asyncio.wait_for(accepted.get(), 30)
        try:
            yield served, client
        finally:
            client.abort()
            served.abort()
            done.set()


def payloads(seed: int, count: int) -> list[bytes]:
    """Mixed sizes: batched small messages, single frames and fragmented large ones."""
    rng = random.Random(seed)
    sizes = [rng.choice((1, 100, 3000, 8000, 20000)) for _ in range(count)]
    return [rng.randbytes(size) for size in sizes]


async def exchange(ep: rdmaio.Endpoint, seed: int, count: int) -> tuple[str, str]:
    """Send ``count`` messages and receive as many (an echo peer returns them); the two SHA-256 digests."""
    sent, received = hashlib.sha256(), hashlib.sha256()

    async def send_all() -> None:
        for data in payloads(seed, count):
            sent.update(data)
            await ep.send(data)

    async def recv_all() -> None:
        for _ in range(count):
            msg = await ep.recv()
            assert msg is not None
            received.update(msg)

    await asyncio.gather(send_all(), recv_all())
    return sent.hexdigest(), received.hexdigest()
