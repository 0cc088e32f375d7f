"""``rdmaio perf`` between the pair's two nodes: a ``perf --server`` process on node B, the client on node A
(``--bind``), as a user runs them on two hosts. Every mode with ``--json``: the document's schema, every
figure positive, and what the server counted equal to what the client sent (message, stream), echoed
(echo) or added (atomic). Then ``--parallel``, the server's limits (a refusal is exit status 3 and one
line), no server listening (exit status 2 and one line), and the server's clean stop on SIGINT.

It lives in the fault suite because this suite is the one that runs in the pair topology (tools/dev test).
The loop is the command's own ``--loop`` option (each process runs one), so both asyncio and uvloop run.
Nothing here asserts a duration: figures are checked for being positive and for adding up.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from netfault import Pair

from rdmaio.cli.perf import MODES, SCHEMA

PERF = [sys.executable, "-m", "rdmaio", "perf"]
RUN_TIMEOUT = 300  # a whole client run in the emulated VM (many runs of 1 s, each with its connection)


class PerfServer:
    """A ``perf --server`` process on node B; ``port`` is the one it listens on."""

    def __init__(self, pair: Pair, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*PERF, "--server", pair.b.addr, "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first.startswith("rdmaio perf server listening on"), (first, self.proc.poll())
        self.port = int(first.split()[-1])

    def stop(self) -> tuple[int, str]:
        """SIGINT, as Ctrl-C: returns the exit status and what it printed after its first line."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            out, _err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _err = self.proc.communicate()
        return self.proc.returncode, out


@pytest.fixture(params=["asyncio", pytest.param("uvloop", marks=pytest.mark.long)])
def loop(request: pytest.FixtureRequest) -> str:
    """The ``--loop`` both processes run on (uvloop in the long run only, as the suite's ``arun``: these
    check the command's behaviour, which the loop does not change, and each process start costs seconds in
    the emulated VM); :func:`test_every_mode_with_json` runs on both loops in every run."""
    return str(request.param)


@pytest.fixture(params=["asyncio", "uvloop"])
def every_loop(request: pytest.FixtureRequest) -> str:
    """Both loops, in every run."""
    return str(request.param)


@pytest.fixture
def server(pair: Pair, loop: str) -> Iterator[PerfServer]:
    """A perf server on node B with its default limits."""
    srv = PerfServer(pair, "--loop", loop)
    try:
        yield srv
    finally:
        srv.stop()


def client(pair: Pair, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The perf client on node A (bound to its address), to node B."""
    return subprocess.run(
        [*PERF, pair.b.addr, str(port), "--bind", pair.a.addr, *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )


def check_document(
    doc: dict[str, Any], pair: Pair, modes: Sequence[str], sizes: Sequence[int], parallel: int
) -> None:
    """The ``--json`` document as docs/cli.md documents it, and its figures consistent."""
    assert doc["schema"] == SCHEMA and doc["error"] is None
    assert doc["server"] == {"host": pair.b.addr, "port": doc["server"]["port"]}
    assert doc["options"]["modes"] == list(modes) and doc["options"]["sizes"] == list(sizes)
    assert doc["options"]["parallel"] == parallel and doc["options"]["bind"] == pair.a.addr
    path = doc["path"]  # the first connection's path record: from node A to node B
    assert (path["device"], path["port"]) == (pair.a.device, 1)
    assert (path["local_gid"], path["remote_gid"]) == (f"::ffff:{pair.a.addr}", f"::ffff:{pair.b.addr}")
    expected = [(m, 8 if m == "atomic" else s) for m in modes for s in ((8,) if m == "atomic" else sizes)]
    assert [(r["mode"], r["size"]) for r in doc["results"]] == expected
    for r in doc["results"]:
        what = f"{r['mode']} {r['size']}"
        assert r["parallel"] == parallel == len(r["connections"]), what
        for name in (
            "seconds",
            "operations",
            "bytes",
            "client_bytes",
            "bytes_per_second",
            "operations_per_second",
        ):
            assert r[name] > 0, (what, name, r[name])
        assert r["bits_per_second"] == pytest.approx(8 * r["bytes_per_second"])
        assert r["operations"] == sum(c["operations"] for c in r["connections"])
        server = r["server"]
        for c in r["connections"]:
            assert c["operations"] > 0 and c["seconds"] > 0, what
            if r["mode"] in ("message", "stream"):
                # What the peer received is what the client sent, connection by connection.
                assert c["server"]["bytes"] == c["client_bytes"] == c["bytes"], what
            if r["mode"] in ("message", "echo"):
                assert c["server"]["messages"] == c["operations"], what
            if r["mode"] == "atomic":
                assert c["server"]["counter"] == c["operations"], what
        if r["mode"] in ("message", "stream"):
            assert server["bytes"] == r["client_bytes"] == r["bytes"] == r["operations"] * r["size"], what
        else:
            assert r["bytes"] == r["operations"] * r["size"], what
        latency = r["latency_us"]
        if r["mode"] in ("message", "stream"):
            assert latency is None, what
        else:
            assert latency["samples"] == r["operations"], what
            ordered = [latency[k] for k in ("min", "p50", "p90", "p99", "p99.9", "max")]
            assert ordered[0] > 0 and ordered == sorted(ordered), (what, latency)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_every_mode_with_json(pair: Pair, every_loop: str) -> None:
    sizes = [64, 300 * 1024]  # 300 KiB: above the rendezvous threshold, several slots
    server = PerfServer(pair, "--loop", every_loop)
    try:
        done = client(
            pair,
            server.port,
            "--mode",
            "all",
            "--size",
            "64,300K",
            "--time",
            "1",
            "--json",
            "--loop",
            every_loop,
        )
    finally:
        status, out = server.stop()
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # the whole of stdout is the one document
    check_document(doc, pair, MODES, sizes, 1)
    assert doc["options"]["loop"] == every_loop
    assert status == 0, out
    assert out.rstrip().splitlines()[-1] == "rdmaio perf server stopped after 11 runs (0 refused)"


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_parallel_connections_add_up(pair: Pair, server: PerfServer, loop: str) -> None:
    done = client(
        pair,
        server.port,
        "--mode",
        "message,echo,atomic",
        "--size",
        "4K",
        "--time",
        "1",
        "-P",
        "2",
        "--json",
        "--loop",
        loop,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    check_document(doc, pair, ["message", "echo", "atomic"], [4096], 2)
    for r in doc["results"]:
        assert r["bytes_per_second"] == pytest.approx(sum(c["bytes_per_second"] for c in r["connections"]))
    status, out = server.stop()
    assert status == 0 and "stopped after 6 runs (0 refused)" in out


@pytest.mark.timeout(RUN_TIMEOUT)
def test_human_output_has_the_path_and_a_table(pair: Pair, server: PerfServer, loop: str) -> None:
    done = client(pair, server.port, "--mode", "echo", "--size", "64", "--time", "1", "--loop", loop)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"rdmaio perf to {pair.b.addr} port {server.port}"
    table = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    path = "\n".join(lines[1:table])  # the path record's lines: node A's device and both nodes' GIDs
    assert path.startswith(f"path: {pair.a.device} port 1, ")
    assert f"::ffff:{pair.a.addr} -> ::ffff:{pair.b.addr}" in path
    assert lines[table].split()[:3] == ["mode", "size", "conns"]
    assert lines[table + 1].split()[:4] == ["echo", "64", "B", "1"]
    assert "\x1b" not in done.stdout + done.stderr  # no terminal: no progress line


@pytest.mark.timeout(RUN_TIMEOUT)
def test_server_limits_refuse_with_a_reason(pair: Pair, loop: str) -> None:
    srv = PerfServer(pair, "--loop", loop, "--max-clients", "1", "--max-size", "1K")
    try:
        too_big = client(pair, srv.port, "--size", "4K", "--time", "1")
        assert too_big.returncode == 3, too_big.stderr
        assert too_big.stderr.startswith(
            f"rdmaio perf: {pair.b.addr} port {srv.port}: the server refused the run: size 4096"
        )
        assert len(too_big.stderr.splitlines()) == 1  # one line, no traceback
        busy = client(pair, srv.port, "--size", "64", "--time", "1", "-P", "2", "--json", "--loop", loop)
        assert busy.returncode == 3, busy.stderr
        assert "server busy" in busy.stderr
        doc = json.loads(busy.stdout)
        assert doc["error"]["kind"] == "refused" and "server busy" in doc["error"]["message"]
        assert doc["results"] == []
    finally:
        status, out = srv.stop()
    assert status == 0
    assert "refused: size 4096" in out and "refused: server busy" in out


@pytest.mark.timeout(120)
def test_no_server_listening_is_exit_2_and_one_line(pair: Pair, loop: str) -> None:
    srv = PerfServer(pair, "--loop", loop)
    port = srv.port
    srv.stop()  # the port was just in use, nobody listens on it now
    done = client(pair, port, "--time", "1", "--json", "--loop", loop)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"rdmaio perf: {pair.b.addr} port {port}: no perf server is listening there "
        f"(start one with: python -m rdmaio perf --server {pair.b.addr} {port})\n"
    )
    assert json.loads(done.stdout)["error"]["kind"] == "no-server"


@pytest.mark.timeout(RUN_TIMEOUT)
def test_doctor_peer_against_a_perf_server(pair: Pair, server: PerfServer) -> None:
    """``rdmaio doctor --peer`` from node A against ``perf --server`` on node B: the perf server hands
    doctor's connection to its probe responder, so the handshake, echo, READ and throughput checks pass."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rdmaio",
            "doctor",
            "--peer",
            pair.b.addr,
            str(server.port),
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    verdicts = {
        m.group(2): m.group(1)
        for line in done.stdout.splitlines()
        if (m := re.match(r"^(ok|WARN|FAIL|skip)\s+(\S+)\s", line))
    }
    for check in ("handshake", "echo", "read", "throughput"):
        assert verdicts.get(check) == "ok", done.stdout
    status, out = server.stop()
    assert status == 0 and ": doctor probe\n" in out and "doctor probe done" in out, out
