"""Many idle connections to one server, then all closed: nothing may be left behind.

The server runs in its own process (on uvloop; the client is on asyncio), so that each side's file
descriptors and resident memory are its own. ``RDMAIO_SCALE_CONNS`` sets how many connections are held
at once: 100 by default (CI's bounded form); the acceptance figure is 1,000
(``RDMAIO_SCALE_CONNS=1000``), which the growing rings (256 KiB registered per idle connection and side)
made fit the test host's memory; docs/performance-log.md has that run's figures. The test refuses (fails,
never skips) a count whose rings cannot fit in the machine's available memory, naming the figures.

What is checked, in both processes: the kernel's RDMA objects (QPs, CQs, MRs, PDs, cm ids: ``rdma resource
show``, the same after as before), open fds (``/proc/PID/fd``: the same after as before), the Endpoint and
Transport objects alive in the heap (none may outlive its close) and, in a second test on the same run,
``VmRSS`` after closing and trimming the C heap. The whole open/echo/close cycle runs twice: a leak grows
RSS again in the second round, while what the allocators keep after the first (at most
:data:`RSS_TOLERANCE`, or a sixteenth of the peak) does not. The trim is there because glibc keeps freed
heap memory otherwise (see that test; the untrimmed figures go to the junit report). One round takes
about 2 s per connection in the test host (193 s at 100).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rdma_state import rdma_resources

import rdmaio
from bench.memory import mem_available, rss_bytes, trim_heap
from rdmaio.core.rings import POOL_LINGER
from rdmaio.core.transport import Transport

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
CONNS = int(os.environ.get("RDMAIO_SCALE_CONNS", "100"))
"""Connections held open at once."""
OPEN_BATCH = 25
"""Connections opened concurrently (well below the server's backlog of 128)."""
# pytest-timeout covers the module fixture too (it runs in the first test's setup): about 2 s per
# connection and round were measured in the test host at N=100 (open, echo on a sample, close: 193 s).
pytestmark = pytest.mark.timeout(max(900, 6 * CONNS))
SAMPLE_EVERY = 10
"""Every this many connections carries traffic (a few echoes) before the close."""
RSS_TOLERANCE = 16 * 1024 * 1024
"""How far above its baseline a process's RSS may stay once everything is closed.

Freed memory is not always given back to the kernel at once (glibc keeps freed heap at the top up to its
trim threshold, Python keeps its arenas); a leak of one slot ring per connection (2 MiB) would exceed this
after eight connections, so it still catches leaks per connection."""

SERVER = textwrap.dedent(
    """
    import asyncio, gc, json, os, resource, sys
    import uvloop
    import rdmaio
    from bench.memory import trim_heap
    from rdmaio.core.transport import Transport

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def echo(ep):
        async with ep:
            while (msg := await ep.recv()) is not None:
                await ep.send(msg)

    async def main():
        server = await rdmaio.serve(echo, sys.argv[1], 0)
        loop = asyncio.get_running_loop()
        print("READY", json.dumps({"port": server.addresses[0][1], "pid": os.getpid()}), flush=True)
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if line.strip() == "stats":
                gc.collect()
                alive = sum(isinstance(o, (rdmaio.Endpoint, Transport)) for o in gc.get_objects())
                print(json.dumps({"clients": server.statistics()["clients"], "alive": alive}), flush=True)
            elif line.strip() == "trim":
                print(json.dumps({"trimmed": trim_heap()}), flush=True)
            else:
                break
        async with server:
            pass

    uvloop.run(main())
    """
)


class Server:
    """The server process: its port and pid, and its clients count on request."""

    def __init__(self, host: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, host], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), f"server did not start: {line!r}"
        info = json.loads(line.split(" ", 1)[1])
        self.port: int = info["port"]
        self.pid: int = info["pid"]

    def stats(self) -> dict[str, int]:
        """``clients``: established connections the server holds; ``alive``: Endpoint and Transport
        objects in its heap (after a collection), held by anyone."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        reply: dict[str, int] = json.loads(self.proc.stdout.readline())
        return reply

    def trim(self) -> bool:
        """Have the server give its free C heap memory back to the kernel."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("trim\n")
        self.proc.stdin.flush()
        return bool(json.loads(self.proc.stdout.readline())["trimmed"])

    def clients(self) -> int:
        """Established connections the server holds now."""
        return self.stats()["clients"]

    def wait_clients(self, want: int, patience: float = 300.0) -> int:
        """Poll until the server holds ``want`` clients (or ``patience`` s passed); the last count."""
        deadline = time.monotonic() + patience
        while (count := self.clients()) != want and time.monotonic() < deadline:
            time.sleep(0.5)
        return count

    def fds(self) -> int:
        """Open fds of the server process."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self) -> int:
        """Ask the server to exit; its exit status."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def _alive_here() -> int:
    gc.collect()
    return sum(isinstance(o, (rdmaio.Endpoint, Transport)) for o in gc.get_objects())


def _state(server: Server) -> dict[str, Any]:
    return {
        # This test's two processes only: a Domain of an earlier test's peer or loop that goes away while
        # this test runs is not a change of ours (seen in CI: an MR count 4 lower after than before).
        "rdma": rdma_resources(pids={os.getpid(), server.pid}),
        "client_alive": _alive_here(),
        "server_alive": server.stats()["alive"],
        "client_fds": len(os.listdir("/proc/self/fd")),
        "server_fds": server.fds(),
        "client_rss": rss_bytes(os.getpid()),
        "server_rss": rss_bytes(server.pid),
    }


async def _open(host: str, port: int, count: int) -> list[rdmaio.Endpoint]:
    endpoints: list[rdmaio.Endpoint] = []
    try:
        while len(endpoints) < count:
            batch = min(OPEN_BATCH, count - len(endpoints))
            results = await asyncio.gather(
                *(rdmaio.connect(host, port, timeout=120) for _ in range(batch)), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            endpoints.extend(r for r in results if isinstance(r, rdmaio.Endpoint))
            if errors:
                raise AssertionError(
                    f"{len(errors)} connects failed after {len(endpoints)} opened: {errors[0]!r}"
                )
    except BaseException:
        for ep in endpoints:
            ep.abort()
        raise
    return endpoints


async def _traffic(endpoints: list[rdmaio.Endpoint]) -> int:
    """A few echoes on every SAMPLE_EVERY-th connection, all at once; returns the bytes echoed."""

    async def one(index: int, ep: rdmaio.Endpoint) -> int:
        total = 0
        for size in (1, 100, 70_000):  # the last one spans two 64 KiB slots
            payload = bytes([index % 251]) * size
            await ep.send(payload)
            assert await ep.recv() == payload
            total += size
        return total

    sample = list(enumerate(endpoints))[::SAMPLE_EVERY]
    return sum(await asyncio.gather(*(one(i, ep) for i, ep in sample)))


@pytest.fixture(scope="module")
def scale_run(rdma_addr: str) -> dict[str, Any]:
    """Hold CONNS connections, echo on a sample, close them all; the states of both processes before,
    while open and after (run once for the module's tests: it takes minutes in the test host)."""
    if not SYSFS_INFINIBAND.exists() or not any(SYSFS_INFINIBAND.iterdir()):
        # Module fixtures run before conftest's per-test device check: same skip (a failure under
        # the test host and in CI).
        pytest.skip(f"no RDMA device in {SYSFS_INFINIBAND}; run through the test host")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a few fds per connection
    try:
        opts = rdmaio.Options()
        # What an idle connection pins per side: its initial rings where they grow on demand (main
        # after the growing-rings change), both full rings before.
        slots = getattr(opts, "initial_depth", opts.recv_depth + opts.send_depth)
        ring_bytes = slots * opts.slot_size * 2  # both sides, one machine
        available = mem_available()
        assert available is None or CONNS * ring_bytes < available * 0.8, (
            f"{CONNS} connections would pin {CONNS * ring_bytes >> 20} MiB of slot rings (both sides) but "
            f"only {available >> 20} MiB are available: lower RDMAIO_SCALE_CONNS or boot the test host "
            "with more --memory"
        )
        return _run(rdma_addr)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_leave_no_kernel_object_fd_or_endpoint(
    scale_run: dict[str, Any],
) -> None:
    before, during = scale_run["before"], scale_run["during"]
    for after in (scale_run["after"], scale_run["after2"]):
        _check_released(before, after)
    assert scale_run["echoed"] == scale_run["echoed2"] == len(range(0, CONNS, SAMPLE_EVERY)) * 70_101
    assert scale_run["server_status"] == 0
    # While open: each connection holds its own QP on each side (CQs are per connection or shared per
    # device, depending on the core: not counted here), fds, and its objects.
    assert during["rdma"]["qp"] - before["rdma"]["qp"] == 2 * CONNS
    assert during["rdma"]["cq"] >= before["rdma"]["cq"]
    # No fd per connection: the completion channel and the rdma_cm event channel are the loop's, shared.
    assert during["client_fds"] - before["client_fds"] < 4 and during["server_fds"] - before["server_fds"] < 4
    assert during["server_alive"] >= 2 * CONNS and during["client_alive"] >= 2 * CONNS


def _check_released(before: dict[str, Any], after: dict[str, Any]) -> None:
    """What must be back to its baseline once a round of connections is closed."""
    # After: the kernel's QPs, CQs, MRs, PDs and cm ids, both processes' fds, and no Endpoint or
    # Transport outlives its close (a survivor would keep its slot buffers, MiBs each).
    assert after["rdma"] == before["rdma"], (before["rdma"], after["rdma"])
    assert after["client_fds"] == before["client_fds"]
    assert after["server_fds"] == before["server_fds"]
    assert after["server_alive"] == before["server_alive"]
    assert after["client_alive"] == before["client_alive"]


def test_idle_connections_leak_no_memory(
    scale_run: dict[str, Any], record_testsuite_property: Callable[[str, object], None]
) -> None:
    """After the close, each process's RSS is back within RSS_TOLERANCE of its baseline once the C heap
    gave its free memory back (glibc ``malloc_trim``).

    Without the trim it is not: glibc keeps the freed 2 MiB slot rings (once the first is freed, its
    dynamic mmap threshold puts later ones on the heap, which is only trimmed from the top). Measured:
    412 MiB kept by the server after closing 100 connections, with no connection object alive, all of it
    returned by the trim. The rings are allocated in ``transport.py`` (being rewritten: mmap-backed or
    small rings would return on close); the untrimmed figures are recorded in the junit report (suite
    properties ``*_rss_kept_untrimmed_kib``); drop the trim once they are within the tolerance too.
    """
    before, during = scale_run["before"], scale_run["during"]
    untrimmed, after = scale_run["after_untrimmed"], scale_run["after"]
    for side in ("client", "server"):
        record_testsuite_property(
            f"{side}_rss_kept_untrimmed_kib", (untrimmed[f"{side}_rss"] - before[f"{side}_rss"]) >> 10
        )
        peak = during[f"{side}_rss"] - before[f"{side}_rss"]
        grown = after[f"{side}_rss"] - before[f"{side}_rss"]
        record_testsuite_property(f"{side}_rss_per_connection_kib", peak // CONNS >> 10)
        assert peak > CONNS * 64 * 1024  # the connections did cost memory: the check can see a leak
        # The acceptance bound (the bench's MEMORY_RSS_TARGET_KIB): an idle connection grows its process's
        # RSS by at most 512 KiB.
        assert peak <= CONNS * 512 * 1024, f"{side}: {peak // CONNS >> 10} KiB RSS per idle connection"
        # The first round may leave the allocators' retention behind, which grows with the peak (at
        # 1,000 connections the client kept 19 MiB of a 352 MiB peak); the second round must add nothing
        # beyond noise: a leak of 4 KiB per connection would show at 1,000. The trim can also return pages
        # the baseline held (the first round then ends below it: -6.6 MiB once in CI), which the second
        # round faults back in: that is no leak, so its growth counts from the higher of the two.
        regrown = scale_run["after2"][f"{side}_rss"] - max(after[f"{side}_rss"], before[f"{side}_rss"])
        record_testsuite_property(f"{side}_rss_kept_round1_kib", grown >> 10)
        record_testsuite_property(f"{side}_rss_added_round2_kib", regrown >> 10)
        assert grown <= max(RSS_TOLERANCE, peak // 16), (
            f"{side} RSS is {grown >> 10} KiB above its baseline after closing {CONNS} connections and "
            f"trimming the heap (it grew by {peak >> 10} KiB while they were open)"
        )
        assert regrown <= max(RSS_TOLERANCE // 4, CONNS * 4096), (
            f"{side} RSS grew by another {regrown >> 10} KiB over a second round of {CONNS} connections "
            f"(first round: {peak >> 10} KiB while open, {grown >> 10} KiB kept): a leak"
        )


def _run(host: str) -> dict[str, Any]:
    gc.collect()  # earlier tests' closed loops: their reactors release their Domains when collected
    server = Server(host)
    result: dict[str, Any] = {}
    try:
        with asyncio.Runner() as runner:
            # Warm-up: the loop's event channel, the device's PD and librdmacm's device handles exist on
            # both sides before the baseline (they live as long as the loop, by design).
            runner.run(_warm_up(host, server.port))
            assert server.wait_clients(0) == 0
            # The domains' ring pools release what closed connections left them once idle (rdmaio.core.rings):
            # let them, on both sides, before each measurement (the client's loop runs only in run()).
            runner.run(asyncio.sleep(POOL_LINGER + 1))
            result["before"] = before = _state(server)
            # Two rounds: what the first leaves behind may be the allocators' (Python's arenas keep pages
            # that still hold one live object); a leak grows again in the second, caches do not.
            for suffix in ("", "2"):
                endpoints = runner.run(_open(host, server.port, CONNS))
                assert server.wait_clients(CONNS) == CONNS
                result["during" + suffix] = _state(server)
                result["echoed" + suffix] = runner.run(_traffic(endpoints))
                runner.run(_close(endpoints))
                assert all(ep.is_closing() for ep in endpoints)
                assert server.wait_clients(0) == 0
                del endpoints
                runner.run(asyncio.sleep(POOL_LINGER + 1))
                result["after_untrimmed" + suffix] = _wait_released(server, before)
                server.trim()
                trim_heap()
                result["after" + suffix] = _state(server)
    finally:
        result["server_status"] = server.stop()
    return result


async def _warm_up(host: str, port: int) -> None:
    async with await rdmaio.connect(host, port, timeout=120) as ep:
        await ep.send(b"warm")
        assert await ep.recv() == b"warm"


async def _close(endpoints: list[rdmaio.Endpoint]) -> None:
    for first in range(0, len(endpoints), OPEN_BATCH):
        await asyncio.gather(*(ep.aclose() for ep in endpoints[first : first + OPEN_BATCH]))


def _wait_released(server: Server, before: dict[str, Any], patience: float = 60.0) -> dict[str, Any]:
    """The state once the kernel objects are gone (destroying them is asynchronous on the peer's side:
    the server tears a connection down when its DISCONNECTED event arrives)."""
    deadline = time.monotonic() + patience
    while True:
        state = _state(server)
        if state["rdma"] == before["rdma"] or time.monotonic() >= deadline:
            return state
        time.sleep(0.5)
