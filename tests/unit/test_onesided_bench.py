"""Unit tests of the one-sided bench workloads: plan, perftest commands and parsing, ratios,
table and JSON. No RDMA device needed."""

from __future__ import annotations

import pytest

from bench.driver import plan_runs
from bench.external import _parse, perftest_command
from bench.model import (
    FULL,
    QUICK,
    Figure,
    Sample,
    Workload,
    expand_workloads,
    resolve_contenders,
)
from bench.onesided import ONESIDED_TARGETS, access_of, parse_onesided_tool
from bench.parsers import ParseError
from bench.report import build_report, index_figures, key_ratios, render_table, validate_report

KiB, MiB = 1024, 1024 * 1024
W, R, A, L = Workload.RDMA_WRITE, Workload.RDMA_READ, Workload.FETCH_ADD, Workload.READ_LAT
M = Workload.FETCH_ADD_MANY
DASHES = "-" * 87 + "\n"
BW_HEADER = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
LAT_HEADER = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
    "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n"
)
# The layout of perftest 6.06's reports (as captured from ib_write_bw / ib_send_lat on rxe0).
READ_BW_1M = (
    DASHES + "                    RDMA_Read BW Test\n Device         : rxe0\n Outstand reads  : 16\n"
    + DASHES + BW_HEADER + " 1048576    32               21.50              19.75  \t\t   0.000020\n" + DASHES
)  # fmt: skip
ATOMIC_BW = (
    DASHES + "                    Atomic FETCH_AND_ADD BW Test\n Outstand reads  : 16\n"
    + DASHES + BW_HEADER + " 8          5000             0.21               0.17   \t\t   0.022282\n" + DASHES
)  # fmt: skip
READ_LAT_64 = (
    DASHES + "                    RDMA_Read Latency Test\n TX depth        : 1\n"
    + DASHES + LAT_HEADER
    + " 64      1000          60.10          9000.00      95.50    \t       150.20      \t300.00\t\t"
    "1200.00 \t\t9000.00\n" + DASHES
)  # fmt: skip


def test_onesided_group_expands_and_unknown_names_are_refused() -> None:
    assert expand_workloads(["onesided"]) == [W, R, A, M, L]
    assert expand_workloads(["stream", "onesided", "rdma_read"]) == [Workload.STREAM, W, R, A, M, L]
    with pytest.raises(ValueError, match="unknown workload 'bogus'"):
        expand_workloads(["bogus"])
    assert resolve_contenders(["onesided"]) == [
        "rdmaio-asyncio",
        "rdmaio-uvloop",
        "ib_write_bw",
        "ib_read_bw",
        "ib_read_lat",
        "ib_atomic_bw",
    ]


def test_plan_pairs_each_workload_with_its_perftest_tool() -> None:
    runs = plan_runs(resolve_contenders(["all"]), expand_workloads(["onesided"]), None, FULL)
    by = {(r.contender, r.workloads, r.size, r.rep) for r in runs}
    for rep in range(3):
        for size in (64 * KiB, MiB):
            assert ("ib_write_bw", (W,), size, rep) in by
            assert ("ib_read_bw", (R,), size, rep) in by
            assert ("rdmaio-uvloop", (W,), size, rep) in by
        assert ("ib_atomic_bw", (A,), 8, rep) in by
        assert ("ib_atomic_bw", (M,), 8, rep) in by  # its own run: the same -n as the batches
        assert ("rdmaio-uvloop", (M,), 8, rep) in by
        assert ("ib_read_lat", (L,), 64, rep) in by
        assert ("rdmaio-asyncio", (L,), 64, rep) in by
    # Nothing else: no TCP, no SEND tools, no 64 B / 4 KiB bandwidth sizes.
    assert {r.contender for r in runs} == {
        "rdmaio-asyncio",
        "rdmaio-uvloop",
        "ib_write_bw",
        "ib_read_bw",
        "ib_read_lat",
        "ib_atomic_bw",
    }
    assert len(runs) == 3 * (7 + 2 * 7)  # per repetition: 7 perftest runs, 7 per loop
    amounts = {(r.contender, r.workloads[0], r.size): r.amount for r in runs}
    # The same byte budget for rdmaio and perftest (-n) at a size.
    assert amounts[("ib_write_bw", W, MiB)] == amounts[("rdmaio-asyncio", W, MiB)] == 32
    assert amounts[("ib_read_bw", R, 64 * KiB)] == 512
    assert amounts[("ib_atomic_bw", A, 8)] == FULL.atomic_ops
    assert amounts[("ib_atomic_bw", M, 8)] == amounts[("rdmaio-asyncio", M, 8)] == 8 * FULL.atomic_ops
    assert QUICK.amount(L, 64) == QUICK.read_lat_iters


def test_perftest_commands_of_the_onesided_tools() -> None:
    assert perftest_command("ib_read_bw", MiB, 32, 19500, "rxe0") == [
        "ib_read_bw", "-R", "-F", "-s", str(MiB), "-n", "32", "-p", "19500", "-d", "rxe0",
    ]  # fmt: skip
    # ib_atomic_bw exits when given -s (its size is fixed at 8 B).
    assert "-s" not in perftest_command("ib_atomic_bw", 8, 5000, 19501, None)
    assert perftest_command("ib_read_lat", 64, 1000, 19502, None)[3:5] == ["-s", "64"]


def test_parse_read_bw_atomic_and_read_lat() -> None:
    read = parse_onesided_tool("ib_read_bw", MiB, READ_BW_1M, "raw")[R]
    assert read.ok and read.bytes_per_s == pytest.approx(19.75 * MiB)
    assert read.value(R) == read.bytes_per_s
    samples = parse_onesided_tool("ib_atomic_bw", 8, ATOMIC_BW, "raw")
    atomic = samples[A]
    # one ib_atomic_bw report stands for both atomic workloads (a Sample object each)
    assert samples[M] is not atomic and samples[M].msgs_per_s == atomic.msgs_per_s
    assert atomic.msgs_per_s == pytest.approx(22282.0)
    # ... but a run counts only for the workload it was run for (its own -n): not a sample of the other
    assert set(_parse("ib_atomic_bw", (M,), 8, ATOMIC_BW)) == {M}
    assert set(_parse("ib_atomic_bw", (A,), 8, ATOMIC_BW)) == {A}
    assert atomic.value(A) == atomic.msgs_per_s
    lat = parse_onesided_tool("ib_read_lat", 64, READ_LAT_64, "raw")[L]
    # A READ's latency is its round trip: not doubled, unlike ib_send_lat's one-way figures.
    assert (lat.p50_us, lat.p99_us, lat.mean_us) == (95.5, 1200.0, 150.2)
    assert lat.value(L) == 95.5


def test_a_message_rate_that_rounds_to_zero_is_taken_from_the_bandwidth() -> None:
    """perftest prints MsgRate in Mpps with 6 decimals: 16 MiB READs at 19.75 MB/s print 0.000000. The
    one-sided parser used to refuse that report (it checked the printed rate); it now shares the perftest
    bandwidth parsing of the two-sided contenders, which derive the rate from the bandwidth."""
    report = READ_BW_1M.replace(" 1048576 ", " 16777216 ").replace("0.000020", "0.000000")
    read = parse_onesided_tool("ib_read_bw", 16 * MiB, report, "raw")[R]
    assert read.ok and read.msgs_per_s == pytest.approx(19.75 / 16)


@pytest.mark.parametrize(
    ("tool", "size", "text", "match"),
    [
        ("ib_read_bw", 64 * KiB, READ_BW_1M, "asked for 65536"),
        ("ib_read_lat", 4096, READ_LAT_64, "asked for 4096"),
        ("ib_atomic_bw", 8, "Message size cannot be changed for Atomic tests\n", "no perftest bandwidth"),
        ("ib_read_bw", MiB, READ_BW_1M.replace("19.75", "0.00").replace("0.000020", "0.000000"), "zero"),
        ("ib_send_bw", 64, READ_BW_1M, "no one-sided parser"),
    ],
)
def test_parse_refuses_bad_reports(tool: str, size: int, text: str, match: str) -> None:
    with pytest.raises(ParseError, match=match):
        parse_onesided_tool(tool, size, text, "raw")


def test_access_granted_per_workload() -> None:
    assert [access_of(w) for w in (W, R, A, M, L)] == ["w", "r", "a", "a", "r"]


def _figures(factor: float, lat_factor: float) -> list[Figure]:
    """perftest figures and rdmaio-asyncio figures at ``factor`` x perftest (latency at ``lat_factor``)."""
    out: list[Figure] = []
    for size in (64 * KiB, MiB):
        for tool, workload in (("ib_write_bw", W), ("ib_read_bw", R)):
            out.append(Figure(tool, workload, size, [Sample(ok=True, bytes_per_s=20 * MiB)]))
            out.append(
                Figure("rdmaio-asyncio", workload, size, [Sample(ok=True, bytes_per_s=20 * MiB * factor)])
            )
    for workload in (A, M):
        out.append(Figure("ib_atomic_bw", workload, 8, [Sample(ok=True, msgs_per_s=20000.0)]))
        out.append(Figure("rdmaio-asyncio", workload, 8, [Sample(ok=True, msgs_per_s=20000.0 * factor)]))
    out.append(Figure("ib_read_lat", L, 64, [Sample(ok=True, p50_us=100.0, p99_us=900.0)]))
    out.append(Figure("rdmaio-asyncio", L, 64, [Sample(ok=True, p50_us=100.0 * lat_factor, p99_us=2000.0)]))
    return out


def test_targets_met_and_missed() -> None:
    ratios = {(r.key, r.loop): r for r in key_ratios(index_figures(_figures(0.95, 2.5)))}
    for key, *_ in ONESIDED_TARGETS:
        assert ratios[(key, "asyncio")].met is True, key
        assert ratios[(key, "uvloop")].value is None  # not measured: n/a, not a miss
    missed = {(r.key, r.loop): r for r in key_ratios(index_figures(_figures(0.45, 3.5)))}
    for key, *_ in ONESIDED_TARGETS:
        assert missed[(key, "asyncio")].met is False, key
    assert missed[("fetch_add_vs_ib_atomic_bw", "asyncio")].value == pytest.approx(0.45)
    assert missed[("read_lat_64b_vs_ib_read_lat", "asyncio")].value == pytest.approx(3.5)
    assert missed[("rdma_read_1m_vs_ib_read_bw", "asyncio")].denominator == "ib_read_bw rdma_read 1 MiB"


def test_table_and_json_of_a_onesided_run() -> None:
    figures = _figures(0.95, 2.5)
    contenders = resolve_contenders(["onesided"])
    text = render_table(figures, contenders, 1)
    assert "One-sided RDMA READ bandwidth (pipelined) - MiB/s" in text
    assert "Remote fetch-and-add rate (pipelined) - thousand op/s" in text
    assert "rdma_read 64 B p50 round trip vs ib_read_lat 64 B" in text
    assert "RDMA READ round trip (one at a time) - round trip p50/p99 in us" in text
    # A one-sided run shows only the one-sided targets.
    assert "one-way 64 KiB" not in text and "setup:" not in text
    doc = build_report(figures, {"reps": 1}, contenders)
    assert validate_report(doc) == []
    keys = {r["key"] for r in doc["ratios"] if r["met"] is not None}
    assert {t[0] for t in ONESIDED_TARGETS} <= keys
    row = next(r for r in doc["rdmaio_ratios"] if r["workload"] == "fetch_add")
    assert row["best_rdma"] == "ib_atomic_bw" and row["vs_best_rdma"] == pytest.approx(0.95)
    assert {f["workload"] for f in doc["figures"]} == {
        "rdma_write", "rdma_read", "fetch_add", "fetch_add_many", "read_lat"
    }  # fmt: skip
    assert Figure.from_json(doc["figures"][0]).value == figures[0].value
