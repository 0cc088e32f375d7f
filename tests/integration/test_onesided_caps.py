"""One-sided RDMA where a device lacks what iWARP devices lack (siw, E810, Chelsio: no atomics, no memory
windows, no immediate data), in the test host on rxe with the capability taken away by Options (or, for
write notices, by the engine's flag), on asyncio and uvloop.

* No atomics: atomics raise ``FeatureNotSupportedError`` before anything is posted, whether this side's
  device or the exporter's lacks them (the key says so), and the connection goes on.
* No memory windows: each connection has a protection domain of its own; an export (its region's own
  rkey) reaches its connection only, is bounded by its region and revoked by deregistering it; rendezvous
  buffers likewise. With a shared receive queue (shared PD) a connection-scoped export raises
  ``FeatureNotSupportedError`` naming the device.
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
from traffic import ping, refused_read, refused_write, server_and_clients, share

import rdmaio
from rdmaio.core.onesided import ACCESS_READ, ACCESS_WRITE

__all__ = ["arun"]


@asynccontextmanager
async def pair(
    addr: str, server_options: dict[str, Any], client_options: dict[str, Any]
) -> AsyncIterator[tuple[rdmaio.Endpoint, rdmaio.Endpoint]]:
    """One connection: (the server's endpoint, the client's), each side with its own Options."""
    async with server_and_clients(addr, 1, server_options=server_options, client_options=client_options) as (
        (served,),
        (client,),
    ):
        yield served, client


def device_of(ep: rdmaio.Endpoint) -> str:
    """The name of the endpoint's device (rxe0, siw0): the errors of what it lacks name it."""
    name: str = ep._conn.transport.device.name
    return name


# --- no atomics ----------------------------------------------------------------------------------------


def test_an_exporter_without_atomics_refuses_them_and_its_keys_say_so(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """The server's device has no atomics (forced): export with "a" raises, its keys carry the flag, the
    client's atomics on them raise FeatureNotSupportedError without posting, the connection goes on."""

    async def main() -> None:
        async with pair(rdma_addr, {"atomics": "off"}, {}) as (server, client):
            memory = bytearray(4096)
            with pytest.raises(rdmaio.FeatureNotSupportedError, match=device_of(server)):
                server.export(memory, access="rwa")
            key = await share(server, client, server.export(memory, access="rw"))
            assert key.exporter_atomics is False
            for call in (
                client.fetch_add(key, 0, 1),
                client.compare_swap(key, 8, 0, 1),
                client.fetch_add_many(key, [0, 8, 16], 1),
            ):
                # On rxe (atomics forced off on the server only) the key's flag; on siw the client's own
                # device already lacks them (checked first).
                with pytest.raises(
                    rdmaio.FeatureNotSupportedError, match=f"peer's device|{device_of(client)}"
                ):
                    await asyncio.wait_for(call, 30)
            stats = client.statistics()
            assert stats["rdma_fetch_adds"] == stats["rdma_compare_swaps"] == 0
            assert bytes(memory) == bytes(4096)
            await client.rdma_write(key, 0, b"still up")
            assert await client.rdma_read(key, 0, 8) == b"still up" == bytes(memory[:8])
            await ping(client, server)
            await ping(server, client)

    arun(main())


@pytest.mark.requires_atomics  # the exporter needs atomics; the importer turns them off
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
                    with pytest.raises(rdmaio.FeatureNotSupportedError, match=device_of(client)):
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


@pytest.mark.requires_atomics
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


def forged(key: rdmaio.RemoteKey, key_id: int = 1) -> rdmaio.RemoteKey:
    """What a client that learnt (or guessed) another connection's address and rkey would use."""
    return rdmaio.RemoteKey(key.addr, key.rkey, key.length, ACCESS_READ | ACCESS_WRITE, key_id)


def test_without_memory_windows_an_export_reaches_its_own_connection_only(
    arun: Runner[Any], rdma_addr: str, provider: str
) -> None:
    """The server's connections have no memory windows (forced): each has a protection domain of its
    own. A's export works through A's connection with the local bounds checks; B, another connection of
    the same server process, presenting A's address and rkey is refused by the NIC (its connection
    fails) and A's memory is unchanged; after revoke the NIC refuses A's rkey too."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 2, server_options={"memory_windows": "off"}) as (
            (to_a, to_b),
            (a, b),
        ):
            transports = to_a._conn.transport, to_b._conn.transport
            assert all(t.private_pd for t in transports)
            assert transports[0].pd is not transports[1].pd is not transports[0].domain.pd
            secret = os.urandom(8192)
            memory = bytearray(secret)
            key = await share(to_a, a, to_a.export(memory, 1024, 4096, access="rw"))
            grant = to_a._conn.onesided.grants[key.key_id]
            assert grant.scoped is None and grant.mr.rkey == key.rkey and grant.mr.length == 4096
            assert await a.rdma_read(key, 0, 16) == secret[1024:1040]
            await a.rdma_write(key, 4090, b"edge!!")
            assert memory[1024 + 4090 : 1024 + 4096] == b"edge!!"
            for call in (a.rdma_read(key, 4090, 7), a.rdma_write(key, -1, b"x"), a.rdma_read(key, 4096, 1)):
                with pytest.raises(rdmaio.RemoteAccessError):
                    await call
            expected = bytes(memory)
            # B (the same server process, the same device, its own PD) with A's address and rkey.
            # On iWARP B's WRITE completes unacknowledged: the refusal ends B's connection.
            await refused_write(b, forged(key), 0, b"\xee" * 4096, provider, rdmaio.RemoteAccessRefusedError)
            assert bytes(memory) == expected  # B's write never landed
            assert await a.rdma_read(key, 0, 16) == secret[1024:1040]  # A's connection is untouched
            await ping(a, to_a)
            with pytest.raises(rdmaio.FeatureNotSupportedError, match="scope='domain'"):
                to_a.export(memory, access="r", scope="domain")
            # Revoked: the MR is deregistered after the importer's ACK; A's key fails locally, and the
            # same rkey under a key id A never saw revoked reaches the NIC, which refuses it.
            await asyncio.wait_for(to_a.revoke(key), 30)
            assert grant.mr.closed
            with pytest.raises(rdmaio.RemoteKeyRevokedError):
                await a.rdma_read(key, 0, 16)
            await refused_write(
                a, forged(key, key.key_id + 1), 0, b"\xee" * 16, provider, rdmaio.RemoteAccessRefusedError
            )
            assert bytes(memory) == expected

    arun(main())


def test_without_memory_windows_rendezvous_reads_through_its_own_connection_only(
    arun: Runner[Any], rdma_addr: str, provider: str
) -> None:
    """Large messages from a server without memory windows (forced) go by rendezvous from its buffer
    registered in the connection's own PD: B cannot read it with the descriptor's address and rkey; A
    pulls it intact (SHA-256); the connection's registrations are released with it."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 2, server_options={"memory_windows": "off"}) as (
            (to_a, _),
            (a, b),
        ):
            rndv = a._conn.rndv
            assert rndv is not None
            rndv.kick = lambda: None  # A leaves the message unpulled (test only)
            payload = os.urandom(4 << 20)
            sending = asyncio.create_task(to_a.send(payload))
            for _ in range(3000):
                if rndv.recvs.active:
                    break
                await asyncio.sleep(0.01)
            (msg,) = rndv.recvs.active.values()
            desc = msg.desc
            assert desc.length == len(payload) and not sending.done()
            stolen = rdmaio.RemoteKey(desc.addr, desc.rkey, desc.length, ACCESS_READ, 1)
            await refused_read(b, stolen, 0, 4096, provider, rdmaio.RemoteAccessRefusedError)
            del rndv.kick  # back to the class's: A pulls now
            received = await asyncio.wait_for(a.recv(), 120)
            await asyncio.wait_for(sending, 60)
            assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
            stats = to_a.statistics()
            assert stats.get("rndv_fallback_eager", 0) == 0 and stats.get("mw_binds", 0) == 0
            # A large message the other way (by rendezvous, from a buffer A scopes with a window where its
            # device has them, else in its own PD): the server pulls it with RDMA READ into memory
            # registered in its own PD (in the shared one the READ would fail).
            back = os.urandom(2 << 20)
            sent = asyncio.create_task(a.send(back))
            got = await asyncio.wait_for(to_a.recv(), 120)
            await asyncio.wait_for(sent, 60)
            assert hashlib.sha256(got).digest() == hashlib.sha256(back).digest()
            assert a.statistics().get("rndv_fallback_eager", 0) == 0
            if provider == "rxe":
                assert a.statistics()["mw_binds"] >= 1
            else:  # no windows on A's device either (iWARP): its buffer is scoped by its own PD
                assert a._conn.transport.private_pd and a.statistics().get("mw_binds", 0) == 0
            assert to_a.statistics()["rdma_reads"] >= 1

    arun(main())


def test_a_connection_scoped_export_on_a_shared_receive_queue_without_windows_says_what_is_missing(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """With a shared receive queue the connection keeps the device's shared PD (the SRQ lives there):
    without memory windows a connection-scoped export raises FeatureNotSupportedError naming the device
    and what it lacks; scope="domain" works; large messages go by copy."""

    async def main() -> None:
        opts = {"memory_windows": "off", "shared_receive_queue": True}
        async with pair(rdma_addr, opts, {}) as (server, client):
            assert server._conn.transport.private_pd is False
            memory = bytearray(b"x" * 4096)
            with pytest.raises(
                rdmaio.FeatureNotSupportedError, match=f"{device_of(server)} has no memory windows"
            ):
                server.export(memory, access="rw")
            key = await share(server, client, server.export(memory, access="rw", scope="domain"))
            assert await client.rdma_read(key, 0, 4) == b"xxxx"
            await server.revoke(key)
            payload = os.urandom(1 << 20)
            sending = asyncio.create_task(server.send(payload))
            received = await asyncio.wait_for(client.recv(), 120)
            await sending
            assert received == payload
            assert server.statistics().get("rndv_fallback_eager", 0) >= 1

    arun(main())


# --- no immediate data ---------------------------------------------------------------------------------


def test_write_notices_by_message_arrive_after_their_data(
    arun: Runner[Any], rdma_addr: str, provider: str
) -> None:
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
            # (The immediate form exists only where both devices have immediate data: not on iWARP.)
            forms = [False, True] * 4 if provider == "rxe" else [True] * 8
            for j, by_message in enumerate(forms):
                client._conn.onesided.write_notice_by_message = by_message
                await client.rdma_write(key, 0, b"mixed", imm=2000 + j)
            got = [await asyncio.wait_for(server.wait_write_notice(), 30) for _ in range(8)]
            assert [n.imm for n in got] == list(range(2000, 2008))
            assert server.statistics()["write_notices"] == rounds + 32 + 8
            assert server.statistics()["write_notices_by_message"] == rounds + 32 + sum(forms)
            await ping(client, server)
            await ping(server, client)

    arun(main())
