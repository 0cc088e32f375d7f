"""``python -m bench --overhead``: rdmaio's own CPU time and Python calls per operation, natively, no device.

Every rdmaio case runs a connected pair of real Endpoints over the null device of
:mod:`rdmaio.testing.nullpair` (both sides in this process, on one event loop); the TCP cases run both ends
of an asyncio streams connection over 127.0.0.1 on the same kind of loop. For each case and loop:

* **CPU us per operation**: :func:`time.thread_time` over ``ops`` operations, the minimum of ``samples``
  samples. Both ends run on the one thread of the one loop, so this is the CPU of both sides together (for
  TCP it includes the kernel's loopback work done in this thread's system calls).
* **The null device's share**: the same case on a twin pair whose every way into the device (posts, the
  deliveries the loop runs, the fake transport's making) and out of it (completion handlers, the peer's
  DISCONNECTED) goes through a :class:`~rdmaio.testing.nullpair.DeviceMeter`: thread CPU inside the device
  only, minus what the meter's own crossings leave there (calibrated on empty crossings); minimum of the
  samples. It is subtracted: **rdmaio us/op = CPU us/op - device us/op** (rdmaio's code and the event
  loop's work for it).
* **Python calls per operation**: ``sys.setprofile`` ``call`` events (every Python function call and every
  resumption of a coroutine, as CPython's profiler reports them) over ``call_ops`` operations, with the
  cyclic GC off, split by the code's file: rdmaio's own (``rdmaio/`` except ``rdmaio/testing/``), the null
  device (``rdmaio/testing/``: the fakes and the null pair) and the rest (the loop, the standard library,
  this harness). These counts are deterministic: ``tests/unit/test_call_budgets.py`` holds rdmaio's to
  budgets.

Ratios: each case's rdmaio us/op over uvloop TCP's echo round trip measured in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import rdmaio
from rdmaio.testing.nullpair import DeviceMeter, NullDevice, NullListener, null_pair

__all__ = [
    "CASES",
    "LOOPS",
    "SCHEMA",
    "TCP_CASES",
    "TOP_FUNCTIONS",
    "CallCounts",
    "CaseResult",
    "Plan",
    "build_report",
    "count_calls",
    "merge_rounds",
    "provenance",
    "render",
    "run_overhead",
]

LOOPS = ("asyncio", "uvloop")
SCHEMA = "rdmaio-overhead/1"
PAYLOAD = 64
BATCH = 64
CHUNK = 64 * 1024
"""The size of the concurrent cases' READs and WRITEs (the one-sided bench's 64 KiB workloads)."""
IN_FLIGHT = 16
"""The concurrent cases' tasks, each with one call in flight (the default ``Options.max_rdma_ops``)."""
TOP_FUNCTIONS = 25
"""rdmaio functions listed per case in the JSON report (the most called first)."""

_RDMAIO_DIR = os.path.dirname(os.path.abspath(rdmaio.__file__)) + os.sep
_TESTING_DIR = _RDMAIO_DIR + "testing" + os.sep


# --- cases -----------------------------------------------------------------------------------------------


class Fixture:
    """One case's connection(s), ready to run ``ops`` operations at a time (:meth:`run`)."""

    meter: DeviceMeter | None = None

    async def run(self, ops: int) -> None:
        """Do ``ops`` operations."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release everything."""


class _PairFixture(Fixture):
    def __init__(self, meter: DeviceMeter | None, *, at_post: bool = True) -> None:
        self.meter = meter
        self.a, self.b, self.device = null_pair(onesided_at_post=at_post, meter=meter)
        self.tasks: list[asyncio.Task[Any]] = []
        self.msg = bytes(PAYLOAD)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self.a.abort()
        self.b.abort()
        await asyncio.sleep(0)


class _Message(_PairFixture):
    async def _receive(self, ops: int) -> None:
        recv = self.b.recv
        for _ in range(ops):
            await recv()

    async def run(self, ops: int) -> None:
        receiver = asyncio.ensure_future(self._receive(ops))
        send, msg = self.a.send, self.msg
        for _ in range(ops):
            await send(msg)
        await receiver


class _Echo(_PairFixture):
    def __init__(self, meter: DeviceMeter | None) -> None:
        super().__init__(meter)
        self.tasks.append(asyncio.ensure_future(self._serve()))

    async def _serve(self) -> None:
        recv, send = self.b.recv, self.b.send
        while (message := await recv()) is not None:
            await send(message)

    async def run(self, ops: int) -> None:
        send, recv, msg = self.a.send, self.a.recv, self.msg
        for _ in range(ops):
            await send(msg)
            await recv()


class _Stream(_PairFixture):
    async def _read(self, ops: int) -> None:
        readexactly = self.b.readexactly
        for _ in range(ops):
            await readexactly(PAYLOAD)

    async def run(self, ops: int) -> None:
        reader = asyncio.ensure_future(self._read(ops))
        write, drain, msg = self.a.write, self.a.drain, self.msg
        for _ in range(ops):
            write(msg)
            await drain()
        await reader


class _OneSided(_PairFixture):
    def __init__(self, meter: DeviceMeter | None, *, at_post: bool) -> None:
        super().__init__(meter, at_post=at_post)
        self.memory = bytearray(4096)
        self.key = self.b.export(self.memory, access="rwa", scope="domain")


class _Read(_OneSided):
    async def run(self, ops: int) -> None:
        read, key = self.a.rdma_read, self.key
        for _ in range(ops):
            await read(key, 0, PAYLOAD)


class _FetchAdd(_OneSided):
    async def run(self, ops: int) -> None:
        fetch_add, key = self.a.fetch_add, self.key
        for _ in range(ops):
            await fetch_add(key, 0, 1)


class _FetchAddMany(_OneSided):
    def __init__(self, meter: DeviceMeter | None, *, at_post: bool) -> None:
        super().__init__(meter, at_post=at_post)
        self.offsets = [8 * i for i in range(BATCH)]

    async def run(self, ops: int) -> None:
        many, key, offsets = self.a.fetch_add_many, self.key, self.offsets
        for _ in range(ops):
            await many(key, offsets, 1)


class _Concurrent(_OneSided):
    """:data:`IN_FLIGHT` tasks calling at once, as the one-sided bench's workloads do; every request goes
    through the doorbell (another task posted the previous one) and completes one loop iteration later,
    its completion delivered by the connection's completion handler. One operation is one request."""

    def __init__(self, meter: DeviceMeter | None) -> None:
        super().__init__(meter, at_post=False)
        self.memory = bytearray(CHUNK)
        self.key = self.b.export(self.memory, access="rwa", scope="domain")
        self.chunk = bytes(CHUNK)

    async def calls(self, count: int) -> None:
        """``count`` requests, one after the other, in one task."""
        raise NotImplementedError

    async def run(self, ops: int) -> None:
        share, extra = divmod(ops, IN_FLIGHT)
        tasks = [asyncio.ensure_future(self.calls(share + (i < extra))) for i in range(IN_FLIGHT)]
        await asyncio.gather(*tasks)


class _ConcurrentWrite(_Concurrent):
    async def calls(self, count: int) -> None:
        write, key, chunk = self.a.rdma_write, self.key, self.chunk
        for _ in range(count):
            await write(key, 0, chunk)


class _ConcurrentRead(_Concurrent):
    async def calls(self, count: int) -> None:
        read, key = self.a.rdma_read, self.key
        for _ in range(count):
            await read(key, 0, CHUNK)


class _ConcurrentFetchAdd(_Concurrent):
    async def calls(self, count: int) -> None:
        fetch_add, key = self.a.fetch_add, self.key
        for _ in range(count):
            await fetch_add(key, 0, 1)


class _Setup(Fixture):
    def __init__(self, meter: DeviceMeter | None) -> None:
        self.meter = meter
        self.listener = NullListener(NullDevice(meter=meter))

    async def run(self, ops: int) -> None:
        connect, forget = self.listener.connect, self.listener.forget_closed
        for _ in range(ops):
            a, b = await connect()
            a.close()
            b.close()
            await a.wait_closed()
            await b.wait_closed()
            forget()


class _Tcp(Fixture):
    """Both ends of an asyncio streams connection over 127.0.0.1, on the running loop."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.msg = bytes(PAYLOAD)
        self.frame = PAYLOAD.to_bytes(4, "big") + self.msg  # one-way messages: a 4-byte length prefix
        self.server: asyncio.Server | None = None
        self.accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self.accepted = loop.create_future()
        accepted = self.accepted

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result((reader, writer))

        self.server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.peer_reader, self.peer_writer = await accepted
        if self.echo:
            self.tasks.append(asyncio.ensure_future(self._serve()))

    async def _serve(self) -> None:
        readexactly, write, drain = (
            self.peer_reader.readexactly,
            self.peer_writer.write,
            self.peer_writer.drain,
        )
        while True:
            write(await readexactly(PAYLOAD))
            await drain()

    async def _receive(self, ops: int) -> None:
        readexactly = self.peer_reader.readexactly
        for _ in range(ops):
            size = int.from_bytes(await readexactly(4), "big")
            await readexactly(size)

    async def run(self, ops: int) -> None:
        write, drain = self.writer.write, self.writer.drain
        if self.echo:
            readexactly, msg = self.reader.readexactly, self.msg
            for _ in range(ops):
                write(msg)
                await drain()
                await readexactly(PAYLOAD)
            return
        receiver = asyncio.ensure_future(self._receive(ops))
        frame = self.frame
        for _ in range(ops):
            write(frame)
            await drain()
        await receiver

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for writer in (self.writer, self.peer_writer):
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def _open_tcp(echo: bool) -> Fixture:
    fixture = _Tcp(echo)
    await fixture.open()
    return fixture


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured operation: ``name`` (JSON key), ``label`` (the table's), ``unit`` (what one operation
    is), ``weight`` (operations per sample relative to the plan's, so that samples last about as long: a
    connection setup weighs 1/200 of a one-way message) and how to open its fixture (``opener(meter)``;
    TCP cases take no meter)."""

    name: str
    label: str
    unit: str
    weight: float
    opener: Callable[[DeviceMeter | None], Awaitable[Fixture]]
    tcp: bool = False


def _sync(
    factory: Callable[[DeviceMeter | None], Fixture],
) -> Callable[[DeviceMeter | None], Awaitable[Fixture]]:
    async def open_fixture(meter: DeviceMeter | None) -> Fixture:
        return factory(meter)

    return open_fixture


CASES: tuple[Case, ...] = (
    Case("message", "one-way message 64 B", "message", 10, _sync(_Message)),
    Case("echo", "echo 64 B", "round trip", 1, _sync(_Echo)),
    Case("stream", "stream write+read 64 B", "write+read", 10, _sync(_Stream)),
    Case(
        "rdma_read_at_post",
        "rdma_read 64 B, completed at post",
        "call",
        2,
        _sync(lambda m: _Read(m, at_post=True)),
    ),
    Case(
        "rdma_read_next",
        "rdma_read 64 B, completed next iteration",
        "call",
        2,
        _sync(lambda m: _Read(m, at_post=False)),
    ),
    Case(
        "fetch_add_at_post",
        "fetch_add, completed at post",
        "call",
        2,
        _sync(lambda m: _FetchAdd(m, at_post=True)),
    ),
    Case(
        "fetch_add_next",
        "fetch_add, completed next iteration",
        "call",
        2,
        _sync(lambda m: _FetchAdd(m, at_post=False)),
    ),
    Case(
        "fetch_add_many",
        f"fetch_add_many of {BATCH}",
        "call",
        0.2,
        _sync(lambda m: _FetchAddMany(m, at_post=False)),
    ),
    Case(
        "rdma_write_64k_x16",
        f"rdma_write 64 KiB, {IN_FLIGHT} in flight",
        "request",
        1,
        _sync(_ConcurrentWrite),
    ),
    Case(
        "rdma_read_64k_x16",
        f"rdma_read 64 KiB, {IN_FLIGHT} in flight",
        "request",
        1,
        _sync(_ConcurrentRead),
    ),
    Case(
        "fetch_add_x16",
        f"fetch_add, {IN_FLIGHT} in flight",
        "request",
        2,
        _sync(_ConcurrentFetchAdd),
    ),
    Case("setup", "connection setup + close", "connection", 0.05, _sync(_Setup)),
)
"""The rdmaio cases, over the null device."""

TCP_CASES: tuple[Case, ...] = (
    Case("tcp_echo", "TCP echo 64 B", "round trip", 2, lambda m: _open_tcp(True), tcp=True),
    Case("tcp_message", "TCP one-way message 64 B", "message", 10, lambda m: _open_tcp(False), tcp=True),
)
"""The TCP loopback cases (asyncio streams, both ends on the loop)."""


# --- counting calls ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallCounts:
    """Python ``call`` events per operation, by where the code lives."""

    rdmaio: float
    device: float
    other: float


def _category(filename: str) -> int:
    if filename.startswith(_RDMAIO_DIR):
        return 1 if filename.startswith(_TESTING_DIR) else 0
    return 2


async def _counted(fixture: Fixture, ops: int, functions: dict[str, float] | None = None) -> CallCounts:
    """Count the calls of ``ops`` operations; ``functions``, when given, receives rdmaio's functions with
    their calls per operation (the :data:`TOP_FUNCTIONS` most called)."""
    counts = [0, 0, 0]
    categories: dict[Any, int] = {}
    per_code: dict[Any, int] = {}

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            category = categories.get(code)
            if category is None:
                category = categories[code] = _category(code.co_filename)
            counts[category] += 1
            if not category:
                per_code[code] = per_code.get(code, 0) + 1

    gc.collect()
    gc.disable()
    sys.setprofile(hook)
    try:
        await fixture.run(ops)
    finally:
        sys.setprofile(None)
        gc.enable()
    if functions is not None:
        top = sorted(per_code.items(), key=lambda item: (-item[1], _function_name(item[0])))[:TOP_FUNCTIONS]
        functions.update((_function_name(code), count / ops) for code, count in top)
    return CallCounts(counts[0] / ops, counts[1] / ops, counts[2] / ops)


def _function_name(code: Any) -> str:
    path = (
        code.co_filename[len(_RDMAIO_DIR) :] if code.co_filename.startswith(_RDMAIO_DIR) else code.co_filename
    )
    return f"{path}:{getattr(code, 'co_qualname', code.co_name)}"


def _loop_runner(loop: str) -> asyncio.Runner:
    if loop == "uvloop":
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


def count_calls(case: Case, loop: str, ops: int, warmup: int = 50) -> CallCounts:
    """The Python calls per operation of ``case`` on ``loop`` (``asyncio`` or ``uvloop``): ``warmup``
    operations, then ``ops`` counted. Runs its own event loop (call it outside one)."""

    async def main() -> CallCounts:
        fixture = await case.opener(None)
        try:
            await fixture.run(warmup)
            return await _counted(fixture, ops)
        finally:
            await fixture.close()

    with _loop_runner(loop) as runner:
        return runner.run(main())


# --- measuring --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much to run: ``ops`` operations per sample (times a case's weight), ``samples`` samples per
    round, ``rounds`` rounds of every case on every loop (the minimum over all samples of all rounds is
    kept: rounds spread each case over the run's length, so a burst of load from other processes on the
    machine inflates fewer of its samples), ``call_ops`` counted operations (times the weight), ``warmup``
    operations first."""

    ops: int = 2000
    samples: int = 5
    rounds: int = 3
    call_ops: int = 1000
    warmup: int = 200

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run in seconds."""
        return cls(ops=300, samples=3, rounds=1, call_ops=200, warmup=50)

    def scaled(self, weight: float) -> tuple[int, int, int]:
        """(ops, call_ops, warmup) of a case of that weight, at least 2 / 2 / 1."""
        return (
            max(2, round(self.ops * weight)),
            max(2, round(self.call_ops * weight)),
            max(1, round(self.warmup * weight)),
        )


@dataclasses.dataclass
class CaseResult:
    """One case on one loop: CPU us per operation (both sides, device included), the device's share, what
    is left (rdmaio's own: its code and the loop's work for it), Python calls per operation, and the ratio
    of rdmaio us/op to uvloop TCP's echo round trip."""

    case: str
    label: str
    unit: str
    loop: str
    tcp: bool
    ops: int
    samples: int
    cpu_us: float
    device_us: float | None
    own_us: float
    calls: CallCounts
    vs_uvloop_tcp_echo: float | None = None
    rdmaio_functions: dict[str, float] = dataclasses.field(default_factory=dict)
    """rdmaio's most called functions (``path:qualname``, path under ``rdmaio/``), calls per operation."""

    def to_json(self) -> dict[str, Any]:
        """A JSON object (calls as a nested object)."""
        doc = dataclasses.asdict(self)
        doc["calls"] = dataclasses.asdict(self.calls)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CaseResult:
        """The inverse of :meth:`to_json`."""
        fields = dict(doc)
        fields["calls"] = CallCounts(**doc["calls"])
        return cls(**fields)


async def _cpu_per_op(fixture: Fixture, ops: int, samples: int) -> tuple[float, float | None]:
    """(minimum CPU seconds per operation, minimum device seconds per operation when metered)."""
    best = best_device = float("inf")
    meter = fixture.meter
    for _ in range(samples):
        if meter is not None:
            meter.reset()
        start = time.thread_time()
        await fixture.run(ops)
        best = min(best, (time.thread_time() - start) / ops)
        if meter is not None:
            best_device = min(best_device, meter.corrected / ops)
    return best, (best_device if meter is not None else None)


async def _measure(case: Case, loop: str, plan: Plan, progress: Callable[[str], None]) -> CaseResult:
    ops, call_ops, warmup = plan.scaled(case.weight)
    fixture = await case.opener(None)
    try:
        await fixture.run(warmup)
        cpu, _ = await _cpu_per_op(fixture, ops, plan.samples)
        functions: dict[str, float] = {}
        calls = await _counted(fixture, call_ops, functions)
    finally:
        await fixture.close()
    device: float | None = None
    if not case.tcp:
        meter = DeviceMeter()
        meter.calibrate()
        metered = await case.opener(meter)
        try:
            await metered.run(warmup)
            _, device = await _cpu_per_op(metered, ops, plan.samples)
        finally:
            await metered.close()
    own = cpu - (device or 0.0)
    result = CaseResult(
        case=case.name,
        label=case.label,
        unit=case.unit,
        loop=loop,
        tcp=case.tcp,
        ops=ops,
        samples=plan.samples,
        cpu_us=cpu * 1e6,
        device_us=None if device is None else device * 1e6,
        own_us=own * 1e6,
        calls=calls,
        rdmaio_functions=functions,
    )
    progress(f"{loop} {case.label}: {_describe(result)}")
    return result


def _describe(r: CaseResult) -> str:
    if r.tcp:
        return f"{r.cpu_us:.1f} us/{r.unit}, {r.calls.other:.1f} Python calls"
    return (
        f"{r.own_us:.1f} us/{r.unit} rdmaio ({r.cpu_us:.1f} with the null device's {r.device_us:.1f}), "
        f"{r.calls.rdmaio:.2f} rdmaio calls, {r.calls.device:.2f} device calls"
    )


def run_overhead(
    plan: Plan,
    loops: Sequence[str] = LOOPS,
    cases: Sequence[Case] = CASES + TCP_CASES,
    progress: Callable[[str], None] = lambda line: None,
) -> list[CaseResult]:
    """Measure every case on every loop (each loop in an event loop of its own), ``plan.rounds`` times;
    one result per case and loop, with the minimum CPU and device figures of the rounds and the ratios
    filled in."""
    results: dict[tuple[str, str], CaseResult] = {}
    for round_number in range(plan.rounds):
        for loop in loops:
            tag = f"round {round_number + 1}/{plan.rounds}: " if plan.rounds > 1 else ""

            def tagged(line: str, tag: str = tag) -> None:
                progress(tag + line)

            async def main(loop: str = loop) -> None:
                for case in cases:
                    result = await _measure(case, loop, plan, tagged)
                    kept = results.setdefault((case.name, loop), result)
                    if kept is not result:
                        merge_rounds(kept, result)

            with _loop_runner(loop) as runner:
                runner.run(main())
    merged = list(results.values())
    fill_ratios(merged)
    return merged


def merge_rounds(kept: CaseResult, other: CaseResult) -> None:
    """Keep the minimum CPU and device figures of two rounds of one case in ``kept`` (its samples summed).
    rdmaio's own call counts are deterministic: a difference between rounds is an error. The other counts
    are not always (a TCP read may find one segment or two, depending on the kernel), so they are averaged."""
    if other.calls.rdmaio != kept.calls.rdmaio:
        raise RuntimeError(
            f"{kept.label} on {kept.loop}: calls differ between rounds: {kept.calls} {other.calls}"
        )
    if other.calls != kept.calls:
        kept.calls = dataclasses.replace(
            kept.calls,
            device=(kept.calls.device + other.calls.device) / 2,
            other=(kept.calls.other + other.calls.other) / 2,
        )
    kept.cpu_us = min(kept.cpu_us, other.cpu_us)
    if kept.device_us is not None and other.device_us is not None:
        kept.device_us = min(kept.device_us, other.device_us)
    kept.own_us = kept.cpu_us - (kept.device_us or 0.0)
    kept.samples += other.samples


def fill_ratios(results: Sequence[CaseResult]) -> None:
    """Set each result's ratio to uvloop TCP's echo round trip (None when that was not measured)."""
    base = next((r.cpu_us for r in results if r.case == "tcp_echo" and r.loop == "uvloop"), None)
    for r in results:
        r.vs_uvloop_tcp_echo = r.own_us / base if base else None


# --- report -------------------------------------------------------------------------------------------------


def build_report(results: Sequence[CaseResult], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: schema, meta, the results, and how they were measured."""
    return {
        "schema": SCHEMA,
        "meta": meta,
        "method": {
            "cpu": "time.thread_time over ops operations, minimum of samples; both ends on one loop/thread",
            "device": "null device CPU measured on a metered twin pair (meter cost calibrated and removed), "
            "minimum of samples; own_us = cpu_us - device_us",
            "calls": "sys.setprofile call events per operation, GC off: rdmaio/ (not rdmaio/testing/), the "
            "null device (rdmaio/testing/), other (loop, stdlib, harness)",
            "ratio": "own_us / uvloop TCP echo cpu_us per round trip, same run",
            "rdmaio_functions": f"rdmaio's {TOP_FUNCTIONS} most called functions of each case, calls per op",
        },
        "results": [r.to_json() for r in results],
    }


def results_from_report(doc: dict[str, Any]) -> list[CaseResult]:
    """The results of a JSON document made by :func:`build_report` (ValueError if it is not one)."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not an overhead report (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    return [CaseResult.from_json(r) for r in doc["results"]]


_HEADERS = (
    "case",
    "loop",
    "CPU us/op",
    "null device us/op",
    "rdmaio us/op",
    "vs uvloop TCP echo",
    "rdmaio calls/op",
    "device calls/op",
    "other calls/op",
)


def _rows(results: Sequence[CaseResult]) -> list[list[str]]:
    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    order = {case.name: i for i, case in enumerate(CASES + TCP_CASES)}
    ordered = sorted(results, key=lambda r: (order.get(r.case, len(order)), r.loop))
    rows = []
    for r in ordered:
        rows.append(
            [
                f"{r.label} (per {r.unit})",
                r.loop,
                num(r.cpu_us),
                num(r.device_us),
                num(r.own_us),
                "-" if r.vs_uvloop_tcp_echo is None else f"{r.vs_uvloop_tcp_echo:.2f}x",
                "-" if r.tcp else num(r.calls.rdmaio, 2),
                "-" if r.tcp else num(r.calls.device, 2),
                num(r.calls.other, 2),
            ]
        )
    return rows


NOTE = (
    "rdmaio us/op = CPU us/op - null device us/op: the null device's own CPU (the fakes: posting, "
    "delivering, completing) is measured on a metered twin pair and subtracted. CPU is time.thread_time, "
    "minimum of the samples, both ends on one loop and thread (TCP: both ends of a 127.0.0.1 asyncio streams "
    "connection, including the kernel's work in this thread's system calls). Calls are sys.setprofile call "
    "events per operation (calls and coroutine resumptions): rdmaio/ without rdmaio/testing/; the device's; "
    "the rest (loop, stdlib, harness). Ratio: rdmaio us/op over uvloop TCP's echo us per round trip."
)


def provenance(meta: dict[str, Any]) -> str:
    """One line: when, at which commit (and whether rdmaio/ had uncommitted changes), with which command and
    plan a report was made."""
    commit = meta.get("git_commit") or "unknown"
    dirty = " (with uncommitted changes in rdmaio/)" if meta.get("git_dirty") else ""
    command = " ".join(meta.get("command") or ["?"])
    plan = meta.get("plan") or {}
    sizes = ", ".join(f"{k} {v}" for k, v in plan.items())
    return (
        f"Measured {meta.get('created', '?')} at commit `{commit[:7]}`{dirty} with `{command}` ({sizes}; "
        f"Python {meta.get('python', '?')}, uvloop {meta.get('uvloop', '?')}, {meta.get('cpus', '?')} CPUs)."
    )


def render(
    results: Sequence[CaseResult], *, markdown: bool = False, meta: dict[str, Any] | None = None
) -> str:
    """The table (text, or markdown with ``markdown``), followed by how to read it; with ``meta`` (a
    report's), headed by :func:`provenance`."""
    rows = _rows(results)
    head = "" if meta is None else provenance(meta) + "\n\n"
    if markdown:
        lines = ["| " + " | ".join(_HEADERS) + " |", "|" + " --- |" * len(_HEADERS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return head + "\n".join(lines) + "\n\n" + NOTE + "\n"
    table = [list(_HEADERS), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEADERS))]

    def line(cells: Sequence[str]) -> str:
        # The first two columns (case, loop) are text, left-aligned; the figures right-aligned.
        return "  ".join(
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = [line(_HEADERS), line(["-" * w for w in widths]), *(line(row) for row in rows)]
    note = textwrap.fill(NOTE, 110)
    return head + "Overhead (native, null device)\n" + "\n".join(lines) + "\n\n" + note + "\n"


def main(
    *, quick: bool, samples: int | None, json_path: Path | None, markdown: bool, argv: Sequence[str]
) -> int:
    """``python -m bench --overhead``: measure, print the table, write the JSON report if asked."""
    plan = Plan.quick() if quick else Plan()
    if samples is not None:
        if samples < 1:
            print("--reps must be at least 1", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, samples=samples)
    started = time.monotonic()
    results = run_overhead(plan, progress=lambda line: print(f"bench: {line}", file=sys.stderr, flush=True))
    print(render(results, markdown=markdown), end="", flush=True)
    if json_path is not None:
        from bench.driver import _git_state, _versions

        meta = {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": ["python", "-m", "bench", *argv],
            "plan": dataclasses.asdict(plan),
            "elapsed_s": round(time.monotonic() - started, 1),
            **_versions(),
            **_git_state(),
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(build_report(results, meta), indent=2) + "\n")
        print(f"bench: JSON report written to {json_path}", file=sys.stderr)
    return 0
