"""The header framing on a real device (test host, rxe; asyncio and uvloop): frames as plain SENDs with a
4-byte header, as on iWARP devices, forced here with ``Options.framing = "header"`` on both sides or on one
side only (the other must follow: a mixed pair interoperates).

Echo of sizes across the slot boundary (a slot carries slot_size - 4 bytes of a frame) and of batched small
messages, stream bytes, zero-copy rendezvous from 1 B to a few MiB with SHA-256, and the asyncio-streams
and anyio drop-ins; the framing shows in ``get_extra_info("framing")`` and in the path record's features.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any

import anyio
import pytest
from loops import Runner, arun  # arun is a fixture used by name
from traffic import endpoint_pair

import rdmaio
import rdmaio.anyio
import rdmaio.streams

SLOT = 4096
HEADER = 4
MiB = 1 << 20
BASE: dict[str, Any] = {"slot_size": SLOT, "max_message_size": 8 * MiB, "keepalive_interval": None}
#: Who forces the header framing: both sides, only the client, only the server.
MODES = {
    "both": ({"framing": "header"}, {"framing": "header"}),
    "client-only": ({"framing": "header"}, {"framing": "auto"}),
    "server-only": ({"framing": "auto"}, {"framing": "header"}),
}
POOL = random.Random(29).randbytes(4 * MiB + 17)

__all__ = ["arun"]


def _options(mode: str, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(client options, server options) of ``mode``."""
    client, server = MODES[mode]
    return {**BASE, **extra, **client}, {**BASE, **extra, **server}


async def _check_header_framing(*endpoints: rdmaio.Endpoint) -> None:
    for ep in endpoints:
        assert ep.get_extra_info("framing") == "header"
        path = ep.get_extra_info("rdma")
        assert path is not None and "header-framing" in path.features, path


@pytest.mark.parametrize("mode", sorted(MODES))
def test_echo_across_the_slot_boundary_and_batches(arun: Runner[None], rdma_addr: str, mode: str) -> None:
    """Every size from slot_size - 4 - 4 to slot_size + 4 (one frame, then two), batched small messages,
    in both directions; both sides end up in the header framing whoever forced it."""
    client_opts, server_opts = _options(mode, rndv_threshold=0)

    async def main() -> None:
        async with endpoint_pair(rdma_addr, client_opts, server_opts) as (served, client):
            await _check_header_framing(served, client)
            sizes = [*range(SLOT - HEADER - 4, SLOT + 5), 0, 1, 3 * SLOT + 1]
            messages = [POOL[n : 2 * n] if n else b"" for n in sizes]
            messages += [bytes([i]) * (i % 40) for i in range(200)]  # DATA_BATCH frames
            for message in messages:
                await client.send(message)
            for message in messages:
                got = await asyncio.wait_for(served.recv(), 60)
                assert got == message, (len(got), len(message))
                await served.send(got)  # echo
            for message in messages:
                assert await asyncio.wait_for(client.recv(), 60) == message
            stats = client.statistics()
            assert stats["messages_sent"] == stats["messages_received"] == len(messages)

    arun(main())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_stream_bytes_and_eof(arun: Runner[None], rdma_addr: str, mode: str) -> None:
    client_opts, server_opts = _options(mode, rndv_threshold=0)
    data = POOL[: 3 * MiB + 5]

    async def main() -> None:
        async with endpoint_pair(rdma_addr, client_opts, server_opts) as (served, client):
            await _check_header_framing(client)

            async def write() -> None:
                view = memoryview(data)
                for start in range(0, len(data), 65536 + 3):
                    client.write(view[start : start + 65536 + 3])
                    await client.drain()
                client.write_eof()
                await client.drain()

            writer = asyncio.ensure_future(write())
            got = await asyncio.wait_for(served.read(), 120)
            await writer
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()

    arun(main())


@pytest.mark.parametrize("mode", ["both", "client-only"])
def test_rendezvous_sizes_with_sha256(arun: Runner[None], rdma_addr: str, mode: str) -> None:
    """Zero-copy messages (RNDV descriptors in header-framed SENDs, data by RDMA READ) from 1 B to 4 MiB."""
    client_opts, server_opts = _options(mode, rndv_threshold=16 * 1024)
    sizes = [1, 1000, SLOT - HEADER, SLOT, 16 * 1024, 100_000, MiB + 3, 4 * MiB]

    async def main() -> None:
        async with endpoint_pair(rdma_addr, client_opts, server_opts) as (served, client):
            await _check_header_framing(served)

            async def send_all() -> None:
                for n in sizes:  # a rendezvous send returns once the peer pulled it: read meanwhile
                    await client.send(POOL[:n])

            sender = asyncio.ensure_future(send_all())
            for n in sizes:
                got = await asyncio.wait_for(served.recv(), 120)
                assert hashlib.sha256(got).hexdigest() == hashlib.sha256(POOL[:n]).hexdigest(), n
            await asyncio.wait_for(sender, 120)
            assert served.statistics()["messages_received"] == len(sizes)

    arun(main())


@pytest.mark.parametrize("mode", ["both", "server-only"])
def test_asyncio_streams_drop_in(arun: Runner[None], rdma_addr: str, mode: str) -> None:
    client_opts, server_opts = _options(mode)

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                writer.write(line.upper())
                await writer.drain()
            writer.close()

        server = await rdmaio.streams.start_server(handle, rdma_addr, 0, options=server_opts)
        async with server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await rdmaio.streams.open_connection(rdma_addr, port, options=client_opts)
            lines = [b"x" * n + b"\n" for n in (0, 10, SLOT - HEADER - 1, SLOT, 3 * SLOT)]
            for line in lines:
                writer.write(line)
            await writer.drain()
            for line in lines:
                assert await asyncio.wait_for(reader.readline(), 60) == line.upper()
            assert writer.get_extra_info("framing") == "header"
            writer.close()
            await writer.wait_closed()

    arun(main())


@pytest.mark.parametrize("mode", ["both", "client-only"])
def test_anyio_drop_in(arun: Runner[None], rdma_addr: str, mode: str) -> None:
    client_opts, server_opts = _options(mode)
    data = POOL[:200_000]

    async def main() -> None:
        listener = await rdmaio.anyio.create_listener(rdma_addr, 0, options=server_opts)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def echo(stream: Any) -> None:
            async with stream:
                got = bytearray()
                while len(got) < len(data):
                    got += await stream.receive()
                await stream.send(bytes(got))

        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, echo)
            stream = await rdmaio.anyio.connect(rdma_addr, port, options=client_opts)
            async with stream:
                await stream.send(data)
                back = bytearray()
                with anyio.fail_after(60):
                    while len(back) < len(data):
                        back += await stream.receive()
                assert bytes(back) == data
            tg.cancel_scope.cancel()
        await listener.aclose()

    arun(main())
