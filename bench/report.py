"""From figures to conclusions: ratios, target checks, the text and markdown tables and the JSON report.

Everything here is pure (no I/O), so it is unit tested on hand-made figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.model import (
    CONTENDERS,
    HIGHER_IS_BETTER,
    SETUP_SIZE,
    THROUGHPUT_WORKLOADS,
    WORKLOAD_TITLES,
    Figure,
    Workload,
    format_size,
    format_what,
    sizes_of,
)

__all__ = [
    "MEMORY_RSS_TARGET_KIB",
    "MEMORY_TARGET_KIB",
    "SCHEMA",
    "SETUP_TARGET",
    "FigureRatios",
    "Notes",
    "Ratio",
    "Table",
    "build_report",
    "figure_ratios",
    "index_figures",
    "key_ratios",
    "memory_ratios",
    "render_markdown",
    "render_table",
    "summary_blocks",
    "validate_report",
]

SCHEMA = "rdmaio-bench/1"
KiB = 1024
MiB = 1024 * KiB
LOOPS = ("asyncio", "uvloop")
SETUP_TARGET = 0.5
"""rdmaio's setup rate over the native rdma_cm loop's, at least."""
MEMORY_TARGET_KIB = 256.0
"""Registered memory per idle connection and side, at most."""
MEMORY_RSS_TARGET_KIB = 512.0
"""RSS growth per idle connection and side, at most."""

FigureKey = tuple[str, Workload, int]
Figures = Mapping[FigureKey, Figure]


def index_figures(figures: Iterable[Figure]) -> dict[FigureKey, Figure]:
    """Figures by (contender, workload, size)."""
    return {(f.contender, f.workload, f.size): f for f in figures}


def _value(figures: Figures, contender: str, workload: Workload, size: int) -> float | None:
    figure = figures.get((contender, workload, size))
    return None if figure is None else figure.value


def _describe_missing(figures: Figures, contender: str, workload: Workload, size: int) -> str:
    figure = figures.get((contender, workload, size))
    where = f"{contender} {workload} {format_what(workload, size)}"
    if figure is None:
        return f"{where} not measured"
    if figure.errors:
        return f"{where} failed: {figure.errors[0]}"
    return f"{where} has no value"


# --- per-figure ratios -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FigureRatios:
    """One rdmaio figure compared with the best native RDMA tool and with TCP on the same loop.

    Ratios are rdmaio's figure divided by the other's, in the workload's own unit: for stream and
    message above 1 means rdmaio is faster; for echo (round-trip times) below 1 means rdmaio is faster.
    """

    contender: str
    workload: Workload
    size: int
    value: float | None
    best_rdma: str | None
    vs_best_rdma: float | None
    tcp: str
    vs_tcp: float | None
    wakeups_per_op: float | None
    client_wakeups_per_op: float | None
    server_wakeups_per_op: float | None
    client_mean_batch: float | None
    server_mean_batch: float | None
    client_frames_per_op: float | None
    """Frames the client posted per operation (stream: below 1 means writes were coalesced)."""

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        data = asdict(self)
        data["workload"] = str(self.workload)
        return data


def best_rdma(figures: Figures, workload: Workload, size: int) -> tuple[str | None, float | None]:
    """The best native RDMA contender (perftest/rstream) for a workload and size, and its figure."""
    best: tuple[str | None, float | None] = (None, None)
    higher = HIGHER_IS_BETTER[workload]
    for name, contender in CONTENDERS.items():
        if not contender.rdma_baseline or workload not in contender.workloads:
            continue
        value = _value(figures, name, workload, size)
        if value is None or value <= 0:
            continue
        current = best[1]
        if current is None or (value > current if higher else value < current):
            best = (name, value)
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def figure_ratios(figures: Figures) -> list[FigureRatios]:
    """Ratios of every rdmaio figure present in ``figures``."""
    rows: list[FigureRatios] = []
    for (name, workload, size), figure in sorted(
        figures.items(), key=lambda kv: (list(Workload).index(kv[0][1]), kv[0][2], kv[0][0])
    ):
        contender = CONTENDERS.get(name)
        if contender is None or contender.kind != "rdmaio" or workload is Workload.MEMORY:
            continue  # memory has no other contender: memory_ratios() checks it against its targets
        value = figure.value
        best_name, best_value = best_rdma(figures, workload, size)
        tcp = f"tcp-{contender.loop}"
        rows.append(
            FigureRatios(
                contender=name,
                workload=workload,
                size=size,
                value=value,
                best_rdma=best_name,
                vs_best_rdma=_ratio(value, best_value),
                tcp=tcp,
                vs_tcp=_ratio(value, _value(figures, tcp, workload, size)),
                wakeups_per_op=figure.rdmaio_median("wakeups_per_op"),
                client_wakeups_per_op=figure.rdmaio_median("client_wakeups_per_op"),
                server_wakeups_per_op=figure.rdmaio_median("server_wakeups_per_op"),
                client_mean_batch=figure.rdmaio_median("client_mean_batch"),
                server_mean_batch=figure.rdmaio_median("server_mean_batch"),
                client_frames_per_op=figure.rdmaio_median("client_frames_per_op"),
            )
        )
    return rows


# --- key ratios and their targets ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ratio:
    """One headline ratio with its target (``value op target``, e.g. ``0.97 >= 0.95``)."""

    key: str
    description: str
    loop: str | None
    value: float | None
    op: str
    target: float
    numerator: str
    denominator: str
    note: str | None = None

    @property
    def met(self) -> bool | None:
        """Whether the target is met; None when the ratio could not be computed."""
        if self.value is None:
            return None
        return self.value >= self.target if self.op == ">=" else self.value <= self.target

    def to_json(self) -> dict[str, Any]:
        """JSON form (with ``met``)."""
        data = asdict(self)
        data["met"] = self.met
        return data


def _pair_ratio(
    figures: Figures,
    key: str,
    description: str,
    loop: str,
    num: tuple[str, Workload, int],
    den: tuple[str, Workload, int] | tuple[tuple[str, ...], Workload, int],
    op: str,
    target: float,
    note: str | None = None,
) -> Ratio:
    """``num``'s figure over ``den``'s (the best of several contenders when ``den`` names a tuple)."""
    num_value = _value(figures, *num)
    den_names = den[0] if isinstance(den[0], tuple) else (den[0],)
    workload, size = den[1], den[2]
    candidates = [(n, _value(figures, n, workload, size)) for n in den_names]
    present = [(n, v) for n, v in candidates if v is not None and v > 0]
    den_label = "/".join(den_names)
    missing: list[str] = []
    if num_value is None:
        missing.append(_describe_missing(figures, *num))
    if not present:
        missing.extend(_describe_missing(figures, n, workload, size) for n in den_names)
        value = None
    else:
        higher = HIGHER_IS_BETTER[workload]
        chosen = max(present, key=lambda p: p[1]) if higher else min(present, key=lambda p: p[1])
        den_label = chosen[0] if len(den_names) == 1 else f"best of {den_label}: {chosen[0]}"
        value = _ratio(num_value, chosen[1])
    notes = [n for n in (note, "; ".join(missing) if missing else None) if n]
    return Ratio(
        key=key,
        description=description,
        loop=loop,
        value=value,
        op=op,
        target=target,
        numerator=f"{num[0]} {num[1]} {format_size(num[2])}",
        denominator=f"{den_label} {workload} {format_size(size)}",
        note="; ".join(notes) or None,
    )


def uvloop_speedups(figures: Figures) -> list[dict[str, Any]]:
    """rdmaio on uvloop against rdmaio on asyncio, figure by figure (above 1: uvloop is faster)."""
    rows: list[dict[str, Any]] = []
    for workload in THROUGHPUT_WORKLOADS:
        for size in sizes_of(workload):
            a = _value(figures, "rdmaio-asyncio", workload, size)
            u = _value(figures, "rdmaio-uvloop", workload, size)
            if a is None or u is None or a <= 0 or u <= 0:
                continue
            speedup = u / a if HIGHER_IS_BETTER[workload] else a / u
            rows.append({"workload": str(workload), "size": size, "speedup": speedup})
    return rows


def key_ratios(figures: Figures) -> list[Ratio]:
    """The headline ratios, each with its target, for both loops."""
    ratios: list[Ratio] = []
    S, M, E = Workload.STREAM, Workload.MESSAGE, Workload.ECHO
    ib_bw = ("ib_send_bw", "ib_write_bw", "ib_read_bw")
    for loop in LOOPS:
        me = f"rdmaio-{loop}"
        tcp = f"tcp-{loop}"
        for size, tag in ((64 * KiB, "64k"), (MiB, "1m"), (16 * MiB, "16m")):
            ratios.append(
                _pair_ratio(
                    figures,
                    f"oneway_{tag}_vs_ib_bw",
                    f"one-way {format_size(size)} vs best of ib_send_bw/ib_write_bw/ib_read_bw",
                    loop,
                    (me, S, size),
                    (ib_bw, S, size),
                    ">=",
                    0.95,
                )
            )
        for size, tag in ((MiB, "1m"), (16 * MiB, "16m")):  # zero-copy: rendezvous messages
            ratios.append(
                _pair_ratio(
                    figures,
                    f"message_{tag}_vs_ib_bw",
                    f"message {format_size(size)} msg/s vs best of ib_send_bw/ib_write_bw/ib_read_bw",
                    loop,
                    (me, M, size),
                    (ib_bw, M, size),
                    ">=",
                    0.95,
                )
            )
        ratios.append(
            _pair_ratio(
                figures,
                "stream_64b_vs_ib_send_bw",
                "stream 64 B bytes/s vs ib_send_bw 64 B bytes/s",
                loop,
                (me, S, 64),
                ("ib_send_bw", S, 64),
                ">=",
                2.0,
            )
        )
        ratios.append(
            _pair_ratio(
                figures,
                "stream_64b_vs_tcp",
                "stream 64 B bytes/s vs TCP streams (same loop)",
                loop,
                (me, S, 64),
                (tcp, S, 64),
                ">=",
                3.0,
            )
        )
        ratios.append(
            _pair_ratio(
                figures,
                "message_64b_vs_ib_send_bw",
                "message API 64 B msg/s vs ib_send_bw 64 B msg rate",
                loop,
                (me, M, 64),
                ("ib_send_bw", M, 64),
                ">=",
                0.5,
            )
        )
        message = figures.get((me, M, 64))
        wakeups = message.rdmaio_median("wakeups_per_op") if message is not None else None
        ratios.append(
            Ratio(
                key="message_64b_wakeups_per_msg",
                description="message API 64 B loop wake-ups per message (sender + receiver)",
                loop=loop,
                value=wakeups,
                op="<=",
                target=0.1,
                numerator=f"{me} wake-ups (both processes)",
                denominator="messages",
                note=None if wakeups is not None else _describe_missing(figures, me, M, 64),
            )
        )
        ratios.append(
            _pair_ratio(
                figures,
                "echo_64b_rtt_vs_tcp",
                "echo 64 B p50 round trip vs TCP streams (same loop)",
                loop,
                (me, E, 64),
                (tcp, E, 64),
                "<=",
                0.5,
            )
        )
        for size, tag in ((4 * KiB, "4k"), (64 * KiB, "64k")):
            ratios.append(
                _pair_ratio(
                    figures,
                    f"stream_{tag}_vs_rstream",
                    f"stream {format_size(size)} vs rstream (rsocket)",
                    loop,
                    (me, S, size),
                    ("rstream", S, size),
                    ">=",
                    1.5,
                )
            )
        ratios.append(
            _pair_ratio(
                figures,
                "setup_vs_native",
                "setup: connect + 16 B echo + close, conn/s vs the native rdma_cm loop",
                loop,
                (me, Workload.SETUP, SETUP_SIZE),
                ("cm_setup", Workload.SETUP, SETUP_SIZE),
                ">=",
                SETUP_TARGET,
            )
        )
        ratios.extend(memory_ratios(figures, loop))
    # The one-sided targets; imported here because that module uses this one's _pair_ratio.
    from bench.onesided import onesided_ratios

    ratios.extend(onesided_ratios(figures, LOOPS))
    speedups = uvloop_speedups(figures)
    geomean = math.exp(sum(math.log(r["speedup"]) for r in speedups) / len(speedups)) if speedups else None
    ratios.append(
        Ratio(
            key="uvloop_vs_asyncio",
            description="rdmaio on uvloop vs on asyncio (geometric mean over all figures)",
            loop=None,
            value=geomean,
            op=">=",
            target=1.0,
            numerator="rdmaio-uvloop",
            denominator="rdmaio-asyncio",
            note=(
                f"{sum(1 for r in speedups if r['speedup'] >= 1)} of {len(speedups)} figures faster on uvloop"
                if speedups
                else "no pair of rdmaio-uvloop / rdmaio-asyncio figures"
            ),
        )
    )
    return ratios


def memory_ratios(figures: Figures, loop: str) -> list[Ratio]:
    """The memory targets for rdmaio on ``loop``: registered KiB and RSS growth KiB per idle connection,
    server and client side, at the largest connection count measured successfully (the note names it,
    and the larger counts that failed and why)."""
    me = f"rdmaio-{loop}"
    measured = sorted(
        (f for (name, workload, _size), f in figures.items() if name == me and workload is Workload.MEMORY),
        key=lambda f: f.size,
    )
    good = [f for f in measured if f.ok_samples]
    chosen = good[-1] if good else None
    failed = [
        f"{f.size} connections failed: {f.errors[0] if f.errors else 'no value'}"
        for f in measured
        if chosen is None or f.size > chosen.size
        if not f.ok_samples
    ]
    ratios: list[Ratio] = []
    for metric, label, target in (
        ("registered", "registered memory", MEMORY_TARGET_KIB),
        ("rss", "RSS growth", MEMORY_RSS_TARGET_KIB),
    ):
        for side in ("server", "client"):
            value = None if chosen is None else chosen.memory_median(f"{metric}_per_conn_{side}")
            notes = [] if chosen is None else [f"at {chosen.size} idle connections"]
            if chosen is None:
                notes.append(f"{me} memory not measured" if not measured else f"{me} memory failed")
            notes.extend(failed)
            ratios.append(
                Ratio(
                    key=f"memory_{metric}_{side}_kib_per_conn",
                    description=f"{label} per idle connection, {side} side (KiB)",
                    loop=loop,
                    value=None if value is None else value / KiB,
                    op="<=",
                    target=target,
                    numerator=f"{me} {side} {metric} growth",
                    denominator="idle connections",
                    note="; ".join(notes) or None,
                )
            )
    return ratios


# --- JSON -----------------------------------------------------------------------------------------------


def build_report(
    figures: Sequence[Figure], meta: Mapping[str, Any], contenders: Sequence[str]
) -> dict[str, Any]:
    """The JSON document: metadata, every contender's figures, per-figure and headline ratios."""
    indexed = index_figures(figures)
    status: dict[str, Any] = {}
    for name in contenders:
        own = [f for f in figures if f.contender == name]
        states = {f.status for f in own}
        if not own:
            state = "not run"
        elif states == {"ok"}:
            state = "ok"
        elif states == {"error"}:
            state = "failed"
        else:
            state = "partial"
        errors: list[str] = []
        for f in own:
            errors.extend(f"{f.workload} {format_size(f.size)}: {e}" for e in f.errors)
        status[name] = {
            "kind": CONTENDERS[name].kind,
            "loop": CONTENDERS[name].loop,
            "description": CONTENDERS[name].description,
            "status": state,
            "errors": errors,
        }
        # Measurements the device cannot make (bench.provider): left out, each with its reason.
        skipped = [
            f"{', '.join(item['workloads'])}: {item['reason']}"
            for item in meta.get("skipped") or ()
            if item.get("contender") == name
        ]
        if skipped:
            status[name]["skipped"] = skipped
    return {
        "schema": SCHEMA,
        "meta": dict(meta),
        "contenders": status,
        "figures": [f.to_json() for f in figures],
        "rdmaio_ratios": [r.to_json() for r in figure_ratios(indexed)],
        "uvloop_vs_asyncio": uvloop_speedups(indexed),
        "ratios": [r.to_json() for r in key_ratios(indexed)],
    }


_FIGURE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "contender": str,
    "workload": str,
    "size": int,
    "status": str,
    "unit": str,
    "samples": list,
}
_RATIO_FIELDS: dict[str, type | tuple[type, ...]] = {
    "key": str,
    "description": str,
    "op": str,
    "target": (int, float),
    "numerator": str,
}


def validate_report(doc: Any) -> list[str]:
    """Check a JSON report's structure; return the problems found (empty when it is valid)."""
    problems: list[str] = []
    if not isinstance(doc, dict):
        return ["report is not an object"]
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    sections: tuple[tuple[str, type], ...] = (
        ("meta", dict),
        ("contenders", dict),
        ("figures", list),
        ("rdmaio_ratios", list),
        ("ratios", list),
    )
    missing = [
        f"{section} missing or not a {kind.__name__}"
        for section, kind in sections
        if not isinstance(doc.get(section), kind)
    ]
    if missing:
        return problems + missing
    for i, fig in enumerate(doc["figures"]):
        for field, typ in _FIGURE_FIELDS.items():
            if not isinstance(fig.get(field), typ):
                problems.append(f"figures[{i}].{field} missing or wrong type")
        if fig.get("workload") not in {str(w) for w in Workload}:
            problems.append(f"figures[{i}].workload unknown: {fig.get('workload')!r}")
        if fig.get("status") not in ("ok", "partial", "error"):
            problems.append(f"figures[{i}].status unknown: {fig.get('status')!r}")
        if fig.get("status") in ("ok", "partial") and not isinstance(fig.get("value"), (int, float)):
            problems.append(f"figures[{i}] is {fig.get('status')} but has no numeric value")
        if fig.get("status") == "error" and not fig.get("errors"):
            problems.append(f"figures[{i}] failed without an error message")
        if fig.get("contender") not in doc["contenders"]:
            problems.append(f"figures[{i}].contender {fig.get('contender')!r} not in contenders")
    for i, ratio in enumerate(doc["ratios"]):
        for field, typ in _RATIO_FIELDS.items():
            if not isinstance(ratio.get(field), typ):
                problems.append(f"ratios[{i}].{field} missing or wrong type")
        if ratio.get("op") not in (">=", "<="):
            problems.append(f"ratios[{i}].op must be >= or <=")
        value, met = ratio.get("value"), ratio.get("met")
        if value is None and met is not None:
            problems.append(f"ratios[{i}] has no value but met={met!r}")
        if value is not None and not isinstance(met, bool):
            problems.append(f"ratios[{i}] has a value but met is not a bool")
    for name, info in doc["contenders"].items():
        if not isinstance(info, dict) or info.get("status") not in ("ok", "partial", "failed", "not run"):
            problems.append(f"contenders[{name!r}] has no valid status")
    return problems


# --- text -----------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    """A number with about ``digits`` significant digits."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:.{decimals}f}"


def _cell(figure: Figure | None, workload: Workload) -> str:
    if figure is None:
        return "-"
    if figure.status == "error":
        return "ERR"
    mark = "*" if figure.status == "partial" else ""
    if workload in (Workload.STREAM, Workload.RDMA_WRITE, Workload.RDMA_READ):
        bps = figure.median_of("bytes_per_s")
        return _fmt(None if bps is None else bps / MiB) + mark
    if workload in (Workload.MESSAGE, Workload.FETCH_ADD, Workload.FETCH_ADD_MANY):
        rate = figure.median_of("msgs_per_s")
        return _fmt(None if rate is None else rate / 1000) + mark
    if workload is Workload.SETUP:
        return _fmt(figure.median_of("conns_per_s")) + mark
    p50, p99 = figure.median_of("p50_us"), figure.median_of("p99_us")
    if p50 is None:
        return f"~{_fmt(figure.median_of('mean_us'))}{mark}"
    return f"{_fmt(p50)}/{_fmt(p99)}{mark}"


_UNITS_TEXT = {
    Workload.STREAM: "MiB/s",
    Workload.MESSAGE: "thousand msg/s",
    Workload.ECHO: "round trip p50/p99 in us (~ = mean only)",
    Workload.SETUP: "connections/s",
    Workload.MEMORY: "KiB per idle connection",
    Workload.RDMA_WRITE: "MiB/s",
    Workload.RDMA_READ: "MiB/s",
    Workload.FETCH_ADD: "thousand op/s",
    Workload.FETCH_ADD_MANY: "thousand op/s",
    Workload.READ_LAT: "round trip p50/p99 in us",
}


_RATIO_PREFIXES: tuple[tuple[str, Workload], ...] = (
    ("oneway_", Workload.STREAM),
    ("stream_", Workload.STREAM),
    ("message_", Workload.MESSAGE),
    ("echo_", Workload.ECHO),
    ("setup_", Workload.SETUP),
    ("memory_", Workload.MEMORY),
    ("rdma_write_", Workload.RDMA_WRITE),
    ("rdma_read_", Workload.RDMA_READ),
    ("fetch_add_many_", Workload.FETCH_ADD_MANY),
    ("fetch_add_", Workload.FETCH_ADD),
    ("read_lat_", Workload.READ_LAT),
)


def _ratio_workloads(key: str) -> set[Workload]:
    """The workloads a headline ratio is computed from (by its key)."""
    for prefix, workload in _RATIO_PREFIXES:
        if key.startswith(prefix):
            return {workload}
    return set(THROUGHPUT_WORKLOADS)  # uvloop_vs_asyncio: the data-path figures


def _kib(value: float | None) -> str:
    return "-" if value is None else _fmt(value / KiB)


_MEMORY_KEYS = tuple(
    f"{metric}_{side}"
    for metric in ("registered_per_conn", "rss_per_conn", "registered_left", "rss_left")
    for side in ("server", "client")
)


def _memory_table(figures: Sequence[Figure], summary: str) -> Table | None:
    """One row per rdmaio contender and connection count: growth per connection on each side, and
    what was still held after every connection was closed (bytes over the baseline, in KiB)."""
    own = sorted((f for f in figures if f.workload is Workload.MEMORY), key=lambda f: (f.contender, f.size))
    if not own:
        return None
    title = f"{WORKLOAD_TITLES[Workload.MEMORY]} - {_UNITS_TEXT[Workload.MEMORY]} ({summary})"
    rows = [
        [
            "contender",
            "connections",
            "registered srv/cli",
            "RSS srv/cli",
            "left after close: registered srv/cli",
            "RSS srv/cli",
        ]
    ]
    for f in own:
        # A failed count still shows what its opened connections cost (marked ERR and how many).
        samples = f.ok_samples or [s for s in f.samples if s.memory]
        if not samples:
            rows.append([f.contender, str(f.size), "ERR", "ERR", "-", "-"])
            continue
        if f.ok_samples:
            # Medians over the successful repetitions.
            values = {key: f.memory_median(key) for key in _MEMORY_KEYS}
            count = str(f.size) + ("*" if f.status == "partial" else "")
        else:
            memory = samples[-1].memory or {}
            values = {key: memory.get(key) for key in _MEMORY_KEYS}
            count = f"{f.size} (ERR: {int(memory.get('connections', 0))} opened)"

        def get(key: str, values: dict[str, float | None] = values) -> float | None:
            return values[key]

        rows.append(
            [
                f.contender,
                count,
                f"{_kib(get('registered_per_conn_server'))}/{_kib(get('registered_per_conn_client'))}",
                f"{_kib(get('rss_per_conn_server'))}/{_kib(get('rss_per_conn_client'))}",
                f"{_kib(get('registered_left_server'))}/{_kib(get('registered_left_client'))}",
                f"{_kib(get('rss_left_server'))}/{_kib(get('rss_left_client'))}",
            ]
        )
    return Table(title, rows, left=1)


def _grid(rows: list[list[str]], left: int = 1) -> list[str]:
    """Align columns: the first ``left`` columns left-justified, the rest right-justified."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [c.ljust(widths[i]) if i < left else c.rjust(widths[i]) for i, c in enumerate(row)]
        out.append("  ".join(cells).rstrip())
    return out


@dataclass(frozen=True, slots=True)
class Table:
    """One table of the summary: a title line, a header row and rows; the first ``left`` columns are text."""

    title: str
    rows: list[list[str]]
    left: int = 1


@dataclass(frozen=True, slots=True)
class Notes:
    """A titled list of remarks (failures, time-capped figures) under the tables."""

    title: str
    items: list[str]
    inline: bool = False
    """Printed as text on one line (``title: a, b, c``) rather than one indented line per item."""


def summary_blocks(
    figures: Sequence[Figure],
    contenders: Sequence[str],
    reps: int,
    workloads: Sequence[Workload] | None = None,
) -> list[Table | Notes]:
    """The summary as blocks: one table per workload, rdmaio ratios, headline targets, failures.

    Shows ``workloads`` (default: those with figures) and, in each, the sizes that have figures.
    :func:`render_table` prints them as aligned text, :func:`render_markdown` as markdown tables.
    """
    indexed = index_figures(figures)
    present = {f.workload for f in figures}
    chosen = list(workloads) if workloads is not None else [w for w in Workload if w in present]
    blocks: list[Table | Notes] = []
    summary = f"median of {reps} runs" if reps > 1 else "single run"
    for workload in chosen:
        if workload is Workload.MEMORY:
            memory = _memory_table(figures, summary)
            if memory is not None:
                blocks.append(memory)
            continue
        columns = [c for c in contenders if workload in CONTENDERS[c].workloads]
        if not columns or workload not in present:
            continue
        rows = [["size", *columns]]
        measured = {f.size for f in figures if f.workload is workload}
        for size in sizes_of(workload):
            if size not in measured:
                continue
            rows.append(
                [format_size(size), *(_cell(indexed.get((c, workload, size)), workload) for c in columns)]
            )
        blocks.append(Table(f"{WORKLOAD_TITLES[workload]} - {_UNITS_TEXT[workload]} ({summary})", rows))

    ratio_rows = [r for r in figure_ratios(indexed) if r.workload in chosen]
    if ratio_rows:
        rows = [
            [
                "workload",
                "size",
                "contender",
                "x best RDMA",
                "x TCP",
                "wakeups/op cli+srv",
                "CQ batch cli/srv",
                "frames/op cli",
            ]
        ]
        for r in ratio_rows:
            best = f"{_fmt(r.vs_best_rdma)} ({r.best_rdma})" if r.vs_best_rdma is not None else "-"
            wake = (
                f"{_fmt(r.wakeups_per_op)} ({_fmt(r.client_wakeups_per_op)}+{_fmt(r.server_wakeups_per_op)})"
                if r.wakeups_per_op is not None
                else "-"
            )
            batch = (
                f"{_fmt(r.client_mean_batch)}/{_fmt(r.server_mean_batch)}"
                if r.client_mean_batch is not None
                else "-"
            )
            rows.append(
                [
                    str(r.workload),
                    format_size(r.size),
                    r.contender,
                    best,
                    _fmt(r.vs_tcp),
                    wake,
                    batch,
                    _fmt(r.client_frames_per_op),
                ]
            )
        blocks.append(
            Table(
                "rdmaio vs the best RDMA tool and vs TCP on the same loop (figure / other figure; "
                "echo compares round trips: below 1 is faster)",
                rows,
                left=3,
            )
        )

    # Only the targets of the workloads shown: a setup-only run has no use for rows of n/a.
    ratios = [r for r in key_ratios(indexed) if not chosen or _ratio_workloads(r.key) & set(chosen)]
    rows = [["ratio", "asyncio", "uvloop", "target"]]
    by_key: dict[str, dict[str | None, Ratio]] = {}
    order: list[str] = []
    for ratio in ratios:
        if ratio.key not in by_key:
            order.append(ratio.key)
        by_key.setdefault(ratio.key, {})[ratio.loop] = ratio

    def verdict(ratio: Ratio | None) -> str:
        if ratio is None:
            return ""
        met = {True: "met", False: "NOT met", None: "n/a"}[ratio.met]
        return f"{_fmt(ratio.value)} {met}"

    for key in order:
        entries = by_key[key]
        any_ratio = next(iter(entries.values()))
        if None in entries:
            rows.append(
                [any_ratio.description, verdict(entries[None]), "", f"{any_ratio.op} {any_ratio.target}"]
            )
        else:
            rows.append(
                [
                    any_ratio.description,
                    verdict(entries.get("asyncio")),
                    verdict(entries.get("uvloop")),
                    f"{any_ratio.op} {any_ratio.target}",
                ]
            )
    blocks.append(Table("Targets", rows))

    failures: list[str] = []
    for figure in figures:
        for error in figure.errors:
            failures.append(
                f"{figure.contender} {figure.workload} {format_what(figure.workload, figure.size)}: {error}"
            )
    capped = [
        f"{f.contender} {f.workload} {format_what(f.workload, f.size)}"
        for f in figures
        if any(s.capped for s in f.ok_samples)
    ]
    if failures:
        blocks.append(Notes("Failures (ERR: every run failed; *: some runs failed)", failures))
    if capped:
        blocks.append(
            Notes(
                "Stopped by the time cap before the byte budget (figure from what was moved)",
                capped,
                inline=True,
            )
        )
    return blocks


def render_table(
    figures: Sequence[Figure],
    contenders: Sequence[str],
    reps: int,
    workloads: Sequence[Workload] | None = None,
) -> str:
    """The human-readable summary: one table per workload, rdmaio ratios, headline targets, failures.

    Shows ``workloads`` (default: those with figures) and, in each, the sizes that have figures.
    """
    parts: list[list[str]] = []
    for block in summary_blocks(figures, contenders, reps, workloads):
        if isinstance(block, Table):
            parts.append([block.title, *_grid(block.rows, block.left)])
        elif block.inline:
            parts.append([f"{block.title}: " + ", ".join(block.items)])
        else:
            parts.append([block.title, *(f"  {item}" for item in block.items)])
    lines: list[str] = []
    for i, part in enumerate(parts):
        if i:
            lines.append("")  # one blank line between blocks
        lines.extend(part)
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    """A table cell's text with markdown's special characters (pipe, asterisk) escaped."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")


def render_markdown(
    figures: Sequence[Figure],
    contenders: Sequence[str],
    reps: int,
    workloads: Sequence[Workload] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> str:
    """The same summary as :func:`render_table`, as markdown: a pipe table per block, lists for the notes.

    With ``meta`` (a JSON report's), a first paragraph says when, at which commit and with which command the
    figures were measured, so that the tables can be pasted into the documentation as they are.
    """
    lines: list[str] = []
    if meta is not None:
        commit = meta.get("git_commit")
        dirty = meta.get("git_dirty")
        where = f"commit `{commit[:7]}`" if isinstance(commit, str) else "an unknown commit"
        if dirty:
            where += " (with uncommitted changes to rdmaio/)"
        command = " ".join(str(part) for part in meta.get("command", [])) or "unknown"
        lines.append(
            f"Measured {meta.get('created', 'at an unknown time')} at {where}, "
            f"{meta.get('mode', '?')} budgets, {meta.get('reps', reps)} repetition(s), "
            f"{meta.get('cpus', '?')} CPUs, kernel {meta.get('kernel', '?')}, with `{command}`."
            + _provider_sentence(meta.get("provider"))
        )
        lines.append("")
    for block in summary_blocks(figures, contenders, reps, workloads):
        lines.append(f"**{_md_cell(block.title)}**")
        lines.append("")
        if isinstance(block, Table):
            header, *body = block.rows
            lines.append("| " + " | ".join(_md_cell(c) for c in header) + " |")
            align = ["---" if i < block.left else "---:" for i in range(len(header))]
            lines.append("| " + " | ".join(align) + " |")
            lines.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in body)
        else:
            lines.extend(f"- {_md_cell(item)}" for item in block.items)
        lines.append("")
    skipped = meta.get("skipped") if meta is not None else None
    if skipped:
        lines.append("**Not run on this device**")
        lines.append("")
        for item in skipped:
            what = f"{item['contender']} {', '.join(item['workloads'])}"
            lines.append(f"- {_md_cell(what)}: {_md_cell(item['reason'])}")
        lines.append("")
    return "\n".join(lines)


def _provider_sentence(provider: Any) -> str:
    """The sentence naming the device, provider, transport and rdmaio's framing of a report's
    ``meta.provider`` (empty without one)."""
    if not isinstance(provider, Mapping) or not provider.get("device"):
        return ""
    return (
        f" Device {provider['device']}: provider {provider.get('provider', '?')}, transport "
        f"{provider.get('transport', '?')}, rdmaio's {provider.get('framing', '?')} framing."
    )
