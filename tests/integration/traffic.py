"""Mixed-size message traffic both ways on one endpoint, checked by digest (shared CQ and SRQ tests)."""

from __future__ import annotations

import asyncio
import hashlib
import random

import rdmaio


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
