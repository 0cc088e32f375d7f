"""The Python contenders: the benchmark server process and the client-side measurements.

The server runs in its own process (``python -m bench --role server``) and is driven through its
standard input, one command per line:

``serve asyncio`` / ``serve uvloop``
    start an event loop of that kind with an rdmaio listener and a TCP (asyncio streams) listener on the
    benchmark address; answer one JSON line ``{"ready": true, "rdmaio_port": ..., "tcp_port": ...}``.
``trim``
    return the C heap's free memory to the kernel (the memory workload's baseline); answer
    ``{"trimmed": true}`` (false without glibc).
``stats``
    answer ``{"stats": {"pid": ..., "clients": ...}}``: the server's process id and the rdmaio
    connections its main listener holds now (the memory workload waits on it).
``stop``
    close both listeners and the loop; answer ``{"stopped": true}``.
``quit`` (or end of input)
    exit.

Each client connection starts with a header (a message for rdmaio, a JSON line for TCP) naming the
workload; the client then runs it and signals its end with ``write_eof()``; the server answers with one
JSON acknowledgement holding what it received and, for rdmaio, its ``Endpoint.statistics()``. The client
stops its clock when that acknowledgement arrives, so a throughput figure covers delivery of every byte.

The setup workload connects to a second pair of listeners (``rdmaio_echo_port``, ``tcp_echo_port``)
whose handlers echo every message without a header, so that a connection costs connect + one round
trip + close and nothing else. The memory workload holds idle connections to the main rdmaio listener
(its handler waits for a header that never comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import math
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import rdmaio
from bench.memory import (
    MEMORY_RESERVE,
    MemoryProbe,
    Snapshot,
    mem_available,
    per_connection,
    raise_fd_limit,
    trim_heap,
    wait_for_clients,
)
from bench.model import ONESIDED_WORKLOADS, Sample, Workload

__all__ = [
    "CONNECT_TIMEOUT",
    "LOOP_FACTORIES",
    "READ_SIZE",
    "loop_factory",
    "measure",
    "measure_memory",
    "measure_setup",
    "rdmaio_stats",
    "server_main",
]

READ_SIZE = 1 << 20
"""Bytes asked for per ``read()`` by the stream receivers (rdmaio and TCP alike)."""
ZERO_COPY_SIZE = 64 * 1024
"""The message workload's server receives messages of at least this size with ``recv_into`` (zero-copy)."""
SEND_WINDOW = int(os.environ.get("RDMAIO_BENCH_SEND_WINDOW", "4"))
"""``send()`` calls (``RDMAIO_BENCH_SEND_WINDOW``, default 4) the message workload's rdmaio client keeps in
flight for messages that go by rendezvous (at least ``Options.rndv_threshold``): such a ``send()`` returns
only once the peer has pulled the data, so one call at a time leaves the link idle for a round trip per
message, where a throughput-minded caller overlaps a few (perftest keeps up to 128 transfers in flight).
Smaller messages are sent one call at a time: their ``send()`` returns once the frame is queued."""
CONNECT_TIMEOUT = 60.0
"""Seconds allowed to connect (the emulated test VM is slow)."""
_FRAME_HEADER = 4  # TCP message framing: 4-byte big-endian length prefix
_STATS_KEYS = (
    "wakeups",
    "completions",
    "mean_batch",
    "frames_posted",
    "post_calls",
    "messages_sent",
    "messages_received",
    "bytes_sent",
    "bytes_received",
)


def _new_uvloop() -> asyncio.AbstractEventLoop:
    import uvloop

    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": _new_uvloop,
}


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop factory of ``asyncio`` or ``uvloop``."""
    try:
        return LOOP_FACTORIES[kind]
    except KeyError:
        raise ValueError(f"unknown loop kind {kind!r}") from None


# --- server -------------------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (``getrusage``)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pick_stats(stats: Mapping[str, float]) -> dict[str, float]:
    return {key: float(stats.get(key, 0.0)) for key in _STATS_KEYS}


async def _rdmaio_handler(ep: rdmaio.Endpoint) -> None:
    try:
        header = await ep.recv()
        if header is None:
            return
        spec = json.loads(header)
        workload = spec["workload"]
        result: dict[str, Any] = {}
        cpu_start = cpu_seconds()
        if workload == Workload.STREAM:
            read = ep.read
            total = 0
            while chunk := await read(READ_SIZE):
                total += len(chunk)
            result["bytes"] = total
        elif workload == Workload.MESSAGE and int(spec["size"]) >= ZERO_COPY_SIZE:
            # Large messages land in the application's buffer (recv_into: zero-copy with rendezvous).
            recv_into, buffer = ep.recv_into, bytearray(int(spec["size"]))
            count = total = 0
            while n := await recv_into(buffer):
                count += 1
                total += n
            result.update(messages=count, bytes=total)
        elif workload == Workload.MESSAGE:
            recv = ep.recv
            count = total = 0
            while (message := await recv()) is not None:
                count += 1
                total += len(message)
            result.update(messages=count, bytes=total)
        elif workload == Workload.ECHO:
            recv, send = ep.recv, ep.send
            count = 0
            while (message := await recv()) is not None:
                await send(message)
                count += 1
            result["messages"] = count
        elif workload in ONESIDED_WORKLOADS:  # one-sided; imported here: that module imports this one
            from bench.onesided import serve_onesided

            result.update(await serve_onesided(ep, spec))
        else:
            result["error"] = f"unknown workload {workload!r}"
        result["cpu_s"] = cpu_seconds() - cpu_start
        result["stats"] = _pick_stats(ep.statistics())
        await ep.send(json.dumps(result).encode())
    except Exception as exc:
        print(f"bench server: rdmaio connection failed: {exc!r}", file=sys.stderr, flush=True)
    finally:
        await ep.aclose()


async def _tcp_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        spec = json.loads(await reader.readline())
        workload = spec["workload"]
        result: dict[str, Any] = {}
        cpu_start = cpu_seconds()
        if workload == Workload.STREAM:
            read = reader.read
            total = 0
            while chunk := await read(READ_SIZE):
                total += len(chunk)
            result["bytes"] = total
        elif workload == Workload.MESSAGE:
            readexactly = reader.readexactly
            count = total = 0
            while True:
                try:
                    head = await readexactly(_FRAME_HEADER)
                except asyncio.IncompleteReadError:
                    break
                total += len(await readexactly(int.from_bytes(head, "big")))
                count += 1
            result.update(messages=count, bytes=total)
        elif workload == Workload.ECHO:
            size = int(spec["size"])
            readexactly, write, drain = reader.readexactly, writer.write, writer.drain
            count = 0
            while True:
                try:
                    message = await readexactly(size)
                except asyncio.IncompleteReadError:
                    break
                write(message)
                await drain()
                count += 1
            result["messages"] = count
        else:
            result["error"] = f"unknown workload {workload!r}"
        result["cpu_s"] = cpu_seconds() - cpu_start
        writer.write(json.dumps(result).encode() + b"\n")
        await writer.drain()
    except Exception as exc:
        print(f"bench server: TCP connection failed: {exc!r}", file=sys.stderr, flush=True)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _rdmaio_echo(ep: rdmaio.Endpoint) -> None:
    """Setup workload: echo every message, no header, until EOF."""
    try:
        recv, send = ep.recv, ep.send
        while (message := await recv()) is not None:
            await send(message)
    except Exception as exc:
        print(f"bench server: rdmaio echo connection failed: {exc!r}", file=sys.stderr, flush=True)
    finally:
        await ep.aclose()


async def _tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Setup workload over TCP: echo whatever arrives until EOF."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except Exception as exc:
        print(f"bench server: TCP echo connection failed: {exc!r}", file=sys.stderr, flush=True)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _reply(obj: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _serve_phase(host: str, kind: str) -> None:
    loop = asyncio.get_running_loop()
    rdma_servers: dict[str, rdmaio.StreamServer] = {}
    reply: dict[str, Any] = {"ready": True, "loop": kind, "pid": os.getpid()}
    for name, handler in (("rdmaio", _rdmaio_handler), ("rdmaio_echo", _rdmaio_echo)):
        reply[f"{name}_port"] = None
        reply[f"{name}_error"] = None
        try:
            # The memory workload holds up to thousands of idle connections, opened one at a time:
            # the backlog only bounds connections not yet established, but keep it out of the way.
            server = await rdmaio.serve(handler, host, 0, backlog=1024)
        except Exception as exc:
            reply[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        else:
            rdma_servers[name] = server
            reply[f"{name}_port"] = server.addresses[0][1]
    tcp_server = await asyncio.start_server(_tcp_handler, host, 0)
    tcp_echo = await asyncio.start_server(_tcp_echo, host, 0)
    reply["tcp_port"] = tcp_server.sockets[0].getsockname()[1]
    reply["tcp_echo_port"] = tcp_echo.sockets[0].getsockname()[1]
    _reply(reply)
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.buffer.readline)
            word = line.split()[:1]
            if word == [b"trim"]:
                _reply({"trimmed": trim_heap()})
                continue
            if word == [b"stats"]:
                main = rdma_servers.get("rdmaio")
                clients = main.statistics()["clients"] if main is not None else -1
                _reply({"stats": {"pid": os.getpid(), "clients": clients}})
                continue
            if not line or word in ([b"stop"], [b"quit"]):
                break
    finally:
        tcp_server.close()
        tcp_echo.close()
        for server in rdma_servers.values():
            server.close()
            server.close_clients()
        for server in rdma_servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 30)
        for tcp in (tcp_server, tcp_echo):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(tcp.wait_closed(), 10)


def server_main(host: str, profile_dir: Path | None = None) -> int:
    """Entry point of ``--role server``: obey ``serve KIND`` / ``stats`` / ``stop`` / ``quit`` on stdin."""
    raise_fd_limit()  # the memory workload holds many connections, each with its own fds
    phase = 0
    while True:
        line = sys.stdin.buffer.readline()
        words = line.decode(errors="replace").split()
        if not words or words[0] == "quit":
            return 0
        if words[0] != "serve" or len(words) != 2 or words[1] not in LOOP_FACTORIES:
            _reply({"error": f"bad command {line!r}"})
            continue
        kind = words[1]
        phase += 1
        profiler = cProfile.Profile() if profile_dir is not None else None
        try:
            with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
                if profiler is not None:
                    profiler.enable()
                runner.run(_serve_phase(host, kind))
        except Exception as exc:
            _reply({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            if profiler is not None and profile_dir is not None:
                profiler.disable()
                profiler.dump_stats(profile_dir / f"server-{phase}-{kind}.prof")
        _reply({"stopped": True, "loop": kind})


# --- client measurements -------------------------------------------------------------------------------


def rdmaio_stats(client: Mapping[str, float], server: Mapping[str, float], ops: int) -> dict[str, float]:
    """Loop wake-ups per operation and CQ batch sizes of both sides of one rdmaio measurement.

    ``ops`` is the number of application operations (writes, messages or round trips).
    ``wakeups_per_op`` counts the wake-ups of both processes; ``*_frames_per_op`` tells how well stream
    writes were coalesced (below 1: several writes per frame).
    """
    ops = max(ops, 1)
    cw = float(client.get("wakeups", 0.0))
    sw = float(server.get("wakeups", 0.0))

    def per_post(stats: Mapping[str, float]) -> float:
        calls = float(stats.get("post_calls", 0.0))
        return float(stats.get("frames_posted", 0.0)) / calls if calls else 0.0

    return {
        "wakeups_per_op": (cw + sw) / ops,
        "client_wakeups_per_op": cw / ops,
        "server_wakeups_per_op": sw / ops,
        "client_mean_batch": float(client.get("mean_batch", 0.0)),
        "server_mean_batch": float(server.get("mean_batch", 0.0)),
        "client_frames_per_post": per_post(client),
        "server_frames_per_post": per_post(server),
        "client_frames_per_op": float(client.get("frames_posted", 0.0)) / ops,
        "server_frames_per_op": float(server.get("frames_posted", 0.0)) / ops,
        "client_wakeups": cw,
        "server_wakeups": sw,
    }


def _percentile(sorted_values: list[int], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = math.ceil(fraction * len(sorted_values) - 1e-9)
    index = min(len(sorted_values) - 1, max(0, rank - 1))
    return float(sorted_values[index])


def _latency_sample(rtts_ns: list[int], seconds: float, capped: bool) -> Sample:
    ordered = sorted(rtts_ns)
    return Sample(
        ok=True,
        p50_us=_percentile(ordered, 0.50) / 1000,
        p99_us=_percentile(ordered, 0.99) / 1000,
        mean_us=sum(ordered) / len(ordered) / 1000,
        seconds=seconds,
        ops=len(ordered),
        capped=capped,
    )


def _throughput_sample(
    workload: Workload, size: int, ops: int, seconds: float, capped: bool, cpu_s: float | None = None
) -> Sample:
    moved = ops * size
    return Sample(
        ok=True,
        bytes_per_s=moved / seconds,
        msgs_per_s=ops / seconds,
        seconds=seconds,
        ops=ops,
        capped=capped,
        cpu_s_per_gib=cpu_s / (moved / 2**30) if cpu_s is not None and moved else None,
    )


def _check_ack(ack: Mapping[str, Any], workload: Workload, size: int, ops: int) -> None:
    if "error" in ack:
        raise RuntimeError(f"server: {ack['error']}")
    if workload is Workload.STREAM and ack.get("bytes") != ops * size:
        raise RuntimeError(f"server received {ack.get('bytes')} bytes, client wrote {ops * size}")
    if workload is not Workload.STREAM and ack.get("messages") != ops:
        raise RuntimeError(f"server counted {ack.get('messages')} messages, client sent {ops}")


def _batch(size: int) -> int:
    """Operations between two looks at the clock: about 64 KiB worth, at least one."""
    return max(1, (64 * 1024) // size)


async def _write_loop(
    write: Callable[[bytes], None],
    drain: Callable[[], Awaitable[None]],
    payload: bytes,
    count: int,
    deadline: float,
    drain_every: int,
) -> tuple[int, bool]:
    """``write(payload)`` up to ``count`` times, awaiting ``drain()`` after every ``drain_every`` writes.

    Looks at the clock every 64 KiB or so and stops after ``deadline``. Returns (writes done, capped).
    """
    batch = _batch(len(payload))
    done = 0
    while done < count:
        n = min(batch, count - done)
        if drain_every <= 1:
            for _ in range(n):
                write(payload)
                await drain()
        else:
            for i in range(1, n + 1):
                write(payload)
                if i % drain_every == 0:
                    await drain()
            await drain()
        done += n
        if time.perf_counter() > deadline:
            return done, done < count
    return done, False


async def _windowed_sends(
    send: Callable[[bytes], Awaitable[None]], payload: bytes, count: int, deadline: float, window: int
) -> tuple[int, bool]:
    """Send ``payload`` ``count`` times with up to ``window`` ``send()`` calls in flight (rdmaio queues
    concurrent sends in call order); stop starting new ones after ``deadline``. Returns (sent, capped)."""
    pending: set[asyncio.Future[None]] = set()
    started = done = 0
    try:
        while True:
            while started < count and len(pending) < window and time.perf_counter() <= deadline:
                pending.add(asyncio.ensure_future(send(payload)))
                started += 1
            if not pending:
                return done, done < count
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in finished:
                future.result()  # a failed send fails the measurement
                done += 1
    finally:
        for future in pending:
            future.cancel()


async def _rdmaio_measure(
    host: str, port: int, workload: Workload, size: int, count: int, cap: float, drain_every: int
) -> Sample:
    ep = await rdmaio.connect(host, port, timeout=CONNECT_TIMEOUT)
    framing = ep.get_extra_info("framing")  # "header" where a device has no immediate data (iWARP)
    try:
        await ep.send(json.dumps({"workload": str(workload), "size": size}).encode())
        payload = bytes(size)
        done = 0
        capped = False
        batch = _batch(size)
        rtts: list[int] = []
        cpu_start = cpu_seconds()
        start = time.perf_counter()
        deadline = start + cap
        if workload is Workload.STREAM:
            done, capped = await _write_loop(ep.write, ep.drain, payload, count, deadline, drain_every)
        elif workload is Workload.MESSAGE and size >= rdmaio.Options().rndv_threshold:
            done, capped = await _windowed_sends(ep.send, payload, count, deadline, SEND_WINDOW)
        elif workload is Workload.MESSAGE:
            send = ep.send
            while done < count:
                n = min(batch, count - done)
                for _ in range(n):
                    await send(payload)
                done += n
                if time.perf_counter() > deadline:
                    capped = done < count
                    break
        else:
            send, recv, clock = ep.send, ep.recv, time.perf_counter_ns
            deadline_ns = clock() + int(cap * 1e9)
            for _ in range(count):
                t0 = clock()
                await send(payload)
                reply = await recv()
                t1 = clock()
                if reply is None or len(reply) != size:
                    raise RuntimeError(f"echo reply of {None if reply is None else len(reply)} bytes")
                rtts.append(t1 - t0)
                if t1 > deadline_ns:
                    break
            done = len(rtts)
            capped = done < count
        ep.write_eof()
        raw_ack = await ep.recv()
        seconds = time.perf_counter() - start
        cpu_client = cpu_seconds() - cpu_start
        client_stats = _pick_stats(ep.statistics())
    finally:
        await ep.aclose()
    if raw_ack is None:
        raise RuntimeError("the server closed without acknowledging")
    ack = json.loads(raw_ack)
    _check_ack(ack, workload, size, done)
    if workload is Workload.ECHO:
        sample = _latency_sample(rtts, seconds, capped)
    else:
        cpu = cpu_client + ack["cpu_s"] if "cpu_s" in ack else None
        sample = _throughput_sample(workload, size, done, seconds, capped, cpu)
    sample.rdmaio = rdmaio_stats(client_stats, ack.get("stats", {}), done)
    sample.note = "; ".join(n for n in (sample.note, f"{framing} framing") if n)
    return sample


async def _tcp_measure(
    host: str, port: int, workload: Workload, size: int, count: int, cap: float, drain_every: int
) -> Sample:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
    try:
        writer.write(json.dumps({"workload": str(workload), "size": size}).encode() + b"\n")
        await writer.drain()
        payload = bytes(size)
        done = 0
        capped = False
        rtts: list[int] = []
        write, drain = writer.write, writer.drain
        cpu_start = cpu_seconds()
        start = time.perf_counter()
        deadline = start + cap
        if workload is Workload.STREAM:
            done, capped = await _write_loop(write, drain, payload, count, deadline, drain_every)
        elif workload is Workload.MESSAGE:
            frame = size.to_bytes(_FRAME_HEADER, "big") + payload
            done, capped = await _write_loop(write, drain, frame, count, deadline, 1)
        else:
            readexactly, clock = reader.readexactly, time.perf_counter_ns
            deadline_ns = clock() + int(cap * 1e9)
            for _ in range(count):
                t0 = clock()
                write(payload)
                await drain()
                await readexactly(size)
                t1 = clock()
                rtts.append(t1 - t0)
                if t1 > deadline_ns:
                    break
            done = len(rtts)
            capped = done < count
        writer.write_eof()
        raw_ack = await reader.readline()
        seconds = time.perf_counter() - start
        cpu_client = cpu_seconds() - cpu_start
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    if not raw_ack:
        raise RuntimeError("the server closed without acknowledging")
    ack = json.loads(raw_ack)
    _check_ack(ack, workload, size, done)
    if workload is Workload.ECHO:
        return _latency_sample(rtts, seconds, capped)
    cpu = cpu_client + ack["cpu_s"] if "cpu_s" in ack else None
    return _throughput_sample(workload, size, done, seconds, capped, cpu)


async def _rdmaio_setup_once(host: str, port: int, payload: bytes) -> None:
    ep = await rdmaio.connect(host, port, timeout=CONNECT_TIMEOUT)
    try:
        await ep.send(payload)
        reply = await ep.recv()
        if reply != payload:
            raise RuntimeError(f"setup echo returned {None if reply is None else len(reply)} bytes")
    finally:
        await ep.aclose()


async def _tcp_setup_once(host: str, port: int, payload: bytes) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
    try:
        writer.write(payload)
        await writer.drain()
        reply = await reader.readexactly(len(payload))
        if reply != payload:
            raise RuntimeError("setup echo returned other bytes")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def measure_setup(kind: str, host: str, port: int, size: int, count: int, seconds: float) -> Sample:
    """The setup workload: connect, echo ``size`` bytes once, close; ``count`` times in sequence or until
    ``seconds`` have passed. The first connection warms up (the loop's event channel, the device's
    protection domain) and is not counted, as in the native ``cm_setup`` loop. Raises on failure."""
    once = _rdmaio_setup_once if kind == "rdmaio" else _tcp_setup_once
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    await once(host, port, payload)
    start = time.perf_counter()
    done = 0
    now = start
    while done < count:
        await once(host, port, payload)
        done += 1
        now = time.perf_counter()
        if now - start >= seconds:
            break
    elapsed = now - start
    # Not "capped": stopping after ``seconds`` is how a setup measurement normally ends.
    return Sample(ok=True, conns_per_s=done / elapsed, seconds=elapsed, ops=done)


async def measure_memory(
    host: str,
    port: int,
    count: int,
    server_pid: int,
    server_stats: Callable[[], Awaitable[Mapping[str, Any]]],
    server_trim: Callable[[], Awaitable[Any]] | None = None,
    *,
    reserve: int = MEMORY_RESERVE,
) -> Sample:
    """The memory workload at ``count`` idle connections (see :mod:`bench.memory`).

    Never raises for a count that does not fit: the sample fails with what was opened and why, and its
    ``memory`` holds the per-connection figures of the connections that were opened.
    """
    raise_fd_limit()
    probe = MemoryProbe(server_pid)
    loop = asyncio.get_running_loop()
    await _rdmaio_setup_once_idle(host, port)
    await wait_for_clients(server_stats, 0, 60.0)
    if server_trim is not None:
        await server_trim()
    trim_heap()
    before = await loop.run_in_executor(None, probe.snapshot)
    endpoints: list[rdmaio.Endpoint] = []
    error: str | None = None
    try:
        for _ in range(count):
            available = mem_available()
            if available is not None and available < reserve:
                error = (
                    f"stopped at {len(endpoints)} of {count} connections: MemAvailable "
                    f"{available >> 20} MiB < reserve {reserve >> 20} MiB"
                )
                break
            try:
                endpoints.append(await rdmaio.connect(host, port, timeout=CONNECT_TIMEOUT))
            except Exception as exc:
                error = f"opened {len(endpoints)} of {count} connections, then {type(exc).__name__}: {exc}"
                break
        clients = await wait_for_clients(server_stats, len(endpoints), 120.0)
        if clients != len(endpoints):
            note = f"server holds {clients} clients, client opened {len(endpoints)}"
            error = f"{error}; {note}" if error else note
        during = await loop.run_in_executor(None, probe.snapshot)
    finally:
        await _close_all(endpoints)
    opened = len(endpoints)
    # A closed Endpoint still holds its slot buffers until it is collected: drop ours before measuring.
    endpoints.clear()
    await wait_for_clients(server_stats, 0, 120.0)
    after: Snapshot | None = await loop.run_in_executor(None, probe.snapshot)
    figures = per_connection(before, during, after, opened)
    if error is not None:
        sample = Sample.failure(error)
        sample.memory = figures if opened else None
        return sample
    return Sample(ok=True, ops=opened, memory=figures)


async def _rdmaio_setup_once_idle(host: str, port: int) -> None:
    """Open and close one connection to the main listener (a warm-up before the baseline)."""
    ep = await rdmaio.connect(host, port, timeout=CONNECT_TIMEOUT)
    await ep.aclose()


async def _close_all(endpoints: list[rdmaio.Endpoint]) -> None:
    """Close the connections, a batch at a time (a graceful close is a round trip each)."""
    for first in range(0, len(endpoints), 64):
        batch = endpoints[first : first + 64]
        results = await asyncio.gather(*(ep.aclose() for ep in batch), return_exceptions=True)
        for ep, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                ep.abort()


async def measure(
    kind: str,
    host: str,
    port: int,
    workload: Workload,
    size: int,
    count: int,
    cap: float,
    drain_every: int = 1,
) -> Sample:
    """Run one measurement of a Python contender (``kind`` ``rdmaio`` or ``tcp``) on the running loop.

    ``count`` operations at most, stopping early after ``cap`` seconds. The stream writer awaits
    ``drain()`` after every ``drain_every`` writes. Failures are returned as a failed :class:`Sample`,
    never raised (except cancellation).
    """
    runner = _rdmaio_measure if kind == "rdmaio" else _tcp_measure
    limit = cap * 5 + 120
    watchdog = asyncio.timeout(limit)
    try:
        async with watchdog:
            if workload is Workload.SETUP:
                return await measure_setup(kind, host, port, size, count, cap)
            return await runner(host, port, workload, size, count, cap, drain_every)
    except Exception as exc:
        if isinstance(exc, TimeoutError) and watchdog.expired():
            return Sample.failure(f"measurement did not finish within {limit:.0f} s")
        return Sample.failure(f"{type(exc).__name__}: {exc}")
