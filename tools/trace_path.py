"""Trace the Python path of one small message: which rdmaio files one ``await ep.send(b"x")`` crosses until
its ``ibv_post_send``, and one ``await ep.recv()`` on the other side, and how many Python calls each makes.

Run it in the test host (two processes on the same rxe device, 198.18.0.1)::

    /work/tools-local/vm .venv/bin/python -m rdmaio.testing.host -- .venv/bin/python tools/trace_path.py

The receiving side is a child process (so the sender's calls never land in the receiver's trace). After a
warm-up of request/reply round trips (the connection is idle between messages, as a request/reply connection
is, so the send is posted at once), the sender traces ``await ep.send(b"x")`` and the receiver
``await ep.recv()`` with :func:`sys.setprofile`; this repeats ``ROUNDS`` times and the smallest counts are
printed (a loop iteration more or less in the receiver's wait is noise, not the path). Counts are
Python-level calls (``call`` events: functions, methods, generators and coroutines resumed), all of them and
those in rdmaio's own files; ``-v`` lists the rdmaio functions too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import rdmaio

ADDR = os.environ.get("RDMAIO_TEST_ADDR", "198.18.0.1")
WARMUP = 200
ROUNDS = 7
OPTIONS = rdmaio.Options(keepalive_interval=None)  # no timer may fire inside a traced call
_RDMAIO = os.path.dirname(os.path.abspath(rdmaio.__file__)) + os.sep


class Trace:
    """The Python calls of one traced await: every one, those in rdmaio's files, the files, and the calls
    up to the first ``post_sends`` (the ibv_post_send of the chain)."""

    def __init__(self) -> None:
        self.calls = 0
        self.rdmaio_calls = 0
        self.files: dict[str, int] = {}
        self.functions: dict[str, int] = {}
        self.calls_to_post: int | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        self.calls += 1
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith(_RDMAIO):
            self.rdmaio_calls += 1
            rel = filename[len(_RDMAIO) - len("rdmaio/") :]
            self.files[rel] = self.files.get(rel, 0) + 1
            name = f"{rel}:{code.co_name}"
            self.functions[name] = self.functions.get(name, 0) + 1
            if self.calls_to_post is None and code.co_name == "post_sends":
                self.calls_to_post = self.calls

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "rdmaio_calls": self.rdmaio_calls,
            "calls_to_post": self.calls_to_post,
            "files": dict(sorted(self.files.items())),
            "functions": dict(sorted(self.functions.items())),
        }


async def traced(make: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """Run ``await make()`` with a profile function on; return its trace's summary."""
    trace = Trace()
    sys.setprofile(trace)
    try:
        await make()
    finally:
        sys.setprofile(None)
    return trace.summary()


def smallest(results: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(results, key=lambda r: (r["calls"], r["rdmaio_calls"]))
    best = dict(best)
    best["calls_all_rounds"] = [r["calls"] for r in results]
    best["rdmaio_calls_all_rounds"] = [r["rdmaio_calls"] for r in results]
    return best


async def receiver() -> None:
    """The child: serve one connection, echo the warm-up, then trace ROUNDS recv() calls."""
    done = asyncio.get_running_loop().create_future()

    async def handler(ep: rdmaio.Endpoint) -> None:
        async with ep:
            for _ in range(WARMUP):
                await ep.send(await ep.recv() or b"")
            results = []
            for _ in range(ROUNDS):
                results.append(await traced(ep.recv))
                await ep.send(b"ack")  # the sender's next round starts from an idle connection again
            done.set_result(results)

    server = await rdmaio.serve(handler, ADDR, 0, options=OPTIONS)
    async with server:
        print(server.addresses[0][1], flush=True)
        results = await done
    print(json.dumps(smallest(results)), flush=True)


async def sender(port: int) -> dict[str, Any]:
    ep = await rdmaio.connect(ADDR, port, options=OPTIONS, timeout=30)
    async with ep:
        for _ in range(WARMUP):
            await ep.send(b"x")
            await ep.recv()
        results = []
        for _ in range(ROUNDS):
            await asyncio.sleep(0.2)  # the receiver is waiting in its traced recv() by now
            results.append(await traced(lambda: ep.send(b"x")))
            await ep.recv()
    return smallest(results)


def main() -> None:
    if "--receiver" in sys.argv:
        asyncio.run(receiver())
        return
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--receiver"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        time.sleep(0.1)
        send = asyncio.run(sender(port))
        recv = json.loads(child.stdout.readline())
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    for name, result in (("await ep.send(b'x')", send), ("await ep.recv()", recv)):
        print(f"== {name}")
        print(f"   Python calls: {result['calls']} (rounds: {result['calls_all_rounds']})")
        print(f"   in rdmaio files: {result['rdmaio_calls']} (rounds: {result['rdmaio_calls_all_rounds']})")
        if result["calls_to_post"] is not None:
            print(f"   calls up to post_sends: {result['calls_to_post']}")
        print(f"   rdmaio files crossed: {len(result['files'])}")
        for path, count in result["files"].items():
            print(f"     {count:4d}  {path}")
        if "-v" in sys.argv:
            print("   rdmaio functions (calls; a coroutine counts once more per resumption):")
            for function, count in result["functions"].items():
                print(f"     {count:4d}  {function}")


if __name__ == "__main__":
    main()
