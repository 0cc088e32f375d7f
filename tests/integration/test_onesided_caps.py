"""One-sided RDMA where a device lacks what iWARP devices lack (siw, E810, Chelsio: no atomics, no memory
windows, no immediate data), in the test host on rxe with the capability taken away by Options (or, for
write notices, by the engine's flag), on asyncio and uvloop.

* No atomics: atomics raise ``FeatureNotSupportedError`` before anything is posted, whether this side's
  device or the exporter's lacks them (the key says so), and the connection goes on.
* No memory windows: a connection-scoped export raises ``FeatureNotSupportedError`` naming the device;
  ``scope="domain"`` still works; rendezvous sends go by copy.
* No immediate data: a write notice is an RDMA WRITE followed by a control message on the same queue pair.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from loops import Runner, arun  # arun is a fixture used by name

import rdmaio

__all__ = ["arun"]


@asynccontextmanager
async def pair(
    addr: str, server_options: dict[str, Any], client_options: dict[str, Any]
) -> AsyncIterator[tuple[rdmaio.Endpoint, rdmaio.Endpoint]]:
    """One connection: (the server's endpoint, the client's), each side with its own Options."""
    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: rdmaio.Endpoint) -> None:
        await accepted.put(ep)
        await done.wait()

    server = await rdmaio.serve(handler, addr, 0, options=rdmaio.Options(**server_options))
    async with server:
        client = await rdmaio.connect(
            addr, server.addresses[0][1], timeout=30, options=rdmaio.Options(**client_options)
        )
        served = await asyncio.wait_for(accepted.get(), 30)
        try:
            yield served, client
        finally:
            client.abort()
            served.abort()
            done.set()


async def share(
    exporter: rdmaio.Endpoint, importer: rdmaio.Endpoint, key: rdmaio.RemoteKey
) -> rdmaio.RemoteKey:
    await exporter.send(bytes(key))
    return rdmaio.RemoteKey.from_bytes(await asyncio.wait_for(importer.recv(), 30))


async def ping(a: rdmaio.Endpoint, b: rdmaio.Endpoint) -> None:
    await a.send(b"ping")
    assert await asyncio.wait_for(b.recv(), 30) == b"ping"


# --- no atomics ----------------------------------------------------------------------------------------


def test_an_exporter_without_atomics_refuses_them_and_its_keys_say_so(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """The server's device has no atomics (forced): export with "a" raises, its keys carry the flag, the
    client's atomics on them raise FeatureNotSupportedError without posting, the connection goes on."""

    async def main() -> None:
        async with pair(rdma_addr, {"atomics": "off"}, {}) as (server, client):
            memory = bytearray(4096)
            with pytest.raises(rdmaio.FeatureNotSupportedError, match="rxe"):
                server.export(memory, access="rwa")
            key = await share(server, client, server.export(memory, access="rw"))
            assert key.exporter_atomics is False
            for call in (
                client.fetch_add(key, 0, 1),
                client.compare_swap(key, 8, 0, 1),
                client.fetch_add_many(key, [0, 8, 16], 1),
            ):
                with pytest.raises(rdmaio.FeatureNotSupportedError, match="peer's device"):
                    await asyncio.wait_for(call, 30)
            stats = client.statistics()
            assert stats["rdma_fetch_adds"] == stats["rdma_compare_swaps"] == 0
            assert bytes(memory) == bytes(4096)
            await client.rdma_write(key, 0, b"still up")
            assert await client.rdma_read(key, 0, 8) == b"still up" == bytes(memory[:8])
            await ping(client, server)
            await ping(server, client)

    arun(main())


def test_an_importer_without_atomics_refuses_them_before_posting(arun: Runner[Any], rdma_addr: str) -> None:
    """The client's device has no atomics (forced); the server's has and grants them: the client's
    atomics raise FeatureNotSupportedError naming its device, nothing reaches the NIC, the connection goes
    on; the server's own atomics on a key of the client's are refused the same way (the client's key)."""

    async def main() -> None:
        async with pair(rdma_addr, {}, {"atomics": "off"}) as (server, client):
            memory = bytearray(4096)
            key = await share(server, client, server.export(memory, access="rwa"))
            assert key.exporter_atomics is True and key.access == "rwa"
            for _ in range(3):  # the serial path too (a caller that calls one at a time)
                for call in (
                    client.fetch_add(key, 0, 1),
                    client.compare_swap(key, 8, 0, 1),
                    client.fetch_add_many(key, [0, 8], 1),
                ):
                    with pytest.raises(rdmaio.FeatureNotSupportedError, match="rxe"):
                        await asyncio.wait_for(call, 30)
                assert await client.rdma_read(key, 0, 8) == bytes(8)
            stats = client.statistics()
            assert stats["rdma_fetch_adds"] == stats["rdma_compare_swaps"] == 0
            assert bytes(memory) == bytes(4096)
            back = await share(client, server, client.export(bytearray(64), access="rw"))
            with pytest.raises(rdmaio.FeatureNotSupportedError):
                await server.fetch_add(back, 0, 1)
            await ping(client, server)

    arun(main())


def test_atomics_work_by_default(arun: Runner[Any], rdma_addr: str) -> None:
    """The control: the same calls with the device's atomics (rxe has them)."""

    async def main() -> None:
        async with pair(rdma_addr, {}, {}) as (server, client):
            memory = bytearray(64)
            key = await share(server, client, server.export(memory, access="rwa"))
            assert await client.fetch_add(key, 0, 5) == 0
            assert await client.compare_swap(key, 0, 5, 9) == 5
            assert await client.fetch_add_many(key, [8, 8], 1) == [0, 1]

    arun(main())


# --- no memory windows ---------------------------------------------------------------------------------


def test_without_memory_windows_a_connection_scoped_export_raises_and_rendezvous_copies(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """The server's device has no memory windows (forced): export() of the default scope raises
    FeatureNotSupportedError naming the device and what it lacks, nothing registered; scope="domain"
    works; a large message goes by copy, intact, and registers no rendezvous buffer."""

    async def main() -> None:
        async with pair(rdma_addr, {"memory_windows": "off"}, {}) as (server, client):
            memory = bytearray(b"x" * 4096)
            before = server.statistics()["grants"]
            with pytest.raises(rdmaio.FeatureNotSupportedError, match=r"rxe\w* has no memory windows"):
                server.export(memory, access="rw")
            assert server.statistics()["grants"] == before
            key = await share(server, client, server.export(memory, access="rw", scope="domain"))
            assert await client.rdma_read(key, 0, 4) == b"xxxx"
            await server.revoke(key)
            payload = os.urandom(4 << 20)
            sending = asyncio.create_task(server.send(payload))
            received = await asyncio.wait_for(client.recv(), 120)
            await sending
            assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
            assert server.statistics().get("rndv_fallback_eager", 0) >= 1
            await ping(client, server)

    arun(main())


# --- no immediate data ---------------------------------------------------------------------------------


def test_write_notices_by_message_arrive_after_their_data(arun: Runner[Any], rdma_addr: str) -> None:
    """The client's writes with a notice go as RDMA WRITE + control message (forced: rxe has immediate
    data): the server sees every notice, in order, each after its data; notices with immediate data (the
    default form) interleave with them; the connection carries messages on."""

    async def main() -> None:
        async with pair(rdma_addr, {}, {}) as (server, client):
            memory = bytearray(64 * 1024)
            key = await share(server, client, server.export(memory, access="w"))
            client._conn.onesided.write_notice_by_message = True
            rounds = 40
            for i in range(rounds):
                chunk = bytes([i]) * (1000 + i)
                await client.rdma_write(key, i * 1024, chunk, imm=i)
                notice = await asyncio.wait_for(server.wait_write_notice(), 30)
                assert notice == rdmaio.WriteNotice(len(chunk), i)
                assert memory[i * 1024 : i * 1024 + len(chunk)] == chunk  # the data is there first
            # Many in flight at once (doorbells, credits), then both forms interleaved.
            await asyncio.gather(
                *(client.rdma_write(key, 8 * j, b"%08d" % j, imm=1000 + j) for j in range(32))
            )
            got = [await asyncio.wait_for(server.wait_write_notice(), 30) for _ in range(32)]
            assert sorted(n.imm for n in got) == list(range(1000, 1032))
            assert all(n.length == 8 for n in got)
            for j, by_message in enumerate([False, True] * 4):
                client._conn.onesided.write_notice_by_message = by_message
                await client.rdma_write(key, 0, b"mixed", imm=2000 + j)
            got = [await asyncio.wait_for(server.wait_write_notice(), 30) for _ in range(8)]
            assert [n.imm for n in got] == list(range(2000, 2008))
            assert server.statistics()["write_notices"] == rounds + 32 + 8
            assert server.statistics()["write_notices_by_message"] == rounds + 32 + 4
            await ping(client, server)
            await ping(server, client)

    arun(main())
