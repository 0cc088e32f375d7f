"""``python -m bench``: plan the measurements, run them, print progress, the table and the JSON.

Process layout. The Python contenders' server side runs in one separate process (``--role server``),
which switches between an asyncio and a uvloop event loop on command; the client side runs in this
process, on a fresh loop of the same kind. perftest and rstream run as a server process and a client
process each. So every contender's two sides are two processes, as with perftest. Measurements run one
at a time; nothing else of the benchmark runs meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime
import importlib.metadata
import ipaddress
import json
import os
import platform
import pstats
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench.display import make_display
from bench.external import ExternalConfig, run_external
from bench.model import (
    CONTENDER_GROUPS,
    CONTENDERS,
    FULL,
    MEMORY_COUNTS,
    ONESIDED_WORKLOADS,
    QUICK,
    Budget,
    Figure,
    Sample,
    Workload,
    expand_workloads,
    format_what,
    parse_size,
    resolve_contenders,
    sizes_of,
)
from bench.onesided import measure_onesided
from bench.peers import loop_factory, measure, measure_memory, server_main
from bench.plot import PlotError, check_plot_target, plot_figures
from bench.provider import Provider, Skip, detect_provider, plan_skips
from bench.report import build_report, render_markdown, render_table, validate_report

__all__ = [
    "REPO_ROOT",
    "Run",
    "build_parser",
    "drop_skipped",
    "harness_env",
    "main",
    "plan_runs",
    "planned_skips",
    "skipped_lines",
]

DEFAULT_HOST = "198.18.0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout holding this harness (``bench/`` lives at its top level and is not installed)."""
BENCH_NET = ipaddress.ip_network("198.18.0.0/15")
SERVER_START_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Run:
    """One measurement: a contender, the workloads it yields, a size, a repetition, an amount."""

    contender: str
    workloads: tuple[Workload, ...]
    size: int
    rep: int
    amount: int

    def label(self) -> str:
        """Short text for the progress line."""
        kinds = "+".join(str(w) for w in self.workloads)
        return f"{self.contender} {kinds} {format_what(self.workloads[0], self.size)}"


def plan_runs(
    contenders: Sequence[str],
    workloads: Sequence[Workload],
    sizes: Sequence[int] | None,
    budget: Budget,
    memory_counts: Sequence[int] = MEMORY_COUNTS,
) -> list[Run]:
    """Every measurement of a benchmark, repetitions outermost (so that drift spreads over contenders).

    Within a repetition: the native tools first, then the Python contenders grouped by event loop.
    ``sizes`` filters the message sizes of the data-path workloads; the setup workload has one size
    (16 B) and the memory workload's "sizes" are ``memory_counts`` (connections held open).
    """

    def wanted(workload: Workload) -> list[int]:
        if workload is Workload.SETUP:
            return list(sizes_of(workload))
        if workload is Workload.MEMORY:
            return list(memory_counts)
        return [s for s in sizes_of(workload) if sizes is None or s in sizes]

    runs: list[Run] = []
    native = [c for c in contenders if not CONTENDERS[c].python]
    python = sorted(
        (c for c in contenders if CONTENDERS[c].python),
        key=lambda c: (0 if CONTENDERS[c].loop == "asyncio" else 1, contenders.index(c)),
    )
    for rep in range(budget.reps):
        for name in native:
            covered = [w for w in CONTENDERS[name].workloads if w in workloads]
            if name in ("ib_send_bw", "ib_write_bw", "ib_read_bw"):
                # One perftest run gives both the bandwidth and the message rate.
                for size in sorted({s for w in covered for s in wanted(w)}):
                    which = tuple(w for w in covered if size in wanted(w))
                    runs.append(Run(name, which, size, rep, budget.amount(which[0], size)))
            else:
                for workload in covered:
                    for size in wanted(workload):
                        runs.append(Run(name, (workload,), size, rep, budget.amount(workload, size)))
        for name in python:
            for workload in workloads:
                if workload not in CONTENDERS[name].workloads:
                    continue
                for size in wanted(workload):
                    runs.append(Run(name, (workload,), size, rep, budget.amount(workload, size)))
    return runs


def drop_skipped(runs: Sequence[Run], skips: Sequence[Skip]) -> list[Run]:
    """``runs`` without the measurements ``skips`` leave out (a run that measures several workloads
    keeps the others)."""
    out: list[Run] = []
    for run in runs:
        left = tuple(
            w
            for w in run.workloads
            if not any(s.contender == run.contender and w in s.workloads for s in skips)
        )
        if left:
            out.append(Run(run.contender, left, run.size, run.rep, run.amount))
    return out


def planned_skips(skips: Sequence[Skip], planned: Sequence[Run]) -> list[Skip]:
    """``skips`` narrowed to the measurements ``planned`` holds (the filters may have left some out)."""
    wanted = {(run.contender, w) for run in planned for w in run.workloads}
    out: list[Skip] = []
    for skip in skips:
        kinds = tuple(w for w in skip.workloads if (skip.contender, w) in wanted)
        if kinds:
            out.append(Skip(skip.contender, kinds, skip.reason))
    return out


def skipped_lines(skipped: Sequence[dict[str, Any]]) -> str:
    """The text printed after the tables for the report's ``meta.skipped`` (empty when nothing was)."""
    if not skipped:
        return ""
    lines = ["", "Not run on this device (the device cannot do it; no figure was made up):"]
    for item in skipped:
        lines.append(f"  {item['contender']} {', '.join(item['workloads'])}: {item['reason']}")
    return "\n".join(lines) + "\n"


# --- the peer server process -------------------------------------------------------------------------


def harness_env() -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH``.

    The harness is not installed (it is not in the wheel): a child ``python -m bench`` finds it through
    the checkout, whatever directory the driver was started from.
    """
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + rest if rest else "")
    return env


class PeerServer:
    """The ``--role server`` subprocess (ours: started here, stopped here)."""

    def __init__(self, host: str, profile_dir: Path | None) -> None:
        cmd = [sys.executable, "-m", "bench", "--role", "server", "--host", host]
        if profile_dir is not None:
            cmd += ["--profile", str(profile_dir)]
        # Closed in close(); a file rather than a pipe so that a chatty server never blocks.
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=harness_env()
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def stderr_tail(self, limit: int = 2000) -> str:
        """The end of the server's standard error."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-limit:]

    def _command(self, line: str, expect: str, timeout: float) -> dict[str, Any]:
        if self.proc.poll() is not None or self.proc.stdin is None:
            raise RuntimeError(f"server exited with status {self.proc.returncode}: {self.stderr_tail()}")
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"no answer to {line!r} from the server within {timeout:.0f} s")
            try:
                raw = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if not raw:
                self.proc.wait(5)
                raise RuntimeError(f"server exited with status {self.proc.returncode}: {self.stderr_tail()}")
            try:
                reply: dict[str, Any] = json.loads(raw)
            except ValueError:
                continue  # stray output
            if "error" in reply:
                raise RuntimeError(f"server: {reply['error']}")
            if expect in reply:
                return reply

    def serve(self, kind: str) -> dict[str, Any]:
        """Start serving on a ``kind`` loop; return the ports."""
        return self._command(f"serve {kind}", "ready", SERVER_START_TIMEOUT)

    def stats(self) -> dict[str, Any]:
        """The server's pid and the rdmaio clients its main listener holds now."""
        reply: dict[str, Any] = self._command("stats", "stats", 60.0)["stats"]
        return reply

    def trim(self) -> bool:
        """Have the server return its free heap memory to the kernel (glibc); False without glibc."""
        return bool(self._command("trim", "trimmed", 60.0)["trimmed"])

    def stop(self) -> None:
        """Stop the current loop."""
        self._command("stop", "stopped", 60.0)

    def close(self) -> None:
        """Ask the server to exit and wait for it (terminate it if it does not)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(10)
        self._stderr.close()


# --- running ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Settings:
    """Everything a benchmark run needs."""

    contenders: list[str]
    workloads: list[Workload]
    sizes: list[int] | None
    budget: Budget
    host: str
    device: str | None
    rstream_mode: str
    port_base: int
    profile_dir: Path | None
    drain_every: int = 1
    memory_counts: tuple[int, ...] = MEMORY_COUNTS
    provider: Provider | None = None


Progress = Callable[[str], None]


def _describe(run: Run, samples: dict[Workload, Sample]) -> str:
    parts = []
    for workload, sample in samples.items():
        if not sample.ok:
            parts.append(f"{workload}: FAILED ({sample.error})")
            if sample.memory:
                parts.append("of those opened: " + _describe_memory(sample.memory))
        elif workload in (Workload.STREAM, Workload.RDMA_WRITE, Workload.RDMA_READ):
            parts.append(f"{(sample.bytes_per_s or 0) / 2**20:.3g} MiB/s")
        elif workload in (Workload.MESSAGE, Workload.FETCH_ADD, Workload.FETCH_ADD_MANY):
            parts.append(f"{(sample.msgs_per_s or 0) / 1000:.3g} kmsg/s")
        elif workload is Workload.SETUP:
            parts.append(f"{sample.conns_per_s or 0:.3g} conn/s over {sample.ops} connections")
        elif workload is Workload.MEMORY:
            parts.append(_describe_memory(sample.memory))
        elif sample.p50_us is not None:
            parts.append(f"p50 {sample.p50_us:.4g} us, p99 {sample.p99_us or 0:.4g} us")
        else:
            parts.append(f"mean {sample.mean_us or 0:.4g} us")
        if sample.ok and sample.rdmaio:
            parts.append(
                f"wakeups/op {sample.rdmaio['wakeups_per_op']:.3g}, "
                f"batch {sample.rdmaio['client_mean_batch']:.3g}/{sample.rdmaio['server_mean_batch']:.3g}"
            )
        if sample.capped:
            parts.append(f"time-capped after {sample.ops} ops")
    return "; ".join(parts)


def _describe_memory(memory: dict[str, float] | None) -> str:
    if not memory:
        return "no figures"
    kib = 1024.0
    return (
        f"per connection: registered {memory['registered_per_conn_server'] / kib:.4g}/"
        f"{memory['registered_per_conn_client'] / kib:.4g} KiB, "
        f"RSS {memory['rss_per_conn_server'] / kib:.4g}/{memory['rss_per_conn_client'] / kib:.4g} KiB "
        "(server/client)"
    )


class Bench:
    """Runs a plan and collects figures."""

    def __init__(
        self, settings: Settings, progress: Progress, on_start: Callable[[int, int, str], None] | None = None
    ) -> None:
        self.s = settings
        self.progress = progress
        self.on_start = on_start
        """Called with (index, total, label) as each measurement starts (the live display's bar)."""
        self.figures: dict[tuple[str, Workload, int], Figure] = {}
        self.external = ExternalConfig(
            host=settings.host,
            device=settings.device,
            port_base=settings.port_base,
            rstream_mode=settings.rstream_mode,
            setup_seconds=settings.budget.setup_seconds,
            provider=settings.provider,
        )
        self._server: PeerServer | None = None
        self._phase: str | None = None
        self._ports: dict[str, Any] = {}
        self._phase_error: str | None = None
        self._runner: asyncio.Runner | None = None
        self._profiles: dict[str, cProfile.Profile] = {}

    def _figure(self, contender: str, workload: Workload, size: int) -> Figure:
        key = (contender, workload, size)
        if key not in self.figures:
            self.figures[key] = Figure(contender, workload, size)
        return self.figures[key]

    def _enter_phase(self, kind: str) -> None:
        if self._phase == kind:
            return
        self._leave_phase()
        self._phase = kind
        self._phase_error = None
        try:
            if self._server is None:
                self.progress(f"starting the benchmark server process ({kind} first)")
                self._server = PeerServer(self.s.host, self.s.profile_dir)
            self._ports = self._server.serve(kind)
        except Exception as exc:
            self._phase_error = f"benchmark server unavailable: {exc}"
            return
        self._runner = asyncio.Runner(loop_factory=loop_factory(kind))

    def _leave_phase(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._phase is not None and self._server is not None and self._phase_error is None:
            try:
                self._server.stop()
            except Exception as exc:
                self.progress(f"warning: stopping the server's {self._phase} loop failed: {exc}")
        self._phase = None

    def _run_python(self, run: Run) -> dict[Workload, Sample]:
        contender = CONTENDERS[run.contender]
        assert contender.loop is not None
        self._enter_phase(contender.loop)
        workload = run.workloads[0]
        if self._phase_error is not None:
            return {workload: Sample.failure(self._phase_error)}
        # The setup workload talks to the echo listeners (no header per connection).
        listener = f"{contender.kind}_echo" if workload is Workload.SETUP else contender.kind
        port = self._ports.get(f"{listener}_port")
        if port is None:
            error = self._ports.get(f"{listener}_error") or "no port"
            return {workload: Sample.failure(f"server could not listen: {error}")}
        assert self._runner is not None
        coro: Coroutine[Any, Any, Sample]
        if workload is Workload.MEMORY:
            coro = self._memory(int(port), run.amount)
        elif workload in ONESIDED_WORKLOADS:  # one-sided: bench.onesided
            coro = measure_onesided(
                self.s.host, int(port), workload, run.size, run.amount, self.s.budget.time_cap
            )
        else:
            coro = measure(
                contender.kind,
                self.s.host,
                int(port),
                workload,
                run.size,
                run.amount,
                self.s.budget.setup_seconds if workload is Workload.SETUP else self.s.budget.time_cap,
                self.s.drain_every,
            )
        profiler = None
        if self.s.profile_dir is not None:
            profiler = self._profiles.setdefault(run.contender, cProfile.Profile())
            profiler.enable()
        try:
            sample = self._runner.run(coro)
        finally:
            if profiler is not None:
                profiler.disable()
        return {workload: sample}

    async def _memory(self, port: int, count: int) -> Sample:
        """One memory measurement; every failure becomes a failed sample."""
        server = self._server
        assert server is not None
        loop = asyncio.get_running_loop()

        async def server_stats() -> dict[str, Any]:
            return await loop.run_in_executor(None, server.stats)

        async def server_trim() -> bool:
            return await loop.run_in_executor(None, server.trim)

        try:
            pid = int(self._ports["pid"])
            return await measure_memory(self.s.host, port, count, pid, server_stats, server_trim)
        except Exception as exc:
            return Sample.failure(f"{type(exc).__name__}: {exc}")

    def execute(self, runs: Sequence[Run]) -> None:
        """Run every measurement, reporting each on the progress callback."""
        total = len(runs)
        width = len(str(total))
        try:
            for index, run in enumerate(runs, 1):
                if self.on_start is not None:
                    self.on_start(index, total, run.label())
                started = time.monotonic()
                if CONTENDERS[run.contender].python:
                    samples = self._run_python(run)
                else:
                    self._leave_phase()
                    samples = run_external(run.contender, run.workloads, run.size, run.amount, self.external)
                for workload, sample in samples.items():
                    self._figure(run.contender, workload, run.size).samples.append(sample)
                elapsed = time.monotonic() - started
                self.progress(
                    f"[{index:>{width}}/{total}] rep {run.rep + 1}/{self.s.budget.reps} {run.label()}: "
                    f"{_describe(run, samples)} ({elapsed:.1f} s)"
                )
        finally:
            self._leave_phase()
            if self._server is not None:
                self._server.close()
                self._server = None
            self._dump_profiles()

    def _dump_profiles(self) -> None:
        if self.s.profile_dir is None:
            return
        for name, profiler in self._profiles.items():
            path = self.s.profile_dir / f"client-{name}.prof"
            profiler.dump_stats(path)
            with open(path.with_suffix(".txt"), "w") as out:
                stats = pstats.Stats(profiler, stream=out)
                stats.sort_stats("tottime").print_stats(40)
            self.progress(f"profile of the {name} client: {path} (+ .txt summary)")


# --- command line -------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Benchmark rdmaio (on asyncio and uvloop) against perftest, rstream (rsockets) and "
            "asyncio/uvloop TCP streams: one-way stream throughput, pipelined message rate and echo "
            "round-trip latency; on request (--only) connection setup rate against a native rdma_cm "
            "loop, and registered memory and RSS per idle connection. "
            "Run it from a checkout of rdmaio where an RDMA device exists, e.g. inside the test host: "
            "tools/dev bench [HOST-OPTIONS --] --json reports/bench.json"
        ),
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small budgets, 1 repetition (a demo in minutes)")
    mode.add_argument(
        "--full", action="store_true", help="full budgets, 3 repetitions, medians (the default)"
    )
    parser.add_argument("--reps", type=int, help="repetitions per figure (overrides the mode's)")
    parser.add_argument("--time-cap", type=float, help="seconds after which a Python client stops early")
    parser.add_argument(
        "--setup-seconds",
        type=float,
        help="setup workload: seconds of connecting per measurement, every contender (default 10; quick 5)",
    )
    parser.add_argument(
        "--only",
        default="stream,message,echo",
        help=(
            "workloads to run: stream,message,echo,setup,memory,rdma_write,rdma_read,fetch_add,"
            "fetch_add_many,read_lat or onesided (those five) (default stream,message,echo; setup: "
            "connections/s against a native "
            "rdma_cm loop; memory: bytes per idle connection; onesided: against ib_write_bw, ib_read_bw, "
            "ib_atomic_bw, ib_read_lat), or dask alone: Dask transfers and a shuffle on tcp:// and rdma:// "
            "(bench.dask; --sizes in MiB, --reps, --quick)"
        ),
    )
    parser.add_argument(
        "--conns",
        default=",".join(str(n) for n in MEMORY_COUNTS),
        help="memory workload: idle connection counts to measure at (default 1,100,1000)",
    )
    parser.add_argument("--sizes", help="sizes to run, e.g. 64,64K (default 64,4K,64K,1M; echo 64,4K)")
    parser.add_argument(
        "--contenders",
        default="all",
        help=(
            f"contenders or groups (default all): {', '.join(CONTENDERS)}; "
            f"groups: {', '.join(CONTENDER_GROUPS)}"
        ),
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("RDMAIO_TEST_ADDR", DEFAULT_HOST),
        help="address of the local RDMA netdev (default $RDMAIO_TEST_ADDR or 198.18.0.1)",
    )
    parser.add_argument(
        "--device", default=os.environ.get("RDMAIO_TEST_DEVICE"), help="RDMA device for perftest (-d)"
    )
    parser.add_argument(
        "--rstream-mode", default="b", choices=("b", "n", "a"), help="rstream -T option (default b)"
    )
    parser.add_argument(
        "--port-base", type=int, default=19500, help="first port of the perftest/rstream servers"
    )
    parser.add_argument(
        "--drain-every",
        type=int,
        default=1,
        help="stream workload: await drain() after every N writes (default 1: after each write)",
    )
    parser.add_argument("--json", type=Path, help="write the JSON report to this file")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="draw the results to FILE.png or .svg (rdmaio[plots])"
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "live", "plain"),
        default="auto",
        help="live progress bar (rich) or plain lines; auto: live on a terminal",
    )
    parser.add_argument("--profile", type=Path, help="cProfile both Python sides into this directory")
    parser.add_argument(
        "--from-json", type=Path, help="print the table of an earlier JSON report; run nothing"
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help=(
            "print the tables as markdown (with --from-json: headed by when, at which commit and with which "
            "command the report was made; this is how docs/benchmarks.md's results are produced)"
        ),
    )
    parser.add_argument(
        "--allow-remote", action="store_true", help="allow a --host that is not an address of this machine"
    )
    parser.add_argument(
        "--overhead",
        action="store_true",
        help=(
            "natively, no device: rdmaio's own CPU us and Python calls per operation over a null device "
            "(rdmaio.testing.nullpair), on asyncio and uvloop, beside TCP loopback (uses --quick, --reps, "
            "--json, --markdown, --from-json)"
        ),
    )
    parser.add_argument("--role", choices=("driver", "server"), default="driver", help=argparse.SUPPRESS)
    return parser


def _is_local_address(host: str) -> bool:
    """True for loopback, the benchmark range 198.18.0.0/15, or an address assigned to this machine."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.is_loopback or address in BENCH_NET:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def _git_state() -> dict[str, Any]:
    """The checked-out commit and whether rdmaio/ has uncommitted changes (read-only git queries)."""
    root = REPO_ROOT
    state: dict[str, Any] = {"git_commit": None, "git_dirty": None}
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if head.returncode == 0:
            state["git_commit"] = head.stdout.strip()
            status = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--", "rdmaio"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if status.returncode == 0:
                state["git_dirty"] = [line[3:] for line in status.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return state


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "testhost": os.environ.get("RDMAIO_TESTHOST"),
    }
    try:
        import rdmaio

        info["rdmaio"] = rdmaio.__version__
    except Exception:  # pragma: no cover - we are inside rdmaio
        info["rdmaio"] = None
    try:
        info["uvloop"] = importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:
        info["uvloop"] = None
    return info


def _stderr_progress(line: str) -> None:
    print(f"bench: {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role == "server":
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        return server_main(args.host, args.profile)

    if args.plot is not None:
        try:
            check_plot_target(args.plot)  # before a long run, not after it
        except PlotError as exc:
            parser.error(str(exc))
    if args.overhead:
        return _run_overhead(args, argv)
    if "dask" in _csv(args.only):
        return _run_dask(parser, args)
    if args.from_json is not None:
        doc = json.loads(args.from_json.read_text())
        problems = validate_report(doc)
        if problems:
            print("invalid report: " + "; ".join(problems), file=sys.stderr)
            return 1
        figures = [Figure.from_json(f) for f in doc["figures"]]
        reps = int(doc["meta"].get("reps", 1))
        if args.markdown:
            print(render_markdown(figures, list(doc["contenders"]), reps, meta=doc["meta"]), end="")
        else:
            print(render_table(figures, list(doc["contenders"]), reps), end="")
            print(skipped_lines(doc["meta"].get("skipped") or []), end="")
        return _plot(args.plot, figures, list(doc["contenders"]), _stderr_progress)

    try:
        contenders = resolve_contenders(_csv(args.contenders))
        workloads = expand_workloads(_csv(args.only))
        sizes = [parse_size(s) for s in _csv(args.sizes)] if args.sizes else None
        memory_counts = tuple(int(n) for n in _csv(args.conns))
    except ValueError as exc:
        parser.error(str(exc))
    if Workload.MEMORY in workloads and (not memory_counts or min(memory_counts) < 1):
        parser.error("--conns needs connection counts of at least 1")
    if not contenders or not workloads:
        parser.error("nothing to run")
    if not args.allow_remote and not _is_local_address(args.host):
        parser.error(
            f"--host {args.host} is not loopback, 198.18.0.0/15 or an address of this machine "
            "(the benchmark only talks to itself; --allow-remote overrides)"
        )
    base = QUICK if args.quick else FULL
    budget = Budget(
        name=base.name,
        stream_bytes=base.stream_bytes,
        message_bytes=base.message_bytes,
        echo_iters=base.echo_iters,
        time_cap=args.time_cap if args.time_cap is not None else base.time_cap,
        reps=args.reps if args.reps is not None else base.reps,
        setup_conns=base.setup_conns,
        setup_seconds=args.setup_seconds if args.setup_seconds is not None else base.setup_seconds,
        onesided_bytes=base.onesided_bytes,
        atomic_ops=base.atomic_ops,
        read_lat_iters=base.read_lat_iters,
    )
    if budget.reps < 1:
        parser.error("--reps must be at least 1")
    if budget.setup_seconds <= 0:
        parser.error("--setup-seconds must be positive")
    if args.drain_every < 1:
        parser.error("--drain-every must be at least 1")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    # The device decides perftest's connection flags and what cannot run at all (no atomics on iWARP).
    provider = detect_provider(args.host, args.device)
    skips = plan_skips(provider, contenders, workloads, {c: CONTENDERS[c].workloads for c in contenders})
    settings = Settings(
        provider=provider,
        contenders=contenders,
        workloads=workloads,
        sizes=sizes,
        budget=budget,
        host=args.host,
        device=args.device,
        rstream_mode=args.rstream_mode,
        port_base=args.port_base,
        profile_dir=args.profile,
        drain_every=args.drain_every,
        memory_counts=memory_counts,
    )
    planned = plan_runs(contenders, workloads, sizes, budget, memory_counts)
    skips = planned_skips(skips, planned)
    runs = drop_skipped(planned, skips)
    if not planned:
        parser.error("the filters leave nothing to run")
    if not runs:
        parser.error(
            "nothing the filters leave can run on this device: " + "; ".join(s.line() for s in skips)
        )
    display = make_display(live={"auto": None, "live": True, "plain": False}[args.progress])
    display.message(
        f"{len(runs)} measurements ({budget.name} budgets, {budget.reps} repetition(s), time cap "
        f"{budget.time_cap:g} s) on {args.host}" + (f" / {args.device}" if args.device else "")
    )
    display.message(provider.describe())
    for skip in skips:
        display.message(skip.line())
    if args.profile is not None:
        display.message("profiling is on: the Python contenders' figures are slowed down by cProfile")
    bench = Bench(settings, display.message, display.started)
    started = time.monotonic()
    interrupted = False
    try:
        bench.execute(runs)
    except KeyboardInterrupt:
        interrupted = True
        display.message("interrupted: reporting what was measured")
    finally:
        display.close()
    figures = list(bench.figures.values())
    provenance = _git_state()
    render = render_markdown if args.markdown else render_table
    print(render(figures, contenders, budget.reps), end="", flush=True)
    skipped = [skip.to_json() for skip in skips]
    print(skipped_lines(skipped), end="", flush=True)
    if args.json is not None:
        meta = {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": ["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)],
            "mode": budget.name,
            "reps": budget.reps,
            "host": args.host,
            "device": args.device,
            "provider": provider.to_json(),
            "skipped": skipped,
            "rstream_mode": args.rstream_mode,
            "drain_every": args.drain_every,
            "budget": budget.to_json(),
            "workloads": [str(w) for w in workloads],
            "sizes": sizes,
            "memory_counts": list(memory_counts),
            "profiled": args.profile is not None,
            "interrupted": interrupted,
            "elapsed_s": round(time.monotonic() - started, 1),
            **_versions(),
            **provenance,
        }
        doc = build_report(figures, meta, contenders)
        problems = validate_report(doc)
        if problems:  # a bug of ours: say so, but still write what we have
            _stderr_progress("warning: report fails its own schema check: " + "; ".join(problems))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        _stderr_progress(f"JSON report written to {args.json}")
    plotted = _plot(args.plot, figures, contenders, _stderr_progress)
    if interrupted:
        return 130
    return plotted or (0 if any(f.status != "error" for f in figures) else 1)


def _run_overhead(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--overhead``: the native overhead benchmark of :mod:`bench.overhead` (or its table from a report)."""
    from bench import overhead

    if args.from_json is not None:
        try:
            doc = json.loads(args.from_json.read_text())
            results = overhead.results_from_report(doc)
        except (ValueError, KeyError, TypeError) as exc:
            print(f"invalid report: {exc}", file=sys.stderr)
            return 1
        meta = doc.get("meta") if args.markdown else None
        print(overhead.render(results, markdown=args.markdown, meta=meta), end="")
        return 0
    return overhead.main(
        quick=args.quick,
        samples=args.reps,
        json_path=args.json,
        markdown=args.markdown,
        argv=list(sys.argv[1:] if argv is None else argv),
    )


def _run_dask(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--only dask``: the Dask comparison of :mod:`bench.dask` (its own table, no JSON report)."""
    from bench import dask as dask_bench

    if _csv(args.only) != ["dask"]:
        parser.error("--only dask runs alone (it starts Dask clusters, not the bench's peers)")
    if args.json is not None or args.plot is not None or args.from_json is not None:
        parser.error("--only dask prints a table only (no --json, --plot or --from-json)")
    argv = ["--host", args.host, "--reps", str(args.reps or (1 if args.quick else 3))]
    if args.sizes:
        try:
            sizes = [parse_size(s) for s in _csv(args.sizes)]
        except ValueError as exc:
            parser.error(str(exc))
        if any(size < 1 << 20 or size % (1 << 20) for size in sizes):
            parser.error("--only dask: --sizes are whole MiB (e.g. 1M,16M,64M)")
        argv += ["--sizes", ",".join(str(size >> 20) for size in sizes)]
    elif args.quick:
        argv += ["--sizes", "1,16"]
    if args.quick:
        argv += ["--rows", "50000"]
    return dask_bench.main(argv)


def _plot(path: Path | None, figures: list[Figure], contenders: list[str], progress: Progress) -> int:
    """Draw the figures to ``path`` if one was given; returns an exit status (1 when it failed)."""
    if path is None:
        return 0
    try:
        plot_figures(figures, contenders, path, title="rdmaio bench")
    except PlotError as exc:
        progress(str(exc))
        return 1
    progress(f"plot written to {path}")
    return 0
