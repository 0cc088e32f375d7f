"""Unit tests of the bench's setup and memory workloads: parsing, accounting, ratios, table, plan, build.

No RDMA device needed: the native contender is compiled (when gcc and the rdma-core headers are here) but
not run; the TCP setup loop runs end to end on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import external
from bench.driver import _describe, plan_runs
from bench.external import CM_SETUP_SOURCE, NativeBuildError, build_cm_setup, cm_setup_commands
from bench.memory import (
    MemoryProbeError,
    Snapshot,
    parse_vmrss,
    per_connection,
    raise_fd_limit,
    rss_bytes,
    sum_mrlen,
    trim_heap,
)
from bench.model import QUICK, Figure, Sample, Workload
from bench.parsers import ParseError, parse_cm_setup
from bench.report import build_report, key_ratios, render_table, validate_report

SETUP, MEMORY = Workload.SETUP, Workload.MEMORY
KiB, MiB = 1024, 1024 * 1024

# --- parsing -------------------------------------------------------------------------------------------


def test_parse_cm_setup() -> None:
    out = (
        "cm_setup server listening on 198.18.0.1 port 1\n"
        "cm_setup connections 173 seconds 8.025224 rate 21.557 echo 1\n"
    )
    result = parse_cm_setup(out)
    assert result.connections == 173
    assert result.seconds == pytest.approx(8.025224)
    assert result.rate == pytest.approx(21.557)
    assert result.echo is True
    assert parse_cm_setup("cm_setup connections 5 seconds 1.0 rate 5.0 echo 0").echo is False


@pytest.mark.parametrize(
    "text",
    [
        "",
        "cm_setup: expected RDMA_CM_EVENT_ESTABLISHED, got RDMA_CM_EVENT_REJECTED (status 8)",
        "cm_setup connections 0 seconds 0.000000 rate 0.000 echo 1",
        "cm_setup connections 3 seconds 1.0 rate nan echo 1",
    ],
)
def test_parse_cm_setup_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        parse_cm_setup(text)


# Captured in the test host (rdma -j resource show mr, iproute2 6.1), with a second process added.
RDMA_MR_JSON = json.dumps(
    [
        {"ifindex": 0, "ifname": "rxe0", "mrn": 0, "mrlen": 2097152, "pdn": 2, "pid": 146, "comm": "python"},
        {"ifindex": 0, "ifname": "rxe0", "mrn": 1, "mrlen": 2097152, "pdn": 2, "pid": 146, "comm": "python"},
        {"ifindex": 0, "ifname": "rxe0", "mrn": 2, "mrlen": 4096, "pdn": 3, "pid": 200, "comm": "python"},
    ]
)


def test_sum_mrlen_counts_one_process() -> None:
    assert sum_mrlen(RDMA_MR_JSON, 146) == 4 * MiB
    assert sum_mrlen(RDMA_MR_JSON, 200) == 4096
    assert sum_mrlen(RDMA_MR_JSON, 999) == 0
    assert sum_mrlen("", 146) == 0  # no MR at all: rdma prints nothing


@pytest.mark.parametrize(
    "text", ["dev rxe0 mrn 0 mrlen 4096 pid 1", '{"pid": 1}', '[{"pid": 1, "mrlen": "4k"}]']
)
def test_sum_mrlen_rejects(text: str) -> None:
    with pytest.raises(MemoryProbeError):
        sum_mrlen(text, 1)


def test_parse_vmrss() -> None:
    status = "Name:\tpython\nVmPeak:\t  100 kB\nVmRSS:\t   26220 kB\nRssAnon:\t 1 kB\n"
    assert parse_vmrss(status) == 26220 * KiB
    with pytest.raises(MemoryProbeError):
        parse_vmrss("Name:\tkthreadd\n")  # kernel threads have no VmRSS
    assert rss_bytes(os.getpid()) > 1 * MiB


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_trim_heap_returns_freed_memory() -> None:
    # Many 1 MiB blocks with small objects between them: freed, glibc keeps most of them (its mmap
    # threshold rises after the first free); a trim gives them back.
    trim_heap()
    blocks = [bytearray(1 << 20) for _ in range(8)]
    del blocks
    blocks = [bytearray(1 << 20) for _ in range(64)]
    keep = [bytes(64) for _ in range(64)]
    del blocks
    before = rss_bytes(os.getpid())
    assert trim_heap() is True
    assert rss_bytes(os.getpid()) <= before
    del keep


def test_raise_fd_limit_never_lowers() -> None:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = raise_fd_limit()
    assert new >= soft
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == new


def test_per_connection() -> None:
    before = Snapshot(
        registered_server=1 * MiB, registered_client=0, rss_server=50 * MiB, rss_client=40 * MiB
    )
    during = Snapshot(
        registered_server=1 * MiB + 100 * 4 * MiB,
        registered_client=100 * 4 * MiB,
        rss_server=50 * MiB + 100 * 300 * KiB,
        rss_client=40 * MiB + 100 * 200 * KiB,
    )
    after = Snapshot(registered_server=1 * MiB, registered_client=0, rss_server=52 * MiB, rss_client=40 * MiB)
    figures = per_connection(before, during, after, 100)
    assert figures["connections"] == 100
    assert figures["registered_per_conn_server"] == 4 * MiB
    assert figures["registered_per_conn_client"] == 4 * MiB
    assert figures["rss_per_conn_server"] == 300 * KiB
    assert figures["rss_per_conn_client"] == 200 * KiB
    assert figures["registered_left_server"] == 0
    assert figures["rss_left_server"] == 2 * MiB
    assert figures["registered_total_server"] == 1 * MiB + 400 * MiB
    assert "registered_left_client" not in per_connection(before, during, None, 100)


# --- samples, figures, ratios, table ---------------------------------------------------------------------


def _memory_sample(reg_srv: float, reg_cli: float, rss_srv: float, rss_cli: float, n: int) -> Sample:
    return Sample(
        ok=True,
        ops=n,
        memory={
            "connections": float(n),
            "registered_per_conn_server": reg_srv,
            "registered_per_conn_client": reg_cli,
            "rss_per_conn_server": rss_srv,
            "rss_per_conn_client": rss_cli,
            "registered_left_server": 0.0,
            "registered_left_client": 0.0,
            "rss_left_server": 64 * KiB,
            "rss_left_client": 0.0,
        },
    )


def _setup(contender: str, rate: float) -> Figure:
    return Figure(contender, SETUP, 16, [Sample(ok=True, conns_per_s=rate, ops=int(rate * 10), seconds=10.0)])


def scale_figures() -> list[Figure]:
    failed = Sample.failure("stopped at 230 of 1000 connections: MemAvailable 180 MiB < reserve 192 MiB")
    failed.memory = _memory_sample(4 * MiB, 4 * MiB, 4.1 * MiB, 4.2 * MiB, 230).memory
    assert failed.memory is not None
    failed.memory["connections"] = 230.0
    return [
        _setup("cm_setup", 100.0),
        _setup("rdmaio-asyncio", 12.0),
        _setup("rdmaio-uvloop", 60.0),
        _setup("tcp-asyncio", 400.0),
        Figure("rdmaio-asyncio", MEMORY, 1, [_memory_sample(4 * MiB, 4 * MiB, 5 * MiB, 6 * MiB, 1)]),
        Figure("rdmaio-asyncio", MEMORY, 100, [_memory_sample(4 * MiB, 4 * MiB, 4 * MiB, 4.5 * MiB, 100)]),
        Figure("rdmaio-asyncio", MEMORY, 1000, [failed]),
    ]


def test_sample_values() -> None:
    figs = {(f.contender, f.workload, f.size): f for f in scale_figures()}
    assert figs[("cm_setup", SETUP, 16)].value == 100.0
    # memory: the larger of the two sides' registered bytes per connection (lower is better)
    lopsided = _memory_sample(256 * KiB, 512 * KiB, 1, 1, 10)
    assert lopsided.value(MEMORY) == 512 * KiB
    assert figs[("rdmaio-asyncio", MEMORY, 1000)].value is None  # failed: no figure claimed
    data = figs[("rdmaio-asyncio", MEMORY, 100)].to_json()
    assert data["memory"]["rss_per_conn_client"] == 4.5 * MiB
    assert data["unit"] == "B/conn"
    assert figs[("rdmaio-uvloop", SETUP, 16)].to_json()["conns_per_s"] == 60.0
    back = Figure.from_json(json.loads(json.dumps(data)))
    assert back.samples[0].memory == figs[("rdmaio-asyncio", MEMORY, 100)].samples[0].memory


def test_setup_and_memory_ratios() -> None:
    ratios = {
        (r.key, r.loop): r
        for r in key_ratios({(f.contender, f.workload, f.size): f for f in scale_figures()})
    }
    setup = ratios[("setup_vs_native", "asyncio")]
    assert setup.value == pytest.approx(0.12) and setup.met is False
    assert setup.denominator == "cm_setup setup 16 B"
    assert ratios[("setup_vs_native", "uvloop")].value == pytest.approx(0.6)
    assert ratios[("setup_vs_native", "uvloop")].met is True
    reg = ratios[("memory_registered_server_kib_per_conn", "asyncio")]
    # the largest count that worked (100), with the failure at 1000 named in the note
    assert reg.value == pytest.approx(4096) and reg.target == 256 and reg.met is False
    assert reg.note is not None and "at 100 idle connections" in reg.note
    assert "1000 connections failed: stopped at 230 of 1000" in reg.note
    rss = ratios[("memory_rss_client_kib_per_conn", "asyncio")]
    assert rss.value == pytest.approx(4.5 * 1024) and rss.target == 512
    missing = ratios[("memory_rss_client_kib_per_conn", "uvloop")]
    assert missing.value is None and missing.met is None
    assert missing.note == "rdmaio-uvloop memory not measured"
    # the uvloop-vs-asyncio geometric mean stays a data-path figure: setup and memory are not in it
    assert ratios[("uvloop_vs_asyncio", None)].value is None


def test_memory_ratio_when_every_count_failed() -> None:
    fig = Figure(
        "rdmaio-asyncio", MEMORY, 1000, [Sample.failure("opened 3 of 1000 connections, then OSError")]
    )
    ratios = {r.key: r for r in key_ratios({(fig.contender, MEMORY, 1000): fig}) if r.loop == "asyncio"}
    reg = ratios["memory_registered_client_kib_per_conn"]
    assert reg.value is None and reg.met is None
    assert reg.note is not None and "memory failed" in reg.note and "opened 3 of 1000" in reg.note


def test_render_setup_and_memory_tables() -> None:
    contenders = ["rdmaio-asyncio", "rdmaio-uvloop", "tcp-asyncio", "cm_setup"]
    text = render_table(scale_figures(), contenders, reps=1)
    lines = text.splitlines()
    assert "Connection setup (connect + 16 B echo + close, sequential) - connections/s (single run)" in lines
    header = next(line for line in lines if line.startswith("size") and "cm_setup" in line)
    assert header.split() == ["size", *contenders]
    row = next(line for line in lines if line.startswith("16 B"))
    assert row.split()[2:] == ["12.0", "60.0", "400", "100"]
    assert "Memory per idle connection - KiB per idle connection (single run)" in lines
    hundred = next(line for line in lines if line.startswith("rdmaio-asyncio") and " 100 " in line)
    assert "4096/4096" in hundred and "4096/4608" in hundred and "64.0/0" in hundred
    failed = next(line for line in lines if "1000 (ERR: 230 opened)" in line)
    assert "4096/4096" in failed  # what the opened connections cost is still shown
    # the ratios table compares setup with the native loop and TCP; memory has no per-figure ratio row
    setup_row = next(line for line in lines if line.startswith("setup") and "rdmaio-asyncio" in line)
    assert "0.120 (cm_setup)" in setup_row and "0.0300" in setup_row
    assert not any(line.startswith("memory ") for line in lines)
    assert "setup: connect + 16 B echo + close, conn/s vs the native rdma_cm loop" in text
    # only the targets of the workloads shown (no rows of n/a for the data path)
    assert "one-way 64 KiB" not in text and "uvloop vs on asyncio" not in text
    # the failure is listed
    assert "rdmaio-asyncio memory 1000 connections: stopped at 230 of 1000 connections" in text


def test_report_with_setup_and_memory_is_valid() -> None:
    figures = scale_figures()
    doc = build_report(
        figures, {"mode": "quick"}, ["rdmaio-asyncio", "rdmaio-uvloop", "tcp-asyncio", "cm_setup"]
    )
    assert validate_report(doc) == []
    keys = {r["key"] for r in doc["ratios"]}
    assert {
        "setup_vs_native",
        "memory_registered_server_kib_per_conn",
        "memory_rss_client_kib_per_conn",
    } <= keys
    assert doc["contenders"]["cm_setup"]["status"] == "ok"
    assert doc["contenders"]["rdmaio-asyncio"]["status"] == "partial"  # 1000 connections failed


def test_describe_progress_lines() -> None:
    sample = _memory_sample(4 * MiB, 4 * MiB, 300 * KiB, 200 * KiB, 100)
    text = _describe(plan_runs(["rdmaio-asyncio"], [MEMORY], None, QUICK, (100,))[0], {MEMORY: sample})
    assert "registered 4096/4096 KiB" in text and "RSS 300/200 KiB" in text
    failed = Sample.failure("opened 3 of 5 connections, then OSError: x")
    failed.memory = sample.memory
    text = _describe(plan_runs(["rdmaio-asyncio"], [MEMORY], None, QUICK, (5,))[0], {MEMORY: failed})
    assert "FAILED (opened 3 of 5" in text and "of those opened: per connection" in text
    setup = Sample(ok=True, conns_per_s=12.34, ops=123)
    run = plan_runs(["cm_setup"], [SETUP], None, QUICK)[0]
    assert "12.3 conn/s over 123 connections" in _describe(run, {SETUP: setup})


# --- plan --------------------------------------------------------------------------------------------------


def test_plan_runs_setup_and_memory() -> None:
    contenders = ["cm_setup", "rdmaio-asyncio", "tcp-asyncio", "ib_send_bw"]
    runs = plan_runs(contenders, [SETUP, MEMORY], [64], QUICK, (1, 50))
    assert [(r.contender, r.workloads, r.size, r.amount) for r in runs] == [
        ("cm_setup", (SETUP,), 16, QUICK.setup_conns),  # the size filter does not apply to setup
        ("rdmaio-asyncio", (SETUP,), 16, QUICK.setup_conns),
        ("rdmaio-asyncio", (MEMORY,), 1, 1),  # memory: the "size" is the connection count
        ("rdmaio-asyncio", (MEMORY,), 50, 50),
        ("tcp-asyncio", (SETUP,), 16, QUICK.setup_conns),  # no memory workload for TCP
    ]


# --- the native contender: build and command lines --------------------------------------------------------


def test_cm_setup_commands_echo() -> None:
    server, client = cm_setup_commands(Path("/x/cm_setup"), "198.18.0.1", 19500, 2000, 10.0)
    assert server == ["/x/cm_setup", "server", "198.18.0.1", "19500", "echo"]
    assert client == ["/x/cm_setup", "client", "198.18.0.1", "19500", "2000", "10", "echo"]


def test_build_cm_setup_without_gcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMAIO_BENCH_CACHE", str(tmp_path / "cache"))
    # A source of its own (another hash): a binary cached by an earlier run must not answer for it.
    source = tmp_path / "cm_setup.c"
    source.write_text(CM_SETUP_SOURCE.read_text() + "\n/* test_build_cm_setup_without_gcc */\n")
    with pytest.raises(NativeBuildError, match="no-such-cc not found on PATH"):
        build_cm_setup(source, compiler="no-such-cc")
    broken = tmp_path / "broken.c"
    broken.write_text("int main(void) { return syntax error; }\n")
    if shutil.which("gcc") is not None:
        with pytest.raises(NativeBuildError, match=r"compiling broken\.c failed"):
            build_cm_setup(broken)
    # run_external turns it into a failed sample, not an exception
    monkeypatch.setattr(external, "build_cm_setup", lambda: build_cm_setup(source, compiler="no-such-cc"))
    config = external.ExternalConfig(host="127.0.0.1")
    sample = external.run_external("cm_setup", [SETUP], 16, 10, config)[SETUP]
    assert not sample.ok and "native setup contender unavailable" in (sample.error or "")


def _have_rdma_headers() -> bool:
    return shutil.which("gcc") is not None and Path("/usr/include/rdma/rdma_cma.h").exists()


@pytest.mark.skipif(
    not _have_rdma_headers(), reason="needs gcc and librdmacm-dev (tools/dev setup installs them)"
)
def test_build_cm_setup_compiles_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMAIO_BENCH_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "cm_setup.c"  # a copy with its own hash: built here, not found in a cache
    source.write_text(CM_SETUP_SOURCE.read_text() + "\n/* test_build_cm_setup_compiles_once */\n")
    first = build_cm_setup(source)
    assert first.parent == tmp_path / "cache" and os.access(first, os.X_OK)
    mtime = first.stat().st_mtime_ns
    assert build_cm_setup(source) == first and first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    usage = subprocess.run([str(first)], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode == 2 and "usage: cm_setup" in usage.stderr


# --- end to end: the TCP setup loop on loopback ---------------------------------------------------------


def test_bench_tcp_setup_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    args = ["--quick", "--contenders", "tcp-asyncio", "--only", "setup", "--setup-seconds", "0.5"]
    args += ["--host", "127.0.0.1", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert validate_report(doc) == []
    (figure,) = doc["figures"]
    assert figure["workload"] == "setup" and figure["status"] == "ok"
    assert figure["conns_per_s"] > 0 and figure["samples"][0]["ops"] >= 1
    assert doc["meta"]["budget"]["setup_seconds"] == 0.5
    assert "Connection setup" in proc.stdout
