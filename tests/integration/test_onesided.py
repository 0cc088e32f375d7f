"""One-sided RDMA in the test host: READ / WRITE / atomics, bounds, revocation, failures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import random
import signal
import struct
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from loops import Runner, arun  # arun is a fixture used by name
from peer_process import peer_process, wait_ready
from rdma_state import rdma_resources
from traffic import refused_write

import rdmaio
from rdmaio._ffi import lib
from rdmaio.core.onesided import RemoteKey

REMOTE_FLAGS = lib.IBV_ACCESS_REMOTE_READ | lib.IBV_ACCESS_REMOTE_WRITE | lib.IBV_ACCESS_REMOTE_ATOMIC


@asynccontextmanager
async def pair(addr: str, **options: Any) -> AsyncIterator[tuple[rdmaio.Endpoint, rdmaio.Endpoint]]:
    """(exporter, importer): the server side and the client side of one connection, on this loop."""
    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: rdmaio.Endpoint) -> None:
        await accepted.put(ep)
        await done.wait()

    server = await rdmaio.serve(handler, addr, 0, options=options or None)
    async with server:
        importer = await rdmaio.connect(addr, server.addresses[0][1], timeout=30, options=options or None)
        exporter = await asyncio.wait_for(accepted.get(), 30)
        try:
            yield exporter, importer
        finally:
            importer.abort()
            exporter.abort()
            done.set()


async def share(exporter: rdmaio.Endpoint, importer: rdmaio.Endpoint, key: rdmaio.RemoteKey) -> RemoteKey:
    """Send the key's wire form over the connection, as an application would."""
    wire = bytes(key)
    assert len(wire) <= 64
    await exporter.send(wire)
    return rdmaio.RemoteKey.from_bytes(await importer.recv())


@pytest.mark.requires_atomics
def test_read_write_atomics_and_nothing_else_remote(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            buf = bytearray(os.urandom(1 << 16))
            key = await share(exp, imp, exp.export(buf, 4096, 8192, access="rwa"))
            assert (key.length, key.access) == (8192, "rwa")
            assert await imp.rdma_read(key, 0, 8192) == buf[4096 : 4096 + 8192]
            await imp.rdma_write(key, 100, b"hello one-sided")
            assert buf[4196 : 4196 + 15] == b"hello one-sided"
            into = bytearray(300)
            assert await imp.rdma_read_into(key, 50, into) == 300
            assert into == buf[4146:4446]
            buf[4096 + 64 : 4096 + 72] = (41).to_bytes(8, sys.byteorder)
            assert await imp.fetch_add(key, 64, 1) == 41
            assert int.from_bytes(buf[4160:4168], sys.byteorder) == 42
            assert await imp.compare_swap(key, 64, 7, 9) == 42  # no match: unchanged
            assert await imp.compare_swap(key, 64, 42, 2**64 - 1) == 42
            assert int.from_bytes(buf[4160:4168], sys.byteorder) == 2**64 - 1
            assert await imp.fetch_add(key, 64, 2) == 2**64 - 1  # wraps modulo 2**64
            assert int.from_bytes(buf[4160:4168], sys.byteorder) == 1
            big = os.urandom(300_000)  # larger than a staging slot: its own registration
            big_buf = bytearray(len(big))
            big_key = await share(exp, imp, exp.export(big_buf))
            await imp.rdma_write(big_key, 0, big)
            assert await imp.rdma_read(big_key, 0, len(big)) == big == big_buf
            # The QP grants remote READ/atomic (rdma_cm does that only with responder_resources > 0) and
            # more than one READ in flight was negotiated.
            access, rd, dest_rd = imp._conn.transport.qp.remote_access()
            assert access & lib.IBV_ACCESS_REMOTE_READ and access & lib.IBV_ACCESS_REMOTE_ATOMIC
            assert rd > 1 and dest_rd > 1
            # Nothing but grants is registered with remote access: the rings and the staging memory.
            for ep in (exp, imp):
                tr = ep._conn.transport
                rings = tr.recv_ring.regions + tr.send_ring.regions
                assert rings and all(not mr.access & REMOTE_FLAGS for mr in rings)
                staging = ep._conn.onesided.operations._staging
                if staging is not None:
                    assert not staging.access & REMOTE_FLAGS
            # The grant's own region has no remote flags (its rkey opens nothing): the access is its
            # window's, bound on this connection's queue pair, over all of the region.
            grant = exp._conn.onesided.grants[key.key_id]
            assert not grant.mr.access & REMOTE_FLAGS and grant.mr.access & lib.IBV_ACCESS_MW_BIND
            assert grant.mr.length == 8192 and grant.scoped is not None and grant.scoped.bound
            assert key.rkey == grant.scoped.rkey != grant.mr.rkey
            # the connection still carries messages
            await imp.send(b"ping")
            assert await exp.recv() == b"ping"

    arun(main())


def test_random_reads_and_writes_against_a_model(rdma_addr: str) -> None:
    """Four tasks, each on its own stripe of a 64 MiB region; every read checked, then the whole region,
    locally and read back over RDMA in full."""
    size = 64 << 20
    tasks = 4
    ops = 150

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            region = bytearray(size)
            model = bytearray(size)
            key = await share(exp, imp, exp.export(region))
            stripe = size // tasks

            async def worker(n: int) -> None:
                rng = random.Random(n)
                base = n * stripe
                for _ in range(ops):
                    length = rng.choice((1, 8, 4095, 65536, 65537, rng.randrange(1, 1 << 19)))
                    off = base + rng.randrange(0, stripe - length)
                    if rng.random() < 0.5:
                        data = rng.randbytes(length)
                        await imp.rdma_write(key, off, data)
                        model[off : off + length] = data
                    elif rng.random() < 0.5:
                        assert await imp.rdma_read(key, off, length) == model[off : off + length]
                    else:
                        into = bytearray(length)
                        await imp.rdma_read_into(key, off, into)
                        assert into == model[off : off + length]

            await asyncio.gather(*(worker(n) for n in range(tasks)))
            assert region == model  # the exporter's memory, every byte
            # ... and every byte again through the NIC: the whole region read back in 4 MiB READs,
            # four in flight, into one buffer (each slice registered once through the Domain's cache).
            chunk = 4 << 20
            back = bytearray(size)
            view = memoryview(back)

            async def pull(first: int) -> None:
                for off in range(first * chunk, size, tasks * chunk):
                    assert await imp.rdma_read_into(key, off, view[off : off + chunk]) == chunk

            await asyncio.gather(*(pull(n) for n in range(tasks)))
            assert back == model

    asyncio.run(main())


@pytest.mark.requires_atomics
def test_eight_clients_fetch_add_exact_total(rdma_addr: str) -> None:
    clients, per_client = 8, 1000

    async def main() -> None:
        counter = bytearray(64)
        keys: list[bytes] = []

        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                key = ep.export(counter, 8, 8, access="a")
                keys.append(bytes(key))
                await ep.send(bytes(key))
                assert await ep.recv() == b"done"

        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]

            async def client() -> list[int]:
                async with await rdmaio.connect(rdma_addr, port, timeout=60) as ep:
                    key = rdmaio.RemoteKey.from_bytes(await ep.recv())
                    olds: list[int] = []

                    async def lane() -> None:  # several in flight per client
                        for _ in range(per_client // 4):
                            olds.append(await ep.fetch_add(key, 0, 1))

                    await asyncio.gather(*(lane() for _ in range(4)))
                    await ep.send(b"done")
                    return olds

            results = await asyncio.gather(*(client() for _ in range(clients)))
        total = clients * per_client
        assert int.from_bytes(counter[8:16], sys.byteorder) == total
        # every fetch_add saw a distinct old value: no lost or duplicated update
        assert sorted(v for r in results for v in r) == list(range(total))
        assert counter[:8] == bytes(8) and counter[16:] == bytes(48)  # nothing outside the grant

    asyncio.run(main())


@pytest.mark.requires_atomics
def test_compare_swap_lock_no_lost_updates(rdma_addr: str) -> None:
    """A spin lock on compare_swap protects a plain (non-atomic) read-modify-write of a counter."""
    clients, rounds = 4, 25

    async def main() -> None:
        memory = bytearray(16)  # [0:8] lock word, [8:16] counter (updated with READ + WRITE only)

        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                await ep.send(bytes(ep.export(memory, access="rwa")))
                assert await ep.recv() == b"done"

        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]

            async def client(me: int) -> None:
                async with await rdmaio.connect(rdma_addr, port, timeout=60) as ep:
                    key = rdmaio.RemoteKey.from_bytes(await ep.recv())
                    for _ in range(rounds):
                        while await ep.compare_swap(key, 0, 0, me) != 0:  # noqa: ASYNC110 (spin lock)
                            await asyncio.sleep(0)
                        value = struct.unpack("<Q", await ep.rdma_read(key, 8, 8))[0]
                        await asyncio.sleep(0)  # let the others spin meanwhile
                        await ep.rdma_write(key, 8, struct.pack("<Q", value + 1))
                        assert await ep.compare_swap(key, 0, me, 0) == me
                    await ep.send(b"done")

            await asyncio.gather(*(client(n + 1) for n in range(clients)))
        assert struct.unpack("<QQ", memory) == (0, clients * rounds)

    asyncio.run(main())


@pytest.mark.requires_atomics
def test_every_local_check_leaves_the_connection_usable(rdma_addr: str) -> None:
    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            buf = bytearray(4096)
            rw = await share(exp, imp, exp.export(buf, 0, 1024, access="rw"))
            ro = await share(exp, imp, exp.export(buf, 1024, 1024, access="r"))
            wo = await share(exp, imp, exp.export(buf, 2048, 1024, access="w"))
            at = await share(exp, imp, exp.export(buf, 3072, 1024, access="a"))
            posted = imp.statistics().get("rdma_ops_posted", 0)
            cases: list[Callable[[], Awaitable[object]]] = [
                lambda: imp.rdma_read(rw, 1000, 25),  # past the end
                lambda: imp.rdma_read(rw, -1, 10),  # negative offset
                lambda: imp.rdma_read(rw, 0, 1025),
                lambda: imp.rdma_read_into(rw, 1, bytearray(1024)),
                lambda: imp.rdma_write(rw, 1020, b"12345"),
                lambda: imp.rdma_write(ro, 0, b"x"),  # write through a read-only key
                lambda: imp.rdma_read(wo, 0, 1),  # read through a write-only key
                lambda: imp.fetch_add(rw, 0, 1),  # atomic without "a"
                lambda: imp.compare_swap(ro, 0, 0, 1),
                lambda: imp.fetch_add(at, 4, 1),  # misaligned
                lambda: imp.compare_swap(at, 1020, 0, 1),  # aligned but runs past the end
                lambda: imp.rdma_read(at, 0, 8),  # atomic-only key
            ]
            for case in cases:
                with pytest.raises(rdmaio.RemoteAccessError) as info:
                    await case()
                assert isinstance(info.value, PermissionError)
            assert imp.statistics().get("rdma_ops_posted", 0) == posted  # nothing was posted
            with pytest.raises(ValueError):
                await imp.rdma_write(rw, 0, b"x", imm=2**32)
            with pytest.raises(ValueError):
                exp.export(buf, 0, 5000)
            with pytest.raises(ValueError):
                exp.export(buf, access="rx")
            with pytest.raises(TypeError):
                exp.export(b"read-only bytes")
            assert buf == bytes(4096)
            # still usable, both ways
            await imp.rdma_write(rw, 0, b"ok")
            assert await imp.fetch_add(at, 8, 5) == 0
            await imp.send(b"alive")
            assert await exp.recv() == b"alive"
            assert buf[:2] == b"ok" and int.from_bytes(buf[3080:3088], sys.byteorder) == 5

    asyncio.run(main())


def test_nic_enforces_bounds_for_a_peer_that_skips_the_checks(rdma_addr: str, provider: str) -> None:
    """A forged key (longer than the grant) passes our local checks; the exporter's NIC refuses it and its
    memory outside the grant is untouched. That remote access error ends the connection."""

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            buf = bytearray(b"\xaa" * 8192)
            key = await share(exp, imp, exp.export(buf, 4096, 1024, access="rw"))
            forged = RemoteKey(key.addr, key.rkey, 8192, key.access_bits, key.key_id)
            await refused_write(imp, forged, 1024, b"\x55" * 4096, provider)  # past the grant
            assert buf == b"\xaa" * 8192
            with pytest.raises((rdmaio.EndpointClosedError, ConnectionError)):
                await imp.rdma_read(key, 0, 8)  # the QP is in the error state: the connection is gone

    asyncio.run(main())


def test_write_with_imm_gives_notices_and_uses_credits(rdma_addr: str) -> None:
    async def main() -> None:
        async with pair(rdma_addr, recv_depth=8) as (exp, imp):
            buf = bytearray(1 << 16)
            key = await share(exp, imp, exp.export(buf, access="w"))
            n = 50  # several times recv_depth: credits must come back for notices too
            for i in range(n):
                await imp.rdma_write(key, i * 8, i.to_bytes(8, "little"), imm=0xFFFF_0000 + i)
            for i in range(n):
                notice = await exp.wait_write_notice()
                assert notice == rdmaio.WriteNotice(8, 0xFFFF_0000 + i)
                assert buf[i * 8 : i * 8 + 8] == i.to_bytes(8, "little")
            await imp.rdma_write(key, 0, b"", imm=7)  # zero-length: only the notice
            assert await exp.wait_write_notice() == rdmaio.WriteNotice(0, 7)
            for i in range(20):  # messages still flow both ways
                await exp.send(b"m%d" % i)
                assert await imp.recv() == b"m%d" % i
            stats = imp.statistics()
            assert stats["protocol_onesided_slots_sent"] == n + 1

    asyncio.run(main())


def test_unconsumed_write_notices_stop_the_writer(arun: Runner[Any], rdma_addr: str) -> None:
    """Options.max_write_notices: past it, notices hold their receive, so the writer's credits run out and
    its writes with imm wait; consuming the notices lets every write through, in order, none lost."""
    limit, depth = 4, 8

    async def main() -> None:
        async with pair(rdma_addr, recv_depth=depth, initial_depth=depth, max_write_notices=limit) as (
            exp,
            imp,
        ):
            buf = bytearray(1 << 16)
            key = await share(exp, imp, exp.export(buf, access="w"))
            total = limit + 4 * depth
            sent = 0

            async def writer() -> None:
                nonlocal sent
                for i in range(total):
                    await imp.rdma_write(key, i * 8, i.to_bytes(8, "little"), imm=i)
                    sent += 1

            task = asyncio.create_task(writer())
            # Nobody consumes: the writer stalls once the held receives have eaten its credits.
            stalled_at = -1
            for _ in range(100):
                await asyncio.sleep(0.1)
                if sent == stalled_at:
                    break
                stalled_at = sent
            assert not task.done() and sent < total
            stats = exp.statistics()
            queued = stats["write_notices_queued"]
            assert limit < queued <= limit + depth, stats
            assert stats["write_notice_slots_held"] == queued - limit
            for i in range(total):
                notice = await asyncio.wait_for(exp.wait_write_notice(), 30)
                assert notice == rdmaio.WriteNotice(8, i)
                assert buf[i * 8 : i * 8 + 8] == i.to_bytes(8, "little")
            await asyncio.wait_for(task, 30)
            assert exp.statistics()["write_notice_slots_held"] == 0
            await imp.send(b"still alive")  # the credits all came back
            assert await exp.recv() == b"still alive"

    arun(main())


def test_a_server_without_the_onesided_feature(rdma_addr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server side plays an older rdmaio (no FEATURE_ONESIDED in its handshake): the client refuses
    write notices locally, and everything that needs nothing of the peer's software still works."""
    import rdmaio.core.acceptor
    import rdmaio.core.negotiation
    from rdmaio.protocol import FEATURE_ONESIDED

    def older(options: rdmaio.Options, *, grow: bool = True) -> Any:
        handshake = rdmaio.core.negotiation.local_handshake(options, grow=grow)
        return dataclasses.replace(handshake, features=handshake.features & ~FEATURE_ONESIDED)

    monkeypatch.setattr(rdmaio.core.acceptor, "local_handshake", older)

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            assert exp._conn.session.peer.features & FEATURE_ONESIDED  # the client announced it
            assert not imp._conn.session.peer.features & FEATURE_ONESIDED
            buf = bytearray(4096)
            key = await share(exp, imp, exp.export(buf, access="rw"))
            with pytest.raises(rdmaio.FeatureNotSupportedError):
                await imp.rdma_write(key, 0, b"x", imm=1)
            with pytest.raises(NotImplementedError):
                await imp.wait_write_notice()
            await imp.rdma_write(key, 0, b"plain")
            assert await imp.rdma_read(key, 0, 5) == b"plain" == buf[:5]
            await imp.send(b"still fine")
            assert await exp.recv() == b"still fine"

    asyncio.run(main())


def test_revoke_idle_and_with_operations_in_flight(rdma_addr: str, provider: str) -> None:
    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            buf = bytearray(1 << 20)
            key = await share(exp, imp, exp.export(buf, access="rw"))
            await imp.rdma_write(key, 0, b"before")
            await exp.revoke(key)
            posted = imp.statistics()["rdma_ops_posted"]
            with pytest.raises(rdmaio.RemoteKeyRevokedError):
                await imp.rdma_read(key, 0, 6)
            with pytest.raises(rdmaio.RemoteAccessError):  # a RemoteAccessError too
                await imp.rdma_write(key, 0, b"after")
            assert imp.statistics()["rdma_ops_posted"] == posted
            assert buf[:6] == b"before"

            # With operations in flight: each completes or raises RemoteKeyRevokedError, nothing else.
            key2 = await share(exp, imp, exp.export(buf, access="rw"))
            outcomes: list[str] = []

            async def hammer(n: int) -> None:
                data = bytes([n + 1]) * 4096
                while True:
                    try:
                        await imp.rdma_write(key2, n * 4096, data)
                        await imp.rdma_read(key2, n * 4096, 4096)
                    except rdmaio.RemoteKeyRevokedError:
                        outcomes.append("revoked")
                        return

            tasks = [asyncio.create_task(hammer(n)) for n in range(8)]
            await asyncio.sleep(0.5)
            await exp.revoke(key2)
            snapshot = bytes(buf)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert outcomes == ["revoked"] * 8
            await asyncio.sleep(0.2)
            assert bytes(buf) == snapshot  # never modified through the key after revoke() returned
            # A peer ignoring the revocation (a forged copy of the old key) is refused by the NIC.
            forged = RemoteKey(key2.addr, key2.rkey, key2.length, key2.access_bits, key2.key_id + 1)
            await refused_write(imp, forged, 0, b"x" * 64, provider)
            assert bytes(buf) == snapshot
            with pytest.raises(ValueError):
                await exp.revoke(key2)  # already revoked

    asyncio.run(main())


def test_revoke_keeps_the_connection_usable(rdma_addr: str) -> None:
    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            buf = bytearray(4096)
            for i in range(20):
                key = await share(exp, imp, exp.export(buf, access="rw"))
                await imp.rdma_write(key, 0, b"%d" % i)
                await exp.revoke(key)
                with pytest.raises(rdmaio.RemoteKeyRevokedError):
                    await imp.rdma_read(key, 0, 1)
            await imp.send(b"still")
            assert await exp.recv() == b"still"

    asyncio.run(main())


def exporter_peer_code(size: int, access: str) -> str:
    """A peer process (``peer_process``) that exports ``size`` bytes with ``access`` to each client, sends
    the key and then waits for ever (to be killed)."""
    return f"""
        import asyncio, sys, rdmaio
        async def handler(ep):
            buf = bytearray({size})
            handler.buf = buf
            await ep.send(bytes(ep.export(buf, access="{access}")))
            await asyncio.Event().wait()
        async def main():
            server = await rdmaio.serve(handler, sys.argv[1], 0)
            print("READY", server.addresses[0][1], flush=True)
            await server.serve_forever()
        asyncio.run(main())
    """


def test_peer_sigkill_during_reads_fails_pending_ops(rdma_addr: str) -> None:
    async def main() -> None:
        proc = peer_process(exporter_peer_code(1 << 22, "r"), rdma_addr)
        try:
            port = int((await asyncio.to_thread(wait_ready, proc)).split()[1])
            ep = await rdmaio.connect(rdma_addr, port, timeout=30)
            key = rdmaio.RemoteKey.from_bytes(await ep.recv())
            errors: list[BaseException] = []

            async def reader() -> None:
                try:
                    while True:
                        await ep.rdma_read(key, 0, 1 << 20)
                except Exception as exc:
                    errors.append(exc)

            tasks = [asyncio.create_task(reader()) for _ in range(8)]
            await asyncio.sleep(1.0)
            assert not errors
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            elapsed = time.monotonic() - killed
            assert len(errors) == 8
            assert all(isinstance(e, ConnectionError) and isinstance(e, rdmaio.RdmaError) for e in errors)
            assert elapsed < 5.0, elapsed
            assert ep._conn.onesided.ops == {}
            ep.abort()
        finally:
            proc.kill()
            proc.wait()

    asyncio.run(main())


def test_no_mr_leak_after_many_export_revoke_cycles(rdma_addr: str, provider: str) -> None:
    cycles = 1000
    rights = "rwa" if provider == "rxe" else "rw"  # atomics only where the device has them

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            buf = bytearray(1 << 16)
            key = exp.export(buf)  # warm up the staging registration on both sides
            await imp.rdma_read(await share(exp, imp, key), 0, 8)
            await exp.revoke(key)
            before = rdma_resources()["mr"]
            for i in range(cycles):
                key = exp.export(buf, i % 4096, 1024, access=rights[: 1 + i % 3])
                if i % 100 == 0:
                    await imp.rdma_read(await share(exp, imp, key), 0, 8)
                await exp.revoke(key)
            assert rdma_resources()["mr"] == before
            assert exp._conn.onesided.grants == {}
        after_close = rdma_resources()["mr"]
        assert after_close < before  # the connections' own registrations went too

    asyncio.run(main())


@pytest.mark.requires_atomics
def test_one_sided_on_trio(rdma_addr: str) -> None:
    async def main() -> None:
        buf = bytearray(1 << 16)
        finished = trio.Event()

        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                key = ep.export(buf, access="rwa")
                await ep.send(bytes(key))
                notice = await ep.wait_write_notice()
                assert notice == rdmaio.WriteNotice(5, 99)
                await ep.revoke(key)
                await ep.send(b"revoked")
                await finished.wait()

        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server, await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=30) as ep:
            key = rdmaio.RemoteKey.from_bytes(await ep.recv())
            await ep.rdma_write(key, 16, b"trio!")
            assert await ep.rdma_read(key, 16, 5) == b"trio!"
            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(ep.fetch_add, key, 0, 3)
            assert int.from_bytes(buf[:8], sys.byteorder) == 30
            # batches on trio: several tasks, waves of max_rdma_ops
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(ep.fetch_add_many, key, [0] * 40, 1)
            assert int.from_bytes(buf[:8], sys.byteorder) == 30 + 160
            parts = await ep.rdma_read_many(key, [(16, 5), (0, 8), (16, 0)])
            assert parts == [b"trio!", (190).to_bytes(8, sys.byteorder), b""]
            with trio.move_on_after(0.001):  # a cancelled rdma_read leaves the endpoint usable
                await ep.rdma_read(key, 0, 60000)
            await ep.rdma_write(key, 100, b"imm!!", imm=99)
            assert await ep.recv() == b"revoked"
            with pytest.raises(rdmaio.RemoteKeyRevokedError):
                await ep.rdma_read(key, 0, 1)
            finished.set()

    trio.run(main)


def test_a_closed_endpoint_is_freed_without_the_cyclic_gc(rdma_addr: str) -> None:
    """The engine must not make endpoints reference cycles: a cycle keeps the loop and its Domain (a PD,
    the event channel's fd) alive until the cyclic GC runs, which other tests see as a leak."""

    async def main() -> None:
        memory = bytearray(64)

        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                await ep.send(bytes(ep.export(memory, access="r")))
                await ep.recv()

        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            ep = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=30)
            key = rdmaio.RemoteKey.from_bytes(await ep.recv())
            assert await ep.rdma_read(key, 0, 8) == bytes(8)
            await ep.aclose()
            ref = weakref.ref(ep)
            del ep
            assert ref() is None

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()
