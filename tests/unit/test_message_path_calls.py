"""The Python structure of the message path: which calls a small message's round trip makes, over the fake
pair of test_connection_unit (both sides, asyncio and uvloop).

Counted, not timed: ``sys.setprofile`` sees every Python function call. The tests pin what the structure
of the path is (one coroutine per send and per recv, no settling or waiting helper, no one-sided pump with
nothing waiting for a credit, one session question after a batch), not the per-frame work that other
parts do, so they hold whatever that work costs.
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from test_connection_unit import pair

from rdmaio.protocol import Handshake, Session
from rdmaio.protocol.handshake import FEATURE_GROW

Run = Callable[[Coroutine[Any, Any, Any]], Any]
ROUND_TRIPS = 200


async def _echo_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Python calls per function (``module:function``) during ROUND_TRIPS echo round trips of 64 bytes."""
    a, b = pair(monkeypatch)

    async def server() -> None:
        while (message := await b.recv()) is not None:
            await b.send(message)

    task = asyncio.ensure_future(server())
    message = b"x" * 64
    for _ in range(20):  # warm: the first messages grow nothing here, but keep the measured ones typical
        await a.send(message)
        assert await a.recv() == message
    counts: collections.Counter[str] = collections.Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            counts[code.co_filename.rsplit("/", 1)[-1] + ":" + code.co_name] += 1

    sys.setprofile(hook)
    try:
        for _ in range(ROUND_TRIPS):
            await a.send(message)
            await a.recv()
    finally:
        sys.setprofile(None)
    task.cancel()
    return counts


def test_an_echo_round_trip_makes_one_coroutine_per_send_and_recv_and_no_helper_calls(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = arun(_echo_calls(monkeypatch))

    def per_round_trip(name: str) -> float:
        calls: int = counts[name]
        return calls / ROUND_TRIPS

    # Each side sends and receives once per round trip: one Sender.send coroutine (it never waits), one
    # Receiver.recv coroutine started and resumed once (it waits), and no front coroutine above them.
    assert per_round_trip("send.py:send") == 2
    assert per_round_trip("receive.py:recv") == 4
    assert per_round_trip("endpoint.py:send") == per_round_trip("endpoint.py:recv") == 0
    # No helper call on the way: the buffer's test, the pop and the wait are inline; a wake-up is a future.
    for name in (
        "rxbuffer.py:has_message",
        "rxbuffer.py:_settle_head",
        "rxbuffer.py:pop_message",
        "rxbuffer.py:_added",
        "receive.py:_wait_more",
        "receive.py:recv_nowait",
        "backend.py:waiter",
        "backend.py:wait",
        "backend.py:set",
        "session.py:check_message_size",
        "operations.py:pump",  # nothing one-sided waits for a credit
        # The close state is an attribute test while no close fact holds: no question asked.
        "closestate.py:send_error",
        "closestate.py:recv_outcome",
        # A batch of one received message adds and admits it inline (no buffer call), and wakes the reader
        # inline.
        "rxbuffer.py:add_message",
        "rxbuffer.py:admit",
        "rxbuffer.py:add_admitted",
        "rxbuffer.py:hold",
        "receive.py:wake_reader",
    ):
        assert counts[name] == 0, name
    # One future per wait, one wait per side, made by the future class itself: no Python call.
    assert counts["backend.py:one_shot"] == 0
    # After a completion batch with nothing queued, staged or waiting, the connection asks C whether a
    # control frame is due and calls no sender method; the session's state is a fast C struct, so no
    # Python call of the session at all.
    assert counts["connection.py:on_completions"] > 0
    assert counts["send.py:on_batch_end"] == 0
    assert counts["session.py:control_frame_due"] == 0
    assert counts["session.py:eof_pending"] == 0
    assert counts["session.py:take_data_frame"] == 0
    # An idle connection's message goes in one C call (room, credit, take, copy, work request) and a post:
    # no queueing, staging or transmit helper.
    for name in ("send.py:_queue_batched", "send.py:transmit", "send.py:_stage_queued", "send.py:_post"):
        assert counts[name] == 0, name
    assert counts["sendqueue.py:queue_message"] == 0
    assert counts["session.py:can_send_data"] == 0


def test_pump_runs_after_a_batch_only_while_something_waits_for_a_credit(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        a, b = pair(monkeypatch)
        conn = a._conn
        pumped: list[int] = []
        real_pump = conn.onesided.pump

        def counting_pump() -> None:
            pumped.append(1)
            real_pump()

        monkeypatch.setattr(conn.onesided, "pump", counting_pump)
        await b.send(b"one")
        assert await a.recv() == b"one"
        assert pumped == []  # a batch came, nothing waited for a credit
        # Something waits for a credit (the one-sided engine counts it): the next batch pumps.
        ops = conn.onesided.operations
        ops.waiting_for_credit += 1  # the engine posts nothing here: its real pump is not run below
        monkeypatch.setattr(conn.onesided, "pump", lambda: pumped.append(1))
        await b.send(b"two")
        assert await a.recv() == b"two"
        assert pumped  # pumped after the batch
        ops.waiting_for_credit -= 1
        count = len(pumped)
        await b.send(b"three")
        assert await a.recv() == b"three"
        assert len(pumped) == count  # nothing waits again: no pump

    arun(main())


def test_control_frame_due_is_eof_pending_or_credit_frame_due() -> None:
    # What the sender's early-out asks in one call must answer as the two questions it replaces, in every
    # state a session goes through: random traffic in both directions, growth, EOF, failures.
    rng = random.Random(7)
    for trial in range(60):
        depth = rng.choice((8, 16, 32))
        hs = Handshake(depth, 4096, 1 << 20, features=FEATURE_GROW, initial_depth=depth // 2)
        me, peer = Session(hs, hs), Session(hs, hs)
        for _ in range(200):
            assert me.control_frame_due() == (me.eof_pending() or me.credit_frame_due())
            action = rng.random()
            if action < 0.3 and peer.can_send_data():
                me.on_frame(peer.take_data_frame(True, 1), 1)
                me.on_recv_reposted(1)
            elif action < 0.45 and peer.credit_frame_due():
                me.on_frame(peer.take_credit_frame(), 0)
                me.on_recv_reposted(1)
            elif action < 0.7 and me.can_send_data():
                peer.on_frame(me.take_data_frame(True, 1), 1)
                peer.on_recv_reposted(1)
            elif action < 0.8 and me.credit_frame_due():
                peer.on_frame(me.take_credit_frame(), 0)
                peer.on_recv_reposted(1)
            elif action < 0.85 and me.can_grow:
                me.grow_receives(1)
            elif action < 0.88:
                me.write_eof()
            elif action < 0.9 and me.can_send_eof():
                peer.on_frame(me.take_eof_frame(), 0)
            elif action < 0.905 and trial % 3 == 0:
                me.on_transport_error(ConnectionResetError("gone"))
        assert me.control_frame_due() == (me.eof_pending() or me.credit_frame_due())


def test_the_stream_fronts_are_the_cores_own_methods_unless_overridden(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    # write(), drain() and readexactly() of an endpoint are the sender's and receiver's bound methods (one
    # call per operation, no front); a subclass that overrides one keeps its own.
    from rdmaio.endpoint import Endpoint

    async def main() -> None:
        a, _b = pair(monkeypatch)
        assert a.write == a._writer.write and a.drain == a._writer.drain
        assert a.readexactly == a._reader.readexactly
        assert a.send == a._writer.send and a.recv == a._reader.recv

        class Own(Endpoint):
            def write(self, data: bytes | bytearray | memoryview) -> None:
                super().write(data)

        own = Own(a._conn)
        assert own.write.__func__ is Own.write  # type: ignore[attr-defined]
        assert own.drain == a._writer.drain

    arun(main())
