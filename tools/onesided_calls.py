"""Python calls and CPU per serial one-sided call, on fake verbs (no device).

Counts ``call`` events (``sys.setprofile``) per operation while one task calls serially on a
:class:`~rdmaio.core.onesided.OneSidedEngine` over :class:`rdmaio.testing.fakes.FakeQP`, whose fake device
completes each request either at its post (as rxe does for a loopback READ or atomic: the completion is in
the CQ when ``ibv_post_send`` returns) or one loop iteration later (then the completion comes through
``on_completion``, as the connection's completion handler would deliver it). Calls are counted in rdmaio's
own code (``rdmaio/`` without ``rdmaio/testing/``) and in all Python code; CPU is ``thread_time`` per op,
the minimum of several runs (noisy on a loaded machine: the calls are the main figure).

Run from the clone's root: ``.venv/bin/python tools/onesided_calls.py [--by-function]``.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rdmaio.protocol.closestate import CloseState
from rdmaio.testing.fakes import onesided_rig

N = 2000
RUNS = 7
CASES = ("read64", "write64", "fetch_add", "compare_swap", "fetch_add_many64")


def _op(rig: Any, case: str) -> Callable[[], Awaitable[Any]]:
    engine, key = rig.engine, rig.key
    if case == "read64":
        return lambda: engine.read(key, 0, 64)
    if case == "write64":
        data = b"w" * 64
        return lambda: engine.write(key, 0, data)
    if case == "fetch_add":
        return lambda: engine.fetch_add(key, 8, 1)
    if case == "compare_swap":
        return lambda: engine.compare_swap(key, 8, 0, 1)
    offsets = list(range(0, 64 * 8, 8))
    return lambda: engine.fetch_add_many(key, offsets, 1)


async def measure(case: str, at_post: bool, max_ops: int = 16) -> dict[str, Any]:
    """Calls (rdmaio's, all) and CPU us per op of ``case``."""
    # A Session's close state behind the credits, as on a connection.
    rig = onesided_rig(max_ops=max_ops, complete_at_post=at_post, record=False, close_state=CloseState())
    op = _op(rig, case)
    for _ in range(50):  # warm up: staging registered, the task known as a serial caller
        await op()
    best = float("inf")
    for _ in range(RUNS):
        t0 = time.thread_time()
        for _ in range(N):
            await op()
        best = min(best, (time.thread_time() - t0) / N * 1e6)
    counts: collections.Counter[str] = collections.Counter()
    everything = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal everything
        if event == "call":
            everything += 1
            path = frame.f_code.co_filename
            if "/rdmaio/" in path and "/rdmaio/testing/" not in path:
                counts[f"{path.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1

    sys.setprofile(hook)
    for _ in range(N):
        await op()
    sys.setprofile(None)
    return {
        "case": case,
        "at_post": at_post,
        "rdmaio_calls": sum(counts.values()) / N,
        "all_calls": everything / N,
        "cpu_us": best,
        "by_function": {k: v / N for k, v in counts.most_common()},
    }


async def main(by_function: bool) -> None:
    for case in (*CASES, "fetch_add_many64 max_ops=64"):
        for at_post in (True, False):
            if case.endswith("max_ops=64"):
                r = await measure(case.split()[0], at_post, max_ops=64)
            else:
                r = await measure(case, at_post)
            when = "at post" if at_post else "next iteration"
            print(
                f"{case:28s} {when:15s} rdmaio calls/op {r['rdmaio_calls']:6.2f}  all calls/op "
                f"{r['all_calls']:6.2f}  cpu {r['cpu_us']:6.2f} us"
            )
            if by_function:
                for name, n in r["by_function"].items():
                    print(f"      {n:6.2f} {name}")


if __name__ == "__main__":
    asyncio.run(main("--by-function" in sys.argv))
