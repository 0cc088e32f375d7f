"""rdmaio.core.keepalive with fake connections: tick logic, the timer task on asyncio, uvloop, trio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import trio
import uvloop

from rdmaio.core.backend import AsyncioBackend, Backend, TrioBackend
from rdmaio.core.keepalive import (
    KEEPALIVE_WR_ID,
    KEEPALIVE_WR_KIND,
    Keepalive,
    ack_timeout_seconds,
    detection_bound,
)
from rdmaio.options import Options

Runner = Callable[[Callable[[Backend], Coroutine[Any, Any, None]]], None]


def _run_asyncio(factory: Callable[[], asyncio.AbstractEventLoop]) -> Runner:
    def run(test: Callable[[Backend], Coroutine[Any, Any, None]]) -> None:
        async def main() -> None:
            await asyncio.wait_for(test(AsyncioBackend(asyncio.get_running_loop())), 20)

        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())

    return run


def _run_trio(test: Callable[[Backend], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        with trio.fail_after(20):
            await test(TrioBackend())

    trio.run(main)


RUNNERS: dict[str, Runner] = {
    "asyncio": _run_asyncio(asyncio.new_event_loop),
    "uvloop": _run_asyncio(uvloop.new_event_loop),
    "trio": _run_trio,
}


class FakeConnection:
    """What an endpoint gives a keepalive: an activity counter, a probe poster, a failure sink."""

    def __init__(self, *, acknowledge: bool = True, post_error: Exception | None = None) -> None:
        self.activity = 0
        self.acknowledge = acknowledge
        self.post_error = post_error
        self.posted = 0
        self.errors: list[BaseException] = []
        self.keepalive: Keepalive | None = None

    def progress(self) -> int:
        return self.activity

    def probe(self) -> None:
        if self.post_error is not None:
            raise self.post_error
        self.posted += 1
        if self.acknowledge:
            # The probe's completion is counted as a completion by the endpoint, then routed to us.
            self.activity += 1
            assert self.keepalive is not None
            self.keepalive.on_completion()

    def make(self, io: Backend | None, interval: float | None) -> Keepalive:
        backend: Any = io
        self.keepalive = Keepalive(backend, interval, self.progress, self.probe, self.errors.append)
        return self.keepalive


def test_wr_id_kind_is_in_the_top_byte() -> None:
    assert KEEPALIVE_WR_KIND == 3
    assert KEEPALIVE_WR_ID >> 56 == KEEPALIVE_WR_KIND
    assert KEEPALIVE_WR_ID & ((1 << 56) - 1) == 0
    assert KEEPALIVE_WR_ID < 2**64


def test_detection_bound_of_the_defaults_is_under_30_s() -> None:
    opts = Options()
    assert opts.keepalive_interval is not None and opts.ack_timeout is not None
    bound = detection_bound(opts.keepalive_interval, opts.ack_timeout, opts.retry_count)
    assert ack_timeout_seconds(17) == pytest.approx(0.536870912)
    assert bound == pytest.approx(2 * 10.0 + 7 * 0.536870912)  # retry_count 6: 23.8 s
    assert bound <= 30.0


def test_the_default_retry_budget_is_finite_on_rxe() -> None:
    """rxe never counts a retry budget of 7 down (its completer skips the decrement at 7): with it a dead
    peer is never detected there, and the keepalive bound above is void (the fault suite's default-options
    case hung past bound + 60 s with 7). 6 is finite everywhere."""
    assert Options().retry_count <= 6


def test_options_validate_keepalive_fields() -> None:
    assert Options(keepalive_interval=None, ack_timeout=None).keepalive_interval is None
    with pytest.raises(ValueError, match="keepalive_interval"):
        Options(keepalive_interval=0)
    with pytest.raises(ValueError, match="ack_timeout"):
        Options(ack_timeout=0)
    with pytest.raises(ValueError, match="ack_timeout"):
        Options(ack_timeout=32)


def test_first_tick_only_samples_then_idle_ticks_probe_once_per_interval() -> None:
    conn = FakeConnection()
    ka = conn.make(None, 1.0)
    ka.tick()
    assert conn.posted == 0  # nothing known yet about the idle time
    for expected in range(1, 4):
        ka.tick()
        assert conn.posted == expected  # its own completion does not count as activity
    assert ka.probes_sent == ka.probes_completed == 3
    assert not ka.outstanding


def test_busy_connection_sends_no_probe() -> None:
    conn = FakeConnection()
    ka = conn.make(None, 1.0)
    for _ in range(10):
        conn.activity += 5  # completions or posts between every two ticks
        ka.tick()
    assert conn.posted == 0
    ka.tick()  # one quiet interval: now it probes
    assert conn.posted == 1


def test_one_probe_in_flight_at_most() -> None:
    conn = FakeConnection(acknowledge=False)
    ka = conn.make(None, 1.0)
    for _ in range(6):
        ka.tick()
    assert conn.posted == 1
    assert ka.outstanding
    ka.on_completion()
    conn.activity += 1
    assert not ka.outstanding
    ka.tick()
    ka.tick()
    assert conn.posted == 2


def test_post_failure_is_reported_and_stops_probing() -> None:
    boom = OSError("ibv_post_send failed")
    conn = FakeConnection(post_error=boom)
    ka = conn.make(None, 1.0)
    ka.tick()
    ka.tick()
    assert conn.errors == [boom]
    assert not ka.outstanding
    ka.tick()
    ka.tick()
    assert conn.errors == [boom]  # stopped: no second attempt


def test_stopped_keepalive_never_probes() -> None:
    conn = FakeConnection()
    ka = conn.make(None, 1.0)
    ka.stop()
    ka.tick()
    ka.tick()
    assert conn.posted == 0


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        FakeConnection().make(None, 0)
    with pytest.raises(ValueError):
        FakeConnection().make(None, -1.0)


@pytest.mark.parametrize("backend", sorted(RUNNERS))
def test_timer_task_probes_an_idle_connection_and_stop_ends_it(backend: str) -> None:
    async def test(io: Backend) -> None:
        conn = FakeConnection()
        ka = conn.make(io, 0.02)
        ka.start()
        assert ka.running
        while conn.posted < 3:
            await io.sleep(0.01)
        ka.stop()
        assert not ka.running
        posted = conn.posted
        await io.sleep(0.1)  # five intervals: a live timer would have probed again
        assert conn.posted == posted
        assert conn.errors == []

    RUNNERS[backend](test)


@pytest.mark.parametrize("backend", sorted(RUNNERS))
def test_timer_task_stays_quiet_while_busy(backend: str) -> None:
    async def test(io: Backend) -> None:
        conn = FakeConnection()
        ka = conn.make(io, 0.05)
        ka.start()
        for _ in range(30):  # 0.3 s = 6 intervals of steady activity
            conn.activity += 1
            await io.sleep(0.01)
        assert conn.posted == 0
        while conn.posted == 0:  # activity stopped: a probe follows
            await io.sleep(0.01)
        ka.stop()

    RUNNERS[backend](test)


@pytest.mark.parametrize("backend", sorted(RUNNERS))
def test_off_keepalive_starts_no_task(backend: str) -> None:
    async def test(io: Backend) -> None:
        conn = FakeConnection()
        ka = conn.make(io, None)
        ka.start()
        assert not ka.running
        await io.sleep(0.05)
        assert conn.posted == 0  # no timer runs, so nothing is ever probed
        assert "off" in repr(ka)
        ka.stop()

    RUNNERS[backend](test)


def test_probe_now_probes_once_even_with_the_interval_off() -> None:
    conn = FakeConnection(acknowledge=False)
    ka = conn.make(None, None)
    ka.probe_now()
    ka.probe_now()  # one in flight: no second
    assert conn.posted == 1
    ka.on_completion()
    ka.probe_now()
    assert conn.posted == 2
    ka.stop()
    ka.on_completion()
    ka.probe_now()
    assert conn.posted == 2
