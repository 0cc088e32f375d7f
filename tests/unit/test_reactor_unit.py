"""Unit tests of rdmaio.core.reactor without a device: async-event routing and the per-loop registry."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import trio
import uvloop

from rdmaio import verbs
from rdmaio.core.reactor import Reactor
from rdmaio.testing.fakes import FakeBackend, FakeDevice, FakeDomain, FakeEventChannel


def qp_event(etype: int, qp_num: int) -> verbs.AsyncEvent:
    return verbs.AsyncEvent(etype, f"event {etype}", "qp", qp_num, 0)


def routed(events_by_device: dict[int, list[verbs.AsyncEvent]]) -> dict[str, list[int]]:
    """Register three connections (two devices share QP number 7; a and c share CQ 100) and dispatch."""
    reactor = Reactor(FakeBackend())  # type: ignore[arg-type]
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def handler(name: str) -> Any:
        return lambda event: seen[name].append(event.event_type)

    reactor.watch_qp(1, 7, 100, handler("a"))  # device 1, QP 7, CQ 100
    reactor.watch_qp(2, 7, 200, handler("b"))  # device 2, QP 7 too: QP numbers are per device
    reactor.watch_qp(1, 8, 100, handler("c"))  # device 1, QP 8, CQ 100
    for handle, events in events_by_device.items():
        reactor._on_async_readable(FakeDevice(handle, *events))  # type: ignore[arg-type]
    return seen


def test_qp_events_are_routed_by_device_and_qp_number() -> None:
    seen = routed({2: [qp_event(verbs.EVENT_QP_FATAL, 7)]})
    assert seen == {"a": [], "b": [verbs.EVENT_QP_FATAL], "c": []}


def test_comm_est_is_informational() -> None:
    seen = routed({1: [qp_event(verbs.EVENT_COMM_EST, 7), qp_event(verbs.EVENT_COMM_EST, 8)]})
    assert seen == {"a": [], "b": [], "c": []}


def test_cq_error_fails_only_the_connections_of_that_cq() -> None:
    cq_err = verbs.AsyncEvent(verbs.EVENT_CQ_ERR, "CQ error", "device", 0, 200)
    seen = routed({2: [cq_err]})
    assert seen == {"a": [], "b": [verbs.EVENT_CQ_ERR], "c": []}


def test_device_fatal_fails_every_connection_of_that_device_only() -> None:
    fatal = verbs.AsyncEvent(verbs.EVENT_DEVICE_FATAL, "fatal", "device", 0, 0)
    seen = routed({1: [fatal]})
    assert seen == {"a": [verbs.EVENT_DEVICE_FATAL], "b": [], "c": [verbs.EVENT_DEVICE_FATAL]}


def test_unwatched_connections_get_nothing() -> None:
    reactor = Reactor(FakeBackend())  # type: ignore[arg-type]
    seen: list[int] = []
    reactor.watch_qp(1, 7, 100, lambda event: seen.append(event.event_type))
    reactor.unwatch_qp(1, 7, 100)
    cq_err = verbs.AsyncEvent(verbs.EVENT_CQ_ERR, "CQ error", "device", 0, 100)
    reactor._on_async_readable(FakeDevice(1, qp_event(verbs.EVENT_QP_FATAL, 7), cq_err))  # type: ignore[arg-type]
    assert seen == [] and reactor._cq_handlers == {}


def test_reactors_do_not_keep_their_loops_alive() -> None:
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def touch() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        assert Reactor.current() is Reactor.current()

    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        for _ in range(5):
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(touch())
    gc.collect()
    assert [ref for ref in loops if ref() is not None] == []
    assert len(Reactor._by_loop) == 0


def test_trio_runs_leave_no_reactor_behind() -> None:
    async def touch() -> None:
        assert Reactor.current() is Reactor.current()

    for _ in range(5):
        trio.run(touch)
    gc.collect()
    assert len(Reactor._by_loop) == 0


def test_a_cq_error_on_a_shared_cq_reaches_every_connection_on_it_and_marks_it_failed() -> None:
    """Connections of one domain share CQs: a CQ error fails all of them, and the domain places no new
    connection on that CQ."""
    reactor = Reactor(FakeBackend())  # type: ignore[arg-type]
    domain = FakeDomain()
    marked = domain.failed_cqs
    reactor._domains[1] = domain  # type: ignore[assignment]
    seen: list[str] = []
    for name, qp in (("a", 7), ("b", 8), ("c", 9)):
        reactor.watch_qp(1, qp, 100, lambda event, name=name: seen.append(name))  # type: ignore[misc]
    reactor.watch_qp(1, 10, 200, lambda event: seen.append("other CQ"))
    cq_err = verbs.AsyncEvent(verbs.EVENT_CQ_ERR, "CQ error", "device", 0, 100)
    reactor._on_async_readable(FakeDevice(1, cq_err))  # type: ignore[arg-type]
    assert seen == ["a", "b", "c"] and marked == [100]


def test_cm_events_are_read_one_per_wake_up() -> None:
    """A wake-up of the rdma_cm channel reads one event: the fd is level-triggered, so the next pending event
    wakes the reactor again, and the empty read that ends a drain (a system call) is never made."""

    def event(handle: int) -> verbs.CMEvent:
        return verbs.CMEvent(
            event=verbs.CMEventType.ESTABLISHED,
            status=0,
            id_handle=handle,
            listen_id_handle=0,
            private_data=b"",
            qp_num=0,
            responder_resources=0,
            initiator_depth=0,
            rnr_retry_count=0,
            raw_id=None,
        )

    reactor = Reactor(FakeBackend())  # type: ignore[arg-type]
    channel = FakeEventChannel(event(1), event(2))
    reactor._channel = channel  # type: ignore[assignment]
    seen: list[int] = []
    reactor._handlers[1] = reactor._handlers[2] = lambda e: seen.append(e.id_handle)
    reactor._on_cm_readable()
    assert (seen, channel.calls) == ([1], 1)
    reactor._on_cm_readable()
    assert (seen, channel.calls) == ([1, 2], 2)

    # A deadline drains what is waiting before concluding an event did not come (a busy loop handles one
    # per wake-up: a server dropped 50 connections whose ESTABLISHED waited in the channel).
    channel.events.extend([event(1), event(2), event(1)])
    reactor.drain_cm_events()
    assert (seen, channel.calls) == ([1, 2, 1, 2, 1], 6)
