"""The benchmark's progress display (rich or plain lines) and its plots (matplotlib)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from bench import driver
from bench.display import PlainDisplay, RichDisplay, make_display
from bench.model import Figure, Sample, Workload
from bench.plot import PlotError, check_plot_target, plot_figures


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    display = make_display(out)
    assert isinstance(display, PlainDisplay)
    display.started(1, 2, "tcp-asyncio echo 64 B")  # says nothing: the result line comes at the end
    display.message("[1/2] rep 1/1 tcp-asyncio echo 64 B: p50 30 us (0.1 s)")
    display.close()
    assert out.getvalue() == "bench: [1/2] rep 1/1 tcp-asyncio echo 64 B: p50 30 us (0.1 s)\n"


def test_live_display_prints_results_above_the_bar() -> None:
    out = io.StringIO()
    display = make_display(out, live=True)
    assert isinstance(display, RichDisplay)
    display.started(1, 2, "rdmaio-asyncio stream 64 KiB")
    display.message("[1/2] rdmaio-asyncio stream 64 KiB: 812 MiB/s [not markup]")
    display.started(2, 2, "rdmaio-uvloop stream 64 KiB")
    display.close()
    assert "[1/2] rdmaio-asyncio stream 64 KiB: 812 MiB/s [not markup]" in out.getvalue()


def test_live_falls_back_to_plain_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich.console", None)  # importing it raises ImportError
    assert isinstance(make_display(io.StringIO(), live=True), PlainDisplay)


def figures() -> list[Figure]:
    def sample(**values: float) -> Sample:
        return Sample(ok=True, ops=100, **values)  # type: ignore[arg-type]

    return [
        Figure("perftest", Workload.STREAM, 65536, [sample(bytes_per_s=3e9)]),
        Figure("rdmaio-uvloop", Workload.STREAM, 65536, [sample(bytes_per_s=1e9)]),
        Figure("rdmaio-uvloop", Workload.STREAM, 64, [sample(bytes_per_s=2e7)]),
        Figure("rdmaio-uvloop", Workload.ECHO, 64, [sample(p50_us=30.0, p99_us=50.0)]),
        Figure("tcp-uvloop", Workload.ECHO, 64, [Sample.failure("refused")]),
    ]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / "sub" / f"bench{suffix}"
    plot_figures(figures(), ["perftest", "rdmaio-uvloop", "tcp-uvloop"], path, title="rdmaio bench")
    data = path.read_bytes()
    if suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    else:
        text = data.decode()
        assert "Stream throughput" in text and "Echo round trip" in text
        assert "Message rate" not in text  # no message-rate figures, no panel
        assert "perftest" in text and "rdmaio-uvloop" in text
        assert "tcp-uvloop" not in text  # its only figure failed: nothing to draw, no legend entry


def test_plot_refuses_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlotError, match=r"must end in \.png or \.svg"):
        check_plot_target(tmp_path / "bench.pdf")
    with pytest.raises(PlotError, match="no successful measurement"):
        plot_figures([figures()[-1]], ["tcp-uvloop"], tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"pip install 'rdmaio\[plots\]'"):
        check_plot_target(tmp_path / "bench.png")


def test_bench_rejects_a_bad_plot_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        driver.main(["--quick", "--contenders", "tcp-asyncio", "--host", "127.0.0.1", "--plot", "out.gif"])
    assert exc.value.code == 2
    assert "--plot out.gif: the file name must end in .png or .svg" in capsys.readouterr().err
