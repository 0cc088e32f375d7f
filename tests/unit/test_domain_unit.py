"""Unit tests of the registration cache (rdmaio.core.domain.RegistrationCache) with a fake registrar, and
of the Domain's per-device settings (with a fake protection domain)."""

from __future__ import annotations

import collections
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from rdmaio.core import domain as domain_module
from rdmaio.core.domain import DEFAULT_MAX_PINNED, RegistrationCache
from rdmaio.core.reactor import Reactor
from rdmaio.core.rendezvous import RendezvousEngine
from rdmaio.options import Options
from rdmaio.protocol import FEATURE_RNDV, Handshake, Session
from rdmaio.protocol.rxbuffer import ReceiveBuffer
from rdmaio.testing.fakes import FakeBackend, FakeProtectionDomain, FakeRegion


def make(max_pinned: int) -> tuple[RegistrationCache, list[str]]:
    log: list[str] = []
    cache = RegistrationCache(
        lambda buf, access: FakeRegion(buf, access, log=log, strict=True),
        lambda buf: (id(buf), len(buf)),
        max_pinned,
    )
    return cache, log


def test_a_buffer_is_registered_once_and_shared() -> None:
    cache, log = make(1 << 20)
    buf = bytearray(1000)
    first = cache.get(buf)
    second = cache.get(buf)
    assert first.region is second.region and log == ["reg 1000"]
    assert cache.statistics() == {
        "entries": 1,
        "in_use": 1,
        "pinned": 1000,
        "reserved": 0,
        "hits": 1,
        "misses": 1,
        "evictions": 0,
    }
    first.release()
    first.release()  # idempotent
    second.release()
    assert cache.statistics()["in_use"] == 0 and cache.pinned == 1000  # stays cached


def test_access_flags_make_separate_registrations() -> None:
    cache, log = make(1 << 20)
    buf = bytearray(100)
    assert cache.get(buf, 0).region is not cache.get(buf, 1).region
    assert log == ["reg 100", "reg 100"]


def test_unused_registrations_are_evicted_oldest_first_above_the_bound() -> None:
    cache, log = make(2500)
    bufs = [bytearray(1000) for _ in range(4)]
    for buf in bufs[:2]:
        cache.get(buf).release()
    held = cache.get(bufs[2])  # 3000 pinned > 2500: the oldest unused (bufs[0]) goes
    assert log[-1] == "dereg 1000" and cache.pinned == 2000
    cache.get(bufs[1]).release()  # a hit: bufs[1] becomes the most recently used
    with cache.get(bufs[3]):  # 3000 again: bufs[2] and bufs[3] are in use, so bufs[1] goes
        pass
    assert cache.pinned <= 2500 and cache.statistics()["evictions"] == 2
    assert not held.region.closed  # in use: never evicted
    held.release()


def test_in_use_registrations_may_exceed_the_bound() -> None:
    cache, _log = make(100)
    regs = [cache.get(bytearray(80)) for _ in range(3)]
    assert cache.pinned == 240  # nothing unused to evict
    for reg in regs:
        reg.release()
    assert cache.pinned <= 100


def test_close_deregisters_everything() -> None:
    cache, log = make(1 << 20)
    cache.get(bytearray(10))
    cache.get(bytearray(20)).release()
    cache.close()
    assert sorted(log) == ["dereg 10", "dereg 20", "reg 10", "reg 20"] and cache.pinned == 0


def test_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError):
        make(-1)


def test_a_waiter_for_room_is_called_once_when_room_is_made() -> None:
    """Rendezvous pulls that found no room wait for this call instead of polling."""
    cache, _ = make(1000)
    held = cache.get(bytearray(1000))
    other = bytearray(600)
    assert cache.try_get(other) is None
    calls: list[str] = []
    cache.call_when_room(lambda: calls.append("a"))
    cache.call_when_room(lambda: calls.append("b"))
    assert calls == []
    held.release()  # unused now, so evictable: room
    assert calls == ["a", "b"]
    late = cache.try_get(other)
    assert late is not None
    late.release()
    assert calls == ["a", "b"]  # one-shot


def test_giving_back_a_reservation_or_closing_calls_the_room_waiters() -> None:
    cache, _ = make(1000)
    assert cache.try_reserve(1000)
    assert not cache.try_reserve(1)
    calls: list[int] = []
    cache.call_when_room(lambda: calls.append(1))
    cache.unreserve(1000)
    assert calls == [1]
    cache.call_when_room(lambda: calls.append(2))
    cache.close()
    assert calls == [1, 2]


# --- per-device settings: the Domain's, not a connection's ------------------------------------------


class FakeOneSided:
    """A connection's one-sided engine, as much as a new rendezvous engine uses: it sets the
    ``control_handler``."""

    control_handler: Any = None


class FakeConnection:
    """What the rendezvous engine reads of its connection when it is created (held weakly)."""

    def __init__(self) -> None:
        hs = Handshake(8, 4096, 1 << 20, features=FEATURE_RNDV)
        self.session = Session(hs, hs)  # both announced rendezvous: the engine is made
        self.io = FakeBackend()
        self.rxbuf = ReceiveBuffer(1 << 20)
        self.onesided = FakeOneSided()
        self.stats: collections.Counter[str] = collections.Counter()


@pytest.fixture
def reactor(monkeypatch: pytest.MonkeyPatch) -> Reactor:
    monkeypatch.setattr(domain_module, "ProtectionDomain", FakeProtectionDomain)
    # A fake device has no context to query: no siw key guard (rdmaio.verbs.siw_key_guard) for it.
    monkeypatch.setattr(domain_module.siw_key_guard, "is_siw", lambda device: False)
    return Reactor(FakeBackend())  # type: ignore[arg-type]


DEVICE: Any = SimpleNamespace(handle=1, name="fake0")


def test_a_connections_options_do_not_change_the_devices_registration_bound(reactor: Reactor) -> None:
    """A second connection on a device asks for a smaller ``max_pinned``; its setup (with rendezvous, the
    engine that uses the shared cache) must leave the bound every other connection on the device relies on.

    Before: ``RendezvousEngine.for_connection`` wrote the connection's value into the Domain's shared
    RegistrationCache (``assert 1048576 == 268435456``): the last connection made set every connection's
    bound."""
    domain = reactor.domain(DEVICE)  # made by the first connection, with the default bound
    options = Options(max_pinned=1 << 20)
    transport = SimpleNamespace(domain=domain, pd=domain.pd)
    engine = RendezvousEngine.for_connection(FakeConnection(), transport, options)
    assert engine is not None  # rendezvous is on: the engine shares the device's cache
    assert domain.registrations.max_pinned == DEFAULT_MAX_PINNED
    assert domain.max_pinned == DEFAULT_MAX_PINNED


def test_the_domain_takes_the_per_device_settings_of_the_connection_that_creates_it(
    reactor: Reactor, caplog: pytest.LogCaptureFixture
) -> None:
    """The first connection's ``max_pinned`` is the device's; a later connection asking for another
    value gets the same Domain with its bound unchanged (a warning, once per value), and one that asks
    for nothing (None) or the same value changes and logs nothing."""
    first = reactor.domain(DEVICE, Options(max_pinned=8 << 20))
    assert first.max_pinned == 8 << 20
    with caplog.at_level(logging.WARNING, logger="rdmaio"):
        for options in (
            Options(max_pinned=1 << 20),
            Options(max_pinned=1 << 20),
            Options(),
            Options(max_pinned=8 << 20),
        ):
            assert reactor.domain(DEVICE, options) is first
    assert first.max_pinned == 8 << 20 and first.registrations.max_pinned == 8 << 20
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "max_pinned=1048576 ignored" in warnings[0], warnings
    # A Domain made after the device's was closed takes the settings of the connection that makes it.
    first.close()
    assert reactor.domain(DEVICE, Options()).max_pinned == DEFAULT_MAX_PINNED
