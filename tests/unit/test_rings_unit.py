"""SlotRing, RingArena and ArenaPool against a fake registrar and a fake clock (no device).

The fakes (:mod:`rdmaio.testing.fakes`): :class:`FakeRegistrar` registers chunks with lkeys 100, 101, ...
and counts what is registered now; :class:`FakeBackend` is the clock with ``call_later``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rdmaio.core.rings import ArenaPool, SlotRing
from rdmaio.testing.fakes import FakeBackend, FakeRegistrar

SLOT = 64


def make_pool(
    max_bytes: int = 64 * SLOT, linger: float = 2.0
) -> tuple[ArenaPool, FakeRegistrar, FakeBackend]:
    reg, timers = FakeRegistrar(SLOT), FakeBackend()
    pool = ArenaPool(
        reg, max_bytes=max_bytes, linger=linger, call_later=timers.call_later, clock=timers.clock
    )
    return pool, reg, timers


def test_a_ring_without_slots_has_no_memory_and_registers_on_first_grow() -> None:
    reg = FakeRegistrar(SLOT)
    ring = SlotRing(SLOT, 16, reg)
    assert ring.slots == 0 and reg.calls == 0
    with pytest.raises(RuntimeError):
        _ = ring.view
    assert ring.grow(4) == range(0, 4)
    assert reg.slots == 4 and ring.registered_bytes == 4 * SLOT
    assert [ring.lkeys[i] for i in range(4)] == [100] * 4
    assert ring.grow(8) == range(4, 12) and [ring.lkeys[i] for i in range(4, 12)] == [101] * 8
    assert [region.lkey for region in ring.regions] == [100, 101]
    assert ring.grow(100) == range(12, 16) and ring.full
    ring.close()
    assert reg.live == {}


def test_a_closed_rings_memory_serves_the_next_ring_of_its_shape_without_registering() -> None:
    pool, reg, _timers = make_pool()
    first = SlotRing(SLOT, 16, reg, 4, pool=pool)
    addr = first.addr
    first.grow(4)  # grown to 8 in its life: the extra chunk is not kept
    first.close()
    assert reg.slots == 4 and pool.pooled_bytes == 4 * SLOT
    calls = reg.calls
    second = SlotRing(SLOT, 16, reg, 4, pool=pool)
    assert reg.calls == calls, "the pooled arena was registered again"
    assert second.addr == addr and second.slots == 4 and second.registered_bytes == 4 * SLOT
    assert [second.lkeys[i] for i in range(4)] == [100] * 4
    assert pool.statistics()["reused"] == 1 and pool.pooled_bytes == 0
    # Growing past the pooled chunk registers a new one.
    assert second.grow(4) == range(4, 8) and reg.calls == calls + 1


def test_shapes_do_not_mix() -> None:
    pool, reg, _timers = make_pool()
    SlotRing(SLOT, 16, reg, 4, pool=pool).close()
    other = SlotRing(SLOT, 16, reg, 16, pool=pool)  # a full-depth first chunk: not the pooled shape
    assert pool.statistics()["reused"] == 0 and other.registered_bytes == 16 * SLOT
    assert reg.slots == 4 + 16


def test_the_pool_is_bounded_in_bytes() -> None:
    pool, reg, _timers = make_pool(max_bytes=8 * SLOT)
    rings = [SlotRing(SLOT, 16, reg, 4, pool=pool) for _ in range(5)]
    for ring in rings:
        ring.close()
    assert pool.pooled_bytes == 8 * SLOT and reg.slots == 8
    assert pool.statistics()["closed"] == 3


def test_the_pool_releases_everything_once_idle_for_linger() -> None:
    pool, reg, timers = make_pool(linger=2.0)
    SlotRing(SLOT, 16, reg, 4, pool=pool).close()
    timers.advance(1.5)
    SlotRing(SLOT, 16, reg, 4, pool=pool).close()  # used again: the linger starts over
    timers.advance(1.0)
    assert reg.slots == 4, "released while still in use"
    timers.advance(1.5)
    assert reg.slots == 0 and pool.pooled_bytes == 0
    assert pool.statistics()["expired"] == 1 and not timers.pending


def test_without_a_timer_the_pool_keeps_nothing() -> None:
    reg = FakeRegistrar(SLOT)
    pool = ArenaPool(reg)
    SlotRing(SLOT, 16, reg, 4, pool=pool).close()
    assert reg.slots == 0 and pool.pooled_bytes == 0


def test_a_closed_pool_closes_what_it_holds_and_what_comes_back() -> None:
    pool, reg, timers = make_pool()
    held = SlotRing(SLOT, 16, reg, 4, pool=pool)
    SlotRing(SLOT, 16, reg, 4, pool=pool).close()
    pool.close()
    assert reg.slots == 4  # only the ring still held
    held.close()
    assert reg.slots == 0
    assert all(timer.cancelled for timer in timers.pending)  # its timer was cancelled
