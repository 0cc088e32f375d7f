#!/usr/bin/env python3
"""The floor of connection setup for any Python caller: ``cm_setup``'s loop written in Python.

``tools/dev bench --only setup`` (the harness in ``bench/``) compares rdmaio's connect + 16 B echo +
close loop with ``cm_setup`` (``bench/native/cm_setup.c``). This tool measures what part of the gap is
Python's own and not rdmaio's: the very same loop, step for step and system call for system call, written with
rdmaio's thin verbs layer (:mod:`rdmaio.verbs`, cffi) and no event loop - blocking in ``select()`` where
``cm_setup`` blocks in the kernel, one shared PD, CQ, completion channel and MR, no protocol, no
handshake, no EOF. No Python program that makes these calls can set up connections faster, so its rate
over ``cm_setup``'s is the ceiling of rdmaio's setup ratio on the machine it runs on.

Run it where an RDMA device exists (the test host)::

    python -m rdmaio.testing.host --cpus 2 -- .venv/bin/python tools/setup_floor.py --rounds 3

Each round runs ``cm_setup``'s server and client, then this loop's, then rdmaio's own connect + 16 B
echo + close loop against an rdmaio echo server (each server in its own process, as in the bench), for
``--seconds`` each. It prints each loop's rate and **CPU time per connection** of its client and server
(user + system, from the children's resource usage), and the medians. CPU time is far less noisy than
the rate in a shared VM, and it tells where the time goes: the C loop, the Python calls that are the
floor of any Python caller, and what rdmaio adds on each side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import rdmaio
from rdmaio import verbs
from rdmaio.verbs import CMEventType

# The benchmark harness is not installed (it is not in the wheel): import it from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.external import build_cm_setup, cm_setup_commands
from bench.parsers import parse_cm_setup
from bench.peers import _rdmaio_setup_once  # the bench setup workload's connection

MSG = 16
READY = "setup_floor server listening"


class Shared:
    """What ``cm_setup`` creates once per device: PD, completion channel, CQ and a 32-byte MR."""

    def __init__(self, device: verbs.DeviceContext) -> None:
        self.pd = verbs.ProtectionDomain(device)
        self.channel = verbs.CompletionChannel(device)
        self.cq = verbs.CompletionQueue(device, self.channel, 16, batch=4)
        self.buf = bytearray(2 * MSG)  # [0, 16): receive, [16, 32): send
        self.mr = verbs.MemoryRegion(self.pd, self.buf)

    def wait_completions(self, want: set[int], what: str) -> None:
        """Block until the completions of every wr_id in ``want`` arrived (others: an earlier connection's
        late echo send, skipped as ``cm_setup`` does)."""
        while want:
            n = self.cq.drain()  # reads and acks channel events, re-arms, polls
            for i in range(n):
                wc = self.cq.records[i]
                if wc.wr_id in want:
                    if wc.status:
                        sys.exit(f"setup_floor: {what} completion failed: {verbs.wc_status_str(wc.status)}")
                    want.discard(int(wc.wr_id))
            if n == 0 and want:
                select.select([self.channel.fd], [], [])


def expect(channel: verbs.EventChannel, want: CMEventType) -> verbs.CMEvent:
    """The next CM event, which must be ``want`` (blocking in select)."""
    while (event := channel.get_event()) is None:
        select.select([channel.fd], [], [])
    if event.event != want:
        sys.exit(f"setup_floor: expected {want.name}, got {event.event.name} (status {event.status})")
    return event


def post_recv(shared: Shared, qp: verbs.QueuePair, wr_id: int) -> None:
    qp.post_recv_slots(shared.mr, MSG, [0], wr_id)


def post_send(shared: Shared, qp: verbs.QueuePair, wr_id: int) -> None:
    wr = qp.send_array[0]
    wr.wr_id = wr_id
    wr.addr = shared.mr.addr + MSG
    wr.length = MSG
    wr.lkey = shared.mr.lkey
    wr.imm_data = 0
    wr.opcode = verbs.WR_SEND_WITH_IMM
    wr.send_flags = verbs.SEND_SIGNALED
    qp.post_sends(1)


def serve(host: str, port: int) -> None:
    """``cm_setup server ADDR PORT echo``: accept, receive 16 bytes, echo them, destroy on DISCONNECTED."""
    channel = verbs.EventChannel()
    listener = verbs.CMId(channel)
    listener.bind_addr(host, port)
    listener.listen(16)
    print(READY, flush=True)
    shared: Shared | None = None
    conn = 0
    while True:
        event = expect(channel, CMEventType.CONNECT_REQUEST)
        cm_id = verbs.CMId.from_event(channel, event)
        device = cm_id.device()
        assert device is not None
        if shared is None:
            shared = Shared(device)
        qp = cm_id.create_qp(shared.pd, shared.cq, shared.cq, max_send_wr=2, max_recv_wr=2)
        recv_id, send_id = conn << 1, conn << 1 | 1
        post_recv(shared, qp, recv_id)
        cm_id.accept(rnr_retry_count=1)
        shared.wait_completions({recv_id}, "receive")
        shared.buf[MSG:] = shared.buf[:MSG]
        post_send(shared, qp, send_id)  # not waited for, as in cm_setup (see its comment)
        while True:
            while (ev := channel.get_event()) is None:
                select.select([channel.fd], [], [])
            if ev.event == CMEventType.DISCONNECTED:
                break
            if ev.event not in (CMEventType.ESTABLISHED, CMEventType.TIMEWAIT_EXIT):
                sys.exit(f"setup_floor server: unexpected {ev.event.name} (status {ev.status})")
        qp.close()
        cm_id.close()
        conn += 1


class LoopClock:
    """Times a setup loop as ``cm_setup`` does: the first connection warms up (device opened, PD/CQ/MR
    created) and is not counted; rate and CPU seconds cover the connections after it."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._done = -1
        self._start = self._cpu = 0.0

    def connected(self) -> tuple[float, float, int] | None:
        """One more connection done: ``(rate, cpu seconds, connections)`` once ``seconds`` have passed."""
        self._done += 1
        now = time.perf_counter()
        if self._done == 0:
            self._start, self._cpu = now, time.process_time()
        elif now - self._start >= self._seconds:
            return self._done / (now - self._start), time.process_time() - self._cpu, self._done
        return None


def run_client(host: str, port: int, seconds: float) -> tuple[float, float, int]:
    """``cm_setup client ... echo``: connections per second after one uncounted warm-up connection."""
    channel = verbs.EventChannel()
    shared: Shared | None = None
    clock = LoopClock(seconds)
    n = 0
    while True:
        cm_id = verbs.CMId(channel)
        cm_id.resolve_addr(host, port, timeout_ms=2000)
        expect(channel, CMEventType.ADDR_RESOLVED)
        cm_id.resolve_route(2000)
        expect(channel, CMEventType.ROUTE_RESOLVED)
        if shared is None:
            device = cm_id.device()
            assert device is not None
            shared = Shared(device)
            shared.buf[MSG:] = b"x" * MSG
        qp = cm_id.create_qp(shared.pd, shared.cq, shared.cq, max_send_wr=2, max_recv_wr=2)
        post_recv(shared, qp, n << 1)
        cm_id.connect(retry_count=5, rnr_retry_count=1)
        expect(channel, CMEventType.ESTABLISHED)
        post_send(shared, qp, n << 1 | 1)
        shared.wait_completions({n << 1, n << 1 | 1}, "send/receive")
        cm_id.disconnect()
        qp.close()
        cm_id.close()
        n += 1
        if (result := clock.connected()) is not None:
            return result


async def _rdmaio_serve(host: str, port: int) -> None:
    async def echo(ep: rdmaio.Endpoint) -> None:
        async with ep:
            while (msg := await ep.recv()) is not None:
                await ep.send(msg)

    server = await rdmaio.serve(echo, host, port)
    print(READY, flush=True)
    async with server:
        await server.serve_forever()


async def _rdmaio_client(host: str, port: int, seconds: float) -> tuple[float, float, int]:
    """rdmaio's setup loop, the bench's own connection (connect, echo 16 bytes, check, close)."""
    payload = b"x" * MSG
    clock = LoopClock(seconds)
    while True:
        await _rdmaio_setup_once(host, port, payload)
        if (result := clock.connected()) is not None:
            return result


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Run:
    """One loop's measurement: connections/s and CPU milliseconds per connection of client and server."""

    def __init__(self, rate: float, connections: int, client_cpu: float, server_cpu: float) -> None:
        self.rate = rate
        self.client_ms = 1000 * client_cpu / connections
        self.server_ms = 1000 * server_cpu / connections


def _measure(server_cmd: list[str], client_cmd: list[str], native: bool) -> Run:
    """Start the server, run the client to its end, stop the server. The server's CPU is counted from its
    ready line to the client's end (not its start-up); a Python client reports its own over the timed
    connections, the native client's comes from the children's usage (its start-up is a few ms)."""
    server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    if "listening" not in line:
        server.kill()
        sys.exit(f"setup_floor: server did not start: {line!r}")
    try:
        server_start = _process_cpu(server.pid)
        before = _children_cpu()
        out = subprocess.run(client_cmd, capture_output=True, text=True, check=True, timeout=300).stdout
        server_cpu = _process_cpu(server.pid) - server_start
    finally:
        server.kill()
        server.wait()
    if native:
        result = parse_cm_setup(out)
        return Run(result.rate, result.connections, _children_cpu() - before, server_cpu)
    _, rate, cpu, conns = out.split()
    return Run(float(rate), int(conns), float(cpu), server_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=os.environ.get("RDMAIO_TEST_ADDR", "198.18.0.1"))
    parser.add_argument("--port", type=int, default=19900)
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of connecting per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--role", choices=("server", "client", "rdmaio-server", "rdmaio-client"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.role == "server":
        serve(args.host, args.port)
        return
    if args.role == "client":
        rate, cpu, conns = run_client(args.host, args.port, args.seconds)
        print(f"rate {rate:.3f} {cpu:.6f} {conns}")
        return
    if args.role == "rdmaio-server":
        asyncio.run(_rdmaio_serve(args.host, args.port))
        return
    if args.role == "rdmaio-client":
        rate, cpu, conns = asyncio.run(_rdmaio_client(args.host, args.port, args.seconds))
        print(f"rate {rate:.3f} {cpu:.6f} {conns}")
        return
    binary = build_cm_setup()
    me = [sys.executable, str(Path(__file__).resolve()), "--host", args.host, "--seconds", str(args.seconds)]
    runs: dict[str, list[Run]] = {"cm_setup": [], "Python verbs loop": [], "rdmaio (asyncio)": []}
    port = args.port
    for round_ in range(1, args.rounds + 1):
        port += 3
        server_cmd, client_cmd = cm_setup_commands(binary, args.host, port, 1_000_000, args.seconds)
        runs["cm_setup"].append(_measure(server_cmd, client_cmd, native=True))
        for name, role, p in (("Python verbs loop", "", port + 1), ("rdmaio (asyncio)", "rdmaio-", port + 2)):
            mine = [*me, "--port", str(p)]
            runs[name].append(
                _measure([*mine, "--role", f"{role}server"], [*mine, "--role", f"{role}client"], False)
            )
        line = ", ".join(
            f"{name} {r[-1].rate:.1f} conn/s (CPU ms/conn {r[-1].client_ms:.2f} + {r[-1].server_ms:.2f})"
            for name, r in runs.items()
        )
        print(f"round {round_}: {line}", flush=True)
    native = runs["cm_setup"]
    print("medians over the rounds (ratio: rate over cm_setup's in the same round)")
    for name, r in runs.items():
        ratio = statistics.median(x.rate / n.rate for x, n in zip(r, native, strict=True))
        client = statistics.median(x.client_ms for x in r)
        server = statistics.median(x.server_ms for x in r)
        print(
            f"  {name:18} ratio {ratio:.3f}  CPU ms per connection: client {client:.2f}, server {server:.2f}"
        )


if __name__ == "__main__":
    main()
