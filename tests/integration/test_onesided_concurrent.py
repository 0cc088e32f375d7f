"""One-sided calls made while others are in flight, on a device: 16 tasks calling at once take the engine's
concurrent path (checked and queued for the doorbell in one call, completed through a bare future), and
every byte and every fetch-and-add lands where it should."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from loops import Runner, arun  # arun is a fixture used by name
from test_onesided import pair, share

from rdmaio.core.onesided import operations as onesided_operations

TASKS = 16
ROUNDS = 20
CHUNK = 64 * 1024


def _count_queued(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The opcodes of the calls that take the concurrent path."""
    queued: list[int] = []
    original = onesided_operations.OperationEngine._queue

    def queue(self: Any, *args: Any) -> Any:
        queued.append(args[1])
        return original(self, *args)

    monkeypatch.setattr(onesided_operations.OperationEngine, "_queue", queue)
    return queued


def test_sixteen_tasks_writing_and_reading_64k_take_the_concurrent_path(
    arun: Runner[Any], rdma_addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        async with pair(rdma_addr) as (exporter, importer):
            memory = bytearray(TASKS * CHUNK)
            key = await share(exporter, importer, exporter.export(memory, access="rw"))

            async def worker(i: int) -> None:
                for r in range(ROUNDS):
                    data = bytes([(i * ROUNDS + r) % 251]) * (CHUNK - i)
                    await importer.rdma_write(key, i * CHUNK, data)
                    assert await importer.rdma_read(key, i * CHUNK, CHUNK - i) == data

            await asyncio.gather(*(worker(i) for i in range(TASKS)))
            for i in range(TASKS):
                last = bytes([(i * ROUNDS + ROUNDS - 1) % 251]) * (CHUNK - i)
                assert memory[i * CHUNK : (i + 1) * CHUNK - i] == last
            stats = importer.statistics()
            assert stats["rdma_ops_pending"] == 0
            assert stats["rdma_reads"] == stats["rdma_writes"] == TASKS * ROUNDS

    arun(main())
    # Most calls found others in flight (the first of a wave finds none and is posted alone).
    assert len(queued) > TASKS * ROUNDS
    assert len(set(queued)) == 2


@pytest.mark.requires_atomics
def test_sixteen_tasks_fetch_add_exact_total_through_the_concurrent_path(
    arun: Runner[Any], rdma_addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        async with pair(rdma_addr) as (exporter, importer):
            counter = bytearray(24)
            key = await share(exporter, importer, exporter.export(counter, 8, 8, access="a"))
            olds: list[int] = []

            async def worker() -> None:
                for _ in range(ROUNDS * 4):
                    olds.append(await importer.fetch_add(key, 0, 1))

            await asyncio.gather(*(worker() for _ in range(TASKS)))
            total = TASKS * ROUNDS * 4
            assert int.from_bytes(counter[8:16], sys.byteorder) == total
            assert sorted(olds) == list(range(total))  # no lost or duplicated update
            assert counter[:8] == bytes(8) and counter[16:] == bytes(8)  # nothing outside the grant

    arun(main())
    assert len(queued) > TASKS * ROUNDS * 4 // 2
