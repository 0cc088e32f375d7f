"""SlotRing: a connection's send or receive slots, registered chunk by chunk as load needs them.

A ring reserves address space for its largest size (``max_slots * slot_size``, an anonymous mapping whose
untouched pages cost no memory) and registers only the slots in use: ``initial`` at first, more with
:meth:`SlotRing.grow`. Every chunk is its own memory region, so slots carry their own local key
(:attr:`SlotRing.lkeys`, indexed by slot, readable from C); addresses stay ``addr + slot * slot_size``, so
a slot's bytes are ``view[slot * slot_size:]`` whatever chunk it is in. Rings never shrink while the
connection lives: a slot may be posted to the NIC at any time, and the work to prove a chunk idle is not
worth the memory of a connection that was busy once.

Idle memory is what this buys: 1,000 connections that never send pin only their initial receive slots.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any, Protocol

from rdmaio._ffi import ffi

__all__ = ["SlotRing"]


class _Region(Protocol):
    lkey: int

    def close(self) -> None:
        """Deregister."""


class SlotRing:
    """``max_slots`` slots of ``slot_size`` bytes; the first :attr:`slots` of them registered.

    ``register(view)`` registers one chunk (a memoryview of the ring) and returns its region (an object
    with ``lkey`` and ``close()``); it is the Domain's protection domain in production and a fake in the
    unit tests.
    """

    def __init__(
        self, slot_size: int, max_slots: int, register: Callable[[memoryview], _Region], initial: int = 0
    ) -> None:
        if slot_size <= 0 or max_slots <= 0 or not 0 <= initial <= max_slots:
            raise ValueError(f"bad ring shape: {initial} of {max_slots} slots of {slot_size} bytes")
        self.slot_size = slot_size
        self.max_slots = max_slots
        self._register = register
        self._map = mmap.mmap(-1, slot_size * max_slots)
        self.view = memoryview(self._map)
        self.addr: int = int(ffi.cast("uintptr_t", ffi.from_buffer(self.view)))
        self.lkeys: Any = ffi.new("uint32_t[]", max_slots)
        self.slots = 0
        self._regions: list[_Region] = []
        if initial:
            self.grow(initial)

    @property
    def registered_bytes(self) -> int:
        """Bytes of the ring registered (pinned) now."""
        return self.slots * self.slot_size

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
        size = self.slot_size
        region = self._register(self.view[first * size : (first + n) * size])
        self._regions.append(region)
        lkey = region.lkey
        lkeys = self.lkeys
        for slot in range(first, first + n):
            lkeys[slot] = lkey
        self.slots = first + n
        return range(first, first + n)

    def close(self) -> None:
        """Deregister every chunk (the caller guarantees the NIC no longer uses them). Idempotent."""
        regions, self._regions = self._regions, []
        self.slots = 0
        for region in regions:
            region.close()

    def __repr__(self) -> str:
        return f"<SlotRing {self.slots}/{self.max_slots} slots of {self.slot_size} bytes>"
