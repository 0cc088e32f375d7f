"""rdmaio.core.keepalive with fake connections: tick logic, the shared timers on asyncio, uvloop, trio; the
probe per transport (a READ under a deadline on iWARP, the WRITE elsewhere) on whole fake connections."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import trio
import uvloop

import rdmaio
from rdmaio.core.backend import AsyncioBackend, Backend, TrioBackend
from rdmaio.core.keepalive import (
    KEEPALIVE_WR_ID,
    KEEPALIVE_WR_KIND,
    Keepalive,
    KeepaliveTimers,
    ack_timeout_seconds,
    detection_bound,
    retry_budget,
)
from rdmaio.core.negotiation import local_handshake
from rdmaio.options import Options
from rdmaio.protocol import Capabilities
from rdmaio.testing.nullpair import null_pair

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

    def make(self, io: Backend | KeepaliveTimers | None, interval: float | None) -> Keepalive:
        timers: Any = KeepaliveTimers(io) if io is not None and not isinstance(io, KeepaliveTimers) else io
        self.keepalive = Keepalive(timers, interval, self.progress, self.probe, self.errors.append)
        return self.keepalive


class ManualTimers:
    """A backend whose ``call_later`` timers fire only when the test says so."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None]]] = []
        self.armed = 0

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.armed += 1
        self.pending.append((delay, callback))

    def fire(self, delay: float) -> None:
        due = [cb for d, cb in self.pending if d == delay]
        self.pending = [(d, cb) for d, cb in self.pending if d != delay]
        for callback in due:
            callback()


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
def test_timers_probe_an_idle_connection_and_stop_ends_it(backend: str) -> None:
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
def test_timers_stay_quiet_while_busy(backend: str) -> None:
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
def test_off_keepalive_joins_no_timer(backend: str) -> None:
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


def test_keepalives_of_one_interval_share_one_timer() -> None:
    """Many cheap connections: a thousand idle connections cost one timer per interval, not a
    task each, and stopping a keepalive (every connection's close) wakes nothing."""
    clock = ManualTimers()
    backend: Any = clock
    timers = KeepaliveTimers(backend)
    conns = [FakeConnection() for _ in range(50)]
    for conn in conns:
        conn.make(timers, 1.0).start()
    assert len(timers) == 50
    assert clock.armed == 1 and len(clock.pending) == 1  # one timer for all of them
    clock.fire(1.0)  # the first tick only samples
    assert [c.posted for c in conns] == [0] * 50
    assert len(clock.pending) == 1  # re-armed
    clock.fire(1.0)  # a whole idle interval: every one probes once
    assert [c.posted for c in conns] == [1] * 50
    for conn in conns[1:]:
        assert conn.keepalive is not None
        conn.keepalive.stop()
    assert len(timers) == 1
    clock.fire(1.0)
    assert conns[0].posted == 2
    assert [c.posted for c in conns[1:]] == [1] * 49  # stopped ones are ticked no more
    other = FakeConnection()
    other.make(timers, 2.5).start()  # another interval: its own timer
    assert len(clock.pending) == 2
    assert conns[0].keepalive is not None
    conns[0].keepalive.stop()
    clock.fire(1.0)  # nobody left at 1.0: that timer is not re-armed
    assert [d for d, _ in clock.pending] == [2.5]
    conns[0].make(timers, 1.0).start()  # a new keepalive re-arms it
    assert sorted(d for d, _ in clock.pending) == [1.0, 2.5]


def test_a_failing_tick_is_logged_and_drops_only_that_keepalive(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualTimers()
    backend: Any = clock
    timers = KeepaliveTimers(backend)
    bad, good = FakeConnection(), FakeConnection()

    def broken() -> int:
        raise RuntimeError("progress() has a bug")

    bad.progress = broken  # type: ignore[method-assign]
    bad.make(timers, 1.0).start()
    good.make(timers, 1.0).start()
    clock.fire(1.0)
    clock.fire(1.0)
    assert good.posted == 1
    assert len(timers) == 1
    assert "keepalive tick failed" in caplog.text


# --- per transport: on iWARP a READ probe under a deadline, elsewhere the WRITE probe the RC retry counter
# fails. On iWARP a WRITE completes without the peer and no retry counter ever fails a request.

IWARP = Capabilities(immediate=False, atomics=False, memory_windows=False, max_inline=64, max_read_sge=1)
# Short interval and the smallest retry budget: (0 + 1) * 4.096 us * 2**1 (tests assert state, not time).
TRANSPORT_OPTIONS = rdmaio.Options(
    slot_size=256,
    recv_depth=8,
    send_depth=8,
    initial_depth=4,
    batch_limit=64,
    rndv_threshold=0,
    keepalive_interval=0.02,
    ack_timeout=1,
    retry_count=0,
)
BOUND = 5.0  # turns a pending recv() on a broken build into a failure, not a duration assertion


def test_retry_budget_is_the_detection_bound_less_two_intervals() -> None:
    assert retry_budget(17, 6) == pytest.approx(7 * 0.536870912)
    assert detection_bound(10.0, 17, 6) == pytest.approx(20.0 + retry_budget(17, 6))


def _keepalive(conn: FakeConnection, io: Backend, deadline: float | None) -> Keepalive:
    conn.keepalive = Keepalive(
        KeepaliveTimers(io), None, conn.progress, conn.probe, conn.errors.append, probe_deadline=deadline
    )
    return conn.keepalive


@pytest.mark.parametrize("backend", sorted(RUNNERS))
def test_an_unanswered_probe_fails_at_its_deadline(backend: str) -> None:
    async def test(io: Backend) -> None:
        conn = FakeConnection(acknowledge=False)
        ka = _keepalive(conn, io, 0.03)
        assert ka.probe_deadline == 0.03
        ka.probe_now()
        assert ka.outstanding and conn.errors == []
        while not conn.errors:
            await io.sleep(0.01)
        [error] = conn.errors
        assert isinstance(error, rdmaio.ConnectionResetError) and isinstance(error, ConnectionResetError)
        assert "retry" in str(error), error
        assert ka.probes_expired == 1 and ka.probes_completed == 0  # the probe never completed
        ka.probe_now()  # stopped by its failure: no second probe, no second error
        await io.sleep(0.06)
        assert conn.posted == 1 and len(conn.errors) == 1

    RUNNERS[backend](test)


@pytest.mark.parametrize("backend", sorted(RUNNERS))
def test_an_answered_probe_cancels_its_deadline(backend: str) -> None:
    async def test(io: Backend) -> None:
        conn = FakeConnection(acknowledge=False)
        ka = _keepalive(conn, io, 0.03)
        for _ in range(3):
            ka.probe_now()
            ka.on_completion()  # the peer answered
        await io.sleep(0.1)  # three deadlines' time: none may fire
        assert conn.errors == [] and ka.probes_expired == 0 and conn.posted == 3
        conn.acknowledge = True  # answered within the post: no deadline armed at all
        ka.probe_now()
        await io.sleep(0.05)
        assert conn.errors == [] and ka.probes_completed == 4
        ka.probe_now()  # stop() with a probe in flight cancels its deadline too
        ka.stop()
        await io.sleep(0.05)
        assert conn.errors == []

    RUNNERS[backend](test)


def test_bad_probe_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match="deadline"):
        Keepalive(KeepaliveTimers(Any), 1.0, int, print, print, probe_deadline=0)  # type: ignore[arg-type]


async def _pair(caps: Capabilities | None) -> tuple[Any, Any]:
    hs = local_handshake(TRANSPORT_OPTIONS, grow=False, caps=caps)
    a, b, _device = null_pair(TRANSPORT_OPTIONS, hs, keepalive=True)
    if caps is not None and not caps.immediate:
        for ep in (a, b):
            transport: Any = ep._conn.transport
            transport.qp.immediate = False  # the device refuses immediate data, as libsiw does
    return a, b


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_iwarp_probes_with_a_read_and_a_vanished_peer_fails_idle_recv(loop: str) -> None:
    """The peer stops answering (the fake never completes a probe: a host gone, TCP retransmitting):
    the idle recv() fails with ConnectionResetError naming the retry budget, through the probe's READ.
    On a WRITE probe without deadline (the old iWARP behaviour) recv() stays pending past BOUND."""

    async def main() -> None:
        a, b = await _pair(IWARP)
        assert a._conn.framing.name == "header"
        with pytest.raises(rdmaio.ConnectionResetError) as failed:
            await asyncio.wait_for(a.recv(), BOUND)
        assert "retry" in str(failed.value), failed.value
        qp = a._conn.transport.qp
        assert len(qp.empty_reads) == 1 and qp.empty_writes == []  # one READ probe, no WRITE
        assert a._conn._keepalive.probes_expired == 1
        assert a.statistics()["keepalive_probes"] == 1
        b.abort()

    _run(loop, main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_roce_keeps_the_write_probe_and_no_deadline(loop: str) -> None:
    """Elsewhere the probe stays a zero-length WRITE and only the QP's retry counter fails it: an
    unanswered one (the fake has no retry counter) never fails the connection by our clock."""

    async def main() -> None:
        a, b = await _pair(None)
        assert a._conn.framing.immediate
        assert a._conn._keepalive.probe_deadline is None
        qp = a._conn.transport.qp
        recv = asyncio.ensure_future(a.recv())
        for _ in range(500):  # bounded: a probe comes one or two intervals in
            if qp.empty_writes:
                break
            await asyncio.sleep(0.01)
        assert qp.empty_writes
        for _ in range(20):  # many intervals and many times the retry budget of OPTIONS
            await asyncio.sleep(0.01)
        assert not recv.done()  # still waiting: nothing of ours failed it
        assert len(qp.empty_writes) == 1 and qp.empty_reads == []  # one in flight at most, a WRITE
        await b.send(b"alive")
        assert await asyncio.wait_for(recv, BOUND) == b"alive"
        a.abort()
        b.abort()

    _run(loop, main())


def _run(loop: str, coro: Coroutine[Any, Any, None]) -> None:
    factory = asyncio.new_event_loop if loop == "asyncio" else uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)
