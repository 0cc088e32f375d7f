"""``ConnectInThread``: iWARP's rdma_connect (a blocking kernel TCP connect on Soft-iWARP) runs off the
loop; the loop stays free, the call's error is raised to the waiter, and a waiter that gives up hands the
release of the cm id to the moment the call returns, never earlier. Natively, with a stand-in call."""

from __future__ import annotations

import asyncio
import errno
import threading
import time

import pytest

from rdmaio.core.backend import AsyncioBackend
from rdmaio.core.blocking_connect import ConnectInThread
from rdmaio.errors import UnreachableError


def test_the_loop_runs_while_the_call_blocks_and_its_error_is_raised() -> None:
    release = threading.Event()
    ticks = 0

    def blocking_call() -> None:
        release.wait(30)
        raise UnreachableError(
            "198.18.0.99 port 7471 unreachable", errno=errno.ETIMEDOUT, call="rdma_connect"
        )

    async def main() -> None:
        nonlocal ticks
        pending = ConnectInThread(AsyncioBackend(asyncio.get_running_loop()), blocking_call)
        for _ in range(5):  # the loop keeps running while the call blocks
            await asyncio.sleep(0.01)
            ticks += 1
        assert not pending.done
        release.set()
        with pytest.raises(UnreachableError) as info:
            await asyncio.wait_for(pending.wait(), 30)
        assert info.value.errno == errno.ETIMEDOUT and pending.done

    asyncio.run(main())
    assert ticks == 5


def test_a_waiter_that_gives_up_releases_only_after_the_call_returns() -> None:
    """What a dial's timeout does: the id is released once rdma_connect is out of it, on the loop."""
    release = threading.Event()
    inside = threading.Event()
    events: list[str] = []

    def blocking_call() -> None:
        inside.set()
        release.wait(30)
        events.append("call returned")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pending = ConnectInThread(AsyncioBackend(loop), blocking_call)
        await loop.run_in_executor(None, inside.wait, 30)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pending.wait(), 0.05)
        released = loop.create_future()
        pending.release_when_done(lambda: (events.append("released"), released.set_result(None)))
        await asyncio.sleep(0.05)
        assert events == []  # not while the call may use the id
        release.set()
        await asyncio.wait_for(released, 30)
        assert threading.current_thread() is threading.main_thread()  # the release ran on the loop

    asyncio.run(main())
    assert events == ["call returned", "released"]


def test_a_call_that_succeeded_returns_and_a_late_release_runs_at_once() -> None:
    async def main() -> None:
        pending = ConnectInThread(AsyncioBackend(asyncio.get_running_loop()), lambda: time.sleep(0.01))
        await asyncio.wait_for(pending.wait(), 30)
        ran: list[bool] = []
        pending.release_when_done(lambda: ran.append(True))
        assert ran == [True]

    asyncio.run(main())
