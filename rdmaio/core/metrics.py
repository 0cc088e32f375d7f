"""The process's connection registry behind :mod:`rdmaio.metrics`: pull-based, nothing on the data path.

Every connection already counts what it does (:meth:`Connection.statistics
<rdmaio.core.connection.Connection.statistics>`: its counter, its session's state, its one-sided engine).
So the registry never counts a message: each :class:`~rdmaio.core.connection.Connection` registers itself
(a weak reference, with its device and loop labels) when it is established
(:func:`register_connection`), and folds its final counters into the process totals when it is torn down
(:func:`fold_connection`); a snapshot (:func:`connection_totals`) sums the live connections' counters and
the folded ones. The same for each loop's :class:`~rdmaio.core.domain.Domain` (registration cache,
completion dispatcher: :func:`fold_domain` at its close) and each server's acceptor (its rejections:
:func:`register_acceptor`, :func:`fold_acceptor`). Errors are counted where they are raised, once each
(:func:`connection_failed`, :func:`connect_failed`).

What that costs: three Python calls per connection at setup and teardown together (register, fold, and
the one-sided engine's ``statistics()``), none per message, frame or completion.

Labels: ``device`` (the RDMA device's name; ``""`` when none is known, e.g. a connect that failed before
it resolved one) and ``loop`` (``asyncio-1``, ``uvloop-2``, ``trio-1``: the kind of the event loop and the
order in which this process's loops first used rdmaio).
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rdmaio.core.domain import Domain
from rdmaio.errors import ConnectionRefusedError as RefusedError

if TYPE_CHECKING:
    from rdmaio.core.acceptor import Acceptor
    from rdmaio.core.connection import Connection

__all__ = [
    "CONNECTION_COUNTERS",
    "DOMAIN_COUNTERS",
    "Labels",
    "acceptor_totals",
    "connect_failed",
    "connection_failed",
    "connection_totals",
    "domain_gauges",
    "domain_totals",
    "failure_totals",
    "fold_acceptor",
    "fold_connection",
    "fold_domain",
    "live_connections",
    "loop_label",
    "refusal_totals",
    "register_acceptor",
    "register_connection",
    "reset",
]

Labels = tuple[str, str]
"""``(device, loop)``."""

CONNECTION_COUNTERS: tuple[str, ...] = (
    "opened",
    "closed",
    "bytes_sent",
    "bytes_received",
    "messages_sent",
    "messages_received",
    "frames_sent",
    "frames_received",
    "rndv_sent",
    "rndv_received",
    "rndv_bytes_sent",
    "rndv_bytes_received",
    "onesided_reads",
    "onesided_writes",
    "onesided_fetch_adds",
    "onesided_compare_swaps",
    "completions",
    "completion_batches",
    "keepalive_probes",
    "keepalive_failures",
)
"""The counters kept per (device, loop) for connections (see :func:`connection_totals`)."""

DOMAIN_COUNTERS: tuple[str, ...] = (
    "cache_hits",
    "cache_misses",
    "cache_evictions",
    "loop_wakeups",
    "cq_polls",
    "cq_completions",
    "cq_batches",
)
"""The counters kept per (device, loop) for the loop's Domain of the device (see :func:`domain_totals`)."""

# Connections on loops in several threads: a snapshot sees whole updates. Reentrant: a garbage collection
# inside a locked block may run _lost, which takes it too.
_lock = threading.RLock()
_live: dict[int, tuple[weakref.ref[Connection], str, str]] = {}  # by id(): (connection, device, loop)
_folded: dict[Labels, dict[str, int]] = {}
_failures: dict[tuple[str, str, str], int] = {}  # (device, loop, error type) -> count
_refusals: dict[tuple[str, str], int] = {}  # (loop, side) -> count
_domains: dict[int, tuple[weakref.ref[Domain], str, str]] = {}  # live Domains seen, by id()
_domains_folded: dict[Labels, dict[str, int]] = {}
_acceptors: dict[int, tuple[weakref.ref[Acceptor], str]] = {}  # live acceptors, by id(): (acceptor, loop)
_acceptors_folded: dict[str, dict[str, int]] = {}  # by loop
_loop_numbers = itertools.count(1)
_lost_refs: collections.deque[weakref.ref[Connection]] = collections.deque()  # see _lost


def loop_label(backend: Any) -> str:
    """The ``loop`` label of an rdmaio loop backend (given on first use, kept on the backend)."""
    label: str | None = getattr(backend, "_rdmaio_metrics_loop", None)
    if label is None:
        kind = str(getattr(backend, "name", "loop"))
        if kind == "asyncio":
            loop = getattr(backend, "loop", None)
            if loop is not None and type(loop).__module__.split(".")[0] == "uvloop":
                kind = "uvloop"
        label = f"{kind}-{next(_loop_numbers)}"
        setattr(backend, "_rdmaio_metrics_loop", label)  # noqa: B010 - an attribute of this module's own
    return label


def _new_bucket(table: dict[Any, dict[str, int]], key: Any, names: tuple[str, ...]) -> dict[str, int]:
    bucket = table[key] = dict.fromkeys(names, 0)
    return bucket


def register_connection(connection: Connection) -> None:
    """Count ``connection`` opened and keep a weak reference to it until :func:`fold_connection` (called
    once, at the end of its setup; one Python call)."""
    loop = getattr(connection.io, "_rdmaio_metrics_loop", None) or loop_label(connection.io)
    device = str(connection.extra["device"])
    domain = connection.transport.domain
    if id(domain) not in _domains and isinstance(domain, Domain):
        _domains[id(domain)] = (weakref.ref(domain), device, loop)
    if _lost_refs:
        _drain_lost()
    entry = (weakref.ref(connection, _lost), device, loop)  # built before the lock: held for less
    labels = device, loop
    with _lock:
        _live[id(connection)] = entry
        bucket = _folded.get(labels) or _new_bucket(_folded, labels, CONNECTION_COUNTERS)
        bucket["opened"] += 1


def _lost(ref: weakref.ref[Connection]) -> None:
    """A registered connection was collected without a teardown (its loop ended with it open): noted here
    (the collector may run anywhere) and counted closed by the next registration or snapshot; its traffic
    counters are lost with it."""
    _lost_refs.append(ref)


def _drain_lost() -> None:
    with _lock:
        while _lost_refs:
            ref = _lost_refs.popleft()
            for key, (entry_ref, device, loop) in list(_live.items()):
                if entry_ref is ref:
                    del _live[key]
                    labels = device, loop
                    bucket = _folded.get(labels) or _new_bucket(_folded, labels, CONNECTION_COUNTERS)
                    bucket["closed"] += 1


# The connection's Counter keys folded, with the registry counter each adds to. The per-message counters
# are attributes of the sender, receiver and connection; the Counter holds the rendezvous engine's share of
# the same keys (statistics() adds the two the same way), and nothing at all on most connections.
_COUNTER_KEYS: tuple[tuple[str, str], ...] = (
    ("bytes_sent", "bytes_sent"),
    ("bytes_received", "bytes_received"),
    ("messages_sent", "messages_sent"),
    ("messages_received", "messages_received"),
    ("rndv_sent", "rndv_sent"),
    ("rndv_received", "rndv_received"),
    ("rndv_bytes_sent", "rndv_bytes_sent"),
    ("rndv_bytes_received", "rndv_bytes_received"),
    ("completions", "completions"),
    ("wakeups", "completion_batches"),  # the connection's groups of completion batches
)


def _add_connection(connection: Connection, bucket: dict[str, int]) -> None:
    """Add ``connection``'s counters to ``bucket`` (read from its counter, its session's state and its
    one-sided engine; the same numbers its ``statistics()`` reports)."""
    state = connection.session.rules_state
    sender = connection.sender
    receiver = connection.receiver
    bucket["bytes_sent"] += sender.bytes_sent
    bucket["bytes_received"] += receiver.bytes_received
    bucket["messages_sent"] += sender.messages_sent
    bucket["messages_received"] += receiver.messages_received
    bucket["frames_sent"] += int(state.frames_sent)
    bucket["frames_received"] += int(state.frames_received)
    bucket["completions"] += connection.completions
    bucket["completion_batches"] += connection.wakeups
    bucket["keepalive_probes"] += connection._keepalive.probes_sent  # the core's own part, read here
    stats = connection.stats
    if stats:  # an empty Counter (most connections) adds nothing: skip its ten look-ups
        get = stats.get
        for key, counter in _COUNTER_KEYS:
            bucket[counter] += get(key, 0)
    engine = connection._onesided  # None: one-sided RDMA never used, nothing to add
    if engine is not None:
        onesided = engine.operations.statistics()
        bucket["onesided_reads"] += onesided["rdma_reads"]
        bucket["onesided_writes"] += onesided["rdma_writes"]
        bucket["onesided_fetch_adds"] += onesided["rdma_fetch_adds"]
        bucket["onesided_compare_swaps"] += onesided["rdma_compare_swaps"]


def fold_connection(connection: Connection) -> None:
    """Fold the counters of ``connection``, torn down now, into the process totals and forget it (called
    once, by its teardown)."""
    with _lock:
        entry = _live.pop(id(connection), None)
        if entry is None:
            return
        labels = entry[1], entry[2]
        bucket = _folded.get(labels) or _new_bucket(_folded, labels, CONNECTION_COUNTERS)
        _add_connection(connection, bucket)
        bucket["closed"] += 1


def connection_failed(connection: Connection, exc: BaseException, keepalive_outstanding: bool) -> None:
    """Count one failure of an established ``connection`` by the type of ``exc`` (called where the
    connection fails, once); ``keepalive_outstanding``: a keepalive probe was in flight (the failure counts
    as a keepalive failure too)."""
    entry = _live.get(id(connection))
    device, loop = (entry[1], entry[2]) if entry is not None else (str(connection.extra["device"]), "")
    key = (device, loop, type(exc).__name__)
    with _lock:
        _failures[key] = _failures.get(key, 0) + 1
        if keepalive_outstanding:
            bucket = _folded.get((device, loop)) or _new_bucket(_folded, (device, loop), CONNECTION_COUNTERS)
            bucket["keepalive_failures"] += 1


def connect_failed(backend: Any, exc: BaseException) -> None:
    """Count a failed connect on ``backend``'s loop: refused (``side="client"``) for
    :class:`~rdmaio.errors.ConnectionRefusedError`, else a failure by the type of ``exc`` (no device)."""
    loop = loop_label(backend)
    with _lock:
        if isinstance(exc, RefusedError):
            _refusals[(loop, "client")] = _refusals.get((loop, "client"), 0) + 1
        else:
            key = ("", loop, type(exc).__name__)
            _failures[key] = _failures.get(key, 0) + 1


def register_acceptor(acceptor: Acceptor, backend: Any) -> None:
    """Keep a weak reference to a server's ``acceptor`` until :func:`fold_acceptor` (its rejections are
    counted by the acceptor itself)."""
    key = id(acceptor)
    # forgotten when collected unclosed (its counts go with it; a closed one was folded)
    _acceptors[key] = (weakref.ref(acceptor, lambda _ref: _acceptors.pop(key, None)), loop_label(backend))


def _acceptor_counts(acceptor: Acceptor) -> dict[str, int]:
    return {"rejected": acceptor.rejected, "timed_out": acceptor.timed_out, "accepted": acceptor.accepted}


def fold_acceptor(acceptor: Acceptor) -> None:
    """Fold a closed server's acceptor counters into the process totals (idempotent)."""
    with _lock:
        entry = _acceptors.pop(id(acceptor), None)
        if entry is None:
            return
        bucket = _acceptors_folded.setdefault(entry[1], {"rejected": 0, "timed_out": 0, "accepted": 0})
        for key, value in _acceptor_counts(acceptor).items():
            bucket[key] += value


def _domain_counts(domain: Domain) -> dict[str, int]:
    # Every cache of the device's: the Domain's and its connections' own (without memory windows).
    cache = domain.registration_totals()
    counts = {
        "cache_hits": cache["hits"],
        "cache_misses": cache["misses"],
        "cache_evictions": cache["evictions"],
        "loop_wakeups": 0,
        "cq_polls": 0,
        "cq_completions": 0,
        "cq_batches": 0,
    }
    completions = domain.statistics()["completions"]
    if completions:
        counts["loop_wakeups"] = completions["wakeups"]
        counts["cq_polls"] = completions["polls"]
        counts["cq_completions"] = completions["completions"]
        counts["cq_batches"] = completions["dispatched"]
    return counts


def fold_domain(domain: Domain) -> None:
    """Fold the counters of ``domain``, closing now, into the process totals (once per device and loop;
    a Domain no connection registered with is not counted)."""
    with _lock:
        entry = _domains.pop(id(domain), None)
        if entry is None:
            return
        labels = entry[1], entry[2]
        bucket = _domains_folded.get(labels) or _new_bucket(_domains_folded, labels, DOMAIN_COUNTERS)
        for key, value in _domain_counts(domain).items():
            bucket[key] += value


# --- reading: what rdmaio.metrics.snapshot() sums -------------------------------------------------------


def live_connections() -> Iterator[tuple[Connection, str, str]]:
    """The registered connections not torn down yet, with their device and loop labels."""
    if _lost_refs:
        _drain_lost()
    with _lock:
        entries = list(_live.values())
    for ref, device, loop in entries:
        connection = ref()
        if connection is not None and not connection.torn_down:
            yield connection, device, loop


def connection_totals() -> tuple[dict[Labels, dict[str, int]], dict[Labels, dict[str, int]]]:
    """``(counters, gauges)`` by (device, loop): the :data:`CONNECTION_COUNTERS` of live and folded
    connections summed; the gauges ``open`` (live connections) and ``registered_bytes`` (their slot
    rings)."""
    if _lost_refs:
        _drain_lost()
    with _lock:
        totals = {labels: dict(bucket) for labels, bucket in _folded.items()}
    gauges: dict[Labels, dict[str, int]] = {}
    for connection, device, loop in live_connections():
        labels = device, loop
        bucket = totals.get(labels) or _new_bucket(totals, labels, CONNECTION_COUNTERS)
        _add_connection(connection, bucket)
        gauge = gauges.setdefault(labels, {"open": 0, "registered_bytes": 0})
        gauge["open"] += 1
        gauge["registered_bytes"] += int(connection.transport.registered_bytes)
    for labels in totals:
        gauges.setdefault(labels, {"open": 0, "registered_bytes": 0})
    return totals, gauges


def domain_totals() -> dict[Labels, dict[str, int]]:
    """The :data:`DOMAIN_COUNTERS` by (device, loop): live Domains' and closed ones' summed."""
    with _lock:
        totals = {labels: dict(bucket) for labels, bucket in _domains_folded.items()}
        entries = list(_domains.values())
    for ref, device, loop in entries:
        domain = ref()
        if domain is None or domain.closed:
            continue
        bucket = totals.get((device, loop)) or _new_bucket(totals, (device, loop), DOMAIN_COUNTERS)
        for key, value in _domain_counts(domain).items():
            bucket[key] += value
    return totals


def domain_gauges() -> dict[Labels, dict[str, int]]:
    """By (device, loop) of each live Domain: bytes registered by the registration caches (the Domain's
    and its connections' own: ``cache_pinned_bytes``), kept in the slot-ring pool (``ring_pool_bytes``)
    and by the shared receive queue (``shared_receive_bytes``)."""
    with _lock:
        entries = list(_domains.values())
    gauges: dict[Labels, dict[str, int]] = {}
    for ref, device, loop in entries:
        domain = ref()
        if domain is None or domain.closed:
            continue
        gauge = gauges.setdefault(
            (device, loop), {"cache_pinned_bytes": 0, "ring_pool_bytes": 0, "shared_receive_bytes": 0}
        )
        gauge["cache_pinned_bytes"] += domain.registration_totals()["pinned"]
        gauge["ring_pool_bytes"] += domain.rings.pooled_bytes
        if domain.shared_receive is not None:
            gauge["shared_receive_bytes"] += int(domain.shared_receive.registered_bytes)
    return gauges


def failure_totals() -> dict[tuple[str, str, str], int]:
    """Failures by (device, loop, error type): established connections' and failed connects'."""
    with _lock:
        return dict(_failures)


def refusal_totals() -> dict[tuple[str, str], int]:
    """Refused connections by (loop, side): ``client`` (our connect was refused) and ``server`` (a server
    of ours rejected a request: closed, backlog full, source limit, bad handshake, no resources)."""
    with _lock:
        refusals = dict(_refusals)
    for loop, counts in acceptor_totals().items():
        key = (loop, "server")
        refusals[key] = refusals.get(key, 0) + counts["rejected"]
    return refusals


def acceptor_totals() -> dict[str, dict[str, int]]:
    """Servers' counters by loop (``rejected``, ``timed_out``, ``accepted``): live and closed servers'."""
    with _lock:
        totals = {loop: dict(bucket) for loop, bucket in _acceptors_folded.items()}
        entries = list(_acceptors.values())
    for ref, loop in entries:
        acceptor = ref()
        if acceptor is None:
            continue
        bucket = totals.setdefault(loop, {"rejected": 0, "timed_out": 0, "accepted": 0})
        for key, value in _acceptor_counts(acceptor).items():
            bucket[key] += value
    return totals


def reset() -> None:
    """Forget every total and registration (for tests that need a clean slate: live connections are no
    longer counted either)."""
    with _lock:
        for table in (_live, _folded, _failures, _refusals, _domains, _domains_folded, _acceptors):
            table.clear()
        _acceptors_folded.clear()
