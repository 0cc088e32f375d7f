"""Process metrics (:mod:`rdmaio.metrics`) on a real device, asyncio and uvloop: after a mixed workload
(messages, a byte stream, a rendezvous-size message, one-sided READ/WRITE/fetch-and-add, a refused
connect) the bytes counted are the bytes moved, connections opened and closed balance, the rendezvous and
one-sided requests are counted by kind, the device's own port counters are there, and a Prometheus scrape
over loopback (``http://127.0.0.1:<port>/metrics``) parses with prometheus_client's parser and carries the
same values as :func:`rdmaio.metrics.snapshot`.

On Soft-iWARP the same workload runs without the fetch-and-add (siw has no atomics: it raises
``FeatureNotSupportedError`` before posting, and nothing is counted), and the device has no port counters
to show (siw's driver registers no hardware counters: no ``hw_counters`` in sysfs)."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from loops import Runner, arun  # arun is a fixture used by name
from prometheus_client.parser import text_string_to_metric_families

import rdmaio
from rdmaio.core import metrics as registry
from rdmaio.metrics import Snapshot, snapshot
from rdmaio.metrics.prometheus import start_http_server

MESSAGES = (10, 1000, 5000)
STREAM = 100_000
RNDV = 256 * 1024  # above Options.rndv_threshold: zero-copy
NO_LISTENER_PORT = 7497
BOUND = 600  # seconds: turns a hang into a failure (the VM is slow; nothing here measures time)
SYSFS = Path("/sys/class/infiniband")


async def workload(host: str, atomics: bool) -> tuple[str, int]:
    """The mixed workload; returns this loop's label and the bytes moved (both directions). Without
    ``atomics`` (the device has none) the fetch-and-add is refused up front instead of done."""
    assert rdmaio.Options().rndv_threshold <= RNDV
    key_size: list[int] = []

    async def handler(ep: rdmaio.Endpoint) -> None:
        async with ep:
            for _ in MESSAGES:
                message = await ep.recv()
                assert message is not None
                await ep.send(message)
            assert await ep.readexactly(STREAM) == b"s" * STREAM
            big = await ep.recv()
            assert big is not None and len(big) == RNDV
            memory = bytearray(4096)
            key = ep.export(memory, access="rwa" if atomics else "rw")
            key_size.append(len(bytes(key)))
            await ep.send(bytes(key))
            assert await ep.recv() == b"done"
            assert memory[:64] == b"w" * 64

    server = await rdmaio.serve(handler, host, 0)
    port = server.addresses[0][1]
    try:
        with_refusal = rdmaio.connect(host, NO_LISTENER_PORT)
        try:
            await with_refusal
        except rdmaio.ConnectionRefusedError:
            pass
        else:
            raise AssertionError(f"something listens on port {NO_LISTENER_PORT}")
        client = await rdmaio.connect(host, port)
        loop = registry.loop_label(client._conn.io)
        async with client:
            for size in MESSAGES:
                await client.send(b"m" * size)
                assert await client.recv() == b"m" * size
            client.write(b"s" * STREAM)
            await client.drain()
            await client.send(b"r" * RNDV)
            raw_key = await client.recv()
            assert raw_key is not None
            key = rdmaio.RemoteKey.from_bytes(raw_key)
            await client.rdma_write(key, 0, b"w" * 64)
            assert await client.rdma_read(key, 0, 64) == b"w" * 64
            if atomics:
                assert await client.fetch_add(key, 64, 5) == 0
            else:
                with pytest.raises(rdmaio.FeatureNotSupportedError):
                    await client.fetch_add(key, 64, 5)
            # zero-copy READs into our buffer: registered through the Domain's cache (a miss, then a hit)
            into = bytearray(64)
            for _ in range(2):
                assert await client.rdma_read_into(key, 0, into) == 64
            assert into == b"w" * 64
            await client.send(b"done")
            assert await client.recv() is None  # the server closed after "done"
    finally:
        server.close()
        await server.wait_closed()
    moved = 2 * sum(MESSAGES) + STREAM + RNDV + key_size[0] + len(b"done")
    return loop, moved


def mine(snap: Snapshot, name: str, loop: str, **labels: str) -> float:
    return snap.value(name, loop=loop, **labels)


def test_metrics_add_up_and_a_scrape_carries_them(arun: Runner[Any], rdma_addr: str, provider: str) -> None:
    atomics = provider == "rxe"  # siw: ATOMIC_NONE

    async def bounded() -> tuple[str, int]:
        return await asyncio.wait_for(workload(rdma_addr, atomics), BOUND)

    loop, moved = arun(bounded())
    snap = snapshot()
    # bytes counted are the bytes moved, each way (both ends are this process's connections)
    assert mine(snap, "rdmaio_bytes", loop, direction="sent") == moved
    assert mine(snap, "rdmaio_bytes", loop, direction="received") == moved
    # connections: the client's and the server's, opened and closed; the refused connect is not one
    assert mine(snap, "rdmaio_connections_opened", loop) == 2
    assert mine(snap, "rdmaio_connections_closed", loop) == 2
    assert mine(snap, "rdmaio_connections_open", loop) == 0
    assert snap.value("rdmaio_connections_refused", loop=loop, side="client") == 1
    assert snap["rdmaio_connections_failed"].value(loop=loop) == 0
    # one zero-copy message of RNDV bytes, each way counted once
    assert mine(snap, "rdmaio_rendezvous_messages", loop, direction="sent") == 1
    assert mine(snap, "rdmaio_rendezvous_messages", loop, direction="received") == 1
    assert mine(snap, "rdmaio_rendezvous_bytes", loop, direction="sent") == RNDV
    assert mine(snap, "rdmaio_rendezvous_bytes", loop, direction="received") == RNDV
    # one-sided: by kind (the reads: one rdma_read, two rdma_read_into, and the rendezvous pull's READ)
    kinds = {k: mine(snap, "rdmaio_onesided_operations", loop, kind=k) for k in ("write", "fetch_add")}
    assert kinds == {"write": 1, "fetch_add": 1 if atomics else 0}
    assert mine(snap, "rdmaio_onesided_operations", loop, kind="read") >= 3
    assert mine(snap, "rdmaio_completions", loop) > 0
    assert mine(snap, "rdmaio_loop_wakeups", loop) > 0  # the loop's Domain, folded when it closed
    # (on siw in the connection's own cache: its device has no memory windows, so it has a PD of its own)
    assert mine(snap, "rdmaio_registration_cache_misses", loop) >= 1  # the first rdma_read_into
    assert mine(snap, "rdmaio_registration_cache_hits", loop) >= 1  # the second
    # the device's own counters, as the kernel shows them
    device_ports = {
        (s.labels["device"], s.labels["port"], s.labels["counter"])
        for s in snap["rdmaio_device_port_counter"].samples
        if s.labels["source"] == "hw_counters"
    }
    for counters in SYSFS.glob("*/ports/*/hw_counters"):
        device, port = counters.parts[-4], counters.parts[-2]
        expected = {(device, port, f.name) for f in counters.iterdir() if f.name != "lifespan"}
        assert expected <= device_ports
    if provider == "siw":
        # siw's driver has no hardware counters (its ib_device_ops, siw_main.c, have no alloc_hw_port_stats)
        assert not list(SYSFS.glob("siw*/ports/*/hw_counters")) and not device_ports, device_ports
    else:
        assert device_ports, "no hw_counters for the test host's device"

    # --- the same values through a Prometheus scrape over loopback ------------------------------------------
    own = prometheus_client.CollectorRegistry(auto_describe=True)
    server, thread = start_http_server(0, "127.0.0.1", registry=own)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=120) as response:
            assert response.status == 200
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(60)
    again = snapshot(hardware=False)  # nothing ran since: the totals of this loop are the same
    scraped = {f.name: f for f in text_string_to_metric_families(text)}
    compared = 0
    for family in again:
        assert family.name in scraped, family.name
        assert scraped[family.name].type == family.kind
        suffix = "_total" if family.kind == "counter" else ""
        for sample in family.samples:
            if sample.labels.get("loop") != loop:
                continue
            values = [
                s.value
                for s in scraped[family.name].samples
                if s.name == family.name + suffix and s.labels == dict(sample.labels)
            ]
            assert values == [sample.value], (family.name, dict(sample.labels), values)
            compared += 1
    # 20 connection samples, open, the refusals (client, server), 5 of the Domain's, the registered bytes
    # (4 pools while the loop's Domain is open, 1 once it closed): at least 29
    assert compared >= 29
    assert mine(again, "rdmaio_bytes", loop, direction="sent") == moved
    assert "rdmaio_device_port_counter" in scraped


def test_a_connections_own_registration_cache_is_counted(arun: Runner[Any], rdma_addr: str) -> None:
    """A connection with a protection domain of its own (its device has no memory windows, as siw; here
    forced with ``memory_windows="off"``, so that it runs on every provider) registers READ targets in a
    cache of its own: its misses, hits and pinned bytes are the device's figures, while it is open and
    once it closed."""
    options = rdmaio.Options(memory_windows="off")

    async def main() -> tuple[str, Snapshot]:
        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                memory = bytearray(b"k" * 4096)
                await ep.send(bytes(ep.export(memory, access="r")))
                assert await ep.recv() == b"done"

        server = await rdmaio.serve(handler, rdma_addr, 0, options=options)
        try:
            async with await rdmaio.connect(rdma_addr, server.addresses[0][1], options=options) as client:
                assert client._conn.transport.private_registrations is not None  # a PD of its own
                loop = registry.loop_label(client._conn.io)
                raw_key = await client.recv()
                assert raw_key is not None
                key = rdmaio.RemoteKey.from_bytes(raw_key)
                into = bytearray(64)
                for _ in range(2):  # registered in the connection's cache: a miss, then a hit
                    assert await client.rdma_read_into(key, 0, into) == 64
                assert into == b"k" * 64
                while_open = snapshot(hardware=False)
                await client.send(b"done")
                assert await client.recv() is None
        finally:
            server.close()
            await server.wait_closed()
        return loop, while_open

    loop, while_open = arun(asyncio.wait_for(main(), BOUND))
    assert mine(while_open, "rdmaio_registration_cache_misses", loop) >= 1
    assert mine(while_open, "rdmaio_registration_cache_hits", loop) >= 1
    # the READ target stays cached (registered) while the connection is open
    assert mine(while_open, "rdmaio_registered_bytes", loop, pool="cache") >= 64
    closed = snapshot(hardware=False)  # the connections and the loop's Domain are gone: folded totals
    assert mine(closed, "rdmaio_registration_cache_misses", loop) >= 1
    assert mine(closed, "rdmaio_registration_cache_hits", loop) >= 1
    assert mine(closed, "rdmaio_registration_cache_hits", loop) >= mine(
        while_open, "rdmaio_registration_cache_hits", loop
    )
