"""The Prometheus exporter of :mod:`rdmaio.metrics` (``pip install rdmaio[prometheus]``).

:class:`RdmaioCollector` is a ``prometheus_client`` collector: each scrape takes one
:func:`rdmaio.metrics.snapshot` and yields its families (counters get Prometheus' ``_total`` suffix).
:func:`start_http_server` registers it and serves ``/metrics`` from a thread::

    import rdmaio.metrics.prometheus

    rdmaio.metrics.prometheus.start_http_server(9464)         # http://127.0.0.1:9464/metrics
    rdmaio.metrics.prometheus.start_http_server(9464, "0.0.0.0")  # for a Prometheus on another host

An application that already exports ``prometheus_client`` metrics registers the collector in its own
registry instead: ``prometheus_client.REGISTRY.register(RdmaioCollector())``. Importing :mod:`rdmaio`
never imports ``prometheus_client``; importing this module needs it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test without the package
    raise ImportError(
        "rdmaio.metrics.prometheus needs prometheus_client: pip install 'rdmaio[prometheus]'"
    ) from exc

from rdmaio.metrics import MetricFamily, snapshot

__all__ = ["RdmaioCollector", "register", "start_http_server"]


def _to_prometheus(family: MetricFamily, with_samples: bool = True) -> Metric:
    names = sorted({name for sample in family.samples for name in sample.labels})
    metric: CounterMetricFamily | GaugeMetricFamily
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=names)
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=names)
    if with_samples:
        for sample in family.samples:
            metric.add_metric([sample.labels.get(name, "") for name in names], sample.value)
    return metric


class RdmaioCollector(Collector):
    """A ``prometheus_client`` collector of rdmaio's metrics: one :func:`~rdmaio.metrics.snapshot` per
    scrape. ``hardware``: include the kernel's port counters (``rdmaio_device_port_counter``)."""

    def __init__(self, *, hardware: bool = True) -> None:
        self.hardware = hardware

    def collect(self) -> Iterator[Metric]:
        """The families of a snapshot taken now."""
        for family in snapshot(hardware=self.hardware):
            yield _to_prometheus(family)

    def describe(self) -> Iterator[Metric]:
        """The families without samples (so that registering does not take a snapshot)."""
        for family in snapshot(hardware=False):
            yield _to_prometheus(family, with_samples=False)


_registered: dict[int, RdmaioCollector] = {}  # by id() of the registry: one collector each
_registered_lock = threading.Lock()


def register(registry: CollectorRegistry | None = None, *, hardware: bool = True) -> RdmaioCollector:
    """Register an :class:`RdmaioCollector` in ``registry`` (``prometheus_client.REGISTRY`` by default)
    once, and return it (the one registered before, if any)."""
    target = prometheus_client.REGISTRY if registry is None else registry
    with _registered_lock:
        collector = _registered.get(id(target))
        if collector is None:
            collector = _registered[id(target)] = RdmaioCollector(hardware=hardware)
            target.register(collector)
        return collector


def start_http_server(
    port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry | None = None, hardware: bool = True
) -> tuple[Any, threading.Thread]:
    """Serve ``http://addr:port/metrics`` from a daemon thread (``prometheus_client.start_http_server``)
    with rdmaio's collector registered in ``registry`` (``prometheus_client.REGISTRY`` by default: the
    process and platform metrics come along). Listens on loopback unless ``addr`` says otherwise; ``port``
    0 picks a free port (``server.server_port``). Returns ``(server, thread)``; ``server.shutdown()``
    stops it."""
    target = prometheus_client.REGISTRY if registry is None else registry
    register(target, hardware=hardware)
    server, thread = prometheus_client.start_http_server(port, addr, registry=target)
    return server, thread
