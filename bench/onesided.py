"""The one-sided workloads of ``python -m bench``: ``--only onesided``.

Four workloads, each compared in the same run with the perftest tool that does the same thing:

============== ===================================================== =========================
workload       rdmaio client (several calls in flight, like tx-depth)  perftest (``-R``, rdma_cm)
============== ===================================================== =========================
``rdma_write`` ``await ep.rdma_write(key, 0, chunk)``, bytes/s          ``ib_write_bw -s SIZE``
``rdma_read``  ``await ep.rdma_read(key, 0, size)``, bytes/s            ``ib_read_bw -s SIZE``
``fetch_add``  ``await ep.fetch_add(key, 0, 1)``, operations/s          ``ib_atomic_bw`` (8 B)
``read_lat``   one 64 B ``rdma_read`` at a time, round trip p50/p99     ``ib_read_lat -s 64``
============== ===================================================== =========================

and ``fetch_add_many``: :data:`ATOMIC_LANES` tasks, each ``await ep.fetch_add_many(key, [0] * ATOMIC_BATCH)``
in a loop, operations/s, against the same ``ib_atomic_bw`` run.

The server side (the bench server process, :func:`serve_onesided`) exports one region of the measured
size with the access the workload needs, sends the client its key and then does nothing until the
client's end of stream: it takes no part in the data path, as with perftest. It then checks what it can
(the written bytes, the final counter), revokes the key and acknowledges. The client side
(:func:`measure_onesided`) keeps :data:`DEPTH` calls in flight with that many tasks, each awaiting one
call after another: the pipelining of perftest's ``tx-depth`` / outstanding READs, done the way an asyncio
program would. Its clock runs from the first call to the last completion (every call returns only on its
completion: a WRITE completes when the peer's NIC acknowledged it, a READ when the data is here).

perftest reports READ latency as the round trip itself (it halves only SEND/WRITE ping-pong times), so
``ib_read_lat``'s ``t_typical`` is compared as is.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import rdmaio
from bench.model import ONESIDED_WORKLOADS, Sample, Workload, format_size
from bench.parsers import ParseError, PerftestLatency, parse_perftest_bw, parse_perftest_lat

__all__ = [
    "ATOMIC_SIZE",
    "DEPTH",
    "ONESIDED_TARGETS",
    "ONESIDED_TOOLS",
    "READ_LAT_SIZE",
    "access_of",
    "measure_onesided",
    "onesided_ratios",
    "parse_onesided_tool",
    "perftest_args",
    "serve_onesided",
]

DEPTH = int(os.environ.get("RDMAIO_BENCH_ONESIDED_DEPTH", "16"))
"""Calls in flight on the rdmaio side (16: the default ``Options.max_rdma_ops``; the connection's
``max_rdma_ops`` is set to it). ``RDMAIO_BENCH_ONESIDED_DEPTH`` changes it."""
ATOMIC_BATCH = int(os.environ.get("RDMAIO_BENCH_ATOMIC_BATCH", "64"))
"""Fetch-and-adds per ``fetch_add_many`` call in the ``fetch_add_many`` workload
(``RDMAIO_BENCH_ATOMIC_BATCH``)."""
ATOMIC_LANES = 2
"""Tasks calling ``fetch_add_many`` at once: with the default batch, 128 atomics in flight (the connection's
``max_rdma_ops`` is set to lanes x batch), as ``ib_atomic_bw``'s default ``tx-depth`` of 128."""
ATOMIC_SIZE = 8
READ_LAT_SIZE = 64
CONNECT_TIMEOUT = 60.0
_FILL = 0xA5  # the byte the WRITE workload writes and the READ workload's region holds

ONESIDED_TOOLS: dict[str, Workload] = {
    "ib_read_bw": Workload.RDMA_READ,
    "ib_read_lat": Workload.READ_LAT,
    "ib_atomic_bw": Workload.FETCH_ADD,
}
"""The perftest tools only the one-sided workloads use (``ib_write_bw`` serves the stream workload too)."""

ONESIDED_TARGETS: tuple[tuple[str, str, Workload, int, str, str, float], ...] = (
    ("rdma_write_64k_vs_ib_write_bw", "rdma_write 64 KiB bytes/s", Workload.RDMA_WRITE, 64 * 1024,
     "ib_write_bw", ">=", 0.9),
    ("rdma_write_1m_vs_ib_write_bw", "rdma_write 1 MiB bytes/s", Workload.RDMA_WRITE, 1 << 20,
     "ib_write_bw", ">=", 0.9),
    ("rdma_read_64k_vs_ib_read_bw", "rdma_read 64 KiB bytes/s", Workload.RDMA_READ, 64 * 1024,
     "ib_read_bw", ">=", 0.9),
    ("rdma_read_1m_vs_ib_read_bw", "rdma_read 1 MiB bytes/s", Workload.RDMA_READ, 1 << 20,
     "ib_read_bw", ">=", 0.9),
    ("fetch_add_vs_ib_atomic_bw", "fetch_add ops/s (pipelined)", Workload.FETCH_ADD, ATOMIC_SIZE,
     "ib_atomic_bw", ">=", 0.5),
    ("fetch_add_many_vs_ib_atomic_bw", "fetch_add_many ops/s (batches)", Workload.FETCH_ADD_MANY,
     ATOMIC_SIZE, "ib_atomic_bw", ">=", 0.5),
    ("read_lat_64b_vs_ib_read_lat", "rdma_read 64 B p50 round trip", Workload.READ_LAT, READ_LAT_SIZE,
     "ib_read_lat", "<=", 3.0),
)  # fmt: skip
"""(key, description, workload, size, perftest tool, op, target) of each one-sided ratio."""


_ATOMIC = (Workload.FETCH_ADD, Workload.FETCH_ADD_MANY)


def access_of(workload: Workload) -> str:
    """The access the server grants for ``workload``."""
    return "a" if workload in _ATOMIC else "w" if workload is Workload.RDMA_WRITE else "r"


def _region_size(workload: Workload, size: int) -> int:
    return ATOMIC_SIZE if workload in _ATOMIC else size


# --- server side (in the bench server process) --------------------------------------------------------


async def serve_onesided(ep: rdmaio.Endpoint, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Export a region for the client's workload, send its key, wait for the client's end of stream,
    check the region, revoke the key; return the acknowledgement's fields."""
    workload = Workload(spec["workload"])
    size = int(spec["size"])
    region = bytearray(_region_size(workload, size))
    if workload in (Workload.RDMA_READ, Workload.READ_LAT):
        region[:] = bytes([_FILL]) * len(region)
    key = ep.export(region, access=access_of(workload))
    await ep.send(bytes(key))
    while await ep.recv() is not None:  # the client sends nothing more than its end of stream
        pass
    result: dict[str, Any] = {}
    if workload is Workload.RDMA_WRITE:
        result["written_ok"] = region == bytes([_FILL]) * len(region)
    elif workload in _ATOMIC:
        result["counter"] = int.from_bytes(region, "little")
    await ep.revoke(key)
    return result


# --- client side ----------------------------------------------------------------------------------------


async def _pipelined(
    ep: rdmaio.Endpoint,
    key: rdmaio.RemoteKey,
    workload: Workload,
    size: int,
    count: int,
    deadline: float,
    depth: int,
) -> tuple[int, bool]:
    """``count`` calls with ``depth`` in flight (``depth`` tasks); stops starting new ones after
    ``deadline``. Returns (calls completed, capped)."""
    started = 0
    capped = False
    payload = bytes([_FILL]) * size

    async def worker() -> int:
        nonlocal started, capped
        done = 0
        clock = time.perf_counter
        while started < count:
            if done & 15 == 15 and clock() > deadline:
                capped = True
                break
            started += 1
            if workload is Workload.RDMA_WRITE:
                await ep.rdma_write(key, 0, payload)
            elif workload is Workload.RDMA_READ:
                data = await ep.rdma_read(key, 0, size)
                if len(data) != size:
                    raise RuntimeError(f"rdma_read returned {len(data)} bytes, asked for {size}")
            else:
                await ep.fetch_add(key, 0, 1)
            done += 1
        return done

    results = await asyncio.gather(*(worker() for _ in range(min(depth, count))))
    return sum(results), capped


async def _batched(
    ep: rdmaio.Endpoint, key: rdmaio.RemoteKey, count: int, deadline: float
) -> tuple[int, bool]:
    """About ``count`` fetch-and-adds in ``fetch_add_many`` calls of :data:`ATOMIC_BATCH` (the last call
    is shorter), :data:`ATOMIC_LANES` tasks; stops starting new calls after ``deadline``. Returns
    (fetch-and-adds completed, capped)."""
    started = 0
    capped = False

    async def lane() -> int:
        nonlocal started, capped
        done = 0
        while started < count:
            if time.perf_counter() > deadline:
                capped = True
                break
            batch = min(ATOMIC_BATCH, count - started)
            started += batch
            olds = await ep.fetch_add_many(key, [0] * batch)
            if len(olds) != batch:
                raise RuntimeError(f"fetch_add_many returned {len(olds)} values for {batch}")
            done += batch
        return done

    results = await asyncio.gather(*(lane() for _ in range(ATOMIC_LANES)))
    return sum(results), capped


async def _read_latency(
    ep: rdmaio.Endpoint, key: rdmaio.RemoteKey, size: int, count: int, deadline_ns: int
) -> list[int]:
    rtts: list[int] = []
    read, clock = ep.rdma_read, time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        data = await read(key, 0, size)
        t1 = clock()
        if len(data) != size:
            raise RuntimeError(f"rdma_read returned {len(data)} bytes, asked for {size}")
        rtts.append(t1 - t0)
        if t1 > deadline_ns:
            break
    return rtts


async def measure_onesided(
    host: str, port: int, workload: Workload, size: int, count: int, cap: float, depth: int = DEPTH
) -> Sample:
    """One measurement of a one-sided workload against the bench server's rdmaio listener on the running
    loop. Failures become a failed :class:`Sample` (never raised, except cancellation)."""
    limit = cap * 5 + 120
    watchdog = asyncio.timeout(limit)
    try:
        async with watchdog:
            return await _measure(host, port, workload, size, count, cap, depth)
    except Exception as exc:
        if isinstance(exc, TimeoutError) and watchdog.expired():
            return Sample.failure(f"measurement did not finish within {limit:.0f} s")
        return Sample.failure(f"{type(exc).__name__}: {exc}")


async def _measure(
    host: str, port: int, workload: Workload, size: int, count: int, cap: float, depth: int
) -> Sample:
    # The peers module imports this one lazily (its handler serves our workloads): import it here.
    from bench.peers import _latency_sample, _pick_stats, rdmaio_stats

    if workload not in ONESIDED_WORKLOADS:
        raise ValueError(f"{workload} is not a one-sided workload")
    if workload is Workload.FETCH_ADD_MANY:
        depth = ATOMIC_LANES * ATOMIC_BATCH
    ep = await rdmaio.connect(host, port, timeout=CONNECT_TIMEOUT, options={"max_rdma_ops": depth})
    rtts: list[int] = []
    framing = ep.get_extra_info("framing")
    try:
        await ep.send(json.dumps({"workload": str(workload), "size": size}).encode())
        key = rdmaio.RemoteKey.from_bytes(await ep.recv())
        start = time.perf_counter()
        if workload is Workload.READ_LAT:
            rtts = await _read_latency(ep, key, size, count, time.perf_counter_ns() + int(cap * 1e9))
            done, capped = len(rtts), len(rtts) < count
        elif workload is Workload.FETCH_ADD_MANY:
            done, capped = await _batched(ep, key, count, start + cap)
        else:
            done, capped = await _pipelined(ep, key, workload, size, count, start + cap, depth)
        seconds = time.perf_counter() - start
        client_stats = _pick_stats(ep.statistics())
        ep.write_eof()
        raw_ack = await ep.recv()
    finally:
        await ep.aclose()
    if raw_ack is None:
        raise RuntimeError("the server closed without acknowledging")
    ack = json.loads(raw_ack)
    _check_ack(ack, workload, done)
    if workload is Workload.READ_LAT:
        sample = _latency_sample(rtts, seconds, capped)
        sample.note = "rdma_read of 64 B, one at a time, perf_counter_ns per call"
    else:
        unit = size if workload not in _ATOMIC else ATOMIC_SIZE
        sample = Sample(
            ok=True,
            bytes_per_s=done * unit / seconds,
            msgs_per_s=done / seconds,
            seconds=seconds,
            ops=done,
            capped=capped,
            note=(
                f"{ATOMIC_LANES} tasks x fetch_add_many of {ATOMIC_BATCH} ({depth} in flight)"
                if workload is Workload.FETCH_ADD_MANY
                else f"{depth} calls in flight ({depth} tasks)"
            ),
        )
    sample.rdmaio = rdmaio_stats(client_stats, ack.get("stats", {}), done)
    sample.note = f"{sample.note}; {framing} framing"
    return sample


def _check_ack(ack: Mapping[str, Any], workload: Workload, done: int) -> None:
    if "error" in ack:
        raise RuntimeError(f"server: {ack['error']}")
    if workload is Workload.RDMA_WRITE and ack.get("written_ok") is not True:
        raise RuntimeError("the server's region does not hold the written bytes")
    if workload in _ATOMIC and ack.get("counter") != done:
        raise RuntimeError(f"the server's counter is {ack.get('counter')}, the client added {done}")


# --- perftest -------------------------------------------------------------------------------------------


def perftest_args(tool: str, size: int) -> list[str]:
    """The size arguments of a perftest tool: none for ``ib_atomic_bw`` (its size is fixed at 8 B and
    it exits when given ``-s``), ``-s SIZE`` otherwise."""
    return [] if tool == "ib_atomic_bw" else ["-s", str(size)]


def parse_onesided_tool(tool: str, size: int, out: str, raw: str) -> dict[Workload, Sample]:
    """Samples from the report of ``ib_read_bw``, ``ib_atomic_bw`` or ``ib_read_lat``; ParseError when
    the output holds no valid report for ``size``."""
    workload = ONESIDED_TOOLS.get(tool)
    if workload is None:
        raise ParseError(f"no one-sided parser for {tool}")
    if workload is Workload.READ_LAT:
        lat = checked_perftest_lat(out, size)
        return {
            workload: Sample(
                ok=True,
                p50_us=lat.t_typical_us,
                p99_us=lat.p99_us,
                mean_us=lat.t_avg_us,
                ops=lat.iterations,
                note="READ round trip = t_typical / 99% percentile (perftest does not halve READ times)",
                raw=raw,
            )
        }
    if workload is Workload.FETCH_ADD:  # ib_atomic_bw is the contender of both atomic workloads
        # one Sample object each: later steps annotate them per workload
        return {w: perftest_bw_sample(out, size, raw) for w in (Workload.FETCH_ADD, Workload.FETCH_ADD_MANY)}
    return {workload: perftest_bw_sample(out, size, raw)}


def checked_perftest_lat(out: str, size: int) -> PerftestLatency:
    """A perftest latency report for ``size``; ParseError when it is for another size or gives zero."""
    lat = parse_perftest_lat(out)
    if lat.size != size:
        raise ParseError(f"report is for {lat.size} B, asked for {size} B")
    if lat.t_typical_us <= 0:
        raise ParseError("the report gives a zero latency (no valid measurement)")
    return lat


def perftest_bw_sample(out: str, size: int, raw: str) -> Sample:
    """The sample of a perftest bandwidth report (``ib_send_bw``, ``ib_write_bw``, ``ib_read_bw``,
    ``ib_atomic_bw``) for ``size``; ParseError when it is for another size or gives zero. The message rate
    is :attr:`PerftestBandwidth.msgs_per_s` (exact from the bandwidth where perftest's MsgRate rounds)."""
    bw = parse_perftest_bw(out)
    if bw.size != size:
        raise ParseError(f"report is for {bw.size} B, asked for {size} B")
    if bw.bw_average_bytes_per_s <= 0 or bw.msgs_per_s <= 0:
        raise ParseError("the report gives a zero bandwidth or message rate (no valid measurement)")
    return Sample(
        ok=True,
        bytes_per_s=bw.bw_average_bytes_per_s,
        msgs_per_s=bw.msgs_per_s,
        ops=bw.iterations,
        note="BW average (perftest MB = 2^20 B) and MsgRate",
        raw=raw,
    )


# --- targets ----------------------------------------------------------------------------------------------


def onesided_ratios(figures: Mapping[tuple[str, Workload, int], Any], loops: Sequence[str]) -> list[Any]:
    """The one-sided targets for rdmaio on each of ``loops``: rdmaio's figure over the perftest tool's."""
    from bench.report import _pair_ratio  # report imports this module lazily, in key_ratios

    ratios = []
    for loop in loops:
        me = f"rdmaio-{loop}"
        for key, description, workload, size, tool, op, target in ONESIDED_TARGETS:
            ratios.append(
                _pair_ratio(
                    figures,
                    key,
                    f"{description} vs {tool} {format_size(size)}",
                    loop,
                    (me, workload, size),
                    (tool, workload, size),
                    op,
                    target,
                )
            )
    return ratios
