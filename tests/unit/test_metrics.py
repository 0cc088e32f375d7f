"""Process metrics (:mod:`rdmaio.metrics`) on the null device: the totals add up (bytes counted are the bytes
moved, connections opened and closed balance, one-sided requests by kind), failures and refusals are
counted once where they are raised, a connection collected without a teardown still balances, the kernel's
port counters are read from sysfs, and the Prometheus exporter carries the same values as a snapshot.

Every test reads the samples of its own event loop (``loop`` label), so connections of other tests in the
same process do not disturb it."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rdmaio
import rdmaio.metrics
from rdmaio.core import metrics as registry
from rdmaio.core.dial import dial
from rdmaio.metrics import Snapshot, device_port_counters, snapshot
from rdmaio.testing.nullpair import NullDevice, NullListener, null_connect

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def loop_of(ep: rdmaio.Endpoint) -> str:
    return registry.loop_label(ep._conn.io)


def mine(snap: Snapshot, name: str, loop: str, **labels: str) -> float:
    return snap.value(name, loop=loop, **labels)


def test_bytes_messages_and_connections_add_up(arun: Run) -> None:
    async def main() -> tuple[str, Snapshot, Snapshot, dict[str, float], dict[str, float]]:
        client, server, _device = await null_connect()
        loop = loop_of(client)
        for size in (1, 100, 4000, 9000):  # batched, single-frame and fragmented messages
            await client.send(b"m" * size)
            assert await server.recv() == b"m" * size
        client.write(b"s" * 20000)
        await client.drain()
        assert await server.readexactly(20000) == b"s" * 20000
        await server.send(b"back")
        assert await client.recv() == b"back"
        during = snapshot(hardware=False)
        stats_client, stats_server = client.statistics(), server.statistics()
        await client.aclose()
        await server.wait_closed()
        final = client.statistics()["protocol_frames_sent"] + server.statistics()["protocol_frames_sent"]
        return loop, during, snapshot(hardware=False), stats_client, stats_server, final

    loop, during, after, stats_client, stats_server, final_frames = arun(main())
    moved = 1 + 100 + 4000 + 9000 + 20000 + 4
    for snap in (during, after):  # live connections summed, then the same totals folded
        assert mine(snap, "rdmaio_bytes", loop, direction="sent") == moved
        assert mine(snap, "rdmaio_bytes", loop, direction="received") == moved
        assert mine(snap, "rdmaio_connections_opened", loop) == 2
    # the connections' own statistics(), read with the live snapshot, agree with it
    sent_frames = stats_client["protocol_frames_sent"] + stats_server["protocol_frames_sent"]
    assert mine(during, "rdmaio_frames", loop, direction="sent") == sent_frames
    received_frames = stats_client["protocol_frames_received"] + stats_server["protocol_frames_received"]
    assert mine(during, "rdmaio_frames", loop, direction="received") == received_frames
    messages = stats_client["messages_sent"] + stats_server["messages_sent"]
    assert mine(during, "rdmaio_messages", loop, direction="sent") == messages >= 5
    completions = stats_client["completions"] + stats_server["completions"]
    assert mine(during, "rdmaio_completions", loop) == completions > 0
    # folded at teardown: the frames the connections sent to their end (the close's EOF included)
    assert mine(after, "rdmaio_frames", loop, direction="sent") == final_frames > sent_frames
    assert mine(during, "rdmaio_connections_open", loop) == 2
    assert mine(during, "rdmaio_connections_closed", loop) == 0
    assert mine(after, "rdmaio_connections_open", loop) == 0
    assert mine(after, "rdmaio_connections_closed", loop) == 2
    # every sample names its device and loop
    devices = {s.labels["device"] for s in after["rdmaio_bytes"].samples if s.labels["loop"] == loop}
    assert devices == {"fake0"}


def test_onesided_requests_are_counted_by_kind(arun: Run) -> None:
    async def main() -> tuple[str, Snapshot, dict[str, float]]:
        client, server, _device = await null_connect()
        loop = loop_of(client)
        memory = bytearray(4096)
        key = server.export(memory, access="rwa", scope="domain")
        await client.rdma_write(key, 0, b"w" * 64)
        assert await client.rdma_read(key, 0, 64) == b"w" * 64
        await client.fetch_add(key, 128, 1)
        await client.compare_swap(key, 136, 0, 7)
        await client.fetch_add_many(key, [144, 152, 160], 1)  # one wave of three
        await client.rdma_read_many(key, [(0, 8), (8, 8)])  # one wave of two
        # general paths too: two calls at once cannot both complete at their post
        await asyncio.gather(client.rdma_read(key, 0, 8), client.rdma_read(key, 8, 8))
        stats = client.statistics()
        await client.aclose()
        await server.wait_closed()
        return loop, snapshot(hardware=False), stats

    loop, snap, stats = arun(main())
    kinds = {k: mine(snap, "rdmaio_onesided_operations", loop, kind=k) for k in ("read", "write")}
    kinds.update(
        {k: mine(snap, "rdmaio_onesided_operations", loop, kind=k) for k in ("fetch_add", "compare_swap")}
    )
    assert kinds == {"read": 1 + 2 + 2, "write": 1, "fetch_add": 1 + 3, "compare_swap": 1}
    # the connection's own statistics() agree, and the kinds add up to every request posted
    assert (stats["rdma_reads"], stats["rdma_writes"], stats["rdma_fetch_adds"]) == (5, 1, 4)
    assert stats["rdma_ops_posted"] == sum(kinds.values())


def test_a_failure_is_counted_once_by_type_and_a_keepalive_failure_too(arun: Run) -> None:
    async def main() -> tuple[str, Snapshot]:
        client, server, _device = await null_connect()
        loop = loop_of(client)
        client._conn.fail(rdmaio.ConnectionResetError("work completion failed: retry exceeded"))
        client._conn.fail(rdmaio.ConnectionResetError("again"))  # torn down already: not counted
        server._conn._keepalive.outstanding = True  # as when a probe is in flight and the peer is gone
        server._conn.fail(rdmaio.ConnectionResetError("transport retry counter exceeded"))
        server._conn.fail(rdmaio.ConnectionAbortedError("protocol violation"))  # not counted either
        return loop, snapshot(hardware=False)

    loop, snap = arun(main())
    failed = snap["rdmaio_connections_failed"]
    assert failed.value(loop=loop, device="fake0", error="ConnectionResetError") == 2
    assert failed.value(loop=loop) == 2
    assert mine(snap, "rdmaio_keepalive_failures", loop) == 1
    assert mine(snap, "rdmaio_connections_closed", loop) == 2
    assert mine(snap, "rdmaio_connections_open", loop) == 0


def test_refused_and_failed_connects_are_counted_by_kind(monkeypatch: pytest.MonkeyPatch, arun: Run) -> None:
    errors: list[BaseException] = [
        rdmaio.ConnectionRefusedError("connection refused: no listener on that port"),
        rdmaio.UnreachableError("unreachable"),
        rdmaio.ConnectionRefusedError("connection rejected (status 28)"),
    ]

    async def refusing_dial(*args: Any) -> Any:
        raise errors.pop(0)

    monkeypatch.setattr(rdmaio.client, "dial", refusing_dial)

    async def main() -> tuple[str, Snapshot]:
        for expected in (
            rdmaio.ConnectionRefusedError,
            rdmaio.UnreachableError,
            rdmaio.ConnectionRefusedError,
        ):
            with pytest.raises(expected):
                await rdmaio.connect("198.18.0.2", 7471)
        loop = registry.loop_label(rdmaio.core.reactor.Reactor.current().backend)
        return loop, snapshot(hardware=False)

    loop, snap = arun(main())
    assert snap.value("rdmaio_connections_refused", loop=loop, side="client") == 2
    assert snap.value("rdmaio_connections_failed", loop=loop, device="", error="UnreachableError") == 1
    assert dial is not rdmaio.client.dial  # (the real one is back after the test)


def test_a_servers_rejections_are_counted_live_and_after_close(arun: Run) -> None:
    async def main() -> tuple[str, float, float]:
        listener = NullListener(NullDevice())
        backend = listener.reactor.backend
        registry.register_acceptor(listener.acceptor, backend)
        loop = registry.loop_label(backend)
        client, server = await listener.connect()  # accepted
        listener.acceptor.listening = False  # a closed server rejects what still arrives
        for _ in range(3):
            with pytest.raises(ConnectionRefusedError):
                await listener.connect()
        live = snapshot(hardware=False).value("rdmaio_connections_refused", loop=loop, side="server")
        registry.fold_acceptor(listener.acceptor)
        registry.fold_acceptor(listener.acceptor)  # idempotent
        folded = snapshot(hardware=False).value("rdmaio_connections_refused", loop=loop, side="server")
        await client.aclose()
        await server.wait_closed()
        return loop, live, folded

    _loop, live, folded = arun(main())
    assert live == folded == 3


def test_a_connection_collected_without_teardown_still_counts_closed() -> None:
    class Collected:  # what the registry reads of a connection at registration
        def __init__(self) -> None:
            self.io = SimpleNamespace(name="asyncio")
            self.extra = {"device": "gone0"}
            self.transport = SimpleNamespace(domain=None)
            self.torn_down = True  # (a snapshot while it lives skips it: it has no counters)

    connection: Any = Collected()
    registry.register_connection(connection)
    loop = registry.loop_label(connection.io)
    del connection  # its loop ended with it open: never torn down, then collected
    gc.collect()
    snap = snapshot(hardware=False)
    assert mine(snap, "rdmaio_connections_opened", loop) == mine(snap, "rdmaio_connections_closed", loop) == 1
    assert mine(snap, "rdmaio_connections_open", loop) == 0


def test_the_registry_costs_no_call_per_message(arun: Run) -> None:
    """What the metrics cost: a few calls per connection, none per message (the budgets of
    tests/unit/test_call_budgets.py hold the totals; this names the calls)."""
    calls: list[str] = []

    async def main() -> None:
        client, server, _device = await null_connect()
        names = {"register_connection", "fold_connection", "_add_connection", "connection_failed"}

        def profile(frame: Any, event: str, arg: Any) -> None:
            if (
                event == "call"
                and frame.f_code.co_name in names
                and frame.f_code.co_filename == registry.__file__
            ):
                calls.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            for _ in range(50):
                await client.send(b"x" * 64)
                assert await server.recv() == b"x" * 64
            await client.aclose()
            await server.wait_closed()
        finally:
            sys.setprofile(None)

    arun(main())
    assert sorted(calls) == ["_add_connection", "_add_connection", "fold_connection", "fold_connection"]


def test_device_port_counters_read_sysfs(tmp_path: Path) -> None:
    port = tmp_path / "rxe0" / "ports" / "1"
    (port / "hw_counters").mkdir(parents=True)
    (port / "counters").mkdir()
    (port / "hw_counters" / "retry_exceeded_err").write_text("3\n")
    (port / "hw_counters" / "rcvd_seq_err").write_text("5\n")
    (port / "hw_counters" / "lifespan").write_text("10\n")  # a setting, not a counter
    (port / "counters" / "port_rcv_errors").write_text("7\n")
    (port / "counters" / "bogus").write_text("n/a\n")
    found = {(labels["counter"], labels["source"]): value for labels, value in device_port_counters(tmp_path)}
    assert found == {
        ("rcvd_seq_err", "hw_counters"): 5,
        ("retry_exceeded_err", "hw_counters"): 3,
        ("port_rcv_errors", "counters"): 7,
    }
    assert all(
        labels["device"] == "rxe0" and labels["port"] == "1" for labels, _ in device_port_counters(tmp_path)
    )
    assert list(device_port_counters(tmp_path / "missing")) == []


def test_the_snapshot_is_json_ready_and_families_have_one_label_set(arun: Run) -> None:
    import json

    async def main() -> Snapshot:
        client, server, _device = await null_connect()
        await client.send(b"hi")
        await server.recv()
        snap = snapshot(hardware=False)
        await client.aclose()
        await server.wait_closed()
        return snap

    snap = arun(main())
    record = snap.as_dict()
    assert json.loads(json.dumps(record)) == record
    for family in snap:
        assert family.kind in ("counter", "gauge") and family.help
        assert len({tuple(sorted(s.labels)) for s in family.samples}) <= 1, family.name


# --- the Prometheus exporter --------------------------------------------------------------------------------


def test_importing_rdmaio_and_its_metrics_does_not_need_prometheus_client() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"  # import fails as if not installed
        "import rdmaio, rdmaio.metrics\n"
        "rdmaio.metrics.snapshot(hardware=False)\n"
        "try:\n    import rdmaio.metrics.prometheus\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "pip install 'rdmaio[prometheus]'" in out.stdout


def test_the_exporter_carries_the_snapshot(arun: Run) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from rdmaio.metrics.prometheus import RdmaioCollector, register

    async def main() -> tuple[str, Snapshot, str]:
        client, server, _device = await null_connect()
        loop = loop_of(client)
        await client.send(b"z" * 3000)
        await server.recv()
        snap = snapshot(hardware=False)
        own = prometheus_client.CollectorRegistry(auto_describe=True)
        collector = register(own, hardware=False)
        assert register(own) is collector and isinstance(collector, RdmaioCollector)  # once per registry
        text = prometheus_client.generate_latest(own).decode()
        await client.aclose()
        await server.wait_closed()
        return loop, snap, text

    loop, snap, text = arun(main())
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert parsed["rdmaio_bytes"].type == "counter"
    assert parsed["rdmaio_connections_open"].type == "gauge"
    for name in ("rdmaio_bytes", "rdmaio_messages", "rdmaio_frames", "rdmaio_connections_opened"):
        family = snap[name]
        for sample in family.samples:
            if sample.labels["loop"] != loop:
                continue
            scraped = [
                s.value
                for s in parsed[name].samples
                if s.name == f"{name}_total" and s.labels == dict(sample.labels)
            ]
            assert scraped == [sample.value], (name, sample)
    assert any(s.labels.get("loop") == loop for s in parsed["rdmaio_bytes"].samples)


def test_the_fold_puts_each_counter_of_a_connection_under_its_own_name() -> None:
    """The registry adds a connection's counters to its totals by position: each counter read (every one a
    different number here) lands under its own name, live and after the fold, the Counter's share too."""
    import collections

    class Connection(SimpleNamespace):  # weakly referenced by the registry
        pass

    statistics = {"rdma_reads": 12, "rdma_writes": 13, "rdma_fetch_adds": 14, "rdma_compare_swaps": 15}
    connection: Any = Connection(
        io=SimpleNamespace(name="asyncio"),
        extra={"device": "order0"},
        transport=SimpleNamespace(domain=None, registered_bytes=0),
        torn_down=False,
        session=SimpleNamespace(rules_state=SimpleNamespace(frames_sent=6, frames_received=7)),
        sender=SimpleNamespace(bytes_sent=2, messages_sent=4),
        receiver=SimpleNamespace(bytes_received=3, messages_received=5),
        _onesided=SimpleNamespace(operations=SimpleNamespace(statistics=lambda: statistics)),
        completions=16,
        wakeups=17,
        _keepalive=SimpleNamespace(probes_sent=18),
        stats=collections.Counter(
            bytes_sent=100,
            rndv_sent=8,
            rndv_received=9,
            rndv_bytes_sent=10,
            rndv_bytes_received=11,
            wakeups=200,
        ),
    )
    expected = {
        "opened": 1,
        "closed": 0,
        "bytes_sent": 102,
        "bytes_received": 3,
        "messages_sent": 4,
        "messages_received": 5,
        "frames_sent": 6,
        "frames_received": 7,
        "rndv_sent": 8,
        "rndv_received": 9,
        "rndv_bytes_sent": 10,
        "rndv_bytes_received": 11,
        "onesided_reads": 12,
        "onesided_writes": 13,
        "onesided_fetch_adds": 14,
        "onesided_compare_swaps": 15,
        "completions": 16,
        "completion_batches": 217,
        "keepalive_probes": 18,
        "keepalive_failures": 0,
    }
    assert list(expected) == list(registry.CONNECTION_COUNTERS)
    registry.register_connection(connection)
    labels = ("order0", registry.loop_label(connection.io))
    try:
        assert registry.connection_totals()[0][labels] == expected
        registry.fold_connection(connection)
        assert registry.connection_totals()[0][labels] == expected | {"closed": 1}
    finally:
        registry.fold_connection(connection)
