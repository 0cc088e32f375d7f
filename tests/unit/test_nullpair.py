"""rdmaio.testing.nullpair: real Endpoints over the null device (messages, one-sided requests on real
memory, completed at post or a loop iteration later, setup through the acceptor, close) and its meter."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from rdmaio.core import acceptor as acceptor_module
from rdmaio.core import onesided as onesided_module
from rdmaio.protocol import FEATURE_GROW
from rdmaio.testing import nullpair
from rdmaio.testing.nullpair import DeviceMeter, NullDevice, NullListener, null_connect, null_pair

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def test_messages_and_stream_bytes_travel_both_ways(arun: Run) -> None:
    async def main() -> None:
        a, b, _device = null_pair()
        await a.send(b"ping")
        assert await b.recv() == b"ping"
        await b.send(b"pong")
        assert await a.recv() == b"pong"
        a.write(b"stream bytes")
        await a.drain()
        assert await b.readexactly(12) == b"stream bytes"
        a.close()
        await a.wait_closed()
        assert await b.recv() is None  # the peer's DISCONNECTED came through the device
        b.close()
        await b.wait_closed()

    arun(main())


@pytest.mark.parametrize("at_post", [True, False])
def test_one_sided_requests_run_on_real_memory(arun: Run, at_post: bool) -> None:
    """Every one-sided call does what the NIC would to the exported memory; serial calls complete at
    their post only when the device is told to (counted by the engine), never otherwise."""

    async def main() -> None:
        a, b, device = null_pair(onesided_at_post=at_post)
        memory = bytearray(256)
        memory[:5] = b"hello"
        key = b.export(memory, access="rwa", scope="domain")
        assert await a.rdma_read(key, 0, 5) == b"hello"
        await a.rdma_write(key, 16, b"written")
        assert memory[16:23] == b"written"
        assert await a.fetch_add(key, 32, 5) == 0
        assert await a.fetch_add(key, 32, 2) == 5
        assert struct.unpack_from("<Q", memory, 32)[0] == 7
        assert await a.compare_swap(key, 40, 0, 9) == 0
        assert await a.compare_swap(key, 40, 1, 11) == 9  # no swap: 9 stays
        assert struct.unpack_from("<Q", memory, 40)[0] == 9
        assert await a.fetch_add_many(key, [48, 56, 48], 1) == [0, 0, 1]
        assert struct.unpack_from("<QQ", memory, 48) == (2, 1)
        assert device.executed == 9
        at_post_count = a.statistics()["rdma_completed_at_post"]
        # Six single calls: the first of a task is not a serial one (it is posted without a poll), the 5
        # after it complete at their post when the device completes them there.
        assert at_post_count == (5 if at_post else 0)
        a.abort()
        b.abort()

    arun(main())


def test_setup_through_the_acceptor_and_close(arun: Run) -> None:
    async def main() -> None:
        listener = NullListener(NullDevice())
        for _ in range(3):
            client, server = await listener.connect()
            # The server answered the client's growing handshake with its own (read by the client).
            assert client._conn.session.peer.features & FEATURE_GROW
            await client.send(b"hi")
            assert await server.recv() == b"hi"
            client.close()
            server.close()
            await client.wait_closed()
            await server.wait_closed()
            listener.forget_closed()
            assert listener.reactor.cm_handlers == {} and listener.reactor.handlers == {}
        assert listener.acceptor.accepted == 3 and listener.acceptor.pending == 0
        # The module globals replaced while connections were made are back.
        assert acceptor_module.Transport is not None and acceptor_module.Transport.__name__ == "Transport"
        assert onesided_module.local_and_grant_registrars.__module__ == "rdmaio.core.onesided.registrars"
        c, s, _device = await null_connect()
        await s.send(b"x")
        assert await c.recv() == b"x"
        c.abort()
        s.abort()

    arun(main())


class FakeClock:
    """``thread_time`` from a script of readings."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def thread_time(self) -> float:
        return self.readings.pop(0)


def test_the_meter_counts_the_device_without_what_it_calls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    meter = DeviceMeter()
    calls: list[str] = []

    def rdmaio_code() -> None:
        calls.append("rdmaio")
        post()  # rdmaio posts again from inside the callback: the device once more

    def post_inner() -> None:
        calls.append("post")

    post = meter.device(post_inner)
    callback = meter.callback(rdmaio_code)

    @meter.device
    def deliver() -> None:
        calls.append("deliver")
        callback()

    # Readings: enter deliver 0; leave it for the callback 1; the nested post enters 3, leaves 4; back
    # in deliver 6; deliver ends 10. Device time: (1 - 0) + (4 - 3) + (10 - 6) = 6.
    monkeypatch.setattr(nullpair, "time", FakeClock(0.0, 1.0, 3.0, 4.0, 6.0, 10.0))
    deliver()
    assert calls == ["deliver", "rdmaio", "post"]
    assert (meter.seconds, meter.entries, meter.callbacks) == (6.0, 2, 1)
    meter.entry_cost, meter.callback_cost = 1.0, 0.5
    assert meter.corrected == 6.0 - 2 * 1.0 - 0.5
    post_inner_only = FakeClock(20.0, 20.5)
    monkeypatch.setattr(nullpair, "time", post_inner_only)
    meter.reset()
    post()
    assert (meter.seconds, meter.entries, meter.callbacks) == (0.5, 1, 0)
    meter.callback(calls.clear)()  # called from outside the device: no crossing, no clock read
    assert (meter.seconds, meter.entries, meter.callbacks) == (0.5, 1, 0) and calls == []


def test_calibration_sets_the_crossing_costs() -> None:
    meter = DeviceMeter()
    meter.calibrate(rounds=200)
    assert meter.entry_cost >= 0 and meter.callback_cost >= 0
    assert (meter.seconds, meter.entries, meter.callbacks) == (0.0, 0, 0)  # reset after calibrating


def test_a_metered_pair_carries_the_same_traffic(arun: Run) -> None:
    async def main() -> None:
        meter = DeviceMeter()
        a, b, _device = null_pair(meter=meter)
        for i in range(10):
            await a.send(bytes([i]) * 64)
            assert await b.recv() == bytes([i]) * 64
        memory = bytearray(64)
        key = b.export(memory, access="a", scope="domain")
        for _ in range(3):
            await a.fetch_add(key, 0, 1)
        assert memory[0] == 3
        assert meter.entries > 0 and meter.callbacks > 0  # posts, deliveries, completion handlers
        a.abort()
        b.abort()
        await asyncio.sleep(0)

    arun(main())
