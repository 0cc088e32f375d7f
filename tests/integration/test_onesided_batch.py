"""Batches of one-sided requests (``fetch_add_many``, ``rdma_read_many``) in the test host."""

from __future__ import annotations

import asyncio
import mmap
import random
import signal
import struct
import sys
import time
from typing import Any

import pytest
from loops import Runner, arun  # arun is a fixture used by name
from peer_process import peer_process, wait_ready
from test_onesided import exporter_peer_code, pair, share

import rdmaio
from rdmaio.core.onesided import RemoteKey


@pytest.mark.requires_atomics  # fetch_add_many's typed error without atomics: test_onesided_caps
def test_eight_clients_fetch_add_many_exact_totals(arun: Runner[Any], rdma_addr: str) -> None:
    """Eight clients, two tasks each, add to 8 counters in batches of 16 (every counter twice per batch,
    waves of 8 with max_rdma_ops=8): each counter ends at the exact total and every old value was seen
    exactly once (no lost or duplicated update); nothing outside the grant changed."""
    clients, lanes, calls, counters = 8, 2, 40, 8
    offsets = [8 * (i % counters) for i in range(2 * counters)]

    async def main() -> None:
        memory = bytearray(8 * counters + 16)
        served = 0
        all_served = asyncio.Event()

        async def handler(ep: rdmaio.Endpoint) -> None:
            nonlocal served
            async with ep:
                key = ep.export(memory, 8, 8 * counters, access="a")
                await ep.send(bytes(key))
                assert await ep.recv() == b"done"
                served += 1
                if served == clients:
                    all_served.set()

        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]

            async def client() -> list[list[int]]:
                opts = {"max_rdma_ops": 8}
                async with await rdmaio.connect(rdma_addr, port, timeout=60, options=opts) as ep:
                    key = rdmaio.RemoteKey.from_bytes(await ep.recv())
                    seen: list[list[int]] = [[] for _ in range(counters)]

                    async def lane() -> None:
                        for _ in range(calls):
                            olds = await ep.fetch_add_many(key, offsets)
                            assert len(olds) == len(offsets)
                            for offset, old in zip(offsets, olds, strict=True):
                                seen[offset // 8].append(old)

                    await asyncio.gather(*(lane() for _ in range(lanes)))
                    stats = ep.statistics()
                    assert stats["rdma_batches"] == lanes * calls * 2  # two waves of 8 per call
                    await ep.send(b"done")
                    return seen

            results = await asyncio.gather(*(client() for _ in range(clients)))
            await asyncio.wait_for(all_served.wait(), 60)
        total = clients * lanes * calls * 2
        values = struct.unpack_from(f"={counters}Q", memory, 8)
        assert values == (total,) * counters
        for c in range(counters):
            assert sorted(v for seen in results for v in seen[c]) == list(range(total))
        assert memory[:8] == bytes(8) and memory[8 + 8 * counters :] == bytes(8)

    arun(main())


def test_read_many_against_a_model(arun: Runner[Any], rdma_addr: str) -> None:
    """Random batches of ranges (empty ones, 1 B to 16 KiB, overlapping, more than one wave) read back
    exactly what the exporter holds, also after the region changes."""

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            rng = random.Random(11)
            region = bytearray(rng.randbytes(1 << 20))
            key = await share(exp, imp, exp.export(region, access="r"))
            for round_ in range(30):
                ranges = []
                for _ in range(rng.randrange(1, 40)):
                    length = rng.choice((0, 1, 8, 100, 4096, rng.randrange(1, 16385)))
                    offset = rng.randrange(0, len(region) - length + 1)
                    ranges.append((offset, length))
                got = await imp.rdma_read_many(key, ranges)
                assert got == [bytes(region[o : o + n]) for o, n in ranges], f"round {round_}"
                region[rng.randrange(len(region))] ^= 0xFF  # the exporter writes between rounds
            assert imp.statistics()["rdma_batches"] >= 30

    arun(main())


def test_small_reads_across_a_page_boundary_read_the_right_bytes(arun: Runner[Any], rdma_addr: str) -> None:
    """READs of at most 32 bytes that cross a page boundary of the exported memory, in a batch, alone and
    into a caller buffer, read exactly its bytes (siw, Linux 6.1, sends them inline with a wrong split at
    the page boundary: rdmaio splits them there on iWARP connections; docs/providers.md)."""

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            pages = 4
            region = mmap.mmap(-1, pages * 4096)  # page-aligned: its pages are the exporter's pages
            region[:] = random.Random(5).randbytes(pages * 4096)
            key = await share(exp, imp, exp.export(region, access="r"))
            ranges = [
                (4096 * page - before, length)
                for page in range(1, pages)
                for length in (2, 8, 13, 32)
                for before in range(1, length)
            ]
            want = [bytes(region[o : o + n]) for o, n in ranges]
            got = await imp.rdma_read_many(key, ranges)
            wrong = [(o, n) for (o, n), a, b in zip(ranges, got, want, strict=True) if a != b]
            assert not wrong, f"rdma_read_many: {len(wrong)} of {len(ranges)} ranges wrong, e.g. {wrong[:5]}"
            for offset, length in ranges[:: max(1, len(ranges) // 24)]:
                assert await imp.rdma_read(key, offset, length) == region[offset : offset + length], offset
                into = bytearray(length)
                assert await imp.rdma_read_into(key, offset, into) == length
                assert into == region[offset : offset + length], offset

    arun(main())


@pytest.mark.requires_atomics  # the read-only batches: the next test, on every provider
def test_a_bad_batch_posts_nothing_and_a_forged_one_is_refused_by_the_nic(rdma_addr: str) -> None:
    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            memory = bytearray(b"\xaa" * 256)
            key = await share(exp, imp, exp.export(memory, 64, 64, access="ra"))
            with pytest.raises(rdmaio.RemoteAccessError, match="aligned"):
                await imp.fetch_add_many(key, [0, 8, 4])
            with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
                await imp.fetch_add_many(key, [0, 64])
            with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
                await imp.rdma_read_many(key, [(0, 8), (60, 8)])
            assert imp.statistics()["rdma_batches"] == 0
            # still usable
            assert await imp.fetch_add_many(key, [0, 8], 1) == [0xAAAAAAAAAAAAAAAA] * 2
            assert (
                await imp.rdma_read_many(key, [(0, 8), (8, 8)])
                == [(0xAAAAAAAAAAAAAAAB).to_bytes(8, sys.byteorder)] * 2
            )
            forged = RemoteKey(key.addr, key.rkey, 256, key.access_bits, key.key_id)
            with pytest.raises(rdmaio.RemoteAccessError):
                await imp.fetch_add_many(forged, [0, 64, 128])  # the second is past the grant
            assert memory[:64] == b"\xaa" * 64 and memory[128:] == b"\xaa" * 128

    asyncio.run(main())


def test_a_bad_read_batch_posts_nothing_and_a_forged_one_is_refused_by_the_nic(
    rdma_addr: str, provider: str
) -> None:
    """The read half of the test above, on every provider (no atomics needed): a batch with a range outside
    the grant raises before anything is posted and the connection stays usable; a batch through a forged
    key (the grant's rkey, a longer length) passes the local check and the exporter's NIC refuses the READ
    past the grant's region (RoCE: the READ's own RemoteAccessError; iWARP: the TERMINATE that ends the
    connection, which fails the batch)."""

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            memory = bytearray(b"\xaa" * 64 + b"\xbb" * 64 + b"\xcc" * 128)
            key = await share(exp, imp, exp.export(memory, 64, 64, access="r"))
            with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
                await imp.rdma_read_many(key, [(0, 8), (60, 8)])
            with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
                await imp.rdma_read_many(key, [(64, 1)])
            assert imp.statistics()["rdma_batches"] == 0
            # still usable
            assert await imp.rdma_read_many(key, [(0, 8), (56, 8)]) == [b"\xbb" * 8] * 2
            assert imp.statistics()["rdma_batches"] == 1
            forged = RemoteKey(key.addr, key.rkey, 256, key.access_bits, key.key_id)
            refused: tuple[type[BaseException], ...] = (rdmaio.RemoteAccessError,)
            if provider != "rxe":
                refused = (rdmaio.EndpointClosedError, ConnectionError, rdmaio.RemoteAccessError)
            with pytest.raises(refused):
                await asyncio.wait_for(imp.rdma_read_many(forged, [(0, 8), (128, 8)]), 30)
            assert memory == b"\xaa" * 64 + b"\xbb" * 64 + b"\xcc" * 128

    asyncio.run(main())


def test_peer_sigkill_during_batches_fails_them_typed_within_the_bound(rdma_addr: str, provider: str) -> None:
    """Batches in flight when the exporter dies fail with a typed error within the bound that holds for
    single calls (5 s), and leave no op, slot or staging memory behind. Two tasks add and two read where
    the devices have atomics; four read where they do not (iWARP)."""
    atomics = provider == "rxe"

    async def main() -> None:
        proc = peer_process(exporter_peer_code(1 << 20, "ra" if atomics else "r"), rdma_addr)
        try:
            port = int((await asyncio.to_thread(wait_ready, proc)).split()[1])
            ep = await rdmaio.connect(rdma_addr, port, timeout=30, options={"max_rdma_ops": 64})
            key = rdmaio.RemoteKey.from_bytes(await ep.recv())
            errors: list[BaseException] = []

            async def adder() -> None:
                try:
                    while True:
                        await ep.fetch_add_many(key, [8 * i for i in range(16)])
                except Exception as exc:
                    errors.append(exc)

            async def reader() -> None:
                try:
                    while True:
                        await ep.rdma_read_many(key, [(4096 * i, 4096) for i in range(16)])
                except Exception as exc:
                    errors.append(exc)

            kinds = (adder, adder, reader, reader) if atomics else (reader,) * 4
            tasks = [asyncio.create_task(f()) for f in kinds]
            await asyncio.sleep(1.0)
            assert not errors
            assert ep.statistics()["rdma_batches"] > 0
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            elapsed = time.monotonic() - killed
            assert len(errors) == 4
            assert all(isinstance(e, ConnectionError) and isinstance(e, rdmaio.RdmaError) for e in errors), (
                errors
            )
            assert elapsed < 5.0, elapsed
            engine = ep._conn.onesided
            assert engine.ops == {} and engine.operations.in_flight == 0
            assert sorted(engine.operations._free_staging) == list(range(64))
            ep.abort()
        finally:
            proc.kill()
            proc.wait()

    asyncio.run(main())


def test_revoke_with_batches_in_flight(rdma_addr: str, provider: str) -> None:
    """Batches in flight when the exporter revokes: every call completes or raises RemoteKeyRevokedError
    (nothing else), later ones raise it without posting, and the memory is not modified through the key
    once revoke() returned. Where the devices have no atomics (iWARP) the adders' batches are reads too,
    and the call after the revoke an rdma_read_many."""
    atomics = provider == "rxe"

    async def main() -> None:
        async with pair(rdma_addr) as (exp, imp):
            memory = bytearray(1 << 16)
            key = await share(exp, imp, exp.export(memory, access="ra" if atomics else "r"))
            outcomes: list[str] = []

            async def adder(n: int) -> None:
                offsets = [n * 1024 + 8 * i for i in range(32)]
                while True:
                    try:
                        if atomics:
                            await imp.fetch_add_many(key, offsets)
                        else:
                            await imp.rdma_read_many(key, [(offset, 8) for offset in offsets])
                    except rdmaio.RemoteKeyRevokedError:
                        outcomes.append("revoked")
                        return

            async def reader(n: int) -> None:
                while True:
                    try:
                        await imp.rdma_read_many(key, [(n * 4096 + 64 * i, 64) for i in range(32)])
                    except rdmaio.RemoteKeyRevokedError:
                        outcomes.append("revoked")
                        return

            tasks = [asyncio.create_task(adder(n)) for n in range(4)]
            tasks += [asyncio.create_task(reader(n)) for n in range(4)]
            await asyncio.sleep(0.5)
            assert imp.statistics()["rdma_batches"] > 0
            await exp.revoke(key)
            snapshot = bytes(memory)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert outcomes == ["revoked"] * 8
            posted = imp.statistics()["rdma_ops_posted"]
            with pytest.raises(rdmaio.RemoteKeyRevokedError):
                if atomics:
                    await imp.fetch_add_many(key, [0])
                else:
                    await imp.rdma_read_many(key, [(0, 8)])
            assert imp.statistics()["rdma_ops_posted"] == posted
            await asyncio.sleep(0.2)
            assert bytes(memory) == snapshot
            assert (
                await imp.rdma_read(await share(exp, imp, exp.export(memory, access="r")), 0, 8)
                == snapshot[:8]
            )

    asyncio.run(main())
