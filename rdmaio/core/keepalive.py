"""Keepalive: detect a vanished peer on an idle connection.

RC transport only notices a dead peer when it has something unacknowledged to retransmit: an endpoint
idle in ``recv()`` has only posted receives, which never time out, so without a probe it would wait
forever for a peer whose host crashed or whose network went away (no DREQ ever arrives).

:class:`Keepalive` watches a connection's progress (completions and posted frames). When a whole
``interval`` passed without any, it posts one probe: a signalled zero-length RDMA WRITE
(:meth:`rdmaio.verbs.QueuePair.post_empty_write`). It consumes no receive and no credit at the peer and
produces no completion there; the peer's RC transport just acknowledges it. If the peer is gone the
probe's retry timer runs out (``retry_count + 1`` ACK timeouts of ``4.096 us * 2**ack_timeout``) and the
probe completes with ``IBV_WC_RETRY_EXC_ERR``, which fails the endpoint like any other failed work
request: every pending and later call raises :class:`~rdmaio.ConnectionResetError`.

On iWARP (Soft-iWARP, Chelsio, E810 in iWARP mode) neither half of that holds: a signalled WRITE completes
as soon as the local TCP stack took it, and there is no RC retry counter (``ack_timeout`` and
``retry_count`` are ignored; TCP retransmits for about 15 minutes). So an iWARP connection probes with a
zero-length RDMA READ (:meth:`rdmaio.verbs.QueuePair.post_empty_read`), whose completion needs the peer's
response, and gives the outstanding probe a deadline equal to the retry budget the options describe
(:func:`retry_budget`): unanswered by then, the connection fails with
:class:`~rdmaio.ConnectionResetError` ("keepalive probe unanswered within the retry budget"), the same
path a failed work request takes, so the bound of :func:`detection_bound` holds there too. A connection
whose traffic stalls (a peer gone mid-stream stops returning credits and, on iWARP, TCP stops taking
data) makes no progress, so the idle probe goes out and the same deadline applies. On InfiniBand and
RoCE the probe stays a WRITE with no deadline: the RC retry counter fails it, and real devices may wait
longer per timeout than nominal, so a deadline there could fire before the transport's own verdict.

A busy connection sends no probe (its traffic is the probe: unacknowledged sends are retransmitted and
time out the same way), and an idle one sends at most one per interval, one at a time.

Detection bound on an idle connection: the idleness is sampled once per ``interval``, so a probe goes out
between one and two intervals after the last activity; then the retry budget runs. See
:func:`detection_bound`.

The sampling is driven by :class:`KeepaliveTimers`, one per event loop: one timer per distinct interval
ticks every keepalive with that interval, so a thousand idle connections cost one timer, not a thousand
sleeping tasks, and starting or stopping a keepalive is a set insertion or removal (no task to create or
to wake at close: both sit on every connection's setup and teardown).

The probe's work request id carries operation kind :data:`KEEPALIVE_WR_KIND` in its top 8 bits
(``wr_id >> 56``), so the connection routes its completion here instead of to the sender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rdmaio.core.backend import Backend, Handle
from rdmaio.errors import ConnectionResetError
from rdmaio.verbs import WR_KIND_CONTROL

__all__ = [
    "KEEPALIVE_WR_ID",
    "KEEPALIVE_WR_KIND",
    "RDMA_CM_ACK_TIMEOUT",
    "Keepalive",
    "KeepaliveTimers",
    "ack_timeout_seconds",
    "detection_bound",
    "retry_budget",
]

log = logging.getLogger("rdmaio")

KEEPALIVE_WR_KIND = WR_KIND_CONTROL
"""Operation kind of control/keepalive work requests (``wr_id >> 56``; the verbs layer's wr_id layout)."""
KEEPALIVE_WR_ID = KEEPALIVE_WR_KIND << 56
"""The ``wr_id`` of a keepalive probe with tag and index 0 (the endpoint adds its connection tag)."""


RDMA_CM_ACK_TIMEOUT = 19
"""The ACK timeout exponent rdma_cm gives a queue pair when the options leave ``ack_timeout`` None."""


def ack_timeout_seconds(exponent: int) -> float:
    """The local ACK timeout an exponent stands for: ``4.096 us * 2**exponent`` (IBTA 9.7.6.1.3)."""
    return 4.096e-6 * (1 << exponent)


def retry_budget(ack_timeout: int, retry_count: int) -> float:
    """Seconds the RC transport gives one unacknowledged request before failing it, by the
    specification: the first transmission and ``retry_count`` retransmissions, one ACK timeout each
    (the deadline of a probe on iWARP, which has no retry counter of its own)."""
    return (retry_count + 1) * ack_timeout_seconds(ack_timeout)


def detection_bound(interval: float, ack_timeout: int, retry_count: int) -> float:
    """Worst-case seconds from a peer vanishing to an idle endpoint failing, by the specification.

    Two intervals (idleness is sampled once per interval) plus the retry budget: the first transmission
    and ``retry_count`` retransmissions, each given one ACK timeout. Real devices may wait up to four
    times longer per timeout than nominal (IBTA allows it); rxe uses the nominal value.
    """
    return 2 * interval + retry_budget(ack_timeout, retry_count)


class Keepalive:
    """Probe the peer of one connection when it has been idle for ``interval`` seconds.

    ``progress()`` returns a counter that grows with the connection's activity (it may include this
    keepalive's own completions: they are subtracted). ``probe()`` posts one probe whose completion must
    be reported with :meth:`on_completion`; an exception from it is passed to ``on_error`` and stops the
    keepalive. ``interval`` None makes a keepalive that never probes. Ticked by the loop's
    :class:`KeepaliveTimers` between :meth:`start` and :meth:`stop`.

    ``probe_deadline`` (seconds; iWARP, whose transport never fails an unanswered request in time): a
    probe not completed that long after it was posted passes a :class:`~rdmaio.ConnectionResetError` to
    ``on_error`` and stops the keepalive. None (InfiniBand, RoCE): the QP's retry counter decides.
    """

    def __init__(
        self,
        timers: KeepaliveTimers,
        interval: float | None,
        progress: Callable[[], int],
        probe: Callable[[], None],
        on_error: Callable[[BaseException], None],
        *,
        name: str = "rdmaio keepalive",
        probe_deadline: float | None = None,
    ) -> None:
        if interval is not None and not interval > 0:
            raise ValueError("keepalive interval must be positive (or None to turn keepalive off)")
        if probe_deadline is not None and not probe_deadline > 0:
            raise ValueError("keepalive probe deadline must be positive (or None for none)")
        self._timers = timers
        self._interval = interval
        self._progress = progress
        self._probe = probe
        self._on_error = on_error
        self._name = name
        self._started = False
        self._stopped = False
        self._last = -1  # never equal to a first sample: the first tick after start never probes
        self._probe_deadline = probe_deadline
        self._deadline_timer: Handle | None = None  # armed while a probe with a deadline is outstanding
        self.outstanding = False
        """True while a probe is posted and not yet completed."""
        self.probes_sent = 0
        """Probes posted so far."""
        self.probes_completed = 0
        """Probes the peer acknowledged so far."""
        self.probes_expired = 0
        """Probes that passed their deadline unanswered (each one failed the connection)."""

    @property
    def probe_deadline(self) -> float | None:
        """Seconds an outstanding probe may stay unanswered before the connection fails (iWARP); None
        when the transport's retry counter decides."""
        return self._probe_deadline

    @property
    def interval(self) -> float | None:
        """Seconds of idleness before a probe; None when keepalive is off."""
        return self._interval

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop` (always False when the interval is None)."""
        return self._started and not self._stopped

    def start(self) -> None:
        """Join the loop's timers (no effect when the interval is None, or when started or stopped)."""
        if self._interval is None or self._started or self._stopped:
            return
        self._started = True
        self._timers.add(self, self._interval)

    def stop(self) -> None:
        """Stop probing: no tick reaches this keepalive any more. Idempotent; a probe in flight is left to
        its QP."""
        if self._stopped:
            return
        self._stopped = True
        if self._deadline_timer is not None:  # tested inline: stop() is on every connection's teardown
            self._cancel_deadline()
        if self._started and self._interval is not None:
            self._timers.discard(self, self._interval)

    def on_completion(self) -> None:
        """The peer acknowledged the probe in flight (a successful completion of :data:`KEEPALIVE_WR_ID`)."""
        self.outstanding = False
        self.probes_completed += 1
        if self._deadline_timer is not None:
            self._cancel_deadline()

    def probe_now(self) -> None:
        """Probe at once unless a probe is in flight or this keepalive was stopped (used on a port error:
        if the port stays down the probe fails within the retry budget, if it comes back in time the
        connection survives). Works even when the interval is None: one probe on a real event."""
        if self._stopped or self.outstanding:
            return
        self._post()

    def tick(self) -> None:
        """One timer expiry: probe if nothing happened since the previous one and no probe is in flight."""
        if self._stopped:
            return
        # The probe's own completion is activity to progress() but not to us: without subtracting it
        # an idle connection would be probed only every other interval.
        sample = self._progress() - self.probes_completed
        if sample != self._last:
            self._last = sample
            return
        if self.outstanding:
            return  # its retry timer is running: it either completes or fails the connection
        self._post()

    def _post(self) -> None:
        self.outstanding = True
        self.probes_sent += 1
        try:
            self._probe()
        except Exception as exc:
            self.outstanding = False
            self.stop()
            self._on_error(exc)
            return
        if self._probe_deadline is not None and self.outstanding:  # not answered within the post itself
            self._deadline_timer = self._timers.call_later(self._probe_deadline, self._deadline_passed)

    def _cancel_deadline(self) -> None:
        timer, self._deadline_timer = self._deadline_timer, None
        if timer is not None:
            timer.cancel()

    def _deadline_passed(self) -> None:
        """The outstanding probe's deadline: unanswered, the peer is presumed gone."""
        self._deadline_timer = None
        if self._stopped or not self.outstanding:
            return  # answered or stopped in the same loop iteration as the timer fired
        self.probes_expired += 1
        self.stop()
        # "retry" in the message: the same verdict an RC retry counter gives (RETRY_EXC_ERR), reached
        # by the clock because iWARP has none.
        self._on_error(
            ConnectionResetError(
                f"keepalive probe unanswered within the retry budget ({self._probe_deadline:g} s): "
                "peer presumed gone",
                errno=104,
                call="keepalive",
            )
        )

    def __repr__(self) -> str:
        state = "off" if self._interval is None else "running" if self.running else "stopped"
        return f"<{self._name} {state} interval={self._interval} sent={self.probes_sent}>"


class KeepaliveTimers:
    """The timers of every :class:`Keepalive` of one event loop: one per distinct interval.

    Each timer ticks every keepalive of its interval once per interval, then re-arms while any is left;
    a keepalive added between two ticks is first ticked at the next one (which only samples it), so each
    is still ticked once per interval and probes between one and two intervals after its last activity.
    Works on any backend (``call_later``: a loop timer on asyncio/uvloop, a system task on trio).
    """

    def __init__(self, backend: Backend) -> None:
        self._io = backend
        # interval -> the keepalives of that interval, as an ordered set (ticked in start order)
        self._groups: dict[float, dict[Keepalive, None]] = {}

    def add(self, keepalive: Keepalive, interval: float) -> None:
        """Tick ``keepalive`` every ``interval`` seconds from the next tick of that interval on."""
        group = self._groups.get(interval)
        if group is None:
            group = self._groups[interval] = {}
            self._arm(interval)
        group[keepalive] = None

    def discard(self, keepalive: Keepalive, interval: float) -> None:
        """Tick ``keepalive`` no more (the timer of an interval left empty stops at its next expiry)."""
        group = self._groups.get(interval)
        if group is not None:
            group.pop(keepalive, None)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        """Run ``callback`` after ``delay`` seconds on this loop (a probe's deadline); cancellable."""
        return self._io.call_later(delay, callback)

    def __len__(self) -> int:
        """Keepalives ticked now."""
        return sum(len(group) for group in self._groups.values())

    def _arm(self, interval: float) -> None:
        self._io.call_later(interval, lambda: self._expired(interval))

    def _expired(self, interval: float) -> None:
        group = self._groups.get(interval)
        if not group:
            self._groups.pop(interval, None)  # nobody left: the timer stops; the next add re-arms it
            return
        for keepalive in list(group):  # a tick may stop keepalives (a failed probe fails a connection)
            try:
                keepalive.tick()
            except Exception:  # a bug in a callback: log it, stop that one, keep ticking the others
                log.exception("rdmaio: keepalive tick failed")
                group.pop(keepalive, None)
        self._arm(interval)
