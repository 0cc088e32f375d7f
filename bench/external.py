"""The native RDMA contenders: perftest (``ib_send_bw``, ``ib_write_bw``, ``ib_send_lat``), rstream, and
``cm_setup``, the native floor of the setup workload (``native/cm_setup.c``, compiled with gcc on first
use and cached by the hash of its source).

Each measurement starts the tool's server and its client as two processes on the benchmark address,
waits for the server to listen (it reads the server's output through a pseudo-terminal, so that it comes
line by line), runs the client, and parses the client's report. A tool that is missing, fails, times out
or prints something unparsable yields a failed :class:`~bench.model.Sample` carrying the error
and the output's tail.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pty
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.model import Sample, Workload
from bench.onesided import (
    ONESIDED_TOOLS,
    checked_perftest_lat,
    parse_onesided_tool,
    perftest_args,
    perftest_bw_sample,
)
from bench.parsers import (
    ParseError,
    parse_cm_setup,
    parse_rstream,
)
from bench.provider import Provider, perftest_transport_args

__all__ = [
    "CM_SETUP_SOURCE",
    "ExternalConfig",
    "NativeBuildError",
    "build_cm_setup",
    "cm_setup_commands",
    "perftest_command",
    "rstream_command",
    "run_external",
    "run_pair",
]

_TAIL = 3000
# perftest prints "Waiting for client rdma_cm QP to connect" only once a client reached its control
# connection; its opening banner comes just before it listens for that connection.
_PERFTEST_READY = "Waiting for client to connect"
_RSTREAM_READY = "usec/xfer"  # rstream prints its header after it listens
_CM_SETUP_READY = "cm_setup server listening"  # printed once rdma_listen() returned
# perftest converts its cycle counts with the CPU frequency it estimates (get_cpu_mhz in src/get_clock.c:
# a regression of the cycle counter against gettimeofday). When the estimate fails it prints this and
# uses 0 MHz: with -F (ours) it does not abort, and a bandwidth report is then all zeros. Such a run
# measured nothing usable, so it is run again (a test host's emulated clock fails it now and then).
_PERFTEST_CLOCK_FAILED = "Correlation coefficient r^2"
PERFTEST_CLOCK_RETRIES = 3
"""Runs of a perftest tool made again, beyond the config's attempts, when its clock estimate failed."""

CM_SETUP_SOURCE = Path(__file__).with_name("native") / "cm_setup.c"
"""The C source of the native setup contender."""


class NativeBuildError(RuntimeError):
    """The native setup contender could not be compiled (no gcc, no rdma-core headers, a compile error)."""


def _cache_dirs() -> list[Path]:
    """Where a compiled ``cm_setup`` may be kept, in order of preference.

    In a source checkout, its ``build/`` directory comes first: the test host shares the checkout with
    its VM (whose home directory does not outlive the VM), so a binary built once, on the host or in an
    earlier VM, is found again; compiling under emulation takes half a minute.
    """
    dirs = []
    if os.environ.get("RDMAIO_BENCH_CACHE"):
        dirs.append(Path(os.environ["RDMAIO_BENCH_CACHE"]))
    checkout = CM_SETUP_SOURCE.parents[2]
    if (checkout / ".git").exists() and (checkout / "pyproject.toml").exists():
        dirs.append(checkout / "build" / "bench-native")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(Path(base) / "rdmaio" / "bench")
    dirs.append(Path(tempfile.gettempdir()) / f"rdmaio-bench-{os.getuid()}")
    return dirs


def build_cm_setup(source: Path = CM_SETUP_SOURCE, compiler: str = "gcc") -> Path:
    """Compile ``cm_setup.c`` (once per source version: the binary is named by the source's hash and
    reused while it exists) and return the executable's path. Raises :class:`NativeBuildError` saying
    what is missing."""
    code = source.read_bytes()
    digest = hashlib.sha256(code).hexdigest()[:16]
    name = f"cm_setup-{digest}"
    for directory in _cache_dirs():
        cached = directory / name
        if os.access(cached, os.X_OK):
            return cached
    gcc = shutil.which(compiler)
    if gcc is None:
        raise NativeBuildError(
            f"{compiler} not found on PATH: the native setup contender is compiled at bench time "
            "(apt-get install gcc libc6-dev librdmacm-dev libibverbs-dev)"
        )
    problems: list[str] = []
    for directory in _cache_dirs():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problems.append(f"{directory}: {exc.strerror}")
            continue
        target = directory / name
        partial = directory / f"{name}.{os.getpid()}.tmp"
        cmd = [gcc, "-O2", "-o", str(partial), str(source), "-lrdmacm", "-libverbs"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            problems.append(f"{directory}: {exc}")
            continue
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise NativeBuildError(
                f"compiling {source.name} failed (needs librdmacm-dev and libibverbs-dev): "
                + result.stderr.strip()[-800:]
            )
        partial.replace(target)  # atomic: a concurrent run never executes a half-written file
        return target
    raise NativeBuildError("no writable cache directory for the compiled cm_setup: " + "; ".join(problems))


def cm_setup_commands(
    binary: Path, host: str, port: int, count: int, seconds: float
) -> tuple[list[str], list[str]]:
    """Server and client command lines of one ``cm_setup`` measurement (with the 16 B echo, the same
    work per connection as the rdmaio setup workload)."""
    server = [str(binary), "server", host, str(port), "echo"]
    client = [str(binary), "client", host, str(port), str(count), f"{seconds:g}", "echo"]
    return server, client


@dataclass(slots=True)
class ExternalConfig:
    """Where and how the native tools run."""

    host: str
    device: str | None = None
    port_base: int = 19500
    timeout: float = 120.0
    """Seconds one client run may take."""
    attempts: int = 2
    """Server starts per measurement (each with up to 3 client tries)."""
    rstream_mode: str = "b"
    """rstream ``-T`` option: ``b`` (blocking calls) or ``n`` (its default, non-blocking spinning)."""
    setup_seconds: float = 10.0
    """Seconds after which ``cm_setup``'s client stops (the same as the Python setup loop's)."""
    provider: Provider | None = None
    """The device's provider and transport (:func:`bench.provider.detect_provider`): perftest's
    connection flags depend on the transport."""
    _ports: Iterator[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ports = itertools.count(self.port_base)

    def next_port(self) -> int:
        """A fresh port for each server, so a lingering listener never answers the next test."""
        return next(self._ports)


@dataclass(slots=True)
class PairResult:
    """Outputs of one server/client run."""

    ok: bool
    client_out: str
    server_out: str
    error: str | None = None


def _tail(text: str) -> str:
    return text[-_TAIL:]


class _Server:
    """A tool's server process whose output is collected by a thread that notices a marker line.

    Its output goes to a pseudo-terminal when one can be had, so that the C stdio of the tool is line
    buffered and the marker shows up when it is printed (with a pipe it would come only at exit).
    """

    def __init__(self, cmd: Sequence[str], marker: str | None) -> None:
        self.chunks: list[str] = []
        self.ready = threading.Event()
        self._marker = marker
        self._seen = ""
        try:
            master, slave = pty.openpty()
        except OSError:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            assert self.proc.stdout is not None
            self._fd = os.dup(self.proc.stdout.fileno())
            self.proc.stdout.close()
        else:
            try:
                self.proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            self._fd = master
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self._fd, 65536)
                except OSError:  # EIO: the pty's last writer is gone
                    break
                if not data:
                    break
                text = data.decode(errors="replace").replace("\r\n", "\n")
                self.chunks.append(text)
                if self._marker is not None and not self.ready.is_set():
                    self._seen = (self._seen + text)[-4096:]
                    if self._marker in self._seen:
                        self.ready.set()
        finally:
            os.close(self._fd)
            self.ready.set()

    def text(self, join_timeout: float = 2.0) -> str:
        """Everything the server printed (waits briefly for the reader to finish)."""
        self._thread.join(join_timeout)
        return "".join(self.chunks)

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` s for the process (ours), then terminate it, then kill it."""
        proc = self.proc
        if proc.poll() is not None:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_pair(
    server_cmd: Sequence[str],
    client_cmd: Sequence[str],
    *,
    ready_marker: str | None,
    timeout: float,
    ready_wait: float = 10.0,
    client_tries: int = 4,
    server_grace: float = 15.0,
) -> PairResult:
    """Start ``server_cmd``, then run ``client_cmd`` against it; return both outputs.

    The client starts once the server printed ``ready_marker``, or after ``ready_wait`` seconds if the
    marker does not show up; a client that fails while the server still runs (typically: connection
    rejected because the server was not listening yet) is retried, ``client_tries`` times in all.
    After a successful client the server gets ``server_grace`` seconds to exit on its own before it is
    terminated (0 for a server that never exits by itself).
    """
    server = _Server(server_cmd, ready_marker)
    failures: list[str] = []
    client_out = ""
    try:
        if ready_marker is not None:
            if server.ready.wait(ready_wait) and server.proc.poll() is None:
                time.sleep(0.3)  # the marker is printed just before the listen call
        else:
            time.sleep(ready_wait)
        for _ in range(client_tries):
            if server.proc.poll() is not None:
                failures.append(f"server exited with status {server.proc.returncode}")
                break
            try:
                client = subprocess.run(
                    list(client_cmd),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                client_out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
                failures.append(f"client did not finish within {timeout:.0f} s")
                break
            client_out = client.stdout + client.stderr
            if client.returncode == 0:
                server.stop(server_grace)
                return PairResult(True, client_out, server.text())
            failures.append(f"client exited with status {client.returncode}")
            time.sleep(1.0)
        server.stop(0.0)
        return PairResult(False, client_out, server.text(), ", ".join(failures))
    finally:
        server.stop(0.0)


EVENT_MODE_SUFFIX = "-e"
"""A perftest contender named ``TOOL-e`` runs ``TOOL -e``: it sleeps on its completion channel until the
next completion (as rdmaio does, with no busy polling) instead of spinning on the CQ."""


def perftest_command(
    tool: str, size: int, iters: int, port: int, device: str | None, provider: Provider | None = None
) -> list[str]:
    """Arguments of a perftest run (server form; the client appends the server address); the connection
    flags are those of ``provider``'s transport (:func:`bench.provider.perftest_transport_args`). ``tool``
    is a contender's name: ``ib_send_lat-e`` is ``ib_send_lat -e``."""
    events = tool.endswith(EVENT_MODE_SUFFIX)
    if events:
        tool = tool.removesuffix(EVENT_MODE_SUFFIX)
    cmd = [tool, *perftest_transport_args(provider), "-F", *perftest_args(tool, size)]
    if events:
        cmd.append("-e")
    cmd += ["-n", str(iters), "-p", str(port)]
    if device:
        cmd += ["-d", device]
    return cmd


def rstream_command(size: int, count: int, iters: int, port: int, mode: str) -> list[str]:
    """Arguments of an rstream run (without ``-s``/``-b``): ``count`` transfers each way, ``iters`` times."""
    return [
        "rstream",
        "-T",
        mode,
        "-f",
        "ip",
        "-p",
        str(port),
        "-S",
        str(size),
        "-C",
        str(count),
        "-I",
        str(iters),
    ]


def run_external(
    contender: str, workloads: Sequence[Workload], size: int, amount: int, config: ExternalConfig
) -> dict[Workload, Sample]:
    """Run one native-tool measurement; return a Sample for each workload it covers.

    ``amount`` is the number of messages (perftest ``-n``) for the bandwidth tools, the number of round
    trips for the latency tools, and the number of one-way transfers for rstream's stream test.
    """
    tool = contender.removesuffix(EVENT_MODE_SUFFIX)  # the binary (ib_send_lat-e runs ib_send_lat -e)
    binary: Path | None = None
    if contender == "cm_setup":
        try:
            binary = build_cm_setup()
        except (NativeBuildError, OSError) as exc:
            failure = Sample.failure(f"native setup contender unavailable: {exc}")
            return {w: failure for w in workloads}
    elif shutil.which(tool) is None:
        failure = Sample.failure(f"{tool} not found on PATH (install perftest / rdmacm-utils)")
        return {w: failure for w in workloads}
    errors: list[str] = []
    last: PairResult | None = None
    clock_retries = PERFTEST_CLOCK_RETRIES
    attempt = 0
    while attempt < config.attempts:
        attempt += 1
        port = config.next_port()
        if contender == "rstream":
            latency = Workload.ECHO in workloads
            count, iters = (1, amount) if latency else (max(1, amount // 2), 1)
            base = rstream_command(size, count, iters, port, config.rstream_mode)
            server_cmd = [*base, "-b", config.host]
            client_cmd = [*base, "-s", config.host]
            marker = _RSTREAM_READY
        elif binary is not None:
            server_cmd, client_cmd = cm_setup_commands(
                binary, config.host, port, amount, config.setup_seconds
            )
            marker = _CM_SETUP_READY
        else:
            base = perftest_command(contender, size, amount, port, config.device, config.provider)
            server_cmd, client_cmd = base, [*base, config.host]
            marker = _PERFTEST_READY
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        last = run_pair(
            server_cmd,
            client_cmd,
            ready_marker=marker,
            timeout=max(config.timeout, config.setup_seconds * 3) if binary else config.timeout,
            server_grace=0.0 if binary is not None else 15.0,
        )
        if (
            last.ok
            and marker == _PERFTEST_READY
            and _clock_failed(contender, workloads, size, last.client_out)
        ):
            reason = "perftest's CPU frequency estimate failed (r^2 < 0.9): its report is all zeros"
            last = PairResult(False, last.client_out, last.server_out, reason)
            if clock_retries > 0:
                clock_retries -= 1
                attempt -= 1  # perftest measured nothing: not an attempt of the config's
        if last.ok:
            break
        errors.append(f"attempt {len(errors) + 1}: {last.error}")
        time.sleep(1.0)
    assert last is not None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Both processes of the pair were waited for: their CPU time is in RUSAGE_CHILDREN (zero-copy).
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if not last.ok:
        failure = Sample.failure("; ".join(errors), raw=_tail(last.client_out + last.server_out))
        return {w: failure for w in workloads}
    try:
        samples = _parse(contender, workloads, size, last.client_out)
    except ParseError as exc:
        failure = Sample.failure(f"cannot parse {tool} output: {exc}", raw=_tail(last.client_out))
        return {w: failure for w in workloads}
    for workload, sample in samples.items():
        if workload in (Workload.STREAM, Workload.MESSAGE) and sample.ops and contender != "rstream":
            sample.cpu_s_per_gib = cpu_s / (sample.ops * size / 2**30)
    warnings = list(errors)  # it worked on a later attempt: say so
    if _PERFTEST_CLOCK_FAILED in last.client_out:
        warnings.append("perftest warned that its CPU frequency estimate is unreliable (r^2 < 0.9)")
    if warnings:
        for sample in samples.values():
            sample.note = "; ".join([*warnings, sample.note or ""]).rstrip("; ")
    return samples


def _clock_failed(contender: str, workloads: Sequence[Workload], size: int, out: str) -> bool:
    """Whether a perftest run's report is unusable because its CPU frequency estimate failed."""
    if _PERFTEST_CLOCK_FAILED not in out:
        return False
    try:
        _parse(contender, workloads, size, out)
    except ParseError:
        return True
    return False


def _parse(contender: str, workloads: Sequence[Workload], size: int, out: str) -> dict[Workload, Sample]:
    raw = _tail(out)
    samples: dict[Workload, Sample] = {}
    if contender in ("ib_send_bw", "ib_write_bw", "ib_read_bw"):
        for workload in workloads:  # one Sample object each: later steps annotate them per workload
            samples[workload] = perftest_bw_sample(out, size, raw)
    elif contender in ("ib_send_lat", "ib_send_lat-e"):
        lat = checked_perftest_lat(out, size)
        samples[Workload.ECHO] = Sample(
            ok=True,
            p50_us=lat.rtt_p50_us,
            p99_us=lat.rtt_p99_us,
            mean_us=lat.rtt_mean_us,
            ops=lat.iterations,
            note="RTT = 2 x one-way t_typical / 99% percentile",
            raw=raw,
        )
    elif contender == "rstream":
        result = parse_rstream(out)
        if result.usec_per_xfer <= 0 and result.gbit_per_s <= 0:
            raise ParseError("the report gives neither a rate nor a time per transfer")
        if Workload.ECHO in workloads:
            samples[Workload.ECHO] = Sample(
                ok=True,
                mean_us=result.rtt_us,
                seconds=result.seconds,
                note="RTT = 2 x usec/xfer of a -C 1 ping-pong (mean; rstream reports no percentiles)",
                raw=raw,
            )
        else:
            samples[Workload.STREAM] = Sample(
                ok=True,
                bytes_per_s=result.bytes_per_s(size),
                seconds=result.seconds,
                note="rstream -I 1 -C N: N transfers one way then N back; bytes/s over both",
                raw=raw,
            )
    elif contender == "cm_setup":
        setup = parse_cm_setup(out)
        if not setup.echo:
            raise ParseError("cm_setup ran without the 16 B echo the setup workload compares")
        samples[Workload.SETUP] = Sample(
            ok=True,
            conns_per_s=setup.rate,
            seconds=setup.seconds,
            ops=setup.connections,
            note=(
                "C rdma_cm loop: connect + 16 B echo + disconnect, PD/CQ/MR reused, "
                "first connection not counted"
            ),
            raw=raw,
        )
    elif contender in ONESIDED_TOOLS:  # one-sided: ib_read_bw, ib_atomic_bw, ib_read_lat
        parsed = parse_onesided_tool(contender, size, out, raw)
        missing = [str(w) for w in workloads if w not in parsed]
        if missing:
            raise ParseError(f"{contender} does not measure {', '.join(missing)}")
        # Only the run's own workloads: one ib_atomic_bw report stands for both atomic workloads, but each
        # of its runs (with that workload's -n) counts for the workload it was run for.
        samples = {w: parsed[w] for w in workloads}
    else:
        raise ParseError(f"no parser for {contender}")
    return samples
