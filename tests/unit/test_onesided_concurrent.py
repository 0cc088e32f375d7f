"""The concurrent path of a one-sided call: a READ, WRITE or fetch-and-add made while other requests of the
engine are in flight (several tasks calling at once) is checked, given its staging slot, tracked and
collected for the iteration's doorbell in one call (``OperationEngine._queue``), and its completion
resolves its future directly. These tests check that such calls take that path, that their results are
right on real memory (the null device), and that it keeps the general path's rules: a cancelled call
leaves its staging to the completion, a key revoked before the doorbell rings fails the call without a
post, a failed post fails the calls and the connection, a closed connection fails them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import rdmaio
from rdmaio.core.onesided import operations as onesided_operations
from rdmaio.testing.fakes import onesided_rig
from rdmaio.testing.nullpair import null_pair

Run = Callable[[Awaitable[Any]], Any]


def _count_queued(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls that take the concurrent path (the list's length)."""
    queued: list[int] = []
    original = onesided_operations.OperationEngine._queue

    def queue(self: Any, *args: Any) -> Any:
        queued.append(args[1])
        return original(self, *args)

    monkeypatch.setattr(onesided_operations.OperationEngine, "_queue", queue)
    return queued


def test_concurrent_calls_take_the_concurrent_path_with_right_results(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        a, b, _device = null_pair(onesided_at_post=False)
        memory = bytearray(16 * 4096 + 8)
        key = b.export(memory, access="rwa", scope="domain")
        rounds = 5

        async def worker(i: int) -> None:
            for r in range(rounds):
                data = bytes([i * 16 + r]) * 4096
                await a.rdma_write(key, i * 4096, data)
                assert await a.rdma_read(key, i * 4096, 4096) == data
                await a.fetch_add(key, 16 * 4096, 1)

        await asyncio.gather(*(worker(i) for i in range(16)))
        assert int.from_bytes(memory[16 * 4096 :], "little") == 16 * rounds
        assert await a.fetch_add(key, 16 * 4096, 0) == 16 * rounds
        ops = a._onesided.operations
        assert ops.ops == {} and ops.in_flight == 0 and len(ops._free_staging) == ops.max_ops
        a.abort()
        b.abort()
        await asyncio.sleep(0)

    arun(main())
    # Every call but those that found nothing else in flight went the concurrent way, of every kind.
    assert len(queued) > 16 * 5 * 3 / 2
    assert set(queued) == {
        onesided_operations.WR_READ,
        int(rdmaio.verbs.native.lib.IBV_WR_RDMA_WRITE),
        onesided_operations.WR_FADD,
    }


async def _two_in_flight(rig: Any) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """With completions held back: a first READ (alone: posted at once, the general path) and a second
    from another task (the concurrent path: the first is in flight), both posted and waiting."""
    first = asyncio.ensure_future(rig.engine.read(rig.key, 0, 8))
    second = asyncio.ensure_future(rig.engine.read(rig.key, 8, 8))
    for _ in range(3):
        await asyncio.sleep(0)
    return first, second


def _hold_completions(rig: Any) -> list[int]:
    """The wr_ids of the completions the fake device delivers from now on, held back (not delivered)."""
    held: list[int] = []
    rig.engine.on_completion = lambda wr_id, status, *rest: held.append(wr_id)
    return held


def test_a_cancelled_concurrent_call_keeps_its_staging_until_the_completion(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        rig = onesided_rig(complete_at_post=False)
        engine = rig.engine
        await engine.read(rig.key, 0, 8)  # registers the staging (the first call takes the general path)
        held = _hold_completions(rig)
        first, second = await _two_in_flight(rig)
        assert len(queued) == 1 and len(rig.qp.posted) == 3 and len(held) == 2  # both posted
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        ops = engine.operations
        assert len(ops._free_staging) == ops.max_ops - 2  # the NIC may still write into both
        for wr_id in held:
            ops.on_completion(wr_id, 0)
        assert await first == bytes(8)
        assert len(ops._free_staging) == ops.max_ops and ops.ops == {} and ops.in_flight == 0

    arun(main())


def test_a_key_revoked_before_the_doorbell_fails_the_concurrent_call_without_a_post(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        rig = onesided_rig(complete_at_post=False)
        engine = rig.engine
        await engine.read(rig.key, 0, 8)
        posted = len(rig.qp.posted)
        held = _hold_completions(rig)
        first = asyncio.ensure_future(engine.read(rig.key, 0, 8))  # posted alone
        second = asyncio.ensure_future(engine.write(rig.key, 8, b"x" * 8))
        third = asyncio.ensure_future(engine.fetch_add(rig.key, 16, 1))

        async def revoke() -> None:  # runs after both calls queued, before the doorbell
            engine.revoked_ids.add(rig.key.key_id)

        revoker = asyncio.ensure_future(revoke())
        await revoker
        for call in (second, third):
            with pytest.raises(rdmaio.RemoteKeyRevokedError):
                await call
        assert len(held) == 1
        engine.operations.on_completion(held[0], 0)
        assert await first == bytes(8)
        assert len(rig.qp.posted) == posted + 1  # only the first went out
        ops = engine.operations
        assert len(ops._free_staging) == ops.max_ops and ops.ops == {} and not engine.closed

    arun(main())
    assert len(queued) == 2


def test_a_failed_doorbell_fails_the_concurrent_calls_and_the_connection(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        rig = onesided_rig(complete_at_post=False)
        engine = rig.engine
        await engine.read(rig.key, 0, 8)
        _hold_completions(rig)
        first = asyncio.ensure_future(engine.read(rig.key, 0, 8))  # posted alone
        calls = [asyncio.ensure_future(engine.fetch_add(rig.key, 8 * i, 1)) for i in range(1, 4)]
        await asyncio.sleep(0)  # all four called, the doorbell not rung yet
        rig.qp.fail_next = True
        results = await asyncio.gather(first, *calls, return_exceptions=True)
        assert all(isinstance(r, rdmaio.RdmaError) for r in results[1:]), results
        assert len(rig.failures) == 1 and engine.closed
        with pytest.raises(rdmaio.RdmaError):
            await engine.read(rig.key, 0, 8)

    arun(main())
    assert len(queued) == 3


def test_concurrent_calls_waiting_fail_when_the_connection_closes(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued = _count_queued(monkeypatch)

    async def main() -> None:
        rig = onesided_rig(complete_at_post=False)
        engine = rig.engine
        await engine.read(rig.key, 0, 8)
        _hold_completions(rig)
        first, second = await _two_in_flight(rig)
        engine.close(rdmaio.EndpointClosedError("gone"))
        for call in (first, second):
            with pytest.raises(rdmaio.EndpointClosedError):
                await call

    arun(main())
    assert len(queued) == 1
