"""Process-wide metrics of rdmaio: counters and gauges per RDMA device and event loop, read on demand.

``rdmaio.metrics.snapshot()`` returns a :class:`Snapshot`: metric families (:class:`MetricFamily`) of
labelled samples, Prometheus-style. Nothing is counted on the data path: every connection counts what it
does anyway (its ``statistics()``), registers itself when it is established and folds its final counters
into the process totals when it is torn down (:mod:`rdmaio.core.metrics`), so a snapshot sums the live
connections and the closed ones. Errors are counted once each, where they are raised.

The families (counters end in ``_total`` in Prometheus' text format; labels ``device`` and ``loop`` unless
said otherwise):

========================================== ======= ===============================================
family                                     kind    what
========================================== ======= ===============================================
``rdmaio_connections_opened``              counter connections established
``rdmaio_connections_closed``              counter connections torn down (any reason)
``rdmaio_connections_open``                gauge   connections established and not torn down
``rdmaio_connections_failed``              counter failures by ``error`` (the exception type):
                                                   established connections, and connects
                                                   (``device=""``) other than refused ones
``rdmaio_connections_refused``             counter by ``loop`` and ``side``: ``client`` (a
                                                   connect of ours was refused), ``server`` (a
                                                   server of ours rejected a request)
``rdmaio_bytes``                           counter message/stream bytes by ``direction``
                                                   (``sent``/``received``), rendezvous included
``rdmaio_messages``                        counter messages (stream frames count as messages)
``rdmaio_frames``                          counter protocol frames (data, batch, credit, EOF)
``rdmaio_rendezvous_messages``             counter zero-copy messages by ``direction``
``rdmaio_rendezvous_bytes``                counter their bytes
``rdmaio_onesided_operations``             counter requests posted by ``kind``: ``read``,
                                                   ``write``, ``fetch_add``, ``compare_swap``
``rdmaio_completions``                     counter work completions handled by connections
``rdmaio_completion_batches``              counter groups of completions handed to connections
``rdmaio_loop_wakeups``                    counter completion-channel wake-ups of the loop
``rdmaio_cq_polls``                        counter CQ polls (the C helper's)
``rdmaio_keepalive_probes``                counter keepalive probes posted
``rdmaio_keepalive_failures``              counter connections that failed with a probe in
                                                   flight (the peer stopped answering)
``rdmaio_registered_bytes``                gauge   registered memory by ``pool``: ``connections``
                                                   (slot rings), ``ring_pool``, ``cache``,
                                                   ``shared_receive``
``rdmaio_registration_cache_hits``         counter registration cache hits (the Domain's cache
                                                   and, on a device without memory windows, each
                                                   connection's own)
``rdmaio_registration_cache_misses``       counter and misses (each a registration)
``rdmaio_registration_cache_evictions``    counter and evictions
``rdmaio_device_port_counter``             counter the kernel's counters of each port
                                                   (``hw_counters/`` and ``counters/`` in sysfs):
                                                   labels ``device``, ``port``, ``counter``,
                                                   ``source``; retries, sequence errors, RNR NAKs
========================================== ======= ===============================================

A connection's counters move into the totals when it is torn down; one that is garbage-collected without
a teardown (its loop ended while it was open) counts as closed and its traffic since the last snapshot is
lost. The optional Prometheus exporter is :mod:`rdmaio.metrics.prometheus` (``pip install
rdmaio[prometheus]``). docs/monitoring.md shows both, with a scrape configuration and dashboard queries.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rdmaio.core import metrics as registry

__all__ = [
    "SYSFS_INFINIBAND",
    "MetricFamily",
    "Sample",
    "Snapshot",
    "device_port_counters",
    "snapshot",
]

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
"""Where the kernel shows each RDMA device's ports and their counters."""

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of a family, with its labels."""

    labels: Mapping[str, str]
    """Label names to values (``device``, ``loop``, and the family's own)."""
    value: float
    """The value (counters: the total since the process started using rdmaio)."""


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """A named metric and its samples (one per label combination)."""

    name: str
    """The family's name (``rdmaio_...``; Prometheus' text format adds ``_total`` to a counter's)."""
    kind: Kind
    """``"counter"`` (only grows) or ``"gauge"`` (goes up and down)."""
    help: str
    """One line on what it counts."""
    samples: tuple[Sample, ...] = ()
    """Its samples."""

    def value(self, **labels: str) -> float:
        """The sum of the samples whose labels include ``labels`` (all samples without arguments)."""
        return sum(s.value for s in self.samples if all(s.labels.get(k) == v for k, v in labels.items()))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every family at one moment (:func:`snapshot`), by name."""

    families: Mapping[str, MetricFamily] = field(default_factory=dict)
    """The families by name."""

    def __getitem__(self, name: str) -> MetricFamily:
        return self.families[name]

    def __iter__(self) -> Any:
        return iter(self.families.values())

    def value(self, name: str, **labels: str) -> float:
        """The sum of family ``name``'s samples whose labels include ``labels`` (0 if it has none)."""
        return self.families[name].value(**labels)

    def as_dict(self) -> dict[str, Any]:
        """``{name: {"kind", "help", "samples": [{"labels": {...}, "value": v}, ...]}}``, JSON-ready."""
        return {
            f.name: {
                "kind": f.kind,
                "help": f.help,
                "samples": [{"labels": dict(s.labels), "value": s.value} for s in f.samples],
            }
            for f in self.families.values()
        }


class _Builder:
    def __init__(self) -> None:
        self.families: dict[str, tuple[Kind, str, list[Sample]]] = {}

    def family(self, name: str, kind: Kind, help_text: str) -> list[Sample]:
        return self.families.setdefault(name, (kind, help_text, []))[2]

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        self.families[name][2].append(Sample(dict(labels), value))

    def build(self) -> Snapshot:
        return Snapshot(
            {
                name: MetricFamily(name, kind, help_text, tuple(samples))
                for name, (kind, help_text, samples) in self.families.items()
            }
        )


# The families of the per-connection totals: (name, kind, help, the family's own label or None, and its
# (label value, counter key) pairs: one sample per pair and (device, loop)).
_CONNECTION_FAMILIES: tuple[tuple[str, Kind, str, str | None, tuple[tuple[str, str], ...]], ...] = (
    ("rdmaio_connections_opened", "counter", "Connections established.", None, (("", "opened"),)),
    ("rdmaio_connections_closed", "counter", "Connections torn down (any reason).", None, (("", "closed"),)),
    (
        "rdmaio_bytes",
        "counter",
        "Message and stream bytes (rendezvous included).",
        "direction",
        (("sent", "bytes_sent"), ("received", "bytes_received")),
    ),
    (
        "rdmaio_messages",
        "counter",
        "Messages (stream frames count as messages).",
        "direction",
        (("sent", "messages_sent"), ("received", "messages_received")),
    ),
    (
        "rdmaio_frames",
        "counter",
        "Protocol frames (data, batch, credit, EOF).",
        "direction",
        (("sent", "frames_sent"), ("received", "frames_received")),
    ),
    (
        "rdmaio_rendezvous_messages",
        "counter",
        "Zero-copy (rendezvous) messages.",
        "direction",
        (("sent", "rndv_sent"), ("received", "rndv_received")),
    ),
    (
        "rdmaio_rendezvous_bytes",
        "counter",
        "Bytes of zero-copy (rendezvous) messages.",
        "direction",
        (("sent", "rndv_bytes_sent"), ("received", "rndv_bytes_received")),
    ),
    (
        "rdmaio_onesided_operations",
        "counter",
        "One-sided requests posted, by kind.",
        "kind",
        (
            ("read", "onesided_reads"),
            ("write", "onesided_writes"),
            ("fetch_add", "onesided_fetch_adds"),
            ("compare_swap", "onesided_compare_swaps"),
        ),
    ),
    (
        "rdmaio_completions",
        "counter",
        "Work completions handled by connections.",
        None,
        (("", "completions"),),
    ),
    (
        "rdmaio_completion_batches",
        "counter",
        "Groups of completions handed to connections (one per connection per poll).",
        None,
        (("", "completion_batches"),),
    ),
    ("rdmaio_keepalive_probes", "counter", "Keepalive probes posted.", None, (("", "keepalive_probes"),)),
    (
        "rdmaio_keepalive_failures",
        "counter",
        "Connections that failed with a keepalive probe in flight.",
        None,
        (("", "keepalive_failures"),),
    ),
)

_DOMAIN_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("rdmaio_loop_wakeups", "Completion-channel wake-ups of the event loop.", "loop_wakeups"),
    ("rdmaio_cq_polls", "Completion-queue polls.", "cq_polls"),
    ("rdmaio_registration_cache_hits", "Registration cache hits.", "cache_hits"),
    ("rdmaio_registration_cache_misses", "Registration cache misses (each a registration).", "cache_misses"),
    ("rdmaio_registration_cache_evictions", "Registration cache evictions.", "cache_evictions"),
)


def snapshot(*, hardware: bool = True) -> Snapshot:
    """Every family now (see the module docstring). ``hardware``: include the kernel's port counters of
    every RDMA device (``rdmaio_device_port_counter``; a read of a few sysfs files per port).

    Safe to call from any thread; it reads the connections' counters without stopping them, so a
    snapshot taken while traffic flows is a consistent sum of per-connection values, each one current
    as of its read."""
    out = _Builder()
    counters, gauges = registry.connection_totals()
    for name, kind, help_text, label, values in _CONNECTION_FAMILIES:
        out.family(name, kind, help_text)
        for (device, loop), bucket in sorted(counters.items()):
            for label_value, key in values:
                labels = {"device": device, "loop": loop}
                if label is not None:
                    labels[label] = label_value
                out.add(name, labels, bucket[key])
    out.family("rdmaio_connections_open", "gauge", "Connections established and not torn down.")
    for (device, loop), gauge in sorted(gauges.items()):
        out.add("rdmaio_connections_open", {"device": device, "loop": loop}, gauge["open"])
    out.family("rdmaio_connections_failed", "counter", "Connection failures by error type.")
    for (device, loop, error), count in sorted(registry.failure_totals().items()):
        out.add("rdmaio_connections_failed", {"device": device, "loop": loop, "error": error}, count)
    out.family("rdmaio_connections_refused", "counter", "Refused connections (client: ours refused).")
    for (loop, side), count in sorted(registry.refusal_totals().items()):
        out.add("rdmaio_connections_refused", {"loop": loop, "side": side}, count)
    domains = registry.domain_totals()
    for name, help_text, key in _DOMAIN_FAMILIES:
        out.family(name, "counter", help_text)
        for (device, loop), bucket in sorted(domains.items()):
            out.add(name, {"device": device, "loop": loop}, bucket[key])
    out.family("rdmaio_registered_bytes", "gauge", "Registered (pinned) memory by pool.")
    for (device, loop), gauge in sorted(gauges.items()):
        out.add(
            "rdmaio_registered_bytes",
            {"device": device, "loop": loop, "pool": "connections"},
            gauge["registered_bytes"],
        )
    for (device, loop), gauge in sorted(registry.domain_gauges().items()):
        for pool, key in (
            ("ring_pool", "ring_pool_bytes"),
            ("cache", "cache_pinned_bytes"),
            ("shared_receive", "shared_receive_bytes"),
        ):
            out.add("rdmaio_registered_bytes", {"device": device, "loop": loop, "pool": pool}, gauge[key])
    if hardware:
        out.family(
            "rdmaio_device_port_counter",
            "counter",
            "The kernel's counters of each RDMA port (sysfs hw_counters/ and counters/).",
        )
        for labels, value in device_port_counters():
            out.add("rdmaio_device_port_counter", labels, value)
    return out.build()


# Files under hw_counters/ that are not counters (a rate, a lifetime setting).
_NOT_COUNTERS = frozenset({"lifespan"})


def device_port_counters(root: Path = SYSFS_INFINIBAND) -> Iterable[tuple[dict[str, str], int]]:
    """``(labels, value)`` of every counter the kernel shows for every port of every RDMA device under
    ``root``: ``hw_counters/`` (the driver's: rxe's ``retry_exceeded_err``, ``rcvd_seq_err``,
    ``rcvd_rnr_err``, ...; mlx5's ``out_of_sequence``, ``rnr_nak_retry_err``, ...) and ``counters/`` (the
    InfiniBand port counters, where the driver has them). Unreadable or non-numeric files are skipped."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    found: list[tuple[dict[str, str], int]] = []
    for device in devices:
        ports = root / device / "ports"
        try:
            port_names = sorted(os.listdir(ports), key=lambda p: (len(p), p))
        except OSError:
            continue
        for port in port_names:
            for source in ("hw_counters", "counters"):
                directory = ports / port / source
                try:
                    names = sorted(os.listdir(directory))
                except OSError:
                    continue
                for name in names:
                    if name in _NOT_COUNTERS:
                        continue
                    try:
                        value = int((directory / name).read_text().strip())
                    except (OSError, ValueError):
                        continue
                    labels = {"device": device, "port": port, "counter": name, "source": source}
                    found.append((labels, value))
    return found
