"""The native overhead benchmark's report (``python -m bench --overhead``): ratios, table, markdown, JSON,
the command line, and one tiny real run of every case over the null device (no figure is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import driver, overhead
from bench.overhead import CallCounts, CaseResult, Plan


def result(case: str, loop: str, cpu: float, device: float | None, calls: float = 10.0) -> CaseResult:
    spec = next(c for c in overhead.CASES + overhead.TCP_CASES if c.name == case)
    return CaseResult(
        case=case,
        label=spec.label,
        unit=spec.unit,
        loop=loop,
        tcp=spec.tcp,
        ops=100,
        samples=3,
        cpu_us=cpu,
        device_us=device,
        own_us=cpu - (device or 0.0),
        calls=CallCounts(rdmaio=0.0 if spec.tcp else calls, device=0.0 if spec.tcp else 2.5, other=4.0),
    )


def results() -> list[CaseResult]:
    rows = [
        result("tcp_echo", "uvloop", 20.0, None),
        result("echo", "asyncio", 70.0, 10.0, 111.5),
        result("echo", "uvloop", 50.0, 10.0, 111.5),
        result("tcp_echo", "asyncio", 30.0, None),
        result("setup", "uvloop", 400.0, 100.0, 280.0),
    ]
    overhead.fill_ratios(rows)
    return rows


def test_ratios_are_rdmaios_own_cpu_over_uvloop_tcp_echo() -> None:
    rows = {(r.case, r.loop): r for r in results()}
    assert rows["echo", "uvloop"].vs_uvloop_tcp_echo == pytest.approx(40.0 / 20.0)
    assert rows["echo", "asyncio"].vs_uvloop_tcp_echo == pytest.approx(60.0 / 20.0)
    assert rows["tcp_echo", "uvloop"].vs_uvloop_tcp_echo == pytest.approx(1.0)
    assert rows["setup", "uvloop"].vs_uvloop_tcp_echo == pytest.approx(15.0)
    alone = [result("echo", "uvloop", 50.0, 10.0)]
    overhead.fill_ratios(alone)  # no TCP baseline measured: no ratio, not a made-up one
    assert alone[0].vs_uvloop_tcp_echo is None


def test_text_table_orders_cases_and_says_what_was_subtracted() -> None:
    text = overhead.render(results())
    lines = text.splitlines()
    assert lines[0] == "Overhead (native, null device)"
    assert lines[1].split()[:2] == ["case", "loop"] and "null device us/op" in lines[1]
    body = lines[3 : lines.index("", 3)]  # the rows, up to the blank line before the note
    # The cases in the order of CASES then TCP_CASES, asyncio before uvloop.
    assert [line.split(" (per")[0] for line in body] == [
        "echo 64 B",
        "echo 64 B",
        "connection setup + close",
        "TCP echo 64 B",
        "TCP echo 64 B",
    ]
    echo_uvloop = body[1].split()
    assert echo_uvloop[-8:] == ["uvloop", "50.0", "10.0", "40.0", "2.00x", "111.50", "2.50", "4.00"]
    tcp_asyncio = body[3].split()
    assert tcp_asyncio[-8:] == ["asyncio", "30.0", "-", "30.0", "1.50x", "-", "-", "4.00"]
    assert "measured on a metered twin pair and subtracted" in " ".join(text.split())


def test_markdown_table() -> None:
    text = overhead.render(results(), markdown=True)
    lines = text.splitlines()
    assert lines[0].startswith("| case | loop | CPU us/op | null device us/op | rdmaio us/op |")
    assert lines[1].count("---") == len(overhead._HEADERS)
    assert (
        "| echo 64 B (per round trip) | uvloop | 50.0 | 10.0 | 40.0 | 2.00x | 111.50 | 2.50 | 4.00 |" in lines
    )
    assert "| TCP echo 64 B (per round trip) | uvloop | 20.0 | - | 20.0 | 1.00x | - | - | 4.00 |" in lines


def test_json_report_round_trips() -> None:
    rows = results()
    doc = json.loads(json.dumps(overhead.build_report(rows, {"created": "now"})))
    assert doc["schema"] == overhead.SCHEMA and doc["meta"] == {"created": "now"}
    assert set(doc["method"]) == {"cpu", "device", "calls", "ratio", "rdmaio_functions"}
    first = doc["results"][0]
    assert first["calls"] == {"rdmaio": 0.0, "device": 0.0, "other": 4.0} and first["device_us"] is None
    assert overhead.results_from_report(doc) == rows
    del doc["results"][1]["rdmaio_functions"]  # a report written before the functions were listed
    assert overhead.results_from_report(doc)[1].rdmaio_functions == {}
    with pytest.raises(ValueError, match="not an overhead report"):
        overhead.results_from_report({"schema": "something else", "results": []})


def test_from_json_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "overhead.json"
    meta = {
        "created": "2026-11-26T17:06:05+00:00",
        "command": ["python", "-m", "bench", "--overhead"],
        "plan": {"ops": 2000, "samples": 5},
        "git_commit": "b36e9bde691840c4b72714bbcce7ef8fbec7e42a",
        "git_dirty": [],
        "python": "3.11.7",
        "uvloop": "0.23.0",
        "cpus": 2,
    }
    path.write_text(json.dumps(overhead.build_report(results(), meta)))
    assert driver.main(["--overhead", "--from-json", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "Measured 2026-11-26T17:06:05+00:00 at commit `b36e9bd` with `python -m bench --overhead` (ops 2000, "
        "samples 5; Python 3.11.7, uvloop 0.23.0, 2 CPUs).\n\n| case |"
    )
    assert "| echo 64 B (per round trip) | uvloop |" in out
    assert driver.main(["--overhead", "--from-json", str(path)]) == 0  # the text table: no heading
    assert capsys.readouterr().out.startswith("Overhead (native, null device)\n")
    path.write_text(json.dumps({"schema": "rdmaio-bench/1"}))
    assert driver.main(["--overhead", "--from-json", str(path)]) == 1
    assert "invalid report" in capsys.readouterr().err


def test_rounds_keep_the_minimum_figures() -> None:
    kept = result("echo", "uvloop", 50.0, 10.0)
    overhead.merge_rounds(kept, result("echo", "uvloop", 45.0, 12.0))
    assert (kept.cpu_us, kept.device_us, kept.own_us, kept.samples) == (45.0, 10.0, 35.0, 6)
    tcp = result("tcp_echo", "uvloop", 20.0, None)
    overhead.merge_rounds(tcp, result("tcp_echo", "uvloop", 25.0, None))
    assert (tcp.cpu_us, tcp.device_us, tcp.own_us) == (20.0, None, 20.0)
    with pytest.raises(RuntimeError, match="calls differ between rounds"):
        overhead.merge_rounds(kept, result("echo", "uvloop", 45.0, 12.0, calls=112.5))


def test_rounds_average_the_calls_outside_rdmaio() -> None:
    # TCP's Python calls per operation depend on how the kernel splits reads: they may differ by a hair
    # between rounds (8.004 and 8.0032 were seen), which is not an error; rdmaio's own counts must agree.
    tcp = result("tcp_message", "uvloop", 2.0, None)
    tcp.calls = overhead.CallCounts(rdmaio=0.0, device=0.0, other=8.004)
    other = result("tcp_message", "uvloop", 2.1, None)
    other.calls = overhead.CallCounts(rdmaio=0.0, device=0.0, other=8.0032)
    overhead.merge_rounds(tcp, other)
    assert tcp.calls == overhead.CallCounts(rdmaio=0.0, device=0.0, other=(8.004 + 8.0032) / 2)
    assert tcp.cpu_us == 2.0


def test_plan_scales_by_weight() -> None:
    assert Plan().scaled(1) == (2000, 1000, 200)
    assert Plan().scaled(0.02) == (40, 20, 4)
    assert Plan(ops=10, call_ops=10, warmup=10).scaled(0.001) == (2, 2, 1)
    assert Plan.quick().samples < Plan().samples and Plan.quick().rounds == 1 < Plan().rounds


def test_a_tiny_run_measures_every_case_on_one_loop(tmp_path: Path) -> None:
    """Every case runs end to end over the null device and TCP loopback and gives a complete row (the
    figures themselves are not asserted: they are times)."""
    lines: list[str] = []
    plan = Plan(ops=4, samples=1, rounds=2, call_ops=4, warmup=2)
    rows = overhead.run_overhead(plan, loops=["asyncio"], progress=lines.append)
    assert [r.case for r in rows] == [c.name for c in overhead.CASES + overhead.TCP_CASES]
    # Two rounds, merged (their call counts agreed, or merge_rounds would have raised).
    assert len(lines) == 2 * len(rows) and lines[0].startswith("round 1/2: asyncio ")
    assert all(r.samples == 2 for r in rows)
    for r in rows:
        assert r.cpu_us > 0 and r.vs_uvloop_tcp_echo is None  # no uvloop TCP echo in this run
        if r.tcp:
            assert r.device_us is None and r.own_us == r.cpu_us and r.calls.rdmaio == 0
            assert r.rdmaio_functions == {}
        else:
            assert r.device_us is not None and r.device_us >= 0 and r.calls.rdmaio > 0 and r.calls.device > 0
            assert r.own_us == pytest.approx(r.cpu_us - r.device_us)
            # rdmaio's most called functions, named by their file under rdmaio/ (never the fakes')
            functions = r.rdmaio_functions
            assert 0 < len(functions) <= overhead.TOP_FUNCTIONS
            assert sum(functions.values()) <= r.calls.rdmaio + 1e-9
            assert not any(name.startswith("testing/") for name in functions)
    echo = next(r for r in rows if r.case == "echo")
    assert any(name.startswith("core/") for name in echo.rdmaio_functions)
