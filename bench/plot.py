"""``python -m bench --plot FILE.png|FILE.svg``: the results as bar charts (matplotlib, optional).

One panel per workload (stream throughput, message rate, echo round trip), the sizes along the x axis and
one bar per contender, on a log scale: the contenders differ by orders of magnitude (perftest vs Python
over TCP), and a linear axis would flatten everything but the fastest. Install with
``pip install 'rdmaio[plots]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.model import Figure, Workload, format_size

__all__ = ["FORMATS", "PlotError", "check_plot_target", "plot_figures"]

FORMATS = (".png", ".svg")
_PANELS: dict[Workload, tuple[str, float]] = {
    # title, and the divisor from the figure's unit to the axis's
    Workload.STREAM: ("Stream throughput, MiB/s (higher is better)", 2**20),
    Workload.MESSAGE: ("Message rate, kmsg/s (higher is better)", 1000),
    Workload.ECHO: ("Echo round trip p50, µs (lower is better)", 1),
}


class PlotError(Exception):
    """The plot cannot be made: matplotlib is missing, or the file name has an unknown format."""


def check_plot_target(path: Path) -> None:
    """Fail early (before a long benchmark) when ``path`` cannot be plotted to."""
    if path.suffix.lower() not in FORMATS:
        raise PlotError(f"--plot {path}: the file name must end in {' or '.join(FORMATS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'rdmaio[plots]'") from None


def _panel(ax: Any, figures: Sequence[Figure], workload: Workload, contenders: Sequence[str]) -> None:
    from matplotlib.ticker import FuncFormatter

    title, divisor = _PANELS[workload]
    mine = {(f.contender, f.size): f.value for f in figures if f.workload is workload}
    sizes = sorted({size for _c, size in mine})
    shown = [c for c in contenders if any(mine.get((c, s)) for s in sizes)]  # drawn at least once
    width = 0.8 / max(len(shown), 1)
    for i, contender in enumerate(shown):
        xs, heights = [], []
        for j, size in enumerate(sizes):
            value = mine.get((contender, size))
            if value:  # a failed or missing measurement is a gap, not a zero
                xs.append(j + (i - (len(shown) - 1) / 2) * width)
                heights.append(value / divisor)
        ax.bar(xs, heights, width, label=contender)
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(len(sizes)), [format_size(s) for s in sizes])
    ax.set_xlabel("message size")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _pos: f"{value:g}")  # 90, not 9x10^1
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, ncols=2)


def plot_figures(figures: Sequence[Figure], contenders: Sequence[str], path: Path, title: str = "") -> None:
    """Write the bar charts of ``figures`` to ``path`` (PNG or SVG by its suffix)."""
    check_plot_target(path)
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    workloads = [w for w in Workload if any(f.workload is w and f.value for f in figures)]
    if not workloads:
        raise PlotError("--plot: no successful measurement to plot")
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        _panel(ax, figures, workload, contenders)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix.lower().lstrip("."), dpi=120)
    plt.close(fig)
