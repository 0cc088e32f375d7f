"""Slot rings: a connection's send or receive slots, registered chunk by chunk as load needs them.

A :class:`SlotRing` is backed by a :class:`RingArena`: address space reserved for the ring's largest size
(``max_slots * slot_size``, an anonymous mapping whose untouched pages cost no memory) of which only the
slots in use are registered: ``initial`` at first, more with :meth:`SlotRing.grow`. Every chunk is its own
memory region, so slots carry their own local key (:attr:`SlotRing.lkeys`, indexed by slot, readable from
C); addresses stay ``addr + slot * slot_size``, so a slot's bytes are ``view[slot * slot_size:]`` whatever
chunk it is in. Rings never shrink while the connection lives: a slot may be posted to the NIC at any time,
and the work to prove a chunk idle is not worth the memory of a connection that was busy once.

Idle memory is what this buys: 1,000 connections that never send pin only their initial receive slots (a
ring gets its arena at its first :meth:`~SlotRing.grow`, so a send ring that never sent has none).

Setup time is what the :class:`ArenaPool` buys. Registering memory is the most expensive step of a
connection's setup (two ``ibv_reg_mr`` per side, a third of a connection's setup time in the test host).
A closed connection's arenas go back to the per-device pool with their first chunk still registered, and
the next connection of the same shape takes one instead of registering: a server with a steady churn of
short connections registers nothing in steady state. The pool is bounded in bytes, and what it holds is
released once it has been idle for ``linger`` seconds, so a loop that stops opening connections goes back
to pinning nothing for them. Reuse is safe because an arena is returned only after its QP is destroyed
(the NIC no longer touches it) and is only ever registered for local access.
"""

from __future__ import annotations

import collections
import mmap
import time
from collections.abc import Callable
from typing import Any, Protocol

from rdmaio.verbs.native import ffi

__all__ = ["POOL_LINGER", "POOL_MAX_BYTES", "ArenaPool", "RingArena", "SlotRing"]

POOL_MAX_BYTES = 4 << 20
"""Registered bytes a Domain's ring pool keeps at most (16 idle connections' first receive chunks)."""
POOL_LINGER = 2.0
"""Seconds without a connection opened or closed after which a Domain's ring pool releases what it holds."""


class _Region(Protocol):
    lkey: int

    def close(self) -> None:
        """Deregister."""


class _Handle(Protocol):
    def cancel(self) -> None:
        """Do not run the callback."""


Register = Callable[[memoryview], _Region]
"""Registers one chunk (a memoryview of an arena) for local access; returns its region."""


class RingArena:
    """The memory of one ring: ``max_slots * slot_size`` bytes of address space, its first
    :attr:`registered` slots registered in chunks (each chunk one memory region)."""

    def __init__(self, slot_size: int, max_slots: int, register: Register) -> None:
        self.slot_size = slot_size
        self.max_slots = max_slots
        self._register = register
        self._map = mmap.mmap(-1, slot_size * max_slots)
        self.view = memoryview(self._map)
        self.addr: int = int(ffi.cast("uintptr_t", ffi.from_buffer(self.view)))
        self.lkeys: Any = ffi.new("uint32_t[]", max_slots)
        self.registered = 0
        self._chunks: list[tuple[int, _Region]] = []  # (first slot past the chunk, region), in order

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(slot_size, max_slots, slots of the first chunk)``: arenas of one shape are interchangeable."""
        return (self.slot_size, self.max_slots, self._chunks[0][0] if self._chunks else 0)

    @property
    def registered_bytes(self) -> int:
        """Bytes registered (pinned) now."""
        return self.registered * self.slot_size

    @property
    def regions(self) -> list[Any]:
        """The memory region of each registered chunk, in slot order."""
        return [region for _end, region in self._chunks]

    def ensure(self, slots: int) -> None:
        """Register slots up to ``slots`` (one new chunk for those not registered yet)."""
        first = self.registered
        if slots <= first:
            return
        size = self.slot_size
        region = self._register(self.view[first * size : slots * size])
        self._chunks.append((slots, region))
        lkey = region.lkey
        lkeys = self.lkeys
        for slot in range(first, slots):
            lkeys[slot] = lkey
        self.registered = slots

    def trim(self) -> None:
        """Deregister every chunk but the first (what a new owner of this shape starts with)."""
        while len(self._chunks) > 1:
            _end, region = self._chunks.pop()
            region.close()
        self.registered = self._chunks[0][0] if self._chunks else 0

    def close(self) -> None:
        """Deregister every chunk. Idempotent."""
        chunks, self._chunks = self._chunks, []
        self.registered = 0
        for _end, region in chunks:
            region.close()


class ArenaPool:
    """Arenas of closed connections, kept registered for the next connection of the same shape.

    Holds at most ``max_bytes`` of registered memory; an arena given back beyond that is closed. Whatever
    the pool holds is closed once no arena was given back or taken for ``linger`` seconds (checked by a
    timer from ``call_later(delay, callback)``; without one the pool keeps nothing). Sans-IO apart from the
    timer, so the unit tests drive it with a fake clock.
    """

    def __init__(
        self,
        register: Register,
        *,
        max_bytes: int = POOL_MAX_BYTES,
        linger: float = POOL_LINGER,
        call_later: Callable[[float, Callable[[], None]], _Handle] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._register = register
        self.max_bytes = max_bytes if call_later is not None else 0
        self.linger = linger
        self._call_later = call_later
        self._clock = clock
        self._free: dict[tuple[int, int, int], list[RingArena]] = collections.defaultdict(list)
        self.pooled_bytes = 0
        self._last_use = 0.0
        self._timer: _Handle | None = None
        self._closed = False
        self.stats = collections.Counter[str]()

    def take(self, slot_size: int, max_slots: int, first: int) -> RingArena:
        """An arena of that shape whose first ``first`` slots are registered (from the pool if it has
        one, else a new one)."""
        self._last_use = self._clock()
        free = self._free.get((slot_size, max_slots, first))
        if free:
            arena = free.pop()
            self.pooled_bytes -= arena.registered_bytes
            self.stats["reused"] += 1
            return arena
        arena = RingArena(slot_size, max_slots, self._register)
        if first:
            arena.ensure(first)
        self.stats["created"] += 1
        return arena

    def give(self, arena: RingArena) -> None:
        """Take back an arena the NIC no longer uses: keep its first chunk for reuse, or close it."""
        arena.trim()
        size = arena.registered_bytes
        if self._closed or not size or self.pooled_bytes + size > self.max_bytes:
            arena.close()
            self.stats["closed"] += 1
            return
        self._free[arena.shape].append(arena)
        self.pooled_bytes += size
        self._last_use = self._clock()
        if self._timer is None and self._call_later is not None:
            self._timer = self._call_later(self.linger, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self._closed or not self.pooled_bytes:
            return
        idle = self._clock() - self._last_use
        if idle >= self.linger:
            self.stats["expired"] += 1
            self.clear()
        elif self._call_later is not None:
            self._timer = self._call_later(self.linger - idle, self._expire)

    def clear(self) -> None:
        """Close every pooled arena (their memory is deregistered)."""
        arenas = [arena for free in self._free.values() for arena in free]
        self._free.clear()
        self.pooled_bytes = 0
        for arena in arenas:
            arena.close()

    def statistics(self) -> dict[str, int]:
        """Arenas created, reused from the pool, closed on return, pool expiries, and bytes pooled now."""
        return {
            "created": self.stats["created"],
            "reused": self.stats["reused"],
            "closed": self.stats["closed"],
            "expired": self.stats["expired"],
            "pooled_bytes": self.pooled_bytes,
        }

    def close(self) -> None:
        """Close what the pool holds and keep nothing from now on. Idempotent."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.clear()


class SlotRing:
    """``max_slots`` slots of ``slot_size`` bytes; the first :attr:`slots` of them registered.

    ``register(view)`` registers one chunk (a memoryview of the ring) and returns its region (an object
    with ``lkey`` and ``close()``); it is the Domain's protection domain in production and a fake in the
    unit tests. With a ``pool`` (the Domain's :class:`ArenaPool`) the ring takes its arena from the pool
    at its first :meth:`grow` and gives it back on :meth:`close`; without one it owns a private arena.
    :attr:`view`, :attr:`addr` and :attr:`lkeys` exist once the ring has slots.
    """

    def __init__(
        self,
        slot_size: int,
        max_slots: int,
        register: Register,
        initial: int = 0,
        *,
        pool: ArenaPool | None = None,
    ) -> None:
        if slot_size <= 0 or max_slots <= 0 or not 0 <= initial <= max_slots:
            raise ValueError(f"bad ring shape: {initial} of {max_slots} slots of {slot_size} bytes")
        self.slot_size = slot_size
        self.max_slots = max_slots
        self._register = register
        self._pool = pool
        self.arena: RingArena | None = None
        """The ring's memory (None before the first slot is registered and after :meth:`close`). Read as an
        attribute on the receive path, which re-posts slots on every completion batch: the properties below
        cost two Python calls each."""
        self.slots = 0
        if initial:
            self.grow(initial)

    def _arena_or_raise(self) -> RingArena:
        if self.arena is None:
            raise RuntimeError(f"{self!r} has no memory yet (no slot was ever registered)")
        return self.arena

    @property
    def view(self) -> memoryview:
        """The ring's bytes (slot ``i`` at ``i * slot_size``)."""
        return self._arena_or_raise().view

    @property
    def addr(self) -> int:
        """Address of slot 0."""
        return self._arena_or_raise().addr

    @property
    def lkeys(self) -> Any:
        """``uint32_t[max_slots]``: the local key of each registered slot."""
        return self._arena_or_raise().lkeys

    @property
    def registered_bytes(self) -> int:
        """Bytes of the ring registered (pinned) now."""
        return self.slots * self.slot_size

    @property
    def regions(self) -> list[Any]:
        """The memory regions of the ring's registered chunks, in slot order (for inspection)."""
        return self.arena.regions if self.arena is not None else []

    @property
    def full(self) -> bool:
        """True once every slot is registered."""
        return self.slots >= self.max_slots

    def grow(self, n: int) -> range:
        """Register up to ``n`` more slots (fewer at the ring's end); return their indices."""
        n = min(n, self.max_slots - self.slots)
        if n <= 0:
            return range(0)
        first = self.slots
        if self.arena is None:
            if self._pool is not None:
                self.arena = self._pool.take(self.slot_size, self.max_slots, n)
            else:
                self.arena = RingArena(self.slot_size, self.max_slots, self._register)
        self.arena.ensure(first + n)
        self.slots = first + n
        return range(first, first + n)

    def close(self) -> None:
        """Give the memory back (to the pool, or deregister it); the caller guarantees the NIC no longer
        uses it. Idempotent."""
        arena, self.arena = self.arena, None
        self.slots = 0
        if arena is None:
            return
        if self._pool is not None:
            self._pool.give(arena)
        else:
            arena.close()

    def __repr__(self) -> str:
        return f"<SlotRing {self.slots}/{self.max_slots} slots of {self.slot_size} bytes>"
