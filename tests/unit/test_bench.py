"""Unit tests of ``python -m bench``: parsers (on captured tool output), ratios, table, JSON, plan.

They need no RDMA device. The end-to-end tests run the TCP contenders on loopback and the native-tool
orchestration against stand-in scripts that print captured perftest/rstream reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.driver import _is_local_address, plan_runs
from bench.driver import main as bench_main
from bench.external import ExternalConfig, perftest_command, run_external
from bench.model import (
    FULL,
    QUICK,
    Figure,
    Sample,
    Workload,
    format_size,
    parse_size,
    resolve_contenders,
)
from bench.parsers import (
    ParseError,
    parse_perftest_bw,
    parse_perftest_lat,
    parse_rstream,
)
from bench.peers import _percentile, _windowed_sends, rdmaio_stats
from bench.report import (
    SCHEMA,
    best_rdma,
    build_report,
    figure_ratios,
    index_figures,
    key_ratios,
    render_markdown,
    render_table,
    validate_report,
)
from rdmaio.__main__ import main as rdmaio_main

S, M, E = Workload.STREAM, Workload.MESSAGE, Workload.ECHO
KiB, MiB = 1024, 1024 * 1024
DASHES = "-" * 87 + "\n"

# --- captured outputs (perftest 6.06 and rdmacm-utils 44.0 on Soft-RoCE rxe0 in the test VM) -------------

SEND_BW_64 = (
    DASHES + "                    Send BW Test\n"
    " Dual-port       : OFF\t\tDevice         : rxe0\n"
    " Number of qps   : 1\t\tTransport type : IB\n"
    " Connection type : RC\t\tUsing SRQ      : OFF\n"
    " PCIe relax order: ON\n ibv_wr* API     : OFF\n TX depth        : 128\n CQ Moderation   : 100\n"
    " Mtu             : 1024[B]\n Link type       : Ethernet\n GID index       : 1\n"
    " Max inline data : 0[B]\n rdma_cm QPs\t : ON\n Data ex. method : rdma_cm\n"
    + DASHES
    + " local address: LID 0000 QPN 0x0013 PSN 0x8de8a6\n"
    " GID: 00:00:00:00:00:00:00:00:00:00:255:255:198:18:00:01\n"
    " remote address: LID 0000 QPN 0x0014 PSN 0x8d92f\n"
    " GID: 00:00:00:00:00:00:00:00:00:00:255:255:198:18:00:01\n"
    + DASHES
    + " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
    " 64         5000             0.89               0.29   \t\t   0.004751\n" + DASHES
)
WRITE_BW_64K = (
    DASHES + "                    RDMA_Write BW Test\n"
    " Dual-port       : OFF\t\tDevice         : rxe0\n"
    " CQ Moderation   : 1\n Mtu             : 1024[B]\n rdma_cm QPs\t : ON\n"
    + DASHES
    + " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
    " 65536      200              29.21              14.09  \t\t   0.000226\n" + DASHES
)
SEND_LAT_64 = (
    DASHES + "                    Send Latency Test\n"
    " Dual-port       : OFF\t\tDevice         : rxe0\n TX depth        : 1\n"
    + DASHES
    + " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
    "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n"
    " 64      1000          20.65          12324.55      41.92    \t       453.11      \t1396.51\t\t"
    "7064.41 \t\t12324.55\n" + DASHES + "Correlation coefficient r^2: 0.604686 < 0.9\n"
)
RSTREAM_BW_4K = (
    "name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer\n"
    "custom    4k      2k      1       15m         3.53s      0.04     881.75\n"
)
RSTREAM_LAT_64 = (
    "name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer\n"
    "custom    64      1       1k      125k        8.29s      0.00    4147.02\n"
)
PERFTEST_NO_SERVER = (
    "Unexpected CM event bl blka 8\n"
    " Unable to perform rdma_client function\n"
    " Unable to init the socket connection\n"
)


# --- parsers ---------------------------------------------------------------------------------------------


def test_perftest_bw_send_64() -> None:
    bw = parse_perftest_bw(SEND_BW_64)
    assert bw.size == 64
    assert bw.iterations == 5000
    assert bw.bw_average_bytes_per_s == pytest.approx(0.29 * MiB)  # perftest MB = 2**20 B
    assert bw.bw_peak_bytes_per_s == pytest.approx(0.89 * MiB)
    assert bw.msgs_per_s == pytest.approx(4751)


def test_perftest_bw_write_64k() -> None:
    bw = parse_perftest_bw(WRITE_BW_64K)
    assert (bw.size, bw.iterations) == (65536, 200)
    assert bw.bw_average_bytes_per_s == pytest.approx(14.09 * MiB)
    assert bw.msg_rate_mpps == pytest.approx(0.000226)


def test_perftest_bw_gbits_header() -> None:
    text = (
        " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
        " 1048576    16               8.00               4.00               0.000477\n"
    )
    bw = parse_perftest_bw(text)
    assert bw.bw_average_bytes_per_s == pytest.approx(4.0e9 / 8)


@pytest.mark.parametrize(
    "text",
    [
        "",
        PERFTEST_NO_SERVER,
        " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n" + DASHES,
        " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 64 5000 0.89\n",
        " #bytes     #iterations    BW peak[xB/sec]    BW average[xB/sec]   MsgRate[Mpps]\n 64 1 1 1 1\n",
        SEND_LAT_64,
    ],
)
def test_perftest_bw_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        parse_perftest_bw(text)


SEND_LAT_INF = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
    "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n"
    " 64      1000          inf            inf          inf      \t       inf         \t-nan   \t\tinf"
    "     \t\tinf    \n" + DASHES
)


def test_perftest_lat_non_finite() -> None:
    # ib_send_lat -e on rxe in the emulated VM printed this
    with pytest.raises(ParseError, match="non-finite"):
        parse_perftest_lat(SEND_LAT_INF)


def test_perftest_lat_send_64() -> None:
    lat = parse_perftest_lat(SEND_LAT_64)
    assert (lat.size, lat.iterations) == (64, 1000)
    assert lat.t_typical_us == pytest.approx(41.92)
    assert lat.p99_us == pytest.approx(7064.41)
    assert lat.p999_us == pytest.approx(12324.55)
    # one-way figures: the round trip is twice as long
    assert lat.rtt_p50_us == pytest.approx(83.84)
    assert lat.rtt_p99_us == pytest.approx(2 * 7064.41)
    assert lat.rtt_mean_us == pytest.approx(2 * 453.11)


@pytest.mark.parametrize(
    "text", ["", PERFTEST_NO_SERVER, SEND_BW_64, SEND_LAT_64.replace("12324.55\n", "\n", 2)]
)
def test_perftest_lat_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        parse_perftest_lat(text)


def test_rstream_bw() -> None:
    result = parse_rstream(RSTREAM_BW_4K)
    assert result.name == "custom"
    assert result.size_field == "4k"
    assert result.seconds == pytest.approx(3.53)
    assert result.gbit_per_s == pytest.approx(0.04)
    assert result.usec_per_xfer == pytest.approx(881.75)
    # usec/xfer has more significant digits than "0.04" Gb/s here
    assert result.bytes_per_s(4096) == pytest.approx(4096 / 881.75e-6)


def test_rstream_bw_prefers_gbits_when_fast() -> None:
    text = "name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer\n"
    text += "64k_bw    64k     1k      1       128m        0.10s     10.74       0.05\n"
    assert parse_rstream(text).bytes_per_s(65536) == pytest.approx(10.74e9 / 8)


def test_rstream_lat() -> None:
    result = parse_rstream(RSTREAM_LAT_64)
    assert result.rtt_us == pytest.approx(2 * 4147.02)


@pytest.mark.parametrize(
    "text",
    ["", "rconnect: Connection refused\n", RSTREAM_BW_4K.splitlines()[0] + "\n", SEND_BW_64],
)
def test_rstream_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        parse_rstream(text)


# --- model -----------------------------------------------------------------------------------------------


def test_sizes() -> None:
    assert [parse_size(s) for s in ("64", "4K", "64KiB", "1M", "1mb", "512b")] == [
        64,
        4096,
        65536,
        MiB,
        MiB,
        512,
    ]
    assert [format_size(s) for s in (64, 4096, 65536, MiB, 1000)] == [
        "64 B",
        "4 KiB",
        "64 KiB",
        "1 MiB",
        "1000 B",
    ]
    for bad in ("", "K", "4X", "-1"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_resolve_contenders() -> None:
    assert resolve_contenders(["perftest"]) == [
        "ib_send_bw",
        "ib_write_bw",
        "ib_read_bw",
        "ib_send_lat",
        "ib_send_lat-e",
    ]
    assert resolve_contenders(["rdmaio", "rdmaio-asyncio", "tcp-uvloop"]) == [
        "rdmaio-asyncio",
        "rdmaio-uvloop",
        "tcp-uvloop",
    ]
    assert (
        len(resolve_contenders(["all"])) == 13
    )  # with cm_setup, ib_read_bw, ib_send_lat -e and the one-sided perftest tools
    with pytest.raises(ValueError, match="unknown contender"):
        resolve_contenders(["iperf"])


def test_budget_amounts() -> None:
    assert QUICK.amount(S, 64) == QUICK.stream_bytes[64] // 64
    assert FULL.amount(S, MiB) == 64
    assert QUICK.amount(E, 4096) == QUICK.echo_iters[4096]
    assert QUICK.reps == 1 and FULL.reps == 3
    for budget in (QUICK, FULL):
        for workload in Workload:
            for size in (64, 4096, 65536, MiB):
                assert budget.amount(workload, size) >= 5


def test_figure_median_and_status() -> None:
    fig = Figure("rdmaio-asyncio", S, 64)
    fig.samples = [Sample(ok=True, bytes_per_s=v) for v in (3.0, 1.0, 2.0)]
    assert fig.value == 2.0 and fig.status == "ok"
    fig.samples.append(Sample.failure("boom"))
    assert fig.status == "partial" and fig.errors == ["boom"] and fig.value == 2.0
    failed = Figure("rstream", E, 64, [Sample.failure("x"), Sample.failure("x")])
    assert failed.status == "error" and failed.value is None and failed.errors == ["x"]
    echo = Figure("rstream", E, 64, [Sample(ok=True, mean_us=10.0)])
    assert echo.value == 10.0  # no p50: the mean stands in
    assert Figure.from_json(json.loads(json.dumps(fig.to_json()))).samples == fig.samples


def test_rdmaio_stats() -> None:
    client = {"wakeups": 10, "completions": 80, "mean_batch": 8.0, "frames_posted": 100, "post_calls": 25}
    server = {"wakeups": 20, "completions": 100, "mean_batch": 5.0, "frames_posted": 0, "post_calls": 0}
    stats = rdmaio_stats(client, server, 300)
    assert stats["wakeups_per_op"] == pytest.approx(0.1)
    assert stats["client_wakeups_per_op"] == pytest.approx(10 / 300)
    assert stats["server_wakeups_per_op"] == pytest.approx(20 / 300)
    assert stats["client_frames_per_post"] == 4.0 and stats["server_frames_per_post"] == 0.0
    assert stats["client_frames_per_op"] == pytest.approx(100 / 300)
    assert stats["server_mean_batch"] == 5.0


def test_percentile() -> None:
    values = list(range(1, 101))
    assert _percentile(values, 0.5) == 50.0
    assert _percentile(values, 0.99) == 99.0
    assert _percentile([7], 0.99) == 7.0


# --- ratios, table, JSON ----------------------------------------------------------------------------------


def _fig(contender: str, workload: Workload, size: int, **values: float) -> Figure:
    sample = Sample(ok=True, **values)  # type: ignore[arg-type]
    return Figure(contender, workload, size, [sample])


def _rdmaio(contender: str, workload: Workload, size: int, wakeups: float = 0.05, **values: float) -> Figure:
    fig = _fig(contender, workload, size, **values)
    fig.samples[0].rdmaio = {
        "wakeups_per_op": wakeups,
        "client_wakeups_per_op": wakeups / 2,
        "server_wakeups_per_op": wakeups / 2,
        "client_mean_batch": 8.0,
        "server_mean_batch": 16.0,
    }
    return fig


def sample_figures() -> list[Figure]:
    figs = [
        _fig("ib_send_bw", S, 64 * KiB, bytes_per_s=100.0),
        _fig("ib_write_bw", S, 64 * KiB, bytes_per_s=120.0),
        _fig("ib_send_bw", S, MiB, bytes_per_s=200.0),
        Figure("ib_write_bw", S, MiB, [Sample.failure("ib_write_bw not found on PATH")]),
        _fig("ib_send_bw", S, 64, bytes_per_s=10.0),
        _fig("ib_send_bw", M, 64, msgs_per_s=1000.0),
        _fig("rstream", S, 4 * KiB, bytes_per_s=50.0),
        _fig("rstream", S, 64 * KiB, bytes_per_s=60.0),
        _fig("rstream", E, 64, mean_us=30.0),
        _fig("ib_send_lat", E, 64, p50_us=20.0, p99_us=40.0),
        _fig("tcp-asyncio", S, 64, bytes_per_s=5.0),
        _fig("tcp-asyncio", E, 64, p50_us=100.0, p99_us=300.0),
        _rdmaio("rdmaio-asyncio", S, 64 * KiB, bytes_per_s=114.0),
        _rdmaio("rdmaio-asyncio", S, MiB, bytes_per_s=150.0),
        _rdmaio("rdmaio-asyncio", S, 64, bytes_per_s=25.0),
        _rdmaio("rdmaio-asyncio", S, 4 * KiB, bytes_per_s=100.0),
        _rdmaio("rdmaio-asyncio", M, 64, wakeups=0.2, msgs_per_s=600.0),
        _rdmaio("rdmaio-asyncio", E, 64, p50_us=40.0, p99_us=90.0),
        _rdmaio("rdmaio-uvloop", S, 64 * KiB, bytes_per_s=120.0),
        _rdmaio("rdmaio-uvloop", E, 64, p50_us=50.0, p99_us=90.0),
    ]
    return figs


def test_best_rdma() -> None:
    figures = index_figures(sample_figures())
    assert best_rdma(figures, S, 64 * KiB) == ("ib_write_bw", 120.0)
    assert best_rdma(figures, S, MiB) == ("ib_send_bw", 200.0)  # the failed ib_write_bw is skipped
    assert best_rdma(figures, E, 64) == ("ib_send_lat", 20.0)  # lowest round trip wins
    assert best_rdma(figures, M, 4096) == (None, None)


def test_key_ratios() -> None:
    ratios = {(r.key, r.loop): r for r in key_ratios(index_figures(sample_figures()))}
    r = ratios["oneway_64k_vs_ib_bw", "asyncio"]
    assert r.value == pytest.approx(114 / 120) and r.met is True  # 0.95
    assert "ib_write_bw" in r.denominator
    r = ratios["oneway_1m_vs_ib_bw", "asyncio"]
    assert r.value == pytest.approx(0.75) and r.met is False
    assert ratios["stream_64b_vs_ib_send_bw", "asyncio"].value == pytest.approx(2.5)
    assert ratios["stream_64b_vs_tcp", "asyncio"].value == pytest.approx(5.0)
    assert ratios["stream_64b_vs_tcp", "asyncio"].met is True
    assert ratios["message_64b_vs_ib_send_bw", "asyncio"].value == pytest.approx(0.6)
    wake = ratios["message_64b_wakeups_per_msg", "asyncio"]
    assert wake.value == pytest.approx(0.2) and wake.op == "<=" and wake.met is False
    echo = ratios["echo_64b_rtt_vs_tcp", "asyncio"]
    assert echo.value == pytest.approx(0.4) and echo.met is True
    assert ratios["stream_4k_vs_rstream", "asyncio"].value == pytest.approx(2.0)
    # missing pieces give no value, no verdict, and say why
    missing = ratios["stream_64b_vs_tcp", "uvloop"]
    assert missing.value is None and missing.met is None
    assert missing.note is not None and "rdmaio-uvloop stream 64 B not measured" in missing.note
    uv = ratios["uvloop_vs_asyncio", None]
    # stream 64K: 120/114 faster; echo 64: 40/50 slower -> geometric mean
    assert uv.value == pytest.approx(math.sqrt((120 / 114) * (40 / 50)))


def test_key_ratio_rstream_64k() -> None:
    ratios = {(r.key, r.loop): r for r in key_ratios(index_figures(sample_figures()))}
    assert ratios["stream_64k_vs_rstream", "asyncio"].value == pytest.approx(114 / 60)
    assert ratios["stream_64k_vs_rstream", "asyncio"].met is True


def test_figure_ratios() -> None:
    rows = {(r.contender, r.workload, r.size): r for r in figure_ratios(index_figures(sample_figures()))}
    row = rows["rdmaio-asyncio", S, 64]
    assert row.best_rdma == "ib_send_bw" and row.vs_best_rdma == pytest.approx(2.5)
    assert row.tcp == "tcp-asyncio" and row.vs_tcp == pytest.approx(5.0)
    assert row.wakeups_per_op == pytest.approx(0.05)
    echo = rows["rdmaio-asyncio", E, 64]
    assert echo.vs_best_rdma == pytest.approx(2.0) and echo.vs_tcp == pytest.approx(0.4)
    assert rows["rdmaio-uvloop", S, 64 * KiB].vs_tcp is None  # no tcp-uvloop figure


def test_render_table() -> None:
    figs = sample_figures()
    contenders = resolve_contenders(["all"])
    text = render_table(figs, contenders, reps=3)
    assert "One-way stream throughput - MiB/s (median of 3 runs)" in text
    assert "Message rate" in text and "Echo round trip" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("size") and "ib_write_bw" in line)
    others = ("ib_send_lat", "ib_send_lat-e", "cm_setup", "ib_read_lat", "ib_atomic_bw")  # not stream tools
    assert header.split() == ["size", *[c for c in contenders if c not in others]]
    one_mib = next(line for line in lines if line.startswith("1 MiB"))
    assert "ERR" in one_mib  # the failed ib_write_bw
    assert "ib_write_bw stream 1 MiB: ib_write_bw not found on PATH" in text
    assert "~60.0" in text or "~30.0" in text  # rstream echo: mean only
    assert "20.0/40.0" in text  # ib_send_lat p50/p99
    assert "NOT met" in text and "met" in text and "n/a" in text
    assert "wakeups/op" in text


def test_render_markdown_has_the_text_tables_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figs = sample_figures()
    contenders = resolve_contenders(["all"])
    text = render_table(figs, contenders, reps=3)
    markdown = render_markdown(figs, contenders, reps=3)
    tables = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert "**One-way stream throughput - MiB/s (median of 3 runs)**" in markdown
    header = next(line for line in tables if line.startswith("| size |") and "ib_write_bw" in line)
    others = ("ib_send_lat", "ib_send_lat-e", "cm_setup", "ib_read_lat", "ib_atomic_bw")  # not stream tools
    assert header == "| " + " | ".join(["size", *[c for c in contenders if c not in others]]) + " |"
    assert "| --- | ---: |" in markdown  # text column left, figures right
    # Every row is a closed pipe row, and the text table's notable cells are in the markdown too.
    for line in tables:
        assert line.endswith(" |")
    for word in ("ERR", "~60.0" if "~60.0" in text else "~30.0", "20.0/40.0", "NOT met", "n/a"):
        assert word in markdown, word
    assert "- ib_write_bw stream 1 MiB: ib_write_bw not found on PATH" in markdown
    # From a JSON report: the tables headed by when, where and how they were measured.
    meta = {"mode": "full", "reps": 3, "created": "2026-11-26T12:43:00+00:00", "cpus": 2, "kernel": "6.1"}
    meta |= {"git_commit": "a1eed163ac7307740469d18ca0b85afb72c7790c", "git_dirty": []}
    meta["command"] = ["python", "-m", "bench", "--json", "reports/bench.json"]
    report = tmp_path / "bench.json"
    report.write_text(json.dumps(build_report(figs, meta, contenders)))
    assert bench_main(["--from-json", str(report), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "Measured 2026-11-26T12:43:00+00:00 at commit `a1eed16`, full budgets, 3 repetition(s), 2 CPUs, "
        "kernel 6.1, with `python -m bench --json reports/bench.json`.\n\n"
    )
    assert out.endswith(markdown)


def test_render_table_only_selected_workloads() -> None:
    text = render_table(sample_figures(), ["ib_send_lat", "rdmaio-asyncio"], reps=1, workloads=[E])
    assert "Echo round trip" in text and "One-way" not in text and "single run" in text


def test_report_json_valid_and_round_trips() -> None:
    figs = sample_figures()
    contenders = resolve_contenders(["all"])
    doc = build_report(figs, {"mode": "quick", "reps": 1}, contenders)
    assert validate_report(doc) == []
    text = json.dumps(doc)
    back = json.loads(text)
    assert validate_report(back) == []
    assert back["schema"] == SCHEMA
    assert back["contenders"]["ib_write_bw"]["status"] == "partial"
    assert back["contenders"]["ib_send_lat"]["status"] == "ok"
    assert back["contenders"]["tcp-uvloop"]["status"] == "not run"
    assert any("not found" in e for e in back["contenders"]["ib_write_bw"]["errors"])
    keys = {r["key"] for r in back["ratios"]}
    assert {
        "oneway_64k_vs_ib_bw",
        "oneway_1m_vs_ib_bw",
        "stream_64b_vs_ib_send_bw",
        "stream_64b_vs_tcp",
        "message_64b_vs_ib_send_bw",
        "message_64b_wakeups_per_msg",
        "echo_64b_rtt_vs_tcp",
        "stream_4k_vs_rstream",
        "stream_64k_vs_rstream",
        "uvloop_vs_asyncio",
    } <= keys
    failed = next(f for f in back["figures"] if f["contender"] == "ib_write_bw" and f["size"] == MiB)
    assert failed["status"] == "error" and failed["value"] is None and failed["errors"]
    rebuilt = [Figure.from_json(f) for f in back["figures"]]
    assert render_table(rebuilt, contenders, 1) == render_table(figs, contenders, 1)


def test_validate_report_finds_problems() -> None:
    doc = build_report(sample_figures(), {}, resolve_contenders(["all"]))
    assert validate_report([]) == ["report is not an object"]
    bad = json.loads(json.dumps(doc))
    bad["schema"] = "other"
    bad["figures"][0]["status"] = "fine"
    bad["figures"][1]["value"] = None
    bad["ratios"][0]["met"] = "yes"
    bad["ratios"][0]["op"] = "=="
    problems = validate_report(bad)
    assert any("schema" in p for p in problems)
    assert any("status unknown" in p for p in problems)
    assert any("no numeric value" in p for p in problems)
    assert any("met is not a bool" in p for p in problems)
    assert any("op must be" in p for p in problems)
    missing = json.loads(json.dumps(doc))
    del missing["ratios"]
    assert validate_report(missing) == ["ratios missing or not a list"]


# --- plan and command line ---------------------------------------------------------------------------------


def test_plan_runs() -> None:
    contenders = resolve_contenders(["all"])
    runs = plan_runs(contenders, [S, M, E], None, FULL)
    per_rep = len(runs) // 3
    assert len(runs) == 3 * per_rep
    assert [r.rep for r in runs] == sorted(r.rep for r in runs)  # repetitions outermost
    first = runs[:per_rep]
    send_bw = [r for r in first if r.contender == "ib_send_bw"]
    assert len(send_bw) == 5 and all(r.workloads == (S, M) for r in send_bw)
    assert [r.size for r in first if r.contender == "ib_send_lat"] == [64, 4096]
    assert [(r.workloads, r.size) for r in first if r.contender == "rstream"] == [
        ((S,), 64),
        ((S,), 4096),
        ((S,), 65536),
        ((S,), MiB),
        ((S,), 16 * MiB),
        ((E,), 64),
        ((E,), 4096),
    ]
    python = [r.contender for r in first if r.contender.startswith(("rdmaio", "tcp"))]
    loops = [c.split("-")[1] for c in python]
    assert loops == sorted(loops)  # asyncio contenders first, then uvloop: one switch per repetition
    assert len([r for r in first if r.contender == "rdmaio-uvloop"]) == 12
    # native tools before the Python contenders
    kinds = ["py" if r.contender.startswith(("rdmaio", "tcp")) else "native" for r in first]
    assert kinds == sorted(kinds, key=lambda k: k == "py")


def test_plan_runs_filters() -> None:
    runs = plan_runs(["ib_send_bw", "rdmaio-asyncio"], [M], [64], QUICK)
    assert [(r.contender, r.workloads, r.size) for r in runs] == [
        ("ib_send_bw", (M,), 64),
        ("rdmaio-asyncio", (M,), 64),
    ]
    assert plan_runs(["ib_send_lat"], [S], None, QUICK) == []


def test_local_address_guard() -> None:
    assert _is_local_address("127.0.0.1")
    assert _is_local_address("198.18.0.1")
    assert not _is_local_address("192.0.2.7")  # TEST-NET-1: never ours
    assert not _is_local_address("not-an-address")


def test_cli_refuses_remote_host(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench_main(["--host", "192.0.2.7"])
    assert info.value.code == 2
    assert "not loopback" in capsys.readouterr().err


def test_installed_cli_points_to_the_harness(capsys: pytest.CaptureFixture[str]) -> None:
    # The harness is not in the wheel: ``rdmaio bench`` says where it went and runs nothing.
    assert rdmaio_main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "tools/dev bench" in err and "python -m bench" in err


def test_cli_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert rdmaio_main([]) == 2
    assert rdmaio_main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
    assert rdmaio_main(["nope"]) == 2


# --- native-tool orchestration against stand-in scripts ---------------------------------------------


def _fake_tool(
    directory: Path, name: str, server_out: str, client_out: str, client_status: int = 0, linger: float = 1
) -> None:
    """A script that plays a tool: a client (address last, or ``-s ADDR``) or a server (``-b ADDR``)."""
    script = directory / name
    (directory / f"{name}.server").write_text(server_out)
    (directory / f"{name}.client").write_text(client_out)
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do last="$a"; done\n'
        "role=server\n"
        'case "$last" in 127.*) role=client ;; esac\n'
        'case " $* " in *" -b 127."*) role=server ;; esac\n'
        'case " $* " in *" -s 127."*) role=client ;; esac\n'
        f'if [ "$role" = client ]; then cat "{directory}/{name}.client"; exit {client_status}; fi\n'
        f'cat "{directory}/{name}.server"; sleep {linger}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only the stand-in tools and the few utilities they use (not the real perftest)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for util in ("cat", "sleep"):
        found = shutil.which(util)
        if found:
            (bin_dir / util).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_external_perftest_bw(fake_path: Path) -> None:
    _fake_tool(fake_path, "ib_send_bw", "* Waiting for client to connect... *\n" + SEND_BW_64, SEND_BW_64)
    config = ExternalConfig(host="127.0.0.1", device="rxe0", timeout=20)
    samples = run_external("ib_send_bw", [S, M], 64, 5000, config)
    assert samples[S].ok and samples[M].ok
    assert samples[S].bytes_per_s == pytest.approx(0.29 * MiB)
    assert samples[M].msgs_per_s == pytest.approx(4751)
    assert "BW average" in (samples[S].raw or "")


def test_external_ib_send_lat_in_event_mode(fake_path: Path) -> None:
    # The contender ib_send_lat-e runs the ib_send_lat binary with -e (sleeping on the completion channel).
    _fake_tool(
        fake_path, "ib_send_lat.real", "* Waiting for client to connect... *\n" + SEND_LAT_64, SEND_LAT_64
    )
    calls = fake_path / "calls"
    wrapper = fake_path / "ib_send_lat"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\nexec "{fake_path}/ib_send_lat.real" "$@"\n')
    wrapper.chmod(0o755)
    samples = run_external("ib_send_lat-e", [E], 64, 1000, ExternalConfig(host="127.0.0.1", timeout=20))
    assert samples[E].ok and samples[E].p50_us == pytest.approx(83.84)  # the round trip: 2 x t_typical
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all(" -e" in f" {line} " for line in lines)  # server and client
    assert perftest_command("ib_send_lat-e", 64, 10, 19500, None)[0] == "ib_send_lat"
    assert "-e" not in perftest_command("ib_send_lat", 64, 10, 19500, None)


def test_external_zero_report_is_an_error(fake_path: Path) -> None:
    zero = SEND_BW_64.replace(
        "0.89               0.29   \t\t   0.004751", "0.00               0.00   \t\t   0.000000"
    )
    assert zero != SEND_BW_64
    _fake_tool(fake_path, "ib_send_bw", "* Waiting for client to connect... *\n", zero)
    samples = run_external("ib_send_bw", [S, M], 64, 10, ExternalConfig(host="127.0.0.1", timeout=20))
    assert not samples[S].ok and "zero bandwidth" in (samples[S].error or "")
    assert not samples[M].ok


def test_external_perftest_clock_failure_is_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """perftest whose CPU frequency estimate failed (r^2 < 0.9) reports all zeros: the run measured
    nothing, so it is run again, without using up one of the configured attempts."""
    import bench.external
    from bench.external import PairResult

    zero = SEND_BW_64.replace(
        "0.89               0.29   \t\t   0.004751", "0.00               0.00   \t\t   0.000000"
    )
    clock = "Correlation coefficient r^2: 0.828688 < 0.9\n"
    outputs = [clock + zero, clock + zero, SEND_BW_64]
    runs: list[int] = []

    def fake_pair(server_cmd: Sequence[str], client_cmd: Sequence[str], **_: object) -> PairResult:
        runs.append(1)
        return PairResult(True, outputs[min(len(runs), len(outputs)) - 1], "")

    monkeypatch.setattr("bench.external.run_pair", fake_pair)
    monkeypatch.setattr("bench.external.shutil.which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr("bench.external.time.sleep", lambda s: None)
    config = ExternalConfig(host="127.0.0.1", timeout=20, attempts=1)
    samples = run_external("ib_send_bw", [S, M], 64, 5000, config)
    assert len(runs) == 3
    assert samples[S].ok and samples[S].bytes_per_s == pytest.approx(0.29 * MiB)
    assert "CPU frequency estimate failed" in (samples[S].note or "")
    # A clock that keeps failing: the retries, then the configured attempt, fail with the reason.
    outputs[:] = [clock + zero]
    runs.clear()
    failed = run_external("ib_send_bw", [S], 64, 5000, config)[S]
    assert len(runs) == bench.external.PERFTEST_CLOCK_RETRIES + 1
    assert not failed.ok and "CPU frequency estimate failed (r^2 < 0.9)" in (failed.error or "")


def test_external_size_mismatch_is_an_error(fake_path: Path) -> None:
    _fake_tool(fake_path, "ib_write_bw", "* Waiting for client to connect... *\n", WRITE_BW_64K)
    samples = run_external("ib_write_bw", [S], 4096, 10, ExternalConfig(host="127.0.0.1", timeout=20))
    assert not samples[S].ok and "65536" in (samples[S].error or "")


def test_external_latency_and_rstream(fake_path: Path) -> None:
    _fake_tool(fake_path, "ib_send_lat", "* Waiting for client to connect... *\n", SEND_LAT_64)
    _fake_tool(fake_path, "rstream", RSTREAM_LAT_64, RSTREAM_LAT_64)
    config = ExternalConfig(host="127.0.0.1", timeout=20)
    lat = run_external("ib_send_lat", [E], 64, 1000, config)[E]
    assert lat.ok and lat.p50_us == pytest.approx(83.84) and lat.p99_us == pytest.approx(14128.82)
    rs = run_external("rstream", [E], 64, 1000, config)[E]
    assert rs.ok and rs.mean_us == pytest.approx(8294.04) and rs.p50_us is None


def test_external_failures_are_reported(fake_path: Path) -> None:
    config = ExternalConfig(host="127.0.0.1", timeout=20, attempts=2)
    missing = run_external("ib_send_bw", [S, M], 64, 100, config)
    assert not missing[S].ok and "not found" in (missing[S].error or "")
    _fake_tool(fake_path, "ib_send_bw", "* Waiting for client to connect... *\n", PERFTEST_NO_SERVER, 1, 30)
    failed = run_external("ib_send_bw", [S], 64, 100, config)[S]
    assert not failed.ok
    assert "attempt 1: client exited with status 1, client exited with status 1" in (failed.error or "")
    assert "attempt 2" in (failed.error or "")
    assert "Unable to perform rdma_client function" in (failed.raw or "")
    _fake_tool(fake_path, "rstream", "name  usec/xfer\n", "garbage\n")
    garbled = run_external("rstream", [S], 4096, 100, config)[S]
    assert not garbled.ok and "cannot parse rstream output" in (garbled.error or "")


# --- end to end: the TCP contenders on loopback ------------------------------------------------------------


def test_bench_tcp_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--contenders",
            "tcp-asyncio,tcp-uvloop",
            "--sizes",
            "64,4K",
            "--host",
            "127.0.0.1",
            "--time-cap",
            "0.3",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "bench.svg"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[12/12]" in proc.stderr  # one progress line per measurement (plain: stderr is not a terminal)
    assert f"bench: plot written to {tmp_path / 'bench.svg'}" in proc.stderr
    svg = (tmp_path / "bench.svg").read_text()
    assert svg.startswith("<?xml") and "tcp-uvloop" in svg and "Echo round trip" in svg
    assert "Echo round trip" in proc.stdout and "Targets" in proc.stdout
    doc = json.loads(out.read_text())
    assert validate_report(doc) == []
    assert {f["status"] for f in doc["figures"]} == {"ok"}
    assert len(doc["figures"]) == 12
    echo = next(f for f in doc["figures"] if f["workload"] == "echo" and f["contender"] == "tcp-uvloop")
    assert 0 < echo["p50_us"] <= echo["p99_us"]
    again = subprocess.run(
        [sys.executable, "-m", "bench", "--from-json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert again.returncode == 0 and again.stdout == proc.stdout


def test_bench_drain_every(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    args = ["--quick", "--contenders", "tcp-asyncio", "--only", "stream", "--sizes", "64"]
    args += ["--host", "127.0.0.1", "--drain-every", "16", "--json", str(out)]
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
    assert doc["meta"]["drain_every"] == 16
    (figure,) = doc["figures"]
    assert figure["status"] == "ok" and figure["value"] > 0


def test_render_table_shows_only_measured_sizes_and_workloads() -> None:
    figs = [f for f in sample_figures() if f.workload is S and f.size in (64, 4 * KiB)]
    text = render_table(figs, ["rdmaio-asyncio", "ib_send_bw", "rstream"], reps=1)
    assert "One-way" in text and "Message rate" not in text and "Echo round trip" not in text
    rows = [line.split()[0:2] for line in text.splitlines()]
    assert ["64", "B"] in rows and ["4", "KiB"] in rows
    assert ["64", "KiB"] not in rows and ["1", "MiB"] not in rows


def test_windowed_sends_keep_the_window_full_and_stop_at_the_deadline() -> None:
    """The message workload's rendezvous sends: at most ``window`` in flight, all ``count`` of them sent,
    none started after the deadline, and a failed send fails the measurement."""

    async def main() -> None:
        in_flight = peak = 0
        sent: list[bytes] = []

        async def send(payload: bytes) -> None:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.001)
            in_flight -= 1
            sent.append(payload)

        assert await _windowed_sends(send, b"x", 10, time.perf_counter() + 60, 4) == (10, False)
        assert len(sent) == 10 and peak == 4
        sent.clear()
        assert await _windowed_sends(send, b"x", 10, 0.0, 4) == (0, True)  # deadline passed: nothing starts
        assert sent == []

        async def failing(payload: bytes) -> None:
            raise ConnectionResetError("peer gone")

        with pytest.raises(ConnectionResetError):
            await _windowed_sends(failing, b"x", 3, time.perf_counter() + 60, 2)

    asyncio.run(main())
