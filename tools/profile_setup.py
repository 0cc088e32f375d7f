#!/usr/bin/env python3
"""Where does rdmaio's connection setup spend its time? A connect + 16 B echo + close loop, timed by step.

Run it where an RDMA device exists (the test host)::

    python -m rdmaio.testing.host --cpus 2 -- .venv/bin/python tools/profile_setup.py --conns 40
    ... tools/profile_setup.py --conns 40 --cprofile .scratch/prof   # plus cProfile of both sides

It starts an echo server in a subprocess (its own event loop, as a real server), then runs the loop in this
process after one warm-up connection. Two views, both per connection (means over the loop):

* the client's timeline: the time between consecutive steps of one connection (the call of
  ``rdma_resolve_addr``, the ``ADDR_RESOLVED`` event reaching the loop, ...), so waits on the network and
  on the peer show up where they happen;
* the synchronous verbs/rdma_cm calls of each side (QP, CQ, MR creation and destruction, ...), timed by
  wrapping them, with the number of calls; what is left of a step's time is Python and the event loop.

The wrappers cost a few microseconds per call; the figures are for finding where the time goes, not for
publishing (``tools/dev bench --only setup`` measures the rate).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rdmaio
from rdmaio import client as client_mod
from rdmaio import endpoint as endpoint_mod
from rdmaio import server as server_mod
from rdmaio import verbs
from rdmaio.core import connection as connection_mod
from rdmaio.core import transport as transport_mod

# (object, attribute, label): the synchronous calls whose time is accounted separately.
_TIMED: list[tuple[Any, str, str]] = [
    (verbs.CMId, "__init__", "rdma_create_id"),
    (verbs.CMId, "resolve_addr", "rdma_resolve_addr (call)"),
    (verbs.CMId, "resolve_route", "rdma_resolve_route (call)"),
    (verbs.CMId, "create_qp", "rdma_create_qp"),
    (verbs.CMId, "connect", "rdma_connect (call)"),
    (verbs.CMId, "accept", "rdma_accept (call)"),
    (verbs.CMId, "disconnect", "rdma_disconnect"),
    (verbs.CMId, "_destroy", "rdma_destroy_id"),
    (verbs.CMId, "device", "cm_id.device()"),
    (verbs.MemoryRegion, "__init__", "ibv_reg_mr"),
    (verbs.MemoryRegion, "_destroy", "ibv_dereg_mr"),
    (verbs.CompletionChannel, "__init__", "ibv_create_comp_channel"),
    (verbs.CompletionChannel, "_destroy", "ibv_destroy_comp_channel"),
    (verbs.CompletionQueue, "__init__", "ibv_create_cq"),
    (verbs.CompletionQueue, "_destroy", "ibv_destroy_cq"),
    (verbs.QueuePair, "_destroy", "rdma_destroy_qp"),
    (verbs.QueuePair, "post_recv_slots", "ibv_post_recv (all slots)"),
    (verbs.DeviceContext, "query_port", "ibv_query_port"),
    (verbs.EventChannel, "get_event", "rdma_get_cm_event+ack"),
    (transport_mod.Transport, "__init__", "Transport() total"),
    (transport_mod.Transport, "close", "Transport.close() total"),
    (endpoint_mod.Endpoint, "__init__", "Endpoint() total"),
    (connection_mod.Connection, "teardown", "Connection.teardown() total"),
]

_sync: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
_timeline: list[tuple[float, str]] = []


def _mark(label: str) -> None:
    _timeline.append((time.perf_counter(), label))


def _timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = _sync[label]
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
            if label.endswith("(call)") or label in ("Transport() total", "Endpoint() total"):
                _mark(label.removesuffix(" (call)"))

    return wrapper


def _instrument() -> None:
    for owner, name, label in _TIMED:
        original = getattr(owner, name, None)
        if original is not None:  # the core changes: time what exists
            setattr(owner, name, _timed(original, label))
    put = client_mod.CMEventQueue.put

    def put_marked(self: Any, event: verbs.CMEvent) -> None:
        _mark(f"event {event.event.name}")
        put(self, event)

    client_mod.CMEventQueue.put = put_marked  # type: ignore[method-assign]


# --- server (subprocess) --------------------------------------------------------------------------------


async def _echo(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


async def _serve(host: str, out: Path, options: dict[str, Any]) -> None:
    server = await rdmaio.serve(_echo, host, 0, options=options)
    print(json.dumps({"port": server.addresses[0][1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    server.close()
    server.close_clients()
    await server.wait_closed()
    accepted = server.connections_accepted
    with open(out, "w") as file:  # noqa: ASYNC230 - once, at the end
        file.write(json.dumps({"accepted": accepted, "sync": dict(_sync)}))


def server_main(host: str, out: Path, cprofile: Path | None, options: dict[str, Any]) -> None:
    """The echo server: print the port, serve until a line arrives on stdin, write the timings."""
    _instrument()
    original = server_mod.StreamServer._on_connect_request
    server_mod.StreamServer._on_connect_request = _timed(  # type: ignore[method-assign]
        original, "server: CONNECT_REQUEST handling total"
    )
    profiler = cProfile.Profile() if cprofile else None
    if profiler is not None:
        profiler.enable()
    asyncio.run(_serve(host, out, options))
    if profiler is not None and cprofile is not None:
        profiler.disable()
        profiler.dump_stats(cprofile / "server.prof")


# --- client ---------------------------------------------------------------------------------------------


async def _one(host: str, port: int, payload: bytes, options: dict[str, Any]) -> None:
    _mark("start")
    ep = await rdmaio.connect(host, port, timeout=60, options=options)
    _mark("connect() returned")
    await ep.send(payload)
    reply = await ep.recv()
    _mark("echo done")
    if reply != payload:
        raise RuntimeError("bad echo")
    await ep.aclose()
    _mark("aclose() returned")


async def _client(host: str, port: int, conns: int, options: dict[str, Any]) -> float:
    payload = b"x" * 16
    await _one(host, port, payload, options)  # warm-up: the loop's event channel, the device's PD
    _timeline.clear()
    _sync.clear()
    t0 = time.perf_counter()
    for _ in range(conns):
        await _one(host, port, payload, options)
    return time.perf_counter() - t0


def _steps() -> dict[str, list[float]]:
    """Time between consecutive timeline marks, per step label (summed over connections)."""
    steps: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    prev: tuple[float, str] | None = None
    for when, label in _timeline:
        if prev is not None and label != "start":
            entry = steps[f"{prev[1]} -> {label}"]
            entry[0] += when - prev[0]
            entry[1] += 1
        prev = (when, label)
    return steps


def _table(title: str, rows: dict[str, list[float]], conns: int, order: list[str] | None = None) -> None:
    print(title)
    keys = order if order is not None else sorted(rows, key=lambda k: -rows[k][0])
    for key in keys:
        total, calls = rows[key]
        print(f"  {total / conns * 1e3:9.2f} ms/conn  {calls / conns:5.2f} calls/conn  {key}")


def main() -> int:
    """Run the server subprocess and the client loop; print both views."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default=os.environ.get("RDMAIO_TEST_ADDR", "198.18.0.1"))
    parser.add_argument("--conns", type=int, default=40, help="connections to time (after one warm-up)")
    parser.add_argument("--cprofile", type=Path, help="also cProfile both sides into this directory")
    parser.add_argument(
        "--options",
        default="{}",
        help="rdmaio Options overrides for both sides, as JSON, e.g. '{\"slot_size\": 8192}'",
    )
    parser.add_argument("--role", default="client", choices=("client", "server"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cprofile is not None:
        args.cprofile.mkdir(parents=True, exist_ok=True)
    options = json.loads(args.options)
    rdmaio.Options.coerce(options)  # refuse a bad override here rather than in the server
    if args.role == "server":
        server_main(args.host, args.out, args.cprofile, options)
        return 0

    out = Path(f"/tmp/profile_setup_server_{os.getpid()}.json")
    cmd = [sys.executable, __file__, "--role", "server", "--host", args.host, "--out", str(out)]
    cmd += ["--options", args.options]
    if args.cprofile is not None:
        cmd += ["--cprofile", str(args.cprofile)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    port = int(json.loads(proc.stdout.readline())["port"])
    _instrument()
    profiler = cProfile.Profile() if args.cprofile else None
    if profiler is not None:
        profiler.enable()
    try:
        elapsed = asyncio.run(_client(args.host, port, args.conns, options))
    finally:
        if profiler is not None and args.cprofile is not None:
            profiler.disable()
            profiler.dump_stats(args.cprofile / "client.prof")
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        proc.wait(120)
    server = json.loads(out.read_text())
    out.unlink()
    steps = _steps()
    print(f"options: {options or 'defaults'}")
    print(
        f"{args.conns} connections in {elapsed:.2f} s: {args.conns / elapsed:.2f} conn/s, "
        f"{elapsed / args.conns * 1e3:.1f} ms per connection"
    )
    _table(
        "client timeline (time between consecutive steps)",
        steps,
        args.conns,
        order=sorted(steps, key=lambda k: -steps[k][0]),
    )
    _table("client synchronous calls", _sync, args.conns)
    _table("server synchronous calls", server["sync"], args.conns + 1)
    print("(server figures are over the warm-up connection too)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
