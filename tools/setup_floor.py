#!/usr/bin/env python3
"""The floor of connection setup for any Python caller: ``cm_setup``'s loop written in Python.

``python -m rdmaio bench --only setup`` compares rdmaio's connect + 16 B echo + close loop with
``cm_setup`` (``rdmaio/bench/native/cm_setup.c``). This tool measures what part of the gap is Python's
own and not rdmaio's: the very same loop, step for step and system call for system call, written with
rdmaio's thin verbs layer (:mod:`rdmaio.verbs`, cffi) and no event loop - blocking in ``select()`` where
``cm_setup`` blocks in the kernel, one shared PD, CQ, completion channel and MR, no protocol, no
handshake, no EOF. No Python program that makes these calls can set up connections faster, so its rate
over ``cm_setup``'s is the ceiling of rdmaio's setup ratio on the machine it runs on.

Run it where an RDMA device exists (the test host)::

    python -m rdmaio.testing.host --cpus 2 -- .venv/bin/python tools/setup_floor.py --rounds 3

Each round runs ``cm_setup``'s server and client, then this loop's (each server in its own process, as
in the bench), for ``--seconds`` each; it prints every rate and the median ratio.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rdmaio import verbs
from rdmaio.bench.external import build_cm_setup, cm_setup_commands
from rdmaio.bench.parsers import parse_cm_setup
from rdmaio.verbs import CMEventType

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


def run_client(host: str, port: int, seconds: float) -> float:
    """``cm_setup client ... echo``: connections per second after one uncounted warm-up connection."""
    channel = verbs.EventChannel()
    shared: Shared | None = None
    done, start = -1, 0.0
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
        n = done + 1
        post_recv(shared, qp, n << 1)
        cm_id.connect(retry_count=5, rnr_retry_count=1)
        expect(channel, CMEventType.ESTABLISHED)
        post_send(shared, qp, n << 1 | 1)
        shared.wait_completions({n << 1, n << 1 | 1}, "send/receive")
        cm_id.disconnect()
        qp.close()
        cm_id.close()
        done += 1
        now = time.perf_counter()
        if done == 0:
            start = now
        elif now - start >= seconds:
            return done / (now - start)


def _start_server(cmd: list[str]) -> subprocess.Popen[str]:
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    if "listening" not in line:
        server.kill()
        sys.exit(f"setup_floor: server did not start: {line!r}")
    return server


def _stop(server: subprocess.Popen[str]) -> None:
    server.kill()
    server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=os.environ.get("RDMAIO_TEST_ADDR", "198.18.0.1"))
    parser.add_argument("--port", type=int, default=19900)
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of connecting per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        serve(args.host, args.port)
        return
    if args.role == "client":
        print(f"rate {run_client(args.host, args.port, args.seconds):.3f}")
        return
    binary = build_cm_setup()
    ratios = []
    port = args.port
    for round_ in range(1, args.rounds + 1):
        port += 2
        server_cmd, client_cmd = cm_setup_commands(binary, args.host, port, 1_000_000, args.seconds)
        server = _start_server(server_cmd)
        try:
            out = subprocess.run(client_cmd, capture_output=True, text=True, check=True, timeout=300).stdout
        finally:
            _stop(server)
        native = parse_cm_setup(out).rate
        me = [sys.executable, str(Path(__file__).resolve()), "--host", args.host]
        server = _start_server([*me, "--port", str(port + 1), "--role", "server"])
        try:
            client = [*me, "--port", str(port + 1), "--seconds", str(args.seconds), "--role", "client"]
            out = subprocess.run(client, capture_output=True, text=True, check=True, timeout=300).stdout
        finally:
            _stop(server)
        floor = float(out.split()[-1])
        ratios.append(floor / native)
        print(
            f"round {round_}: cm_setup {native:.1f} conn/s, Python verbs loop {floor:.1f} conn/s, "
            f"ratio {floor / native:.3f}",
            flush=True,
        )
    print(f"median ratio of the Python verbs loop to cm_setup: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
