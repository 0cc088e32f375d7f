"""Device removal in rdmaio.core.reactor, with fakes: which connections fail, what happens to the
device's Domain and fd watch, and when librdmacm is asked to let go of the device."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from rdmaio import verbs
from rdmaio.core import reactor as reactor_module
from rdmaio.core.backend import AsyncioBackend, TrioBackend
from rdmaio.core.reactor import Reactor
from rdmaio.errors import DeviceError
from rdmaio.testing.fakes import (
    FakeBackend,
    FakeCMId,
    FakeDevice,
    FakeDeviceHandles,
    FakeDomain,
    FakeEventChannel,
)
from rdmaio.verbs import CMEvent, CMEventType


@pytest.fixture
def listed(monkeypatch: pytest.MonkeyPatch) -> FakeDeviceHandles:
    fake = FakeDeviceHandles()
    monkeypatch.setattr(verbs, "cm_device_handles", fake)
    return fake


def cm_event(kind: CMEventType, id_handle: int) -> CMEvent:
    return CMEvent(kind, 0, id_handle, 0, b"", 0, 0, 0, 0, raw_id=None)


def setup(backend: Any) -> tuple[Reactor, dict[str, list[int]], dict[int, FakeDomain], FakeDevice]:
    """Two devices: connections a and b on device 1, c on device 2; both devices watched, with domains."""
    reactor = Reactor(backend)
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for name, dev, qp in (("a", 1, 7), ("b", 1, 8), ("c", 2, 7)):
        reactor.watch_qp(dev, qp, 10 * dev, lambda e, name=name: seen[name].append(e.event_type))  # type: ignore[misc]
        reactor.watch_port(dev, 1, qp, lambda e: None)
    domains = {1: FakeDomain(), 2: FakeDomain()}
    reactor._domains.update(domains)  # type: ignore[arg-type]
    device = FakeDevice(1)
    reactor._devices[1] = device  # type: ignore[assignment]
    reactor._devices[2] = FakeDevice(2)  # type: ignore[assignment]
    return reactor, seen, domains, device


def test_removal_fails_only_that_devices_connections_and_drops_its_domain_and_fd(
    listed: FakeDeviceHandles,
) -> None:
    backend = FakeBackend()
    reactor, seen, domains, device = setup(backend)
    reactor.device_removed(device)  # type: ignore[arg-type]
    fatal = verbs.EVENT_DEVICE_FATAL
    assert seen == {"a": [fatal], "b": [fatal], "c": []}
    assert domains[1].closes == 1 and domains[2].closes == 0
    assert 1 not in reactor._domains and 2 in reactor._domains
    assert 1 not in reactor._devices and 2 in reactor._devices
    assert backend.removed_readers == [device.async_fd]  # off the loop before librdmacm closes it
    assert [key for key in reactor._port_handlers if key[0] == 1] == []
    assert (2, 1) in reactor._port_handlers
    # No cm id uses it and librdmacm no longer lists it: forgotten, its handle free for a new device.
    assert reactor._removed == {} and reactor.devices_removed == 1


def test_a_device_fatal_async_event_is_a_removal(listed: FakeDeviceHandles) -> None:
    reactor, seen, domains, _device = setup(FakeBackend())
    fatal = verbs.AsyncEvent(verbs.EVENT_DEVICE_FATAL, "local catastrophic error", "device", 0, 0)
    reactor._dispatch_async_event(FakeDevice(2), fatal)  # type: ignore[arg-type]
    assert seen == {"a": [], "b": [], "c": [verbs.EVENT_DEVICE_FATAL]}
    assert domains[2].closed and 2 not in reactor._domains


def test_cm_device_removal_goes_to_the_handler_first_then_removes_the_device(
    listed: FakeDeviceHandles,
) -> None:
    backend = FakeBackend()
    reactor, seen, domains, device = setup(backend)
    order: list[str] = []
    own = FakeCMId(0xA0, device)
    reactor._ids[own.handle] = own  # type: ignore[assignment]

    def endpoint_handler(event: CMEvent) -> None:
        order.append(f"handler {event.event.name}, domain closed: {domains[1].closed}")
        reactor.release_id(own)  # type: ignore[arg-type] - an endpoint releases its id at once

    reactor._handlers[own.handle] = endpoint_handler
    reactor._channel = FakeEventChannel(cm_event(CMEventType.DEVICE_REMOVAL, own.handle))  # type: ignore[assignment]
    reactor._on_cm_readable()
    assert order == ["handler DEVICE_REMOVAL, domain closed: False"]
    assert own.closed and domains[1].closed and seen["a"] and seen["b"] and not seen["c"]


def test_librdmacm_is_asked_only_once_no_cm_id_is_left_on_the_device(listed: FakeDeviceHandles) -> None:
    reactor, seen, domains, device = setup(FakeBackend())
    pending = FakeCMId(0xB0, device)  # an accept or connect still holding its id on the device
    other = FakeCMId(0xC0, FakeDevice(2))
    reactor._ids[pending.handle] = pending  # type: ignore[assignment]
    reactor._ids[other.handle] = other  # type: ignore[assignment]
    reactor.device_removed(device)  # type: ignore[arg-type]
    assert listed.calls == [] and 1 in reactor._removed
    # Idempotent: the next cm id's DEVICE_REMOVAL report changes nothing.
    reactor.device_removed(device)  # type: ignore[arg-type]
    assert seen["a"] == [verbs.EVENT_DEVICE_FATAL] and domains[1].closes == 1
    assert reactor.devices_removed == 1
    with pytest.raises(DeviceError):  # no new Domain on a device that is going away
        reactor.domain(device)  # type: ignore[arg-type]
    reactor.release_id(pending)  # type: ignore[arg-type]
    assert len(listed.calls) == 1 and reactor._removed == {}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_removal_rechecks_while_librdmacm_still_lists_the_device(
    listed: FakeDeviceHandles, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The recheck sleeps on the backend's timeout scope: asyncio and trio."""
    monkeypatch.setattr(reactor_module, "_REMOVAL_RECHECK", 0.01)
    listed.answers = [{1, 2}, {1, 2}, {2}]  # the kernel lists it twice more, then it is gone

    async def main(sleep: Callable[[float], Awaitable[None]], io: Any) -> tuple[bool, int]:
        reactor, _seen, _domains, device = setup(io)
        reactor._devices.clear()  # fake fds: nothing was added to the loop
        reactor.device_removed(device)  # type: ignore[arg-type]
        still_removed = 1 in reactor._removed
        for _ in range(100):
            await sleep(0.01)
            if not reactor._removed:
                break
        return still_removed, len(reactor._removed)

    if backend == "asyncio":

        async def on_asyncio() -> tuple[bool, int]:
            return await main(asyncio.sleep, AsyncioBackend(asyncio.get_running_loop()))

        still_removed, left = asyncio.run(on_asyncio())
    else:

        async def on_trio() -> tuple[bool, int]:
            return await main(trio.sleep, TrioBackend())

        still_removed, left = trio.run(on_trio)
    assert still_removed and left == 0
    assert listed.calls == [{1, 2}, {1, 2}, {2}]


def test_connections_releasing_their_ids_while_failed_do_not_release_the_device_early(
    listed: FakeDeviceHandles,
) -> None:
    """Each failed endpoint releases its cm id at once; the last one must not make librdmacm close the
    device context before the Domain (PD, CQs, completion channel) is closed."""
    reactor = Reactor(FakeBackend())  # type: ignore[arg-type]
    device = FakeDevice(1)
    domain = FakeDomain()
    reactor._domains[1] = domain  # type: ignore[assignment]
    order: list[str] = []
    listed_then = FakeDeviceHandles()

    def librdmacm() -> set[int]:
        order.append(f"librdmacm asked, domain closed: {domain.closed}")
        return listed_then()

    verbs.cm_device_handles = librdmacm  # type: ignore[assignment] - restored by the fixture
    for qp in (7, 8):
        cm_id = FakeCMId(0xD0 + qp, device)
        reactor._ids[cm_id.handle] = cm_id  # type: ignore[assignment]
        reactor.watch_qp(1, qp, 10, lambda e, cm_id=cm_id: reactor.release_id(cm_id))  # type: ignore[misc]
    reactor.device_removed(device)  # type: ignore[arg-type]
    assert order == ["librdmacm asked, domain closed: True"]
    assert reactor._removed == {}
