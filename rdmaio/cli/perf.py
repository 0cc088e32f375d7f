"""``python -m rdmaio perf``: throughput and latency between two hosts over rdmaio, like ``ib_send_bw`` or
``iperf3``.

``perf --server [HOST] [PORT]`` serves until interrupted, any number of clients one after another and at
once; ``perf HOST [PORT] --mode MODES --size SIZES --time SECONDS --parallel N [--json]`` measures.

Every run (one mode and one size, on each of ``--parallel`` connections) begins with a control message from
the client: a small versioned JSON header naming the mode, the size and the duration, so one server serves
every mode. The server answers with an acceptance (carrying the key of the region it exported for the
one-sided modes) or a refusal that says why (unknown mode, atomics unsupported, server busy, a limit); the
client ends the run with EOF and the server answers with its own count of what arrived, which is what the
message and stream figures are made of.

Modes: ``message`` (one-way ``send()``: message rate and bandwidth as the server received them), ``stream``
(one-way ``write()``/``drain()``), ``echo`` (round trips: latency percentiles and rate), ``read`` and
``write`` (serial RDMA READ/WRITE of ``SIZE`` bytes of a region the server exports per connection:
bandwidth and latency), ``atomic`` (serial fetch-and-add: rate and latency).

Exit status of the client: 0 when every run completed; 1 when a connection failed during a run; 2 when no
connection could be made (no perf server listening, unreachable, no RDMA device) or the options are wrong;
3 when the server refused a run; 130 when interrupted. docs/cli.md documents the options, the output and the
JSON schema.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import dataclasses
import json
import math
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import rdmaio
from rdmaio.cli.ping import describe_error, on_signals, serve_until_signalled
from rdmaio.errors import ProtocolError, RdmaError

__all__ = [
    "DEFAULT_PORT",
    "EXIT_CONNECT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_RUN_FAILED",
    "MODES",
    "PROTOCOL_VERSION",
    "SCHEMA",
    "ClientConfig",
    "ConnectionResult",
    "NotPerfServerError",
    "PerfProtocolError",
    "PerfRefusedError",
    "PerfServer",
    "RunRequest",
    "RunResult",
    "ServerLimits",
    "build_parser",
    "decode_request",
    "format_size",
    "latency_summary",
    "main",
    "measure",
    "parse_modes",
    "parse_size",
    "parse_sizes",
    "path_record",
    "percentile",
    "render_table",
    "run_client",
    "run_server",
]

DEFAULT_PORT = 7472
"""The port of ``perf --server`` when none is given (``ping`` has 7471)."""
PROTOCOL_VERSION = 1
"""The version of the control messages (the ``"perf"`` field of each)."""
SCHEMA = "rdmaio-perf/1"
"""The ``"schema"`` field of the ``--json`` document."""
MODES = ("message", "stream", "echo", "read", "write", "atomic")
"""Every mode, in the order ``--mode all`` runs them."""
ONE_SIDED = frozenset({"read", "write", "atomic"})
"""The modes that work on a region the server exports per connection."""
LATENCY_MODES = frozenset({"echo", "read", "write", "atomic"})
"""The modes that time each operation (serial: one operation in flight per connection)."""
ATOMIC_SIZE = 8
"""The size of a fetch-and-add's operand (and of the region exported for ``atomic``)."""
MAX_CONTROL = 4096
"""The largest control message either side accepts."""
MAX_SAMPLES = 1_000_000
"""Latencies kept per connection and run by default (8 MB); a longer run keeps a uniform random sample of
this many (reservoir sampling), so memory stays bounded however long it runs."""
PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("p99.9", 0.999))
"""The latency percentiles reported, by name."""

_T = TypeVar("_T")

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_CONNECT = 2
EXIT_REFUSED = 3
EXIT_INTERRUPTED = 130

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"(\d+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
MAX_CLIENT_SIZE = 1 << 30
"""The largest ``--size`` the client asks for (the server's ``--max-size`` decides what it accepts)."""


class PerfRefusedError(RdmaError, RuntimeError):
    """The perf server refused a run; ``reason`` is its short code (``busy``, ``mode``, ``version``,
    ``size``, ``time``, ``atomics``, ``header``) and the message says what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        #: The server's short code for why it refused.
        self.reason = reason


class PerfProtocolError(ProtocolError):
    """The peer broke perf's protocol (a malformed control message, a wrong echo)."""


class NotPerfServerError(PerfProtocolError):
    """What answered the header is not a perf server (an ``rdmaio ping`` server, or something else)."""


# --- sizes, modes, numbers -------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``64``, ``64K``, ``1M``, ``2G`` (binary units; ``KiB``/``KB`` accepted) as bytes, at least 1."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r} (use e.g. 64, 64K, 1M)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if not 1 <= value <= MAX_CLIENT_SIZE:
        raise ValueError(f"size out of range: {text!r} (1 B to 1G)")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (:func:`parse_size`), in the order given, without repeats."""
    sizes: list[int] = []
    for part in text.split(","):
        size = parse_size(part)
        if size not in sizes:
            sizes.append(size)
    return sizes


def parse_modes(text: str) -> list[str]:
    """A comma-separated list of modes (``all``: every mode), in the order given, without repeats."""
    modes: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        names = MODES if name == "all" else (name,)
        for mode in names:
            if mode not in MODES:
                raise ValueError(f"unknown mode {part.strip()!r} (modes: {', '.join(MODES)}, all)")
            if mode not in modes:
                modes.append(mode)
    return modes


def format_size(size: int) -> str:
    """``64 B``, ``64 KiB``, ``1 MiB``, ``1536 B``: exact, in the largest unit that divides it."""
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {suffix}"
    return f"{size} B"


def _three_digits(value: float) -> str:
    """``value`` with three significant digits and its decimals kept (``1.20``, ``10.0``, ``123``)."""
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def format_rate(bytes_per_second: float) -> str:
    """A bandwidth in bits a second, in the unit that keeps 3-4 digits (``9.41 Gbit/s``)."""
    bits = bytes_per_second * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{_three_digits(bits / scale)} {unit}"
    return f"{bits:.0f} bit/s"


def format_count(value: float) -> str:
    """An operation rate with a k/M suffix (``1.23M``)."""
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{_three_digits(value / scale)}{suffix}"
    return _three_digits(value)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``ordered`` (sorted ascending), nearest-rank method; 0.0 when empty.

    Nearest rank: the smallest sample with at least ``q`` of the samples at or below it, so every value
    reported is one that was measured (as ``ping``'s p99).
    """
    if not ordered:
        return 0.0
    rank = math.ceil(q * len(ordered) - 1e-9)  # q * n is inexact for q like 0.999
    return ordered[min(len(ordered), max(1, rank)) - 1]


def latency_summary(samples: Sequence[float]) -> dict[str, float | int] | None:
    """``samples`` (seconds) summarised in microseconds: count, min, mean, p50, p90, p99, p99.9, max; None
    without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    summary: dict[str, float | int] = {
        "samples": len(ordered),
        "min": ordered[0] * 1e6,
        "mean": sum(ordered) / len(ordered) * 1e6,
    }
    for name, q in PERCENTILES:
        summary[name] = percentile(ordered, q) * 1e6
    summary["max"] = ordered[-1] * 1e6
    return summary


# --- control messages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What a client asks of the server for one run on one connection (the control header)."""

    mode: str
    size: int
    """Bytes per message, write or operation (8 for ``atomic``)."""
    seconds: float
    stream: int = 0
    """This connection's index among the run's ``streams`` parallel connections."""
    streams: int = 1

    def encode(self) -> bytes:
        """The header as sent: a JSON object with the protocol version."""
        body = {"perf": PROTOCOL_VERSION, "mode": self.mode, "size": self.size, "time": self.seconds}
        body |= {"stream": self.stream, "streams": self.streams}
        return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one perf server lets its clients make it hold: each bound has an option of ``--server``."""

    max_clients: int = 32
    """Runs served at once (connections past it are refused as ``busy``)."""
    max_size: int = 64 << 20
    """Largest ``size`` of a run (bytes a message or an exported region)."""
    max_exported: int = 256 << 20
    """Bytes exported to all one-sided runs at once (a run past it is refused as ``busy``)."""
    max_time: float = 3600.0
    """Longest ``time`` of a run, in seconds."""
    header_timeout: float = 10.0
    """Seconds a new connection may take to send its header before it is dropped."""
    grace: float = 60.0
    """Seconds a run may last beyond its ``time`` (to drain what is queued) before it is aborted."""


def decode_request(data: bytes | None, limits: ServerLimits) -> RunRequest:
    """Validate a client's header against the protocol and ``limits``; raise :class:`PerfRefusedError`
    with the reason to send back."""
    if data is None or len(data) > MAX_CONTROL:
        raise PerfRefusedError("header", "the first message of a run must be a perf header")
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        body = None
    if not isinstance(body, dict) or "perf" not in body:
        raise PerfRefusedError("header", "the first message of a run must be a perf header")
    version = body.get("perf")
    if version != PROTOCOL_VERSION:
        raise PerfRefusedError(
            "version",
            f"perf protocol version {version!r} is not spoken here (this server speaks {PROTOCOL_VERSION})",
        )
    mode = body.get("mode")
    if mode not in MODES:
        raise PerfRefusedError("mode", f"unknown mode {mode!r} (this server knows: {', '.join(MODES)})")
    size, seconds = body.get("size"), body.get("time")
    stream, streams = body.get("stream", 0), body.get("streams", 1)
    if type(size) is not int or not 1 <= size <= limits.max_size:
        raise PerfRefusedError(
            "size", f"size {size!r} is outside what this server accepts (1 to {limits.max_size} bytes)"
        )
    if mode == "atomic" and size != ATOMIC_SIZE:
        raise PerfRefusedError("size", f"atomic runs use {ATOMIC_SIZE}-byte operands, not {size!r}")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 < seconds <= limits.max_time
    ):
        raise PerfRefusedError(
            "time", f"time {seconds!r} is outside what this server accepts (up to {limits.max_time:g} s)"
        )
    if not (type(stream) is int and type(streams) is int and 0 <= stream < streams):
        raise PerfRefusedError("header", "stream must be an index below streams")
    return RunRequest(mode, size, float(seconds), stream, streams)


def _control(body: dict[str, Any]) -> bytes:
    return json.dumps({"perf": PROTOCOL_VERSION, **body}, separators=(",", ":")).encode()


def _decode_control(data: bytes | None, what: str) -> dict[str, Any]:
    """A control message from the server (``what`` names the one expected, for the error)."""
    if data is None:
        raise rdmaio.ConnectionResetError(f"the server closed the connection instead of sending {what}")
    try:
        body = json.loads(data) if len(data) <= MAX_CONTROL else None
    except (UnicodeDecodeError, ValueError):
        body = None
    if not isinstance(body, dict) or body.get("perf") != PROTOCOL_VERSION:
        raise NotPerfServerError(f"the server sent something else than {what}: not an rdmaio perf server")
    if "mode" in body and "ok" not in body:
        # Our own header came back: an echo server (``rdmaio ping --server``) is listening there.
        raise NotPerfServerError(
            "the server echoed the header back: an rdmaio ping server, not a perf server"
        )
    return body


# --- server ----------------------------------------------------------------------------------------------


def _peer_name(ep: Any) -> str:
    peername = ep.get_extra_info("peername")
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"{peername[0]} port {peername[1]}"
    return str(peername)


class PerfServer:
    """The server side of perf: :meth:`handle` serves one connection (one run), checking it against
    :class:`ServerLimits`; one instance serves every connection of a listener."""

    def __init__(self, limits: ServerLimits | None = None, out: TextIO | None = None) -> None:
        self.limits = limits or ServerLimits()
        self.out = out
        self.active = 0
        """Runs being served now (bounded by ``max_clients``)."""
        self.exported = 0
        """Bytes exported to one-sided runs now (bounded by ``max_exported``)."""
        self.runs = 0
        """Runs accepted so far."""
        self.refused = 0
        """Runs refused so far."""

    def _say(self, line: str) -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)

    def _admit(self, request: RunRequest) -> int:
        """Take a client slot (and the region's bytes for a one-sided run); return the bytes taken."""
        limits = self.limits
        if self.active >= limits.max_clients:
            raise PerfRefusedError(
                "busy",
                f"server busy: {self.active} runs in progress (its --max-clients is {limits.max_clients})",
            )
        region = request.size if request.mode in ONE_SIDED else 0
        if self.exported + region > limits.max_exported:
            raise PerfRefusedError(
                "busy",
                f"server busy: {self.exported} bytes exported to other runs, {region} more would pass "
                f"its --max-exported of {limits.max_exported}",
            )
        self.active += 1
        self.exported += region
        return region

    async def handle(self, ep: rdmaio.Endpoint) -> None:
        """Serve one connection: read the header, accept or refuse, run, report. Never raises for what a
        client does; every outcome is one line on ``out``."""
        peer = _peer_name(ep)
        try:
            async with asyncio.timeout(self.limits.header_timeout):
                header = await ep.recv()
        except TimeoutError:
            self._say(f"{peer}: no header within {self.limits.header_timeout:g} s, dropped")
            ep.abort()
            return
        except (OSError, RdmaError) as exc:
            self._say(f"{peer}: {type(exc).__name__}: {exc}")
            ep.abort()
            return
        if header is None:
            await self._close(ep)
            return
        from rdmaio.cli.peer import PROBE_PREFIX

        if header.startswith(PROBE_PREFIX):
            await self._serve_doctor(ep, peer, header)
            return
        taken = 0
        try:
            request = decode_request(header, self.limits)
            taken = self._admit(request)
        except PerfRefusedError as exc:
            self.refused += 1
            self._say(f"{peer}: refused: {exc}")
            await self._refuse(ep, exc)
            return
        try:
            await self._serve(ep, peer, request)
        except (OSError, RdmaError) as exc:
            if type(exc) is TimeoutError:  # the run's own deadline (asyncio.timeout), not rdmaio's
                limit = request.seconds + self.limits.grace
                self._say(f"{peer}: {request.mode} run still going after {limit:g} s: aborted")
            else:
                self._say(f"{peer}: {request.mode} {format_size(request.size)}: {type(exc).__name__}: {exc}")
            ep.abort()
        finally:
            self.active -= 1
            self.exported -= taken

    async def _serve_doctor(self, ep: rdmaio.Endpoint, peer: str, first: bytes) -> None:
        """``rdmaio doctor --peer`` against this server: its probes are answered as ``ping --server``
        answers them (:func:`rdmaio.cli.peer.serve_doctor_session`). The session takes a client slot and
        lasts at most ``max_time``."""
        from rdmaio.cli.peer import serve_doctor_session

        if self.active >= self.limits.max_clients:
            self.refused += 1
            self._say(f"{peer}: doctor probe refused: server busy ({self.active} runs in progress)")
            ep.abort()
            return
        self.active += 1
        self._say(f"{peer}: doctor probe")
        try:
            async with asyncio.timeout(self.limits.max_time):
                handled = await serve_doctor_session(ep, first)
            self._say(f"{peer}: doctor probe done, {handled} messages")
        except (OSError, RdmaError) as exc:
            self._say(f"{peer}: doctor probe: {type(exc).__name__}: {exc}")
            ep.abort()
        finally:
            self.active -= 1

    async def _refuse(self, ep: rdmaio.Endpoint, exc: PerfRefusedError) -> None:
        try:
            await ep.send(_control({"ok": False, "reason": exc.reason, "error": exc.message}))
        except (OSError, RdmaError):
            ep.abort()
            return
        await self._close(ep)

    async def _close(self, ep: rdmaio.Endpoint) -> None:
        try:
            await ep.aclose()
        except (OSError, RdmaError):
            ep.abort()

    def _export(self, ep: rdmaio.Endpoint, region: bytearray, access: str) -> rdmaio.RemoteKey:
        try:
            return ep.export(region, access=access)
        except rdmaio.FeatureNotSupportedError:
            # No memory windows (siw): the region is granted to this loop's connections on the device
            # instead of this one only. It holds nothing but zeros and counters.
            return ep.export(region, access=access, scope="domain")
        except rdmaio.RemoteAccessError as exc:
            if "a" in access:
                raise PerfRefusedError(
                    "atomics", f"the server's device does not support remote atomics ({exc})"
                ) from exc
            raise

    async def _serve(self, ep: rdmaio.Endpoint, peer: str, request: RunRequest) -> None:
        mode, size = request.mode, request.size
        self.runs += 1
        accept: dict[str, Any] = {"ok": True, "rdmaio": rdmaio.__version__}
        region = bytearray(size) if mode in ONE_SIDED else None
        if region is not None:
            access = {"read": "r", "write": "w", "atomic": "a"}[mode]
            try:
                key = self._export(ep, region, access)
            except PerfRefusedError as exc:
                self.refused += 1
                self.runs -= 1
                self._say(f"{peer}: refused: {exc}")
                await self._refuse(ep, exc)
                return
            accept["key"] = bytes(key).hex()
        self._say(f"{peer}: {mode} {format_size(size)} for {request.seconds:g} s")
        await ep.send(_control(accept))
        async with asyncio.timeout(request.seconds + self.limits.grace):
            report = await _SERVE_MODE[mode](ep, region)
        await ep.send(_control({"report": report}))
        await self._close(ep)
        received = report.get("bytes")
        rate = f", {format_rate(received / report['seconds'])}" if received and report["seconds"] > 0 else ""
        counted = "".join(f", {v} {k}" for k, v in report.items() if k != "seconds")
        self._say(f"{peer}: {mode} {format_size(size)} done in {report['seconds']:.3f} s{counted}{rate}")


async def _serve_message(ep: rdmaio.Endpoint, region: bytearray | None) -> dict[str, Any]:
    recv = ep.recv
    messages = received = 0
    first = time.perf_counter()
    while (msg := await recv()) is not None:
        if not messages:
            first = time.perf_counter()
        messages += 1
        received += len(msg)
    return {"bytes": received, "messages": messages, "seconds": time.perf_counter() - first}


async def _serve_stream(ep: rdmaio.Endpoint, region: bytearray | None) -> dict[str, Any]:
    read = ep.read
    reads = received = 0
    first = time.perf_counter()
    while chunk := await read(1 << 20):
        if not reads:
            first = time.perf_counter()
        reads += 1
        received += len(chunk)
    return {"bytes": received, "reads": reads, "seconds": time.perf_counter() - first}


async def _serve_echo(ep: rdmaio.Endpoint, region: bytearray | None) -> dict[str, Any]:
    recv, send = ep.recv, ep.send
    messages = received = 0
    first = time.perf_counter()
    while (msg := await recv()) is not None:
        if not messages:
            first = time.perf_counter()
        await send(msg)
        messages += 1
        received += len(msg)
    return {"bytes": received, "messages": messages, "seconds": time.perf_counter() - first}


async def _serve_onesided(ep: rdmaio.Endpoint, region: bytearray | None) -> dict[str, Any]:
    start = time.perf_counter()
    if await ep.recv() is not None:
        raise PerfProtocolError("the client sent a message during a one-sided run")
    report: dict[str, Any] = {"seconds": time.perf_counter() - start}
    if region is not None and len(region) == ATOMIC_SIZE:
        # The fetch-and-adds landed in this u64 (in this host's byte order, as the NIC applies them).
        report["counter"] = int.from_bytes(region, sys.byteorder)
    return report


_SERVE_MODE: dict[str, Callable[[rdmaio.Endpoint, bytearray | None], Awaitable[dict[str, Any]]]] = {
    "message": _serve_message,
    "stream": _serve_stream,
    "echo": _serve_echo,
    "read": _serve_onesided,
    "write": _serve_onesided,
    "atomic": _serve_onesided,
}


async def run_server(host: str, port: int, limits: ServerLimits, out: TextIO, err: TextIO) -> int:
    """Serve perf runs on ``host``:``port`` until SIGINT/SIGTERM; returns the exit status."""
    perf = PerfServer(limits, out)
    # Messages up to the largest run size are accepted (a header is far smaller).
    options = rdmaio.Options(max_message_size=max(limits.max_size, MAX_CONTROL))
    if not await serve_until_signalled("perf", perf.handle, host, port, options, out, err):
        return EXIT_CONNECT
    print(f"rdmaio perf server stopped after {perf.runs} runs ({perf.refused} refused)", file=out, flush=True)
    return EXIT_OK


# --- client ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """The client's settings (the command line's options)."""

    host: str
    port: int = DEFAULT_PORT
    modes: tuple[str, ...] = ("message",)
    sizes: tuple[int, ...] = (65536,)
    seconds: float = 10.0
    parallel: int = 1
    bind: str | None = None
    """Local address to connect from (``--bind``)."""
    timeout: float = 15.0
    """Seconds to wait for a connection, the server's answer to a header and its report."""
    json: bool = False
    loop: str = "auto"
    max_samples: int = MAX_SAMPLES
    """Latencies kept per connection and run; past it a uniform random sample of this many is kept."""

    def runs(self) -> list[tuple[str, int]]:
        """(mode, size) of every run, in order: each mode over every size (``atomic`` once, 8 bytes)."""
        runs: list[tuple[str, int]] = []
        for mode in self.modes:
            for size in (ATOMIC_SIZE,) if mode == "atomic" else self.sizes:
                runs.append((mode, size))
        return runs


@dataclass(slots=True)
class _Live:
    """What one connection has done so far (read once a second by the progress line)."""

    operations: int = 0


@dataclass(slots=True)
class ConnectionResult:
    """One connection's part of a run: what the client did and what the server reported."""

    operations: int
    """Messages sent, stream writes, round trips, READs, WRITEs or fetch-and-adds completed."""
    client_bytes: int
    """Bytes the client sent (message, stream, echo: each way) or moved (one-sided)."""
    seconds: float
    """From the run's start to the server's report (message, stream) or the last operation (others)."""
    server: dict[str, Any]
    """The server's report: ``bytes``/``messages`` received (message, echo), ``bytes``/``reads`` (stream),
    ``counter`` (atomic), ``seconds`` (its own view of the run)."""
    latencies: array.array[float] = field(default_factory=lambda: array.array("d"))
    """Each operation's latency in seconds (the latency modes)."""

    def figure_bytes(self, mode: str) -> int:
        """The bytes the bandwidth is made of: those the server received for message and stream, else
        those the client moved."""
        if mode in ("message", "stream"):
            return int(self.server.get("bytes", 0))
        return self.client_bytes

    def as_dict(self, mode: str) -> dict[str, Any]:
        """This connection's JSON form."""
        seconds = self.seconds or math.inf
        ops = int(self.server.get("messages", 0)) if mode == "message" else self.operations
        figure = self.figure_bytes(mode)
        return {
            "operations": self.operations,
            "bytes": figure,
            "client_bytes": self.client_bytes,
            "seconds": self.seconds,
            "bytes_per_second": figure / seconds,
            "operations_per_second": ops / seconds,
            "server": dict(self.server),
        }


@dataclass(slots=True)
class RunResult:
    """One run (a mode and a size over ``parallel`` connections)."""

    mode: str
    size: int
    seconds: float
    """The duration asked for."""
    connections: list[ConnectionResult]

    def as_dict(self) -> dict[str, Any]:
        """The run's entry in ``results`` of the JSON document (documented in docs/cli.md)."""
        per = [c.as_dict(self.mode) for c in self.connections]
        server: dict[str, Any] = {}
        for c in self.connections:
            for name, value in c.server.items():
                if name == "seconds":
                    server[name] = max(server.get(name, 0.0), value)
                elif isinstance(value, int):
                    server[name] = server.get(name, 0) + value
        latencies: list[float] = []
        for c in self.connections:
            latencies.extend(c.latencies)
        return {
            "mode": self.mode,
            "size": self.size,
            "time": self.seconds,
            "parallel": len(self.connections),
            "seconds": max((c.seconds for c in self.connections), default=0.0),
            "operations": sum(c.operations for c in self.connections),
            "bytes": sum(p["bytes"] for p in per),
            "client_bytes": sum(c.client_bytes for c in self.connections),
            "bytes_per_second": sum(p["bytes_per_second"] for p in per),
            "bits_per_second": 8 * sum(p["bytes_per_second"] for p in per),
            "operations_per_second": sum(p["operations_per_second"] for p in per),
            "latency_us": latency_summary(latencies) if self.mode in LATENCY_MODES else None,
            "server": server,
            "connections": per,
        }


class _Stop:
    """Set once the run's time is up (by a timer: the hot loops test an attribute, not a clock)."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False


_YIELD_MASK = 255
"""The one-way loops let the event loop run every 256 operations: ``send()`` and ``drain()`` return without
suspending below the write high-water mark, and without a turn of the loop neither is the run's timer
called (the run would go on until the queue next filled) nor are the frames queued so far posted while
the coroutine keeps writing."""


def _reservoir(samples: array.array[float], seen: int, value: float) -> None:
    """Keep ``value``, the ``seen + 1``-th sample, with the probability ``len(samples) / (seen + 1)`` in
    place of a random one (Vitter's algorithm R): every sample stays equally likely to be kept."""
    slot = random.randrange(seen + 1)
    if slot < len(samples):
        samples[slot] = value


async def _recv_within(ep: rdmaio.Endpoint, wait: float, what: str) -> bytes | None:
    try:
        async with asyncio.timeout(wait):
            return await ep.recv()
    except TimeoutError as exc:
        if isinstance(exc, RdmaError):
            raise
        raise rdmaio.TimeoutError(f"{what} within {wait:g} s") from exc


async def _exchange(ep: rdmaio.Endpoint, request: RunRequest, wait: float) -> dict[str, Any]:
    """Send the header, return the server's acceptance (raise :class:`PerfRefusedError` on a refusal)."""
    await ep.send(request.encode())
    answer = _decode_control(
        await _recv_within(ep, wait, "no answer to the header"), "an answer to the header"
    )
    if answer.get("ok") is not True:
        raise PerfRefusedError(str(answer.get("reason", "?")), str(answer.get("error", "refused")))
    return answer


async def _report(ep: rdmaio.Endpoint, wait: float) -> dict[str, Any]:
    """End the run (EOF) and return the server's report."""
    ep.write_eof()
    body = _decode_control(await _recv_within(ep, wait, "no report after the run"), "its report")
    report = body.get("report")
    if not isinstance(report, dict):
        raise PerfProtocolError("the server's report is malformed")
    return {k: v for k, v in report.items() if isinstance(v, int | float) and not isinstance(v, bool)}


async def _measure_connection(
    ep: rdmaio.Endpoint,
    request: RunRequest,
    answer: dict[str, Any],
    stop: _Stop,
    live: _Live,
    start: float,
    wait: float,
    keep: int = MAX_SAMPLES,
) -> ConnectionResult:
    """Run ``request.mode`` on ``ep`` until ``stop``; return what was done and the server's report."""
    mode, size = request.mode, request.size
    clock = time.perf_counter
    latencies: array.array[float] = array.array("d")
    operations = 0
    if mode == "message":
        send, payload = ep.send, bytes(size)
        while True:  # at least one operation, even if the timer fired before the first
            await send(payload)
            operations += 1
            live.operations = operations
            if not operations & _YIELD_MASK:
                await asyncio.sleep(0)
            if not stop.running:
                break
    elif mode == "stream":
        write, drain, chunk = ep.write, ep.drain, bytes(size)
        while True:  # at least one operation, even if the timer fired before the first
            write(chunk)
            await drain()
            operations += 1
            live.operations = operations
            if not operations & _YIELD_MASK:
                await asyncio.sleep(0)
            if not stop.running:
                break
    elif mode == "echo":
        send, recv, payload = ep.send, ep.recv, bytes(size)
        append = latencies.append
        while True:  # at least one operation, even if the timer fired before the first
            began = clock()
            await send(payload)
            reply = await recv()
            ended = clock()
            if reply is None or len(reply) != size:
                what = "closed the connection" if reply is None else f"echoed {len(reply)} bytes, not {size}"
                raise PerfProtocolError(f"the server {what} during an echo run")
            if operations < keep:
                append(ended - began)
            else:
                _reservoir(latencies, operations, ended - began)
            operations += 1
            live.operations = operations
            if not stop.running:
                break
    else:
        try:
            key = rdmaio.RemoteKey.from_bytes(bytes.fromhex(str(answer.get("key", ""))))
        except ValueError as exc:  # InvalidRemoteKeyError is one too
            raise PerfProtocolError(f"the server's key for the {mode} run is malformed: {exc}") from exc
        # One loop for the three modes: a bound method and its arguments (the extra call per operation
        # is tens of nanoseconds, against microseconds for the operation itself).
        operation: Callable[..., Awaitable[object]]
        arguments: tuple[object, ...]
        if mode == "read":
            operation, arguments = ep.rdma_read_into, (key, 0, bytearray(size))
        elif mode == "write":
            operation, arguments = ep.rdma_write, (key, 0, bytes(size))
        else:
            operation, arguments = ep.fetch_add, (key, 0, 1)
        append = latencies.append
        while True:  # at least one operation, even if the timer fired before the first
            began = clock()
            await operation(*arguments)
            if operations < keep:
                append(clock() - began)
            else:
                _reservoir(latencies, operations, clock() - began)
            operations += 1
            live.operations = operations
            if not stop.running:
                break
    ended = clock()
    report = await _report(ep, wait)
    if mode in ("message", "stream"):
        ended = clock()  # what was queued at the deadline counts once the server has it
    return ConnectionResult(operations, operations * size, ended - start, report, latencies)


Connector = Callable[[str, int, str | None, float], Awaitable[rdmaio.Endpoint]]
"""How the client opens a connection: ``(host, port, bind, timeout) -> Endpoint`` (tests replace it)."""


async def _rdmaio_connect(host: str, port: int, bind: str | None, wait: float) -> rdmaio.Endpoint:
    local = (bind, 0) if bind else None
    return await rdmaio.connect(host, port, timeout=wait, local_addr=local)


class _Progress:
    """The live line on a terminal: rewritten in place once a second with plain ANSI (no rich)."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self._handle: asyncio.TimerHandle | None = None

    def start(self, mode: str, size: int, seconds: float, lives: list[_Live], start: float) -> None:
        if self.stream is None:
            return
        loop = asyncio.get_running_loop()

        def tick() -> None:
            elapsed = time.perf_counter() - start
            ops = sum(live.operations for live in lives)
            rate = ops / elapsed if elapsed > 0 else 0.0
            bandwidth = format_rate(rate * (size if mode != "atomic" else ATOMIC_SIZE))
            line = (
                f"{mode} {format_size(size)}: {min(elapsed, seconds):.0f}/{seconds:g} s  "
                f"{format_count(rate)} ops/s  {bandwidth} (client side)"
            )
            assert self.stream is not None
            self.stream.write(f"\r\x1b[2K{line}")
            self.stream.flush()
            self._handle = loop.call_later(1.0, tick)

        self._handle = loop.call_later(1.0, tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.stream is not None:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


async def measure(
    config: ClientConfig,
    mode: str,
    size: int,
    *,
    connect: Connector = _rdmaio_connect,
    progress: _Progress | None = None,
    on_first: Callable[[rdmaio.Endpoint], None] | None = None,
) -> RunResult:
    """One run: ``config.parallel`` connections, each sends the header, then all measure ``mode`` at
    ``size`` for ``config.seconds`` at once; returns their results. ``on_first`` sees the first
    connection (for the path record). Raises what failed (:class:`PerfRefusedError` for a refusal)."""
    request_size = ATOMIC_SIZE if mode == "atomic" else size
    connecting = [
        asyncio.ensure_future(connect(config.host, config.port, config.bind, config.timeout))
        for _ in range(config.parallel)
    ]
    endpoints: list[rdmaio.Endpoint] = []
    try:
        done = await asyncio.gather(*connecting, return_exceptions=True)
        endpoints = [ep for ep in done if isinstance(ep, rdmaio.Endpoint)]
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
        if on_first is not None:
            on_first(endpoints[0])
        requests = [
            RunRequest(mode, request_size, config.seconds, i, config.parallel) for i in range(config.parallel)
        ]
        answers = await _gather_all(
            [_exchange(ep, req, config.timeout) for ep, req in zip(endpoints, requests, strict=True)]
        )
        stop, lives = _Stop(), [_Live() for _ in endpoints]
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        timer = loop.call_later(config.seconds, stop.stop)
        if progress is not None:
            progress.start(mode, request_size, config.seconds, lives, start)
        try:
            results = await _gather_all(
                [
                    _measure_connection(
                        ep, req, answer, stop, live, start, config.timeout, config.max_samples
                    )
                    for ep, req, answer, live in zip(endpoints, requests, answers, lives, strict=True)
                ]
            )
        finally:
            timer.cancel()
            if progress is not None:
                progress.stop()
        await asyncio.gather(*(ep.aclose() for ep in endpoints), return_exceptions=True)
        return RunResult(mode, request_size, config.seconds, results)
    except BaseException:
        for future in connecting:
            if not future.done():
                future.cancel()
            elif not future.cancelled() and future.exception() is None:
                # Made, but the wait for the others was interrupted: without this it would stay open
                # (and hold the server's slot until its header deadline).
                future.result().abort()
        for ep in endpoints:
            ep.abort()
        raise


async def _gather_all(coros: Sequence[Awaitable[_T]]) -> list[_T]:
    """Run ``coros`` as tasks; the first failure cancels the others and is raised (a refusal first)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    refusals = [e for e in errors if isinstance(e, PerfRefusedError)]
    if refusals or errors:
        raise (refusals or errors)[0]  # type: ignore[misc]
    return [t.result() for t in tasks]


def _extra(ep: Any, name: str) -> Any:
    """``ep.get_extra_info(name)``, None when it cannot be had (the path record must not stop a run)."""
    try:
        return ep.get_extra_info(name)
    except Exception:  # e.g. a device query failing: the record shows the field as null
        return None


def path_record(ep: Any) -> tuple[str, dict[str, Any]]:
    """The path of a connection: its lines for humans (the first starts with ``path:``) and a dict for
    ``--json``.

    ``ep.get_extra_info("rdma")`` (a ``rdmaio.PathInfo`` with ``describe()``) where rdmaio has it; else
    the older extra-info keys (device, port, MTU, max inline, QP number).
    """
    info = _extra(ep, "rdma")
    describe = getattr(info, "describe", None)
    if callable(describe):
        described = str(describe())
        text = described if described.startswith("path") else f"path: {described}"
        as_dict = getattr(info, "as_dict", None)
        if callable(as_dict):
            record = dict(as_dict())
        elif dataclasses.is_dataclass(info) and not isinstance(info, type):
            record = dataclasses.asdict(info)
        else:
            record = {"describe": described}
        return text, json.loads(json.dumps(record, default=str))
    record = {name: _extra(ep, name) for name in ("device", "port", "mtu", "max_inline", "qp_num")}
    for name in ("sockname", "peername"):
        value = _extra(ep, name)
        record[name] = list(value) if isinstance(value, tuple) else value
    text = f"path: {record['device']} port {record['port']}, MTU {record['mtu']}"
    text += f", max inline {record['max_inline']}"
    return text, json.loads(json.dumps(record, default=str))


def render_table(results: Sequence[dict[str, Any]]) -> str:
    """The summary table of the runs' JSON entries (:meth:`RunResult.as_dict`)."""
    header = [
        "mode",
        "size",
        "conns",
        "seconds",
        "ops",
        "ops/s",
        "bandwidth",
        "p50 us",
        "p90",
        "p99",
        "p99.9",
        "max",
    ]
    rows = [header]
    for r in results:
        lat = r["latency_us"]
        cells = [
            r["mode"],
            format_size(r["size"]),
            str(r["parallel"]),
            f"{r['seconds']:.2f}",
            str(r["operations"]),
            format_count(r["operations_per_second"]),
            format_rate(r["bytes_per_second"]),
        ]
        cells += [f"{lat[k]:.1f}" for k in ("p50", "p90", "p99", "p99.9", "max")] if lat else ["-"] * 5
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(line.rstrip() for line in lines)


def _describe_failure(exc: BaseException, config: ClientConfig) -> tuple[int, str, str]:
    """(exit status, error kind, one line) for what stopped the client."""
    host, port = config.host, config.port
    where = f"{host} port {port}"
    if isinstance(exc, PerfRefusedError):
        return EXIT_REFUSED, "refused", f"{where}: the server refused the run: {exc.message}"
    if isinstance(exc, rdmaio.ConnectionRefusedError):
        return (
            EXIT_CONNECT,
            "no-server",
            f"{where}: no perf server is listening there "
            f"(start one with: python -m rdmaio perf --server {host} {port})",
        )
    if isinstance(exc, NotPerfServerError):
        return EXIT_CONNECT, "not-perf-server", f"{where}: {exc}"
    if isinstance(exc, PerfProtocolError):
        return EXIT_RUN_FAILED, "protocol", f"{where}: {exc}"
    return EXIT_RUN_FAILED, "connection", describe_error(exc, host, port)


async def run_client(
    config: ClientConfig,
    out: TextIO,
    err: TextIO,
    *,
    connect: Connector = _rdmaio_connect,
    progress: TextIO | None = None,
) -> int:
    """Every run of ``config`` in turn; print the path, then the table (or the JSON document); returns the
    exit status. ``progress``: where the live line goes (a terminal), None for none."""
    path: dict[str, Any] | None = None
    results: list[dict[str, Any]] = []
    error: dict[str, str] | None = None
    status = EXIT_OK
    target = f"{config.host} port {config.port}"

    def first_connection(ep: rdmaio.Endpoint) -> None:
        nonlocal path
        if path is None:
            text, path = path_record(ep)
            if not config.json:
                print(f"rdmaio perf to {target}", file=out)
                print(text, file=out, flush=True)

    task = asyncio.current_task()
    assert task is not None
    undo = on_signals(task.cancel)
    ticker = _Progress(progress if not config.json else None)
    try:
        for mode, size in config.runs():
            run = await measure(
                config, mode, size, connect=connect, progress=ticker, on_first=first_connection
            )
            results.append(run.as_dict())
    except asyncio.CancelledError:
        task.uncancel()
        status, error = EXIT_INTERRUPTED, {"kind": "interrupted", "message": "interrupted"}
        print("rdmaio perf: interrupted", file=err, flush=True)
    except (OSError, RdmaError, TimeoutError) as exc:
        status, kind, line = _describe_failure(exc, config)
        if not results and path is None and status == EXIT_RUN_FAILED:
            status = EXIT_CONNECT  # no connection was made at all
        error = {"kind": kind, "message": line}
        print(f"rdmaio perf: {line}", file=err, flush=True)
    finally:
        undo()
    if config.json:
        document = {
            "schema": SCHEMA,
            "rdmaio": rdmaio.__version__,
            "server": {"host": config.host, "port": config.port},
            "path": path,
            "options": {
                "modes": list(config.modes),
                "sizes": list(config.sizes),
                "time": config.seconds,
                "parallel": config.parallel,
                "bind": config.bind,
                "loop": config.loop,
            },
            "results": results,
            "error": error,
        }
        print(json.dumps(document, indent=2), file=out, flush=True)
    elif results:
        print(render_table(results), file=out, flush=True)
    return status


# --- command line ----------------------------------------------------------------------------------------


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text}")
        return value

    return parse


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return wrapped


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``perf`` (client and ``--server``)."""
    parser = argparse.ArgumentParser(
        prog="rdmaio perf",
        description="Throughput and latency between two hosts over rdmaio (client), or serve them "
        "(--server).",
    )
    parser.add_argument(
        "host", metavar="HOST", nargs="?", help="the server (client); the address to listen on (--server)"
    )
    parser.add_argument(
        "port", metavar="PORT", nargs="?", type=int, default=DEFAULT_PORT, help=f"({DEFAULT_PORT})"
    )
    parser.add_argument("--server", action="store_true", help="serve perf runs until interrupted")
    client = parser.add_argument_group("client")
    client.add_argument(
        "--mode",
        type=_arg(parse_modes),
        default=["message"],
        metavar="MODES",
        help=f"comma-separated: {', '.join(MODES)}, or all (message)",
    )
    client.add_argument(
        "--size",
        type=_arg(parse_sizes),
        default=[65536],
        metavar="SIZES",
        help="comma-separated bytes per message/operation, K/M/G suffixes (64K)",
    )
    client.add_argument("--time", type=_positive(float), default=10.0, metavar="SECONDS", help="per run (10)")
    client.add_argument(
        "--parallel", "-P", type=_positive(int), default=1, metavar="N", help="connections (1)"
    )
    client.add_argument("--bind", "-B", metavar="ADDR", help="local address to connect from")
    client.add_argument(
        "--timeout",
        type=_positive(float),
        default=15.0,
        metavar="SECONDS",
        help="connect and control-message wait (15)",
    )
    client.add_argument(
        "--json", action="store_true", help="print one JSON document and nothing else on stdout"
    )
    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop (auto: uvloop if installed)",
    )
    limits = ServerLimits()
    server = parser.add_argument_group("server limits")
    server.add_argument(
        "--max-clients",
        type=_positive(int),
        default=limits.max_clients,
        metavar="N",
        help=f"runs served at once ({limits.max_clients})",
    )
    server.add_argument(
        "--max-size",
        type=_arg(parse_size),
        default=limits.max_size,
        metavar="SIZE",
        help="largest size of a run (64M)",
    )
    server.add_argument(
        "--max-exported",
        type=_arg(parse_size),
        default=limits.max_exported,
        metavar="SIZE",
        help="bytes exported to one-sided runs at once (256M)",
    )
    server.add_argument(
        "--max-time",
        type=_positive(float),
        default=limits.max_time,
        metavar="SECONDS",
        help=f"longest run ({limits.max_time:g})",
    )
    return parser


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """Run the perf client (or the server); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        factory = _loop_factory(args.loop)
    except ImportError:
        parser.error("--loop uvloop: uvloop is not installed (pip install rdmaio[uvloop])")
    if args.server:
        limits = ServerLimits(
            max_clients=int(args.max_clients),
            max_size=args.max_size,
            max_exported=args.max_exported,
            max_time=args.max_time,
        )
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(run_server(args.host or "0.0.0.0", args.port, limits, sys.stdout, sys.stderr))
    if args.host is None:
        parser.error("HOST is required (the address of a perf server), or --server to serve")
    config = ClientConfig(
        host=args.host,
        port=args.port,
        modes=tuple(args.mode),
        sizes=tuple(args.size),
        seconds=float(args.time),
        parallel=int(args.parallel),
        bind=args.bind,
        timeout=float(args.timeout),
        json=args.json,
        loop=args.loop,
    )
    progress = sys.stderr if sys.stderr.isatty() and not args.json else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run_client(config, sys.stdout, sys.stderr, progress=progress))
