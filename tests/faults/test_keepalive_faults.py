"""Keepalive in the pair topology: a peer host that vanishes is detected while this side is idle in recv().

"The host vanishes" is simulated as a crash behind a switch: its processes are frozen (SIGSTOP, so its
kernel sends no disconnect) and the wire drops everything (netem 100 % loss both ways), while this side's
link stays up (no port event to notice). Only a probe can tell, so the tests also check that without
keepalive the same recv() is still pending long after the bound.

Bounds are checked against :func:`rdmaio.core.keepalive.detection_bound` plus a slack for the emulated VM's
timer and scheduling delays (``VM_SLACK``); the measured times are printed and recorded in the report.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import trio
from netfault import ECHO_SERVER, Pair, connected, partition, peer, wait_ready

import rdmaio
from rdmaio.core.keepalive import detection_bound

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
VM_SLACK = 10.0  # seconds: timers and the scheduler of a 1-vCPU emulated VM lag, never by more than this
FAST = rdmaio.Options(keepalive_interval=2.0, ack_timeout=16, retry_count=5)
FAST_BOUND = detection_bound(2.0, 16, 5)  # 5.6 s


def _bound(opts: rdmaio.Options) -> float:
    assert opts.keepalive_interval is not None and opts.ack_timeout is not None
    return detection_bound(opts.keepalive_interval, opts.ack_timeout, opts.retry_count)


def _idle_detection(
    arun: Runner, pair: Pair, opts: rdmaio.Options, record_property: Callable[[str, object], None]
) -> float:
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> float:
            ep = await connected(pair, port, opts)
            pending = asyncio.create_task(ep.recv())
            await asyncio.sleep(0.5)
            assert not pending.done()
            proc.send_signal(signal.SIGSTOP)
            partition(pair)
            vanished = time.monotonic()
            with pytest.raises(ConnectionResetError) as failed:
                await asyncio.wait_for(pending, _bound(opts) + 60)
            elapsed = time.monotonic() - vanished
            assert isinstance(failed.value, rdmaio.RdmaError)
            assert "retry" in str(failed.value), failed.value
            # future calls fail too, at once
            with pytest.raises(ConnectionResetError):
                await ep.send(b"after")
            with pytest.raises(ConnectionResetError):
                await ep.recv()
            await ep.aclose()
            return elapsed

        elapsed: float = arun(main())
    finally:
        proc.kill()
        proc.wait()
    bound = _bound(opts)
    print(f"idle recv() failed {elapsed:.1f} s after the peer vanished (bound {bound:.1f} s)")
    record_property("detected_after_s", round(elapsed, 2))
    record_property("bound_s", round(bound, 2))
    assert elapsed <= bound + VM_SLACK, (elapsed, bound)
    return elapsed


@pytest.mark.timeout(180)
def test_vanished_peer_fails_idle_recv_within_bound(
    arun: Runner, pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    _idle_detection(arun, pair, FAST, record_property)


# In CI's bounded run too: it caught a default retry_count (7) that rxe never counts down.
@pytest.mark.timeout(180)
def test_vanished_peer_with_default_options_within_30_s(
    pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    opts = rdmaio.Options()
    assert _bound(opts) <= 30.0

    def run(coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run(coro)

    _idle_detection(run, pair, opts, record_property)


@pytest.mark.timeout(180)
def test_vanished_peer_on_trio(pair: Pair, record_property: Callable[[str, object], None]) -> None:
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> float:
            ep = await rdmaio.connect(
                pair.b.addr, port, local_addr=(pair.a.addr, 0), options=FAST, timeout=30
            )
            await ep.send(b"hello")
            assert await ep.recv() == b"hello"
            proc.send_signal(signal.SIGSTOP)
            partition(pair)
            vanished = time.monotonic()
            with trio.fail_after(FAST_BOUND + 60), pytest.raises(ConnectionResetError):
                await ep.recv()  # idle from here on: only the keepalive can notice
            elapsed = time.monotonic() - vanished
            await ep.aclose()
            return elapsed

        elapsed = trio.run(main)
    finally:
        proc.kill()
        proc.wait()
    print(f"trio: idle recv() failed {elapsed:.1f} s after the peer vanished (bound {FAST_BOUND:.1f} s)")
    record_property("detected_after_s", round(elapsed, 2))
    assert elapsed <= FAST_BOUND + VM_SLACK


@pytest.mark.long
@pytest.mark.timeout(180)
def test_without_keepalive_idle_recv_stays_pending(pair: Pair) -> None:
    """The control: keepalive off, the same fault goes unnoticed (the failure keepalive exists to catch)."""
    opts = rdmaio.Options(keepalive_interval=None, ack_timeout=16, retry_count=5)
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> None:
            ep = await connected(pair, port, opts)
            pending = asyncio.create_task(ep.recv())
            proc.send_signal(signal.SIGSTOP)
            partition(pair)
            await asyncio.sleep(FAST_BOUND + 5)
            assert not pending.done(), "recv() ended without keepalive: the control does not hold"
            assert ep.statistics()["keepalive_probes"] == 0
            ep.abort()
            with pytest.raises(ConnectionError):  # abort() wakes it (EndpointClosedError today)
                await pending

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(180)
def test_busy_connection_sends_no_probes_and_idle_probes_are_harmless(arun: Runner, pair: Pair) -> None:
    opts = rdmaio.Options(keepalive_interval=1.0)
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> None:
            ep = await connected(pair, port, opts)
            end = time.monotonic() + 5.0  # five intervals of steady echo traffic
            rounds = 0
            while time.monotonic() < end:
                await ep.send(b"x" * 4096)
                assert await ep.recv() == b"x" * 4096
                rounds += 1
            busy_probes = ep.statistics()["keepalive_probes"]
            await asyncio.sleep(5.0)  # idle: probes go out and are acknowledged
            idle_probes = ep.statistics()["keepalive_probes"]
            await ep.send(b"still there")
            assert await ep.recv() == b"still there"
            await ep.aclose()
            print(f"{rounds} echo rounds in 5 s: {busy_probes} probes; 5 s idle: {idle_probes - busy_probes}")
            assert rounds > 0
            assert busy_probes == 0
            assert idle_probes - busy_probes >= 2

        arun(main())
    finally:
        proc.kill()
        proc.wait()
