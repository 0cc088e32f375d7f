"""Parsers of the reports printed by perftest (``ib_send_bw``, ``ib_write_bw``, ``ib_send_lat``), rstream
and the native setup loop ``cm_setup``.

Units, as the tools define them:

* perftest bandwidth tests print ``BW average[MB/sec]``, where perftest's "MB" is 2**20 bytes (its
  ``--help`` says so: "MiB=2^20 byte"), and ``MsgRate[Mpps]`` in 10**6 messages per second. With
  ``--report_gbits`` the bandwidth is in 10**9 bit/s.
* ``ib_send_lat`` prints **one-way** latencies: half of each measured round trip (perftest divides SEND
  ping-pong times by two). The round trip is twice ``t_typical`` (perftest's median) and twice the 99 %
  percentile.
* rstream prints, per test, the total bytes moved in both directions, the elapsed seconds, ``Gb/sec``
  (10**9 bit/s) and ``usec/xfer`` (elapsed time divided by the number of one-way transfers). A latency
  test (``-C 1``) is a ping-pong, so its round trip is twice ``usec/xfer`` (a mean: rstream gives no
  percentiles).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "CmSetupResult",
    "ParseError",
    "PerftestBandwidth",
    "PerftestLatency",
    "RstreamResult",
    "parse_cm_setup",
    "parse_perftest_bw",
    "parse_perftest_lat",
    "parse_rstream",
]

MIB = 1 << 20


class ParseError(ValueError):
    """A tool's output did not contain the expected report."""


_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def _numbers(line: str) -> list[float] | None:
    """All fields of ``line`` as floats, or None when any field is not a number.

    Raises ParseError for ``inf``/``nan`` (perftest prints them when its clock calibration fails).
    """
    fields = line.split()
    if not fields:
        return None
    try:
        values = [float(f) for f in fields]
    except ValueError:
        return None
    if not all(math.isfinite(v) for v in values):
        raise ParseError(f"non-finite values in the result line: {line.strip()!r}")
    return values


@dataclass(frozen=True, slots=True)
class PerftestBandwidth:
    """The result line of ``ib_send_bw`` / ``ib_write_bw``."""

    size: int
    iterations: int
    bw_peak_bytes_per_s: float
    bw_average_bytes_per_s: float
    msg_rate_mpps: float

    @property
    def msgs_per_s(self) -> float:
        """Message rate in messages per second."""
        if self.msg_rate_mpps < 0.001 and self.size > 0:
            # perftest prints MsgRate in Mpps with 6 decimals: large messages on a slow link round to 0 or
            # to 1 msg/s; the average bandwidth over the size is exact.
            return self.bw_average_bytes_per_s / self.size
        return self.msg_rate_mpps * 1e6


def parse_perftest_bw(text: str) -> PerftestBandwidth:
    """Parse the report of a perftest bandwidth test (the first result line after the header)."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if "#bytes" not in line or "BW average" not in line:
            continue
        if "[Gb/sec]" in line:
            scale = 1e9 / 8
        elif "[MB/sec]" in line or "[MiB/sec]" in line:
            scale = float(MIB)
        else:
            raise ParseError(f"unknown bandwidth unit in perftest header: {line.strip()!r}")
        for row in lines[index + 1 :]:
            values = _numbers(row)
            if values is None:
                if row.strip() and not set(row.strip()) <= {"-"}:
                    break
                continue
            if len(values) < 5:
                raise ParseError(f"short perftest result line: {row.strip()!r}")
            return PerftestBandwidth(
                size=int(values[0]),
                iterations=int(values[1]),
                bw_peak_bytes_per_s=values[2] * scale,
                bw_average_bytes_per_s=values[3] * scale,
                msg_rate_mpps=values[4],
            )
        raise ParseError("perftest bandwidth header found but no result line follows")
    raise ParseError("no perftest bandwidth report (#bytes ... BW average) in the output")


@dataclass(frozen=True, slots=True)
class PerftestLatency:
    """The result line of ``ib_send_lat`` (all times one-way, in microseconds)."""

    size: int
    iterations: int
    t_min_us: float
    t_max_us: float
    t_typical_us: float
    t_avg_us: float
    t_stdev_us: float
    p99_us: float
    p999_us: float

    @property
    def rtt_p50_us(self) -> float:
        """Round trip from the typical (median) one-way latency."""
        return 2 * self.t_typical_us

    @property
    def rtt_p99_us(self) -> float:
        """Round trip from the 99 % percentile one-way latency."""
        return 2 * self.p99_us

    @property
    def rtt_mean_us(self) -> float:
        """Round trip from the average one-way latency."""
        return 2 * self.t_avg_us


def parse_perftest_lat(text: str) -> PerftestLatency:
    """Parse the report of ``ib_send_lat`` (without ``--output``; full table with percentiles)."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if "#bytes" not in line or "t_typical" not in line:
            continue
        for row in lines[index + 1 :]:
            values = _numbers(row)
            if values is None:
                if row.strip() and not set(row.strip()) <= {"-"}:
                    break
                continue
            if len(values) < 9:
                raise ParseError(f"short perftest latency line: {row.strip()!r}")
            return PerftestLatency(int(values[0]), int(values[1]), *values[2:9])
        raise ParseError("perftest latency header found but no result line follows")
    raise ParseError("no perftest latency report (#bytes ... t_typical) in the output")


@dataclass(frozen=True, slots=True)
class RstreamResult:
    """One result line of rstream."""

    name: str
    size_field: str
    seconds: float
    gbit_per_s: float
    usec_per_xfer: float

    def bytes_per_s(self, size: int) -> float:
        """Throughput in bytes/s for transfers of ``size`` bytes, from the more precise printed figure.

        Both printed figures are rounded to two decimals; this picks the one with more significant
        digits (``Gb/sec`` at high rates, ``usec/xfer`` when each transfer takes long).
        """
        from_gbit = self.gbit_per_s * 1e9 / 8
        from_usec = size / (self.usec_per_xfer * 1e-6) if self.usec_per_xfer > 0 else 0.0
        if self.usec_per_xfer >= self.gbit_per_s and from_usec > 0:
            return from_usec
        if from_gbit > 0:
            return from_gbit
        return from_usec

    @property
    def rtt_us(self) -> float:
        """Round trip of a ping-pong (``-C 1``) test: two one-way transfers."""
        return 2 * self.usec_per_xfer


_RSTREAM_LINE = re.compile(
    rf"^(?P<name>\S+)\s+(?P<size>\S+).*?\s(?P<sec>{_NUMBER})s\s*(?P<gbps>{_NUMBER})\s+(?P<usec>{_NUMBER})\s*$"
)


def parse_rstream(text: str) -> RstreamResult:
    """Parse rstream's output: the first result line after its ``name bytes xfers ...`` header."""
    seen_header = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("name") and "usec/xfer" in stripped:
            seen_header = True
            continue
        if not seen_header or not stripped:
            continue
        match = _RSTREAM_LINE.match(stripped)
        if match and "nan" not in stripped and "inf" not in stripped:
            return RstreamResult(
                name=match["name"],
                size_field=match["size"],
                seconds=float(match["sec"]),
                gbit_per_s=float(match["gbps"]),
                usec_per_xfer=float(match["usec"]),
            )
    if not seen_header:
        raise ParseError("no rstream report header (name bytes xfers iters total time Gb/sec usec/xfer)")
    raise ParseError("rstream header found but no result line follows")


@dataclass(frozen=True, slots=True)
class CmSetupResult:
    """The report line of the native setup loop (``bench/native/cm_setup.c``)."""

    connections: int
    seconds: float
    rate: float
    """Connections per second, as the tool computed it (``connections / seconds``)."""
    echo: bool
    """Whether each connection echoed its 16 bytes (the rdmaio setup workload does)."""


_CM_SETUP_LINE = re.compile(
    rf"^cm_setup connections (?P<n>\d+) seconds (?P<sec>{_NUMBER}) rate (?P<rate>{_NUMBER})"
    r" echo (?P<echo>[01])\s*$"
)


def parse_cm_setup(text: str) -> CmSetupResult:
    """Parse the client's ``cm_setup connections N seconds S rate R echo E`` line."""
    for line in text.splitlines():
        match = _CM_SETUP_LINE.match(line.strip())
        if match is None:
            continue
        result = CmSetupResult(
            connections=int(match["n"]),
            seconds=float(match["sec"]),
            rate=float(match["rate"]),
            echo=match["echo"] == "1",
        )
        if result.connections <= 0 or result.seconds <= 0 or not math.isfinite(result.rate):
            raise ParseError(f"cm_setup measured nothing: {line.strip()!r}")
        return result
    raise ParseError("no 'cm_setup connections N seconds S rate R echo E' line in the output")
