"""Traffic helpers: one connected pair of endpoints, several clients of one server, mixed-size message traffic
both ways on one endpoint, checked by digest (shared CQ and SRQ tests), and the one-sided helpers several
modules share (a key handed over, a refused WRITE as each provider reports it)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

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


@asynccontextmanager
async def server_and_clients(
    addr: str,
    clients: int,
    options: dict[str, Any] | None = None,
    server_options: dict[str, Any] | None = None,
    client_options: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[list[rdmaio.Endpoint], list[rdmaio.Endpoint]]]:
    """``clients`` connections to one server on this asyncio loop: (the server's endpoints, the clients'),
    in connection order. Both sides take ``options``, the server ``server_options`` and the clients
    ``client_options`` over them; all are aborted on exit."""
    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: rdmaio.Endpoint) -> None:
        await accepted.put(ep)
        await done.wait()

    both = options or {}
    server = await rdmaio.serve(
        handler, addr, 0, options=rdmaio.Options(**{**both, **(server_options or {})})
    )
    client = rdmaio.Options(**{**both, **(client_options or {})})
    served: list[rdmaio.Endpoint] = []
    connected: list[rdmaio.Endpoint] = []
    async with server:
        try:
            for _ in range(clients):
                port = server.addresses[0][1]
                connected.append(await rdmaio.connect(addr, port, timeout=30, options=client))
                served.append(await asyncio.wait_for(accepted.get(), 30))
            yield served, connected
        finally:
            for ep in connected + served:
                ep.abort()
            done.set()


async def share(
    exporter: rdmaio.Endpoint, importer: rdmaio.Endpoint, key: rdmaio.RemoteKey
) -> rdmaio.RemoteKey:
    """Hand ``key`` from the exporter to the importer as a message; the importer's copy."""
    await exporter.send(bytes(key))
    return rdmaio.RemoteKey.from_bytes(await asyncio.wait_for(importer.recv(), 30))


async def ping(a: rdmaio.Endpoint, b: rdmaio.Endpoint) -> None:
    """A message from ``a`` arrives at ``b``: the connection works."""
    await a.send(b"ping")
    assert await asyncio.wait_for(b.recv(), 30) == b"ping"


async def refused_write(
    imp: rdmaio.Endpoint,
    key: rdmaio.RemoteKey,
    offset: int,
    data: bytes,
    provider: str,
    refused: type[BaseException] = rdmaio.RemoteAccessError,
) -> None:
    """A write the exporter's NIC refuses. On RoCE the refusal is the write's own completion (``refused``,
    a RemoteAccessError). On iWARP an RDMA WRITE completes once sent, with no acknowledgement from the
    responder: the refusal is a TERMINATE that ends the connection, which the next operation sees."""
    if provider == "rxe":
        with pytest.raises(refused):
            await asyncio.wait_for(imp.rdma_write(key, offset, data), 30)
        return
    with contextlib.suppress(rdmaio.RemoteAccessError):
        await asyncio.wait_for(imp.rdma_write(key, offset, data), 30)
    with pytest.raises((rdmaio.EndpointClosedError, ConnectionError, rdmaio.RemoteAccessError)):
        await asyncio.wait_for(imp.rdma_read(key, 0, 8), 30)


async def refused_read(
    imp: rdmaio.Endpoint,
    key: rdmaio.RemoteKey,
    offset: int,
    length: int,
    provider: str,
    refused: type[BaseException] = rdmaio.RemoteAccessError,
) -> None:
    """A READ the exporter's NIC refuses: it fails on every provider, and the connection with it. On RoCE
    the refusal is the READ's own completion (``refused``, a RemoteAccessError). On iWARP the responder
    answers with a TERMINATE that moves the queue pair to the error state: the READ is flushed (the
    connection's error)."""
    read = imp.rdma_read(key, offset, length)
    if provider == "rxe":
        with pytest.raises(refused):
            await asyncio.wait_for(read, 30)
        return
    with pytest.raises((rdmaio.EndpointClosedError, ConnectionError, rdmaio.RemoteAccessError)):
        await asyncio.wait_for(read, 30)


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
