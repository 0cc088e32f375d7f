"""The serial path's flag: one attribute of the operation engine stands for the engine's state that a serial
one-sided call used to check condition by condition, and the connection's close state tells the engine when
closing starts (no introspection of the credits object).

The flag (``OperationEngine._serial_task``) is the id of the task whose next call may take the serial path,
0 while none may. These tests drive the engine through its own code paths (calls, completions, control
messages, cancellation, the close events) and check after every step that the flag equals what the
conditions said (:func:`conditions`); then, fact by fact, that a fact turning false clears the flag and the
next call takes the general path, and that the flag comes back once every fact holds again.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

import rdmaio
from rdmaio.core.backend import AsyncioBackend
from rdmaio.core.onesided import OneSidedEngine
from rdmaio.core.onesided import operations as onesided_operations
from rdmaio.protocol.closestate import CloseState
from rdmaio.testing.fakes import FakeQP, FakeRegion, FakeRegistration, FakeSerialPort, onesided_rig

Run = Callable[[Awaitable[Any]], Any]


def conditions(ops: Any) -> int:
    """What the serial path's engine conditions said before the flag (the caller's task aside): the id of
    the task whose call may take it (the previous poster), or 0. The conditions were: a port, nothing in
    flight, a free staging slot of registered staging, nobody waiting for a slot, no error, not closed,
    and a connection that is not closing (flush_error() None)."""
    state = ops._close_state
    ready = (
        ops._port is not None
        and not ops.ops
        and bool(ops._free_staging)
        and ops._staging is not None
        and not ops._slot_waiters
        and ops.error is None
        and not ops.closed
        and state is not None
        and state.flush_error() is None
    )
    return int(ops._last_poster) if ready else 0


def check(ops: Any) -> None:
    """The flag says exactly what the conditions say."""
    assert ops._serial_task == conditions(ops), (ops._serial_task, conditions(ops))


def serial_calls(ops: Any) -> int:
    """Calls that took the serial path and completed at their post (no op: the general path makes one)."""
    return int(ops._done_at_post)


def me() -> int:
    task = asyncio.current_task()
    assert task is not None
    return id(task)


def step(coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
    """Run a call by hand inside the running task until it waits (for its completion or a slot)."""
    try:
        coro.send(None)
    except StopIteration:
        raise AssertionError("the call did not wait") from None
    return coro


def resume(coro: Coroutine[Any, Any, Any]) -> Any:
    """Resume a call run by :func:`step` whose wait is over; its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the call is still waiting")


async def owned_rig(**kwargs: Any) -> Any:
    """A rig (completions at the post) whose engine's serial path belongs to the running task: its first
    call takes the general path (no previous poster, no staging yet), after which the flag is its."""
    rig = onesided_rig(complete_at_post=True, **kwargs)
    ops = rig.engine.operations
    assert ops._serial_task == 0 and not ops._serial_open  # nothing registered, nobody posted yet
    await rig.engine.read(rig.key, 0, 8)
    assert serial_calls(ops) == 0
    assert ops._serial_task == me()
    check(ops)
    return rig


# --- the flag tracks the conditions through every path ------------------------------------------------------


def test_the_flag_equals_the_conditions_after_every_step(arun: Run) -> None:
    async def main() -> None:
        rig = await owned_rig(max_ops=2)
        engine, key, port = rig.engine, rig.key, rig.port
        ops = engine.operations
        check(ops)
        for _ in range(3):  # serial calls completed at their post
            await engine.fetch_add(key, 8, 1)
            check(ops)
        await engine.write(key, 0, bytearray(b"x" * 8))  # not bytes: the general path, polled
        check(ops)
        big = rdmaio.core.onesided.RemoteKey(key.addr, key.rkey, 1 << 20, key.access_bits, key.key_id)
        await engine.read(big, 0, 100_000)  # larger than a staging slot: a pooled buffer, general path
        check(ops)
        await engine.fetch_add_many(key, [0, 8, 16])  # a wave: serial, completed a loop iteration later
        check(ops)
        # a call completed a loop iteration later: in flight (flag down) until its completion
        port.at_post = lambda wr: rdmaio.verbs.POSTED
        call = step(engine.read(key, 0, 8))
        check(ops)
        assert ops._serial_task == 0
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        check(ops)
        assert len(resume(call)) == 8
        check(ops)
        # a cancelled call: its op stays in flight (and its staging held) until the completion
        task = asyncio.ensure_future(engine.read(key, 0, 8))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        check(ops)
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        check(ops)
        # concurrent tasks: doorbells, completions a loop iteration later
        port.at_post = lambda wr: rdmaio.verbs.POSTED_DONE

        async def caller() -> None:
            for _ in range(3):
                await engine.fetch_add(key, 8, 1)
                check(ops)

        await asyncio.gather(*(caller() for _ in range(3)))
        check(ops)
        # control messages (orphan ops: released by their completion)
        ops.queue_send(b"c1")
        check(ops)
        await asyncio.sleep(0)
        check(ops)
        await engine.read(key, 0, 8)
        check(ops)
        # a failed completion fails the call; the engine goes on
        port.at_post = lambda wr: rdmaio.verbs.POSTED
        call = step(engine.read(key, 0, 8))
        engine.on_completion(rig.qp.posted[-1]["wr_id"], int(rdmaio.verbs.WcStatus.RETRY_EXC_ERR))
        check(ops)
        with pytest.raises(rdmaio.EndpointClosedError):
            resume(call)
        check(ops)
        # the end: closing, then closed
        rig.close_state.close()
        check(ops)
        engine.close(None)
        check(ops)
        assert ops._serial_task == 0

    arun(main())


# --- fact by fact: false clears the flag (the next call takes the general path), true sets it again ---------


def test_a_request_in_flight_lowers_the_flag_and_the_call_shares_its_doorbell(arun: Run) -> None:
    async def main() -> None:
        rig = await owned_rig()
        engine, ops = rig.engine, rig.engine.operations
        ops.queue_send(b"ctl")  # a control message: posted now, completed a loop iteration later
        assert ops.ops and ops._serial_task == 0
        before, calls = serial_calls(ops), len(rig.qp.calls)
        await engine.fetch_add(rig.key, 8, 1)
        assert serial_calls(ops) == before  # the general path
        assert len(rig.qp.calls) == calls + 1  # its own doorbell: the control message was posted alone
        assert not ops.ops and ops._serial_task == me()  # nothing in flight: the flag is back
        await engine.fetch_add(rig.key, 8, 1)
        assert serial_calls(ops) == before + 1

    arun(main())


def test_no_free_staging_slot_and_a_slot_waiter_lower_the_flag(arun: Run) -> None:
    """One staging slot (max_ops=1), held by a call that completed but has not resumed: nothing is in
    flight, but no slot is free. The owner's next call takes the general path and waits for the slot (a
    slot waiter, which keeps the flag down too); the flag is back once the slot is given back and the
    waiter has its op."""

    async def main() -> None:
        rig = await owned_rig(max_ops=1)
        engine, ops, port = rig.engine, rig.engine.operations, rig.port
        port.at_post = lambda wr: rdmaio.verbs.POSTED
        held = step(engine.read(rig.key, 0, 8))
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        assert not ops.ops and not ops._free_staging  # done, its staging slot not given back yet
        assert ops._serial_task == 0
        check(ops)
        port.at_post = lambda wr: rdmaio.verbs.POSTED_DONE
        before = serial_calls(ops)
        waiting = step(engine.fetch_add(rig.key, 8, 1))  # the general path: waits for the slot
        assert len(ops._slot_waiters) == 1 and ops._serial_task == 0
        check(ops)
        assert resume(held) == bytes(8)  # gives the slot back and wakes the waiter
        assert not ops._slot_waiters
        check(ops)
        assert resume(waiting) == 0  # posted on its own (the general path), completed at its post
        assert serial_calls(ops) == before
        assert ops._serial_task == me()
        check(ops)
        await engine.fetch_add(rig.key, 8, 1)
        assert serial_calls(ops) == before + 1

    arun(main())


def test_another_tasks_call_takes_the_general_path_and_the_serial_path_becomes_its(arun: Run) -> None:
    async def main() -> None:
        rig = await owned_rig()
        engine, ops = rig.engine, rig.engine.operations
        before = serial_calls(ops)

        async def other() -> None:
            await engine.read(rig.key, 0, 8)
            assert serial_calls(ops) == before  # not the previous poster: the general path
            assert ops._serial_task == me()
            await engine.read(rig.key, 0, 8)
            assert serial_calls(ops) == before + 1  # now it is

        task = asyncio.ensure_future(other())
        await task
        assert ops._serial_task == id(task)
        await engine.read(rig.key, 0, 8)  # and the first task's next call takes the general path
        assert serial_calls(ops) == before + 1 and ops._serial_task == me()

    arun(main())


@pytest.mark.parametrize("event", ["close", "abort", "on_disconnected", "on_transport_error", "mark_closed"])
def test_each_close_event_lowers_the_flag_for_good(arun: Run, event: str) -> None:
    async def main() -> None:
        rig = await owned_rig()
        engine, ops, state = rig.engine, rig.engine.operations, rig.close_state
        args = (rdmaio.VerbsError("gone"),) if event == "on_transport_error" else ()
        getattr(state, event)(*args)
        assert ops._serial_task == 0 and not ops._serial_open
        check(ops)
        posted = len(rig.qp.posted)
        for call in (engine.read(rig.key, 0, 8), engine.fetch_add(rig.key, 8, 1)):
            with pytest.raises(rdmaio.RdmaError):
                await call  # the general path raises the connection's error
        with pytest.raises(rdmaio.RdmaError):
            await engine.fetch_add_many(rig.key, [0])
        assert len(rig.qp.posted) == posted and ops._serial_task == 0

    arun(main())


def test_a_closed_engine_has_no_serial_path(arun: Run) -> None:
    async def main() -> None:
        rig = await owned_rig()
        engine, ops = rig.engine, rig.engine.operations
        engine.close(rdmaio.EndpointClosedError("gone"))
        assert ops._serial_task == 0
        posted = len(rig.qp.posted)
        with pytest.raises(rdmaio.EndpointClosedError):
            await engine.compare_swap(rig.key, 8, 0, 1)
        assert len(rig.qp.posted) == posted and ops._serial_task == 0

    arun(main())


def test_a_cancelled_slot_wait_gives_the_flag_back(arun: Run) -> None:
    """A caller waiting for a slot keeps the flag down; cancelled, it leaves the queue and the flag comes
    back once nothing else is in the way."""

    async def main() -> None:
        rig = await owned_rig(max_ops=1)
        engine, ops, port = rig.engine, rig.engine.operations, rig.port
        port.at_post = lambda wr: rdmaio.verbs.POSTED
        in_flight = step(engine.read(rig.key, 0, 8))
        waiter = asyncio.ensure_future(engine.fetch_add(rig.key, 8, 1))
        await asyncio.sleep(0)
        assert len(ops._slot_waiters) == 1 and ops._serial_task == 0
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not ops._slot_waiters and ops._serial_task == 0  # still in flight
        check(ops)
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        resume(in_flight)
        assert ops._serial_task == me()
        check(ops)

    arun(main())


def _engine(*, port: bool, close_state: CloseState | None) -> tuple[Any, FakeQP]:
    """An engine on the running loop over a fake QP whose requests complete at their post (when it has a
    port), its credits answering flush_error from a CloseState (a Session's)."""
    qp = FakeQP()
    serial = FakeSerialPort(qp)
    serial.at_post = lambda wr: rdmaio.verbs.POSTED_DONE
    loop = asyncio.get_running_loop()
    state = close_state if close_state is not None else CloseState()
    credits = collections.namedtuple("credits", "can_take_slot take_slot on_slot_used flush_error")(
        lambda: True, lambda: None, lambda: None, state.flush_error
    )
    engine = OneSidedEngine(
        AsyncioBackend(loop),
        qp,
        credits,
        register_local=FakeRegion,
        register_grant=lambda view, bits: FakeRegion(view, bits),
        cache_get=FakeRegistration,
        fail=lambda exc: None,
        max_ops=4,
        max_inline=0,
        revoke_timeout=5.0,
        port=serial if port else None,
        close_state=close_state,
    )
    original = qp.post_rdma

    def completed_later(count: int) -> None:
        start = len(qp.posted)
        original(count)
        for entry in qp.posted[start:]:
            loop.call_soon(engine.on_completion, entry["wr_id"], 0)

    qp.post_rdma = completed_later  # type: ignore[method-assign]
    return engine, qp


@pytest.mark.parametrize(("port", "close_state"), [(True, False), (False, True)])
def test_without_a_port_or_a_close_state_no_call_takes_the_serial_path(
    arun: Run, port: bool, close_state: bool
) -> None:
    """The engine is not told when the connection starts closing unless it is given the close state: it
    does not look for one behind the credits' flush_error (a CloseState's bound method here, which the
    serial path used to find by introspection), so without it no call is serial."""

    async def main() -> None:
        engine, qp = _engine(port=port, close_state=CloseState() if close_state else None)
        key = rdmaio.core.onesided.RemoteKey(0x10000, 0x77, 4096, 7, 1)
        for _ in range(5):
            await engine.read(key, 0, 8)
            await engine.fetch_add(key, 8, 1)
        ops = engine.operations
        assert serial_calls(ops) == 0 and ops._serial_task == 0
        assert len(qp.posted) == 10

    arun(main())


def test_with_its_close_state_an_engine_takes_the_serial_path(arun: Run) -> None:
    async def main() -> None:
        state = CloseState()
        engine, _qp = _engine(port=True, close_state=state)
        key = rdmaio.core.onesided.RemoteKey(0x10000, 0x77, 4096, 7, 1)
        await engine.read(key, 0, 8)
        for _ in range(5):
            await engine.fetch_add(key, 8, 1)
        assert serial_calls(engine.operations) == 5
        state.close()
        with pytest.raises(rdmaio.EndpointClosedError):
            await engine.read(key, 0, 8)

    arun(main())


# --- the close state's watchers ---------------------------------------------------------------------------


class Watcher:
    def __init__(self, told: list[Watcher]) -> None:
        self.told = told

    def on_closing(self) -> None:
        self.told.append(self)


@pytest.mark.parametrize("event", ["close", "abort", "on_disconnected", "on_transport_error", "mark_closed"])
def test_the_close_state_tells_its_watchers_once_when_closing_starts(event: str) -> None:
    state = CloseState()
    told: list[Watcher] = []
    first, second = Watcher(told), Watcher(told)
    state.watch(first)
    state.watch(second)
    state.write_eof()  # a half-close: the connection is still usable
    state.on_peer_eof()
    assert told == [] and not state.closing and state.flush_error() is None
    args = (RuntimeError("gone"),) if event == "on_transport_error" else ()
    getattr(state, event)(*args)
    assert told == [first, second] and state.closing and state.flush_error() is not None
    for later in ("close", "abort", "on_disconnected", "mark_closed"):
        getattr(state, later)()
    state.on_transport_error(RuntimeError("again"))
    assert told == [first, second]  # once
    late = Watcher(told)
    state.watch(late)  # already closing: told at once
    assert told == [first, second, late]


def test_the_close_state_holds_its_watchers_weakly() -> None:
    state = CloseState()
    told: list[Watcher] = []
    watcher = Watcher(told)
    state.watch(watcher)
    gone = weakref.ref(watcher)
    del watcher
    assert gone() is None  # freed at once: no reference from the close state
    state.close()
    assert told == []


def test_the_running_task_is_found_by_the_public_function_where_it_is_c() -> None:
    """On Python 3.12+ asyncio.current_task is C and the engine uses it; on 3.11 (Python code there) the
    engine reads the dict that function reads. Either way it names the running task."""
    task_of_loop = onesided_operations._task_of_loop
    if isinstance(asyncio.current_task, type(len)):
        assert task_of_loop is asyncio.current_task
    found: list[object] = []

    async def main() -> None:
        found.append(task_of_loop(asyncio.get_running_loop()))
        found.append(asyncio.current_task())

    asyncio.run(main())
    assert found[0] is found[1] is not None
