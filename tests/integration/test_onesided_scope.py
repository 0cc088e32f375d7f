"""Key scope and revocation races of one-sided RDMA in the test host.

A key works through the connection that exported it only (a type 2 memory window bound on its queue
pair): another connection of the same process, sharing the protection domain, is refused by the NIC, for
grants and for rendezvous buffers alike. Calls collected for a doorbell when a REVOKE arrives fail with
``RemoteKeyRevokedError`` instead of reaching the NIC after the REVOKE_ACK. The importer's memory of
revoked key ids stays bounded.

The tests of scoping by windows need them (``requires_memory_windows``: deselected on iWARP, where a
connection has a protection domain of its own instead, which test_onesided_caps covers).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from loops import Runner, arun  # arun is a fixture used by name
from rdma_state import rdma_resources
from traffic import ping, server_and_clients, share

import rdmaio
from rdmaio.core.onesided import ACCESS_READ, ACCESS_WRITE, RemoteKey
from rdmaio.core.onesided.exporter import CTL_REVOKE

__all__ = ["arun"]


def forged(addr: int, rkey: int, length: int, bits: int = ACCESS_READ | ACCESS_WRITE) -> RemoteKey:
    """What a client that learnt (or guessed) another connection's address and rkey would use."""
    return RemoteKey(addr, rkey, length, bits, 1)


@pytest.mark.requires_memory_windows
def test_a_grant_works_through_its_own_connection_only(arun: Runner[Any], rdma_addr: str) -> None:
    """Client B (and B2) read and write with client A's address and rkey: B's NIC gets a remote access
    error, A's memory stays as it was, and A's own access still works."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 3) as (served, (a, b, b2)):
            to_a, to_b, to_b2 = served
            secret = os.urandom(8192)
            buf = bytearray(secret)
            key = await share(to_a, a, to_a.export(buf, access="rw"))
            assert await a.rdma_read(key, 0, 16) == secret[:16]  # A's own access works

            with pytest.raises(rdmaio.RemoteAccessRefusedError):
                await asyncio.wait_for(b.rdma_read(forged(key.addr, key.rkey, key.length), 0, 4096), 30)
            with pytest.raises(rdmaio.RemoteAccessRefusedError):
                await asyncio.wait_for(
                    b2.rdma_write(forged(key.addr, key.rkey, key.length), 0, b"\xee" * 4096), 30
                )
            assert bytes(buf) == secret  # B2's write never landed
            # A's connection and key are untouched by B's failures.
            await a.rdma_write(key, 0, b"from A")
            assert buf[:6] == b"from A"
            assert await a.rdma_read(key, 0, 6) == b"from A"
            await ping(a, to_a)
            # The grant's own region opens nothing remotely: its rkey (of the MR) is refused too.
            grant = to_a._conn.onesided.grants[key.key_id]
            assert grant.scoped is not None and grant.mr.rkey != key.rkey
            assert not grant.mr.access & (
                rdmaio.verbs.lib.IBV_ACCESS_REMOTE_READ | rdmaio.verbs.lib.IBV_ACCESS_REMOTE_WRITE
            )
            assert to_b.statistics()["grants"] == to_b2.statistics()["grants"] == 0

    arun(main())


@pytest.mark.requires_memory_windows
def test_a_domain_scoped_grant_is_what_the_caller_asked_for(rdma_addr: str) -> None:
    """scope="domain" keeps the process-wide grant, by name: another connection can use it."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 2) as ((to_a, _), (a, b)):
            buf = bytearray(b"shared" * 100)
            key = await share(to_a, a, to_a.export(buf, access="r", scope="domain"))
            assert await b.rdma_read(forged(key.addr, key.rkey, key.length, ACCESS_READ), 0, 6) == b"shared"
            with pytest.raises(ValueError):
                to_a.export(buf, scope="process")
            await to_a.revoke(key)

    asyncio.run(main())


@pytest.mark.requires_memory_windows
def test_a_rendezvous_buffer_is_readable_through_its_connection_only(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """The server sends A a large message by rendezvous; while A has not pulled it, B reads with the
    descriptor's address and rkey: refused. A then receives the message intact."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 2) as ((to_a, _), (a, b)):
            rndv = a._conn.rndv
            assert rndv is not None
            rndv.kick = lambda: None  # A leaves the message unpulled (test only)
            payload = os.urandom(1 << 20)
            sending = asyncio.create_task(to_a.send(payload))
            for _ in range(3000):
                if rndv.recvs.active:
                    break
                await asyncio.sleep(0.01)
            (msg,) = rndv.recvs.active.values()
            desc = msg.desc
            assert desc.length == len(payload) and not sending.done()
            with pytest.raises(rdmaio.RemoteAccessRefusedError):
                await asyncio.wait_for(b.rdma_read(forged(desc.addr, desc.rkey, desc.length), 0, 4096), 30)
            del rndv.kick  # back to the class's: A pulls now
            assert await asyncio.wait_for(a.recv(), 60) == payload
            await asyncio.wait_for(sending, 60)
            assert to_a.statistics()["mw_binds"] >= 1

    arun(main())


def test_reads_waiting_for_the_doorbell_when_a_revoke_arrives(arun: Runner[Any], rdma_addr: str) -> None:
    """Reads collected for a doorbell that rings only after the REVOKE_ACK went out (the loop was busy):
    they fail with RemoteKeyRevokedError, nothing reaches the NIC on the revoked key, the connection
    lives."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 1) as ((exp,), (imp,)):
            buf = bytearray(os.urandom(1 << 16))
            key = await share(exp, imp, exp.export(buf, access="rw"))
            engine = imp._conn.onesided
            real_ring = engine.operations._ring
            gate = asyncio.Event()

            async def ring_later() -> None:
                await gate.wait()
                real_ring()

            # The doorbell rings once the test opens the gate (a stalled loop, made deterministic).
            engine.operations._ring = lambda: asyncio.get_running_loop().create_task(ring_later())
            reads = [asyncio.create_task(imp.rdma_read(key, 0, 64)) for _ in range(8)]
            for _ in range(5):
                await asyncio.sleep(0)
            held = len(engine.operations._doorbell)
            assert held >= 1
            posted = imp.statistics()["rdma_ops_posted"]
            await asyncio.wait_for(exp.revoke(key), 30)  # the REVOKE_ACK went out before the doorbell
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(*reads, return_exceptions=True), 30)
            revoked = [r for r in results if isinstance(r, rdmaio.RemoteKeyRevokedError)]
            assert len(revoked) == held, results
            assert all(r == buf[:64] for r in results if isinstance(r, bytes)), results
            # Posted since: the REVOKE_ACK (a control SEND) and nothing on the revoked key.
            assert imp.statistics()["rdma_ops_posted"] == posted + 1
            await ping(imp, exp)
            await ping(exp, imp)

    arun(main())


def test_export_revoke_cycles_leave_no_revoked_ids_behind(arun: Runner[Any], rdma_addr: str) -> None:
    """1000 export/revoke cycles leave nothing in the importer's revoked-id memory (a floor moved)."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 1) as ((exp,), (imp,)):
            buf = bytearray(4096)
            for i in range(1000):
                key = exp.export(buf, access="rw")
                if i % 250 == 0:
                    await imp.rdma_write(await share(exp, imp, key), 0, b"%d" % i)
                await exp.revoke(key)
            stats = imp.statistics()
            assert stats["keys_revoked_by_peer"] == 0 and stats["revoked_key_floor"] == 1001, stats
            # One key kept while others come and go: one range for the gap.
            kept = exp.export(buf)
            for _ in range(100):
                await exp.revoke(exp.export(buf))
            assert imp.statistics()["keys_revoked_by_peer"] == 1
            await exp.revoke(kept)
            assert imp.statistics()["keys_revoked_by_peer"] == 0
            await ping(imp, exp)

    arun(main())


def test_revoking_ids_never_issued_stops_at_the_bound(arun: Runner[Any], rdma_addr: str) -> None:
    """An exporter revoking ids it never issued fails the connection at the bound instead of growing the
    importer's memory."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 1, {"max_revoked_key_ranges": 32}) as ((exp,), (imp,)):
            # A hostile exporter: REVOKEs for random ids it never issued (its engine made to send them).
            engine = exp._conn.onesided
            rng = random.Random(7)
            for _ in range(100):
                engine.exporter.send_control_message(CTL_REVOKE, rng.randrange(1 << 40, 1 << 63))
                await asyncio.sleep(0)
            for _ in range(3000):
                if imp._conn.torn_down or imp.statistics()["keys_revoked_by_peer"] >= 32:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(rdmaio.RdmaError):
                await asyncio.wait_for(imp.recv(), 30)
            assert imp.statistics()["keys_revoked_by_peer"] <= 32

    arun(main())


def test_exports_release_their_windows(rdma_addr: str) -> None:
    """Windows and regions of grants go with revoke() and with the connection (no kernel object left)."""

    async def main() -> None:
        async with server_and_clients(rdma_addr, 1) as ((exp,), (imp,)):
            buf = bytearray(1 << 16)
            warm = exp.export(buf)  # registers both sides' staging memory (the REVOKE is sent from it)
            await imp.rdma_read(await share(exp, imp, warm), 0, 8)
            await exp.revoke(warm)
            before = rdma_resources()["mr"]
            keys = [exp.export(buf, i * 64, 64) for i in range(50)]
            assert rdma_resources()["mr"] == before + 50
            for key in keys:
                await exp.revoke(key)
            assert rdma_resources()["mr"] == before
            for i in range(10):
                exp.export(buf, i * 64, 64)
        await asyncio.sleep(0.5)
        assert rdma_resources()["mr"] < before

    asyncio.run(main())
