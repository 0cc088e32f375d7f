"""Partitions (netem 100 % loss both ways, links up): shorter than the retry budget the connection
survives with its data intact; longer, every pending call fails within the documented bound."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from netfault import ECHO_SERVER, Pair, heal, partition, peer, wait_ready

import rdmaio
from rdmaio.core.keepalive import ack_timeout_seconds, detection_bound

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
VM_SLACK = 10.0  # seconds of timer and scheduling lag the emulated 1-vCPU VM may add


@pytest.mark.timeout(180)
def test_partition_shorter_than_retry_budget_is_survived(
    arun: Runner, pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    # Client: 7 transmissions of 1.07 s each; the echo server's QP uses our retry count with its own
    # (default, 0.54 s) timeout: 3.8 s. A 2 s partition is well inside both. (Not retry_count=7: rxe never
    # counts that budget down, so the partition would be survived whatever its length.)
    opts = rdmaio.Options(ack_timeout=18, retry_count=6, keepalive_interval=1.0)
    budget = min(7 * ack_timeout_seconds(18), 7 * ack_timeout_seconds(17))
    cut = 2.0
    assert cut < budget
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> float:
            ep = await rdmaio.connect(
                pair.b.addr, port, local_addr=(pair.a.addr, 0), options=opts, timeout=30
            )
            messages = [os.urandom(1000 + 997 * i) for i in range(20)]

            async def exchange() -> list[bytes]:
                for m in messages:
                    await ep.send(m)
                return [await ep.recv() or b"" for _ in messages]

            partition(pair)
            started = time.monotonic()
            task = asyncio.create_task(exchange())
            await asyncio.sleep(cut)
            assert not task.done(), "the exchange finished through a 100 % loss partition"
            heal(pair)
            echoed = await asyncio.wait_for(task, 120)
            took = time.monotonic() - started
            assert [hashlib.sha256(m).digest() for m in echoed] == [
                hashlib.sha256(m).digest() for m in messages
            ]
            await ep.send(b"after")  # the connection is still usable
            assert await ep.recv() == b"after"
            await ep.aclose()
            return took

        took = arun(main())
    finally:
        proc.kill()
        proc.wait()
    print(f"{cut:.0f} s partition survived; the exchange completed {took:.1f} s after it began")
    record_property("exchange_s", round(took, 2))


@pytest.mark.timeout(180)
def test_partition_longer_than_budget_fails_every_pending_call(
    arun: Runner, pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    opts = rdmaio.Options(ack_timeout=15, retry_count=3, keepalive_interval=2.0)
    bound = detection_bound(2.0, 15, 3)  # 4.5 s: an idle side needs the keepalive, a busy one less
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> dict[str, tuple[str, float]]:
            ep = await rdmaio.connect(
                pair.b.addr, port, local_addr=(pair.a.addr, 0), options=opts, timeout=30
            )
            cut_at: list[float] = []
            outcome: dict[str, tuple[str, float]] = {}

            async def sender() -> None:
                block = os.urandom(65536)
                try:
                    while True:
                        await ep.send(block)
                except Exception as exc:
                    outcome["send"] = (type(exc).__name__, time.monotonic() - cut_at[0])
                    raise

            async def receiver() -> None:
                try:
                    while await ep.recv() is not None:
                        pass
                except Exception as exc:
                    outcome["recv"] = (type(exc).__name__, time.monotonic() - cut_at[0])
                    raise

            async def drainer() -> None:
                await asyncio.sleep(0.2)
                ep.write(os.urandom(4 * 1024 * 1024))  # above the high-water mark: drain() waits
                try:
                    await ep.drain()
                    while True:
                        ep.write(b"z" * 65536)
                        await ep.drain()
                except Exception as exc:
                    outcome["drain"] = (type(exc).__name__, time.monotonic() - cut_at[0])
                    raise

            tasks = [asyncio.create_task(f()) for f in (sender, receiver, drainer)]
            await asyncio.sleep(1.0)
            assert not any(t.done() for t in tasks)
            partition(pair)
            cut_at.append(time.monotonic())
            _done, pending = await asyncio.wait(tasks, timeout=bound + 60)
            assert not pending, f"calls still pending {bound + 60:.0f} s into the partition: {pending}"
            for t in tasks:
                exc = t.exception()
                assert isinstance(exc, ConnectionResetError | TimeoutError), repr(exc)
                assert isinstance(exc, rdmaio.RdmaError), repr(exc)
            with pytest.raises(ConnectionResetError):
                await ep.send(b"later")
            await ep.aclose()
            return outcome

        outcome = arun(main())
    finally:
        proc.kill()
        proc.wait()
    print("pending calls after the partition began:", outcome, f"(bound {bound:.1f} s)")
    for name, (kind, after) in outcome.items():
        record_property(f"{name}_failed_after_s", round(after, 2))
        record_property(f"{name}_error", kind)
        assert after <= bound + VM_SLACK, (name, after, bound)
    assert set(outcome) == {"send", "recv", "drain"}
