"""What the benchmark measures: workloads, sizes, contenders, budgets, and the result records."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "CONTENDERS",
    "CONTENDER_GROUPS",
    "ECHO_SIZES",
    "FULL",
    "MEMORY_COUNTS",
    "ONESIDED_SIZES",
    "ONESIDED_WORKLOADS",
    "QUICK",
    "SETUP_SIZE",
    "SIZES",
    "THROUGHPUT_WORKLOADS",
    "WORKLOAD_GROUPS",
    "Budget",
    "Contender",
    "Figure",
    "Sample",
    "Workload",
    "expand_workloads",
    "format_size",
    "format_what",
    "parse_size",
    "resolve_contenders",
]

KiB = 1024
MiB = 1024 * KiB

SIZES: tuple[int, ...] = (64, 4 * KiB, 64 * KiB, MiB, 16 * MiB)
"""Message/chunk sizes of the stream and message workloads."""
ECHO_SIZES: tuple[int, ...] = (64, 4 * KiB)
"""Sizes of the echo (round-trip latency) workload."""
SETUP_SIZE = 16
"""Bytes echoed once on each connection of the setup workload."""
MEMORY_COUNTS: tuple[int, ...] = (1, 100, 1000)
"""Idle connections held open by the memory workload (its "size" is a connection count)."""


class Workload(StrEnum):
    """The workloads."""

    STREAM = "stream"
    """One-way byte stream, writer to reader: bytes/s."""
    MESSAGE = "message"
    """Messages sent back to back (a pipeline of outstanding sends): messages/s."""
    ECHO = "echo"
    """Ping-pong of one message: round-trip time, p50 and p99."""
    SETUP = "setup"
    """Sequential connect + one 16 B echo + close: connections/s."""
    MEMORY = "memory"
    """Registered bytes and RSS growth per idle connection, server and client side (lower is better)."""
    RDMA_WRITE = "rdma_write"
    """One-sided RDMA WRITE bandwidth, several in flight (:mod:`bench.onesided`): bytes/s."""
    RDMA_READ = "rdma_read"
    """One-sided RDMA READ bandwidth, several in flight: bytes/s."""
    FETCH_ADD = "fetch_add"
    """Remote atomic fetch-and-add rate, several in flight: operations/s."""
    FETCH_ADD_MANY = "fetch_add_many"
    """The same rate with ``fetch_add_many`` (batches posted as one chain): operations/s."""
    READ_LAT = "read_lat"
    """One RDMA READ at a time: round-trip time, p50 and p99."""


ONESIDED_WORKLOADS: tuple[Workload, ...] = (
    Workload.RDMA_WRITE,
    Workload.RDMA_READ,
    Workload.FETCH_ADD,
    Workload.FETCH_ADD_MANY,
    Workload.READ_LAT,
)
"""The one-sided workloads (``--only onesided``)."""
WORKLOAD_GROUPS: dict[str, tuple[Workload, ...]] = {"onesided": ONESIDED_WORKLOADS}
"""Names that ``--only`` expands to several workloads."""
ONESIDED_SIZES: tuple[int, ...] = (64 * 1024, 1024 * 1024)
"""Sizes of the one-sided bandwidth workloads (the fetch-and-add is 8 B, the READ round trip 64 B)."""


THROUGHPUT_WORKLOADS: tuple[Workload, ...] = (Workload.STREAM, Workload.MESSAGE, Workload.ECHO)
"""The data-path workloads (those of the ``uvloop_vs_asyncio`` geometric mean)."""


WORKLOAD_TITLES: dict[Workload, str] = {
    Workload.STREAM: "One-way stream throughput",
    Workload.MESSAGE: "Message rate (pipelined sends)",
    Workload.ECHO: "Echo round trip",
    Workload.SETUP: "Connection setup (connect + 16 B echo + close, sequential)",
    Workload.MEMORY: "Memory per idle connection",
    Workload.RDMA_WRITE: "One-sided RDMA WRITE bandwidth (pipelined)",
    Workload.RDMA_READ: "One-sided RDMA READ bandwidth (pipelined)",
    Workload.FETCH_ADD: "Remote fetch-and-add rate (pipelined)",
    Workload.FETCH_ADD_MANY: "Remote fetch-and-add rate (fetch_add_many batches)",
    Workload.READ_LAT: "RDMA READ round trip (one at a time)",
}
WORKLOAD_UNITS: dict[Workload, str] = {
    Workload.STREAM: "B/s",
    Workload.MESSAGE: "msg/s",
    Workload.ECHO: "us",
    Workload.SETUP: "conn/s",
    Workload.MEMORY: "B/conn",
    Workload.RDMA_WRITE: "B/s",
    Workload.RDMA_READ: "B/s",
    Workload.FETCH_ADD: "op/s",
    Workload.FETCH_ADD_MANY: "op/s",
    Workload.READ_LAT: "us",
}
HIGHER_IS_BETTER: dict[Workload, bool] = {
    Workload.STREAM: True,
    Workload.MESSAGE: True,
    Workload.ECHO: False,
    Workload.SETUP: True,
    Workload.MEMORY: False,
    Workload.RDMA_WRITE: True,
    Workload.RDMA_READ: True,
    Workload.FETCH_ADD: True,
    Workload.FETCH_ADD_MANY: True,
    Workload.READ_LAT: False,
}


def sizes_of(workload: Workload, memory_counts: tuple[int, ...] = MEMORY_COUNTS) -> tuple[int, ...]:
    """The sizes measured for ``workload`` (for the memory workload: its connection counts)."""
    if workload is Workload.ECHO:
        return ECHO_SIZES
    if workload is Workload.SETUP:
        return (SETUP_SIZE,)
    if workload is Workload.MEMORY:
        return memory_counts
    if workload in (Workload.FETCH_ADD, Workload.FETCH_ADD_MANY):
        return (8,)
    if workload is Workload.READ_LAT:
        return (64,)
    if workload in ONESIDED_WORKLOADS:
        return ONESIDED_SIZES
    return SIZES


@dataclass(frozen=True, slots=True)
class Contender:
    """One implementation under test."""

    name: str
    kind: str
    """``rdmaio``, ``tcp``, ``perftest``, ``rstream`` or ``cm_setup`` (the native rdma_cm setup loop)."""
    loop: str | None
    """Event loop of a Python contender (``asyncio`` or ``uvloop``)."""
    workloads: tuple[Workload, ...]
    rdma_baseline: bool
    """A native RDMA tool: a candidate for "best RDMA contender"."""
    description: str

    @property
    def python(self) -> bool:
        """True for the contenders implemented by this module (run as server/client subprocesses)."""
        return self.kind in ("rdmaio", "tcp")


_ALL = (
    Workload.STREAM,
    Workload.MESSAGE,
    Workload.ECHO,
    Workload.SETUP,
    Workload.MEMORY,
    *ONESIDED_WORKLOADS,
)
_TCP = (Workload.STREAM, Workload.MESSAGE, Workload.ECHO, Workload.SETUP)

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("rdmaio-asyncio", "rdmaio", "asyncio", _ALL, False, "rdmaio on the asyncio loop"),
        Contender("rdmaio-uvloop", "rdmaio", "uvloop", _ALL, False, "rdmaio on uvloop"),
        Contender("tcp-asyncio", "tcp", "asyncio", _TCP, False, "asyncio streams over TCP"),
        Contender("tcp-uvloop", "tcp", "uvloop", _TCP, False, "asyncio streams on uvloop over TCP"),
        Contender(
            "ib_send_bw",
            "perftest",
            None,
            (Workload.STREAM, Workload.MESSAGE),
            True,
            "perftest ib_send_bw -R (SEND, rdma_cm)",
        ),
        Contender(
            "ib_write_bw",
            "perftest",
            None,
            (Workload.STREAM, Workload.MESSAGE, Workload.RDMA_WRITE),
            True,
            "perftest ib_write_bw -R (RDMA WRITE, rdma_cm)",
        ),
        Contender(
            "ib_read_bw",
            "perftest",
            None,
            (Workload.STREAM, Workload.MESSAGE, Workload.RDMA_READ),
            True,
            "perftest ib_read_bw -R (RDMA READ, rdma_cm): rdma_read's contender, and the transfer rendezvous "
            "sends make",
        ),
        Contender(
            "ib_read_lat",
            "perftest",
            None,
            (Workload.READ_LAT,),
            True,
            "perftest ib_read_lat -R (one RDMA READ at a time)",
        ),
        Contender(
            "ib_atomic_bw",
            "perftest",
            None,
            (Workload.FETCH_ADD, Workload.FETCH_ADD_MANY),
            True,
            "perftest ib_atomic_bw -R (FETCH_AND_ADD)",
        ),
        Contender(
            "ib_send_lat", "perftest", None, (Workload.ECHO,), True, "perftest ib_send_lat -R (ping-pong)"
        ),
        Contender(
            "ib_send_lat-e",
            "perftest",
            None,
            (Workload.ECHO,),
            True,
            "perftest ib_send_lat -R -e (ping-pong, each side sleeping on its completion channel between "
            "messages, as rdmaio does; the default polls the CQ)",
        ),
        Contender(
            "rstream",
            "rstream",
            None,
            (Workload.STREAM, Workload.ECHO),
            True,
            "rsocket streams (rdmacm-utils rstream)",
        ),
        Contender(
            "cm_setup",
            "cm_setup",
            None,
            (Workload.SETUP,),
            True,
            "minimal C rdma_cm loop: connect + 16 B echo + disconnect (bench/native/cm_setup.c)",
        ),
    )
}

CONTENDER_GROUPS: dict[str, tuple[str, ...]] = {
    "all": tuple(CONTENDERS),
    "rdmaio": ("rdmaio-asyncio", "rdmaio-uvloop"),
    "tcp": ("tcp-asyncio", "tcp-uvloop"),
    "python": ("rdmaio-asyncio", "rdmaio-uvloop", "tcp-asyncio", "tcp-uvloop"),
    "perftest": ("ib_send_bw", "ib_write_bw", "ib_read_bw", "ib_send_lat", "ib_send_lat-e"),
    "native": (
        "ib_send_bw",
        "ib_write_bw",
        "ib_read_bw",
        "ib_send_lat",
        "ib_send_lat-e",
        "rstream",
        "cm_setup",
    ),
    "onesided": (
        "rdmaio-asyncio",
        "rdmaio-uvloop",
        "ib_write_bw",
        "ib_read_bw",
        "ib_read_lat",
        "ib_atomic_bw",
    ),
    "asyncio": ("rdmaio-asyncio", "tcp-asyncio"),
    "uvloop": ("rdmaio-uvloop", "tcp-uvloop"),
}


def resolve_contenders(spec: Iterable[str]) -> list[str]:
    """Expand contender names and group names (``rdmaio``, ``tcp``, ``perftest``, ...), keeping order."""
    names: list[str] = []
    for item in spec:
        item = item.strip()
        if not item:
            continue
        expanded = CONTENDER_GROUPS.get(item, (item,))
        for name in expanded:
            if name not in CONTENDERS:
                known = ", ".join([*CONTENDERS, *CONTENDER_GROUPS])
                raise ValueError(f"unknown contender {name!r} (known: {known})")
            if name not in names:
                names.append(name)
    return names


def expand_workloads(spec: Iterable[str]) -> list[Workload]:
    """Workload names and group names (``onesided``) as workloads, in order; ValueError when unknown."""
    chosen: list[Workload] = []
    for item in spec:
        item = item.strip()
        if not item:
            continue
        group = WORKLOAD_GROUPS.get(item)
        try:
            expanded = group if group is not None else (Workload(item),)
        except ValueError:
            known = ", ".join([*(str(w) for w in Workload), *WORKLOAD_GROUPS])
            raise ValueError(f"unknown workload {item!r} (known: {known})") from None
        chosen.extend(w for w in expanded if w not in chosen)
    return chosen


_SUFFIXES = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB}


def parse_size(text: str) -> int:
    """Parse ``64``, ``4K``, ``64KiB``, ``1M`` into bytes."""
    raw = text.strip().lower().replace(" ", "")
    digits = raw.rstrip("kmgib")
    suffix = raw[len(digits) :]
    if not digits.isdigit() or suffix not in _SUFFIXES:
        raise ValueError(f"bad size {text!r} (examples: 64, 4K, 64K, 1M)")
    return int(digits) * _SUFFIXES[suffix]


def format_size(size: int) -> str:
    """``64 B``, ``4 KiB``, ``64 KiB``, ``1 MiB``."""
    if size >= MiB and size % MiB == 0:
        return f"{size // MiB} MiB"
    if size >= KiB and size % KiB == 0:
        return f"{size // KiB} KiB"
    return f"{size} B"


def format_what(workload: Workload, size: int) -> str:
    """``64 B`` for a message size; ``100 connections`` for the memory workload's connection count."""
    if workload is Workload.MEMORY:
        return f"{size} connection{'s' if size != 1 else ''}"
    return format_size(size)


@dataclass(frozen=True, slots=True)
class Budget:
    """How much each measurement moves, and for how long at most."""

    name: str
    stream_bytes: Mapping[int, int]
    """Bytes written per one-way stream measurement, by chunk size."""
    message_bytes: Mapping[int, int]
    """Bytes sent as messages per message-rate measurement, by message size."""
    echo_iters: Mapping[int, int]
    """Round trips per echo measurement, by message size."""
    time_cap: float
    """Seconds after which a Python client stops early (it reports what it moved)."""
    reps: int
    """Repetitions per figure; the median is reported."""
    setup_conns: int = 2000
    """Connections per setup measurement (at most; :attr:`setup_seconds` usually ends it first)."""
    setup_seconds: float = 10.0
    """Seconds after which a setup measurement stops (every contender, the native one included): at
    about 10 connections/s under emulation the data-path time cap would leave too few to measure."""
    onesided_bytes: int = 32 * MiB
    """Bytes moved per one-sided READ or WRITE bandwidth measurement."""
    atomic_ops: int = 5000
    """Fetch-and-adds per atomic-rate measurement."""
    read_lat_iters: int = 1000
    """READs per READ round-trip measurement."""

    def amount(self, workload: Workload, size: int) -> int:
        """Operations of one measurement: writes, messages, round trips, connections (setup), or the
        connections held open (memory: the "size" is that count)."""
        if workload is Workload.SETUP:
            return max(1, self.setup_conns)
        if workload is Workload.MEMORY:
            return size
        if workload in (Workload.RDMA_WRITE, Workload.RDMA_READ):
            return max(5, self.onesided_bytes // size)
        if workload is Workload.FETCH_ADD:
            return max(5, self.atomic_ops)
        if workload is Workload.FETCH_ADD_MANY:  # batches go 5-10x faster: more for a stable figure
            return max(5, self.atomic_ops * 8)
        if workload is Workload.READ_LAT:
            return max(5, self.read_lat_iters)
        if workload is Workload.ECHO:
            return max(5, self.echo_iters.get(size, 1000))
        table = self.stream_bytes if workload is Workload.STREAM else self.message_bytes
        return max(5, table.get(size, 16 * MiB) // size)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "name": self.name,
            "stream_bytes": {str(k): v for k, v in self.stream_bytes.items()},
            "message_bytes": {str(k): v for k, v in self.message_bytes.items()},
            "echo_iters": {str(k): v for k, v in self.echo_iters.items()},
            "time_cap_s": self.time_cap,
            "reps": self.reps,
            "setup_conns": self.setup_conns,
            "setup_seconds": self.setup_seconds,
            "onesided_bytes": self.onesided_bytes,
            "atomic_ops": self.atomic_ops,
            "read_lat_iters": self.read_lat_iters,
        }


FULL = Budget(
    name="full",
    stream_bytes={64: 4 * MiB, 4 * KiB: 32 * MiB, 64 * KiB: 64 * MiB, MiB: 64 * MiB, 16 * MiB: 128 * MiB},
    message_bytes={64: 2 * MiB, 4 * KiB: 32 * MiB, 64 * KiB: 64 * MiB, MiB: 64 * MiB, 16 * MiB: 128 * MiB},
    echo_iters={64: 2000, 4 * KiB: 2000},
    time_cap=5.0,
    reps=3,
)
QUICK = Budget(
    name="quick",
    stream_bytes={64: 256 * KiB, 4 * KiB: 4 * MiB, 64 * KiB: 8 * MiB, MiB: 8 * MiB, 16 * MiB: 80 * MiB},
    message_bytes={64: 256 * KiB, 4 * KiB: 4 * MiB, 64 * KiB: 8 * MiB, MiB: 8 * MiB, 16 * MiB: 80 * MiB},
    echo_iters={64: 300, 4 * KiB: 300},
    time_cap=1.0,
    reps=1,
    setup_conns=500,
    setup_seconds=5.0,
    onesided_bytes=8 * MiB,
    atomic_ops=1000,
    read_lat_iters=300,
)


@dataclass(slots=True)
class Sample:
    """One repetition of one measurement (or its failure)."""

    ok: bool
    error: str | None = None
    bytes_per_s: float | None = None
    msgs_per_s: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    mean_us: float | None = None
    seconds: float | None = None
    ops: int | None = None
    """Writes, messages, round trips or connections completed."""
    conns_per_s: float | None = None
    """Setup workload: connections per second."""
    memory: dict[str, float] | None = None
    """Memory workload: what :func:`bench.memory.per_connection` computes (bytes per connection,
    server and client side), also on a failed sample when part of the connections were opened."""
    capped: bool = False
    """Stopped by the time cap before the budget was used up."""
    rdmaio: dict[str, float] | None = None
    """Loop wake-ups per operation and CQ batch sizes (rdmaio only)."""
    cpu_s_per_gib: float | None = None
    """CPU seconds (user + system) of both processes per GiB moved (stream and message workloads):
    ``getrusage`` of each side over its measurement for the Python contenders, ``RUSAGE_CHILDREN`` of the
    server and client processes (whole runs, setup included) for perftest."""
    note: str | None = None
    raw: str | None = None
    """Tail of a tool's output, kept for checking the parse."""

    def value(self, workload: Workload) -> float | None:
        """The primary figure: bytes/s, messages/s, p50 round trip (mean when no p50 exists),
        connections/s, or (memory) the larger of the server's and the client's registered bytes per
        connection."""
        if not self.ok:
            return None
        if workload is Workload.SETUP:
            return self.conns_per_s
        if workload is Workload.MEMORY:
            if self.memory is None:
                return None
            sides = [self.memory.get(f"registered_per_conn_{side}") for side in ("server", "client")]
            present = [v for v in sides if v is not None]
            return max(present) if present else None
        if workload in (Workload.STREAM, Workload.RDMA_WRITE, Workload.RDMA_READ):
            return self.bytes_per_s
        if workload in (Workload.MESSAGE, Workload.FETCH_ADD, Workload.FETCH_ADD_MANY):
            return self.msgs_per_s
        return self.p50_us if self.p50_us is not None else self.mean_us

    def to_json(self) -> dict[str, Any]:
        """JSON form (``None`` fields dropped)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sample:
        """Inverse of :meth:`to_json` (unknown keys ignored)."""
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def failure(cls, error: str, raw: str | None = None) -> Sample:
        """A failed measurement."""
        return cls(ok=False, error=error, raw=raw)


def median(values: Iterable[float | None]) -> float | None:
    """Median of the non-None values, or None."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass(slots=True)
class Figure:
    """All repetitions of one (contender, workload, size)."""

    contender: str
    workload: Workload
    size: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def ok_samples(self) -> list[Sample]:
        """The successful repetitions."""
        return [s for s in self.samples if s.ok]

    @property
    def status(self) -> str:
        """``ok`` (every repetition worked), ``partial`` (some did), ``error`` (none did)."""
        ok = len(self.ok_samples)
        if ok and ok == len(self.samples):
            return "ok"
        return "partial" if ok else "error"

    @property
    def errors(self) -> list[str]:
        """Distinct error messages of failed repetitions."""
        seen: list[str] = []
        for s in self.samples:
            if not s.ok and s.error and s.error not in seen:
                seen.append(s.error)
        return seen

    @property
    def value(self) -> float | None:
        """Median primary figure over the successful repetitions."""
        return median(s.value(self.workload) for s in self.ok_samples)

    def median_of(self, name: str) -> float | None:
        """Median of a Sample attribute over the successful repetitions."""
        return median(getattr(s, name) for s in self.ok_samples)

    def memory_median(self, name: str) -> float | None:
        """Median of one memory figure (``registered_per_conn_server``, ...) over the successful
        repetitions."""
        return median((s.memory or {}).get(name) for s in self.ok_samples)

    def rdmaio_median(self, name: str) -> float | None:
        """Median of one rdmaio statistic (``wakeups_per_op``, ...) over the successful repetitions."""
        return median((s.rdmaio or {}).get(name) for s in self.ok_samples)

    def to_json(self) -> dict[str, Any]:
        """JSON form with the medians and every repetition."""
        data: dict[str, Any] = {
            "contender": self.contender,
            "workload": str(self.workload),
            "size": self.size,
            "status": self.status,
            "unit": WORKLOAD_UNITS[self.workload],
            "value": self.value,
            "bytes_per_s": self.median_of("bytes_per_s"),
            "msgs_per_s": self.median_of("msgs_per_s"),
            "p50_us": self.median_of("p50_us"),
            "p99_us": self.median_of("p99_us"),
            "mean_us": self.median_of("mean_us"),
            "conns_per_s": self.median_of("conns_per_s"),
            "errors": self.errors,
            "samples": [s.to_json() for s in self.samples],
        }
        stats_keys: list[str] = []
        for s in self.ok_samples:
            for key in s.rdmaio or {}:
                if key not in stats_keys:
                    stats_keys.append(key)
        if stats_keys:
            data["rdmaio"] = {key: self.rdmaio_median(key) for key in stats_keys}
        memory_keys: list[str] = []
        for s in self.ok_samples:
            for key in s.memory or {}:
                if key not in memory_keys:
                    memory_keys.append(key)
        if memory_keys:
            data["memory"] = {key: self.memory_median(key) for key in memory_keys}
        notes = sorted({s.note for s in self.samples if s.note})
        if notes:
            data["note"] = "; ".join(notes)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Figure:
        """Rebuild a Figure from :meth:`to_json` output."""
        return cls(
            contender=str(data["contender"]),
            workload=Workload(data["workload"]),
            size=int(data["size"]),
            samples=[Sample.from_json(s) for s in data.get("samples", [])],
        )
