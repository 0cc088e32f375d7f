"""Domain: the resources one device shares among every connection of one event loop.

A :class:`Domain` holds the protection domain (so that memory registered once can serve every connection on
the device, which one-sided operations and zero-copy transfers need), a :class:`RegistrationCache`, and the
completion dispatcher (:mod:`rdmaio.core.dispatch`): one completion channel on the loop and a pool
of shared CQs whose completions are dispatched to the connections by QP number and connection tag, so that one
wake-up serves every connection. One exists per device per loop (``Reactor.domain(device)``); it is closed
with the loop (at the end of the trio run, or when the asyncio loop is garbage-collected) or explicitly.

The registration cache registers a user buffer once and hands out the same memory region to every
caller until it is released; unused registrations stay cached (registration pins pages and costs a
system call plus a page walk, as UCX's rcache notes) until the pinned total exceeds ``max_pinned``, when
the least recently used unused ones are deregistered. A cached registration keeps its Python buffer alive,
so the memory cannot be freed (and its address reused by another buffer) while it is registered.

``max_pinned`` is a per-device setting, and per-device settings belong to the Domain: it takes them when
it is created (from the Options of the loop's first connection on the device, ``Reactor.domain``), and
no connection's Options change them afterwards, since every connection on the device shares them. A
later connection that asks for another value gets the device's (a warning is logged once per value).

The ring pool (:class:`~rdmaio.core.rings.ArenaPool`) keeps the slot-ring memory of closed connections
registered for the next ones, bounded in bytes and released after a short idle time.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from rdmaio.core.dispatch import DEFAULT_BATCH, DEFAULT_CQ_CAPACITY, CompletionDispatcher
from rdmaio.core.rings import ArenaPool
from rdmaio.verbs import (
    CompletionBatch,
    CompletionChannel,
    CompletionQueue,
    DeviceContext,
    MemoryRegion,
    ProtectionDomain,
    siw_key_guard,
)
from rdmaio.verbs.native import ffi

__all__ = [
    "ACCESS_REMOTE_READ",
    "ACCESS_REMOTE_WRITE",
    "DEFAULT_MAX_PINNED",
    "Domain",
    "Registration",
    "RegistrationCache",
    "buffer_address",
    "register_in",
]

ACCESS_REMOTE_READ = 0x1
"""Registration access flag: the peer may RDMA READ the buffer."""
ACCESS_REMOTE_WRITE = 0x2
"""Registration access flag: the peer may RDMA WRITE the buffer."""
DEFAULT_MAX_PINNED = 256 * 1024 * 1024
"""Bytes of unused registrations a cache keeps pinned before it evicts (in-use ones always stay)."""

log = logging.getLogger("rdmaio")


class Region(Protocol):
    """What the cache needs of a memory region: its length and close()."""

    length: int

    def close(self) -> None:
        """Deregister."""


class Registration:
    """A cached registration handed to one user; :meth:`release` it when the NIC no longer uses it."""

    __slots__ = ("_cache", "_key", "_released", "region")

    def __init__(self, cache: RegistrationCache, key: tuple[int, int, int], region: Any) -> None:
        self._cache = cache
        self._key = key
        self.region = region
        self._released = False

    @property
    def lkey(self) -> int:
        """The local key of the region (for work requests)."""
        return int(self.region.lkey)

    @property
    def addr(self) -> int:
        """The start address of the registered buffer."""
        return int(self.region.addr)

    def release(self) -> None:
        """Give the registration back (idempotent); it stays cached until evicted."""
        if not self._released:
            self._released = True
            self._cache._release(self._key)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Entry:
    __slots__ = ("region", "users")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.users = 0


class RegistrationCache:
    """Registrations keyed by (address, length, access), reference counted, LRU-evicted above a bound.

    ``register(buffer, access)`` is the function that really registers (``MemoryRegion`` in a
    :class:`Domain`; a fake in the unit tests); ``address_of(buffer)`` gives the buffer's address.
    """

    def __init__(
        self,
        register: Callable[[Any, int], Region],
        address_of: Callable[[Any], tuple[int, int]],
        max_pinned: int = DEFAULT_MAX_PINNED,
    ) -> None:
        if max_pinned < 0:
            raise ValueError("max_pinned must be >= 0")
        self._register = register
        self._address_of = address_of
        self.max_pinned = max_pinned
        self._entries: collections.OrderedDict[tuple[int, int, int], _Entry] = collections.OrderedDict()
        self.pinned = 0  # bytes registered by this cache, in use or not, plus reserved bytes
        self.reserved = 0  # zero-copy: bytes of per-transfer registrations made outside the cache
        self.send_pinned = 0  # of which rendezvous sends waiting for their peers (every connection's)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._room_callbacks: list[Callable[[], None]] = []

    def call_when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, the next time pinned memory may have become available: an entry falls
        out of use (evictable), a reservation is given back, or the cache closes. A waiter that found no
        room (:meth:`try_get`, :meth:`try_reserve` returned None/False) registers here and retries then,
        instead of polling."""
        self._room_callbacks.append(callback)

    def _room_made(self) -> None:
        if self._room_callbacks:
            callbacks, self._room_callbacks = self._room_callbacks, []
            for callback in callbacks:
                callback()

    def get(self, buffer: Any, access: int = 0) -> Registration:
        """A registration of ``buffer`` with ``access`` flags (registered now or taken from the cache)."""
        address, length = self._address_of(buffer)
        key = (address, length, access)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            entry = _Entry(self._register(buffer, access))
            self._entries[key] = entry
            self.pinned += entry.region.length
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        entry.users += 1
        registration = Registration(self, key, entry.region)
        self._evict()
        return registration

    def try_get(self, buffer: Any, access: int = 0) -> Registration | None:
        """As :meth:`get`, but None instead of a new registration that would take :attr:`pinned` above
        ``max_pinned`` even after evicting every unused entry (zero-copy transfers: a hard bound)."""
        address, length = self._address_of(buffer)
        if (address, length, access) not in self._entries and not self._make_room(length):
            return None
        return self.get(buffer, access)

    def try_reserve(self, nbytes: int, limit: int | None = None) -> bool:
        """Count ``nbytes`` of a registration made outside the cache (a per-transfer rendezvous MR, which
        must not outlive its transfer) against the bound; False if it does not fit even after eviction.
        ``limit`` (at most ``max_pinned``) is a lower bound for this request: rendezvous sends use half, so
        that the receives they wait for (on the other side of a two-way exchange) always find room."""
        if not self._make_room(nbytes, self.max_pinned if limit is None else min(limit, self.max_pinned)):
            return False
        self.reserved += nbytes
        self.pinned += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        """Give back what :meth:`try_reserve` counted (the registration was closed)."""
        self.reserved -= nbytes
        self.pinned -= nbytes
        self._room_made()

    def _make_room(self, nbytes: int, limit: int | None = None) -> bool:
        """Evict unused entries (oldest first) until ``nbytes`` more fit under ``limit`` (``max_pinned``)."""
        bound = self.max_pinned if limit is None else limit
        if self.pinned + nbytes <= bound:
            return True
        for key in [k for k, e in self._entries.items() if not e.users]:
            entry = self._entries.pop(key)
            self.pinned -= entry.region.length
            self.evictions += 1
            entry.region.close()
            if self.pinned + nbytes <= bound:
                return True
        return False

    def _release(self, key: tuple[int, int, int]) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.users -= 1
            self._evict()
            if not entry.users:
                self._room_made()

    def _evict(self) -> None:
        if self.pinned <= self.max_pinned:
            return
        for key in [k for k, e in self._entries.items() if not e.users]:  # oldest first
            entry = self._entries.pop(key)
            self.pinned -= entry.region.length
            self.evictions += 1
            entry.region.close()
            if self.pinned <= self.max_pinned:
                return

    def statistics(self) -> dict[str, int]:
        """Entries, pinned bytes, hits, misses and evictions."""
        return {
            "entries": len(self._entries),
            "in_use": sum(1 for e in self._entries.values() if e.users),
            "pinned": self.pinned,
            "reserved": self.reserved,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }

    def close(self) -> None:
        """Deregister everything (the caller guarantees the NIC no longer uses any of it)."""
        entries, self._entries = self._entries, collections.OrderedDict()
        self.pinned = 0
        for entry in entries.values():
            entry.region.close()
        self._room_made()


def buffer_address(buffer: Any) -> tuple[int, int]:
    """The address and length of a writable buffer (a :class:`RegistrationCache`'s ``address_of``)."""
    cbuf = ffi.from_buffer(buffer, require_writable=True)
    return int(ffi.cast("uintptr_t", cbuf)), len(cbuf)


def register_in(pd: ProtectionDomain, buffer: Any, access: int) -> MemoryRegion:
    """Register ``buffer`` in ``pd`` with the cache's ``access`` flags (:data:`ACCESS_REMOTE_READ`,
    :data:`ACCESS_REMOTE_WRITE`; local access only unless asked): a :class:`RegistrationCache`'s
    ``register`` for a protection domain of its own (a connection's, where the device has no memory
    windows; :class:`Domain` registers in its own PD the same way)."""
    return MemoryRegion(
        pd,
        buffer,
        remote_read=bool(access & ACCESS_REMOTE_READ),
        remote_write=bool(access & ACCESS_REMOTE_WRITE),
    )


def _unwatched(fd: int, callback: Callable[[], None]) -> None:
    raise RuntimeError("this Domain was created without an event loop: it has no completion dispatcher")


class Domain:
    """The protection domain of one device, shared by every connection of one loop, its registration
    cache and its completion dispatcher.

    ``watch(fd, callback)`` and ``unwatch(fd)`` put the completion channel's fd on the loop and take it off
    (``Reactor.watch``/``Reactor.unwatch``); ``cq_capacity`` is the size of a pooled CQ. ``max_pinned``
    (None: :data:`DEFAULT_MAX_PINNED`) is the registration cache's bound, a setting of the device fixed
    here (see the module docstring).
    """

    def __init__(
        self,
        device: DeviceContext,
        *,
        max_pinned: int | None = None,
        watch: Callable[[int, Callable[[], None]], None] = _unwatched,
        unwatch: Callable[[int], None] | None = None,
        cq_capacity: int = DEFAULT_CQ_CAPACITY,
        call_later: Callable[[float, Callable[[], None]], Any] | None = None,
    ) -> None:
        self.device = device
        self.pd = ProtectionDomain(device)
        self.registrations = RegistrationCache(
            self._register, buffer_address, DEFAULT_MAX_PINNED if max_pinned is None else max_pinned
        )
        self._settings_refused: set[int] = set()  # max_pinned values later connections asked for, logged
        # Slot-ring memory of closed connections, kept registered (local access only) for the next ones:
        # registration is the dearest step of a connection's setup (rdmaio.core.rings). Without a timer to
        # release it when idle (no loop), the pool keeps nothing.
        self.rings = ArenaPool(self._register_local, call_later=call_later)
        self._watch = watch
        self._unwatch = unwatch if unwatch is not None else (lambda fd: None)
        self._cq_capacity = cq_capacity
        self._completions: CompletionDispatcher | None = None
        # The shared receive queue (rdmaio.core.shared_receive), created by the first connection with
        # Options(shared_receive_queue=True); closed before the PD (its QPs first, then the SRQ, its MRs).
        self.shared_receive: Any = None
        # The registration caches of connections with a protection domain of their own (a device without
        # memory windows): they register instead of this Domain's cache, so the device's registration
        # figures (process metrics) are theirs too: the live ones are read, the closed ones' counts kept.
        self._private_caches: weakref.WeakSet[RegistrationCache] = weakref.WeakSet()
        self._private_closed = dict.fromkeys(("hits", "misses", "evictions"), 0)

    @property
    def completions(self) -> CompletionDispatcher:
        """The completion dispatcher: shared CQs on one completion channel (created on first use)."""
        if self._completions is None:
            if self.closed:
                raise RuntimeError(f"{self!r} is closed")
            device = self.device
            self._completions = CompletionDispatcher(
                create_channel=lambda: CompletionChannel(device),
                # batch=1: a pooled CQ is polled through the dispatcher's batch, not its own records.
                create_cq=lambda channel, cqe: CompletionQueue(device, channel, cqe, batch=1),  # type: ignore[arg-type]
                watch=self._watch,
                unwatch=self._unwatch,
                batch=CompletionBatch(DEFAULT_BATCH),
                max_cqe=device.query().max_cqe,
                cq_capacity=self._cq_capacity,
                # On siw the first CQ, made before the Domain's first QP and kept as long as the Domain,
                # is large enough to cover the mmap key libsiw refuses (rdmaio.verbs.siw_key_guard).
                first_cq_entries=siw_key_guard.GUARD_CQE if siw_key_guard.is_siw(device) else 0,
            )
        return self._completions

    @property
    def max_pinned(self) -> int:
        """The device's bound of pinned registration bytes (fixed when the Domain was created)."""
        return int(self.registrations.max_pinned)

    def check_max_pinned(self, max_pinned: int) -> None:
        """A connection created after this Domain asked for ``max_pinned`` (its ``Options.max_pinned``):
        the device's setting stays (every connection on it shares it); a different value is logged once."""
        current = self.registrations.max_pinned
        if max_pinned != current and max_pinned not in self._settings_refused:
            self._settings_refused.add(max_pinned)
            log.warning(
                "rdmaio: Options.max_pinned=%d ignored for a connection on %s: the device's registration "
                "bound was set to %d when its first connection on this loop was created",
                max_pinned,
                self.device.name,
                current,
            )

    def _register_local(self, view: memoryview) -> MemoryRegion:
        return MemoryRegion(self.pd, view)

    def _register(self, buffer: Any, access: int) -> MemoryRegion:
        # Local access unless asked: nothing is remotely accessible that was not exported on purpose.
        return register_in(self.pd, buffer, access)

    def add_private_registrations(self, cache: RegistrationCache) -> None:
        """Count ``cache`` (a connection's own, in its own PD) in :meth:`registration_totals` until
        :meth:`close_private_registrations`."""
        self._private_caches.add(cache)

    def close_private_registrations(self, cache: RegistrationCache) -> None:
        """Close a connection's own cache and keep its hits, misses and evictions in the totals
        (idempotent)."""
        if cache in self._private_caches:
            self._private_caches.discard(cache)
            closed = self._private_closed
            closed["hits"] += cache.hits
            closed["misses"] += cache.misses
            closed["evictions"] += cache.evictions
        cache.close()

    def registration_totals(self) -> dict[str, int]:
        """Hits, misses, evictions and pinned bytes of every registration cache on this device and loop:
        the Domain's own, its connections' own caches (a device without memory windows gives each
        connection a PD and a cache of its own) and those of the closed ones (not pinned any more)."""
        while True:
            try:
                caches = [self.registrations, *self._private_caches]
                break
            except RuntimeError:  # a connection came or went meanwhile (metrics read from any thread)
                continue
        totals = dict(self._private_closed)
        for cache in caches:
            totals["hits"] += cache.hits
            totals["misses"] += cache.misses
            totals["evictions"] += cache.evictions
        totals["pinned"] = sum(cache.pinned for cache in caches)
        return totals

    def statistics(self) -> dict[str, dict[str, int]]:
        """``{"registrations": ..., "completions": ..., "rings": ...}``: the registration cache's, the
        completion dispatcher's (empty before the first connection) and the ring pool's counters."""
        completions = self._completions.statistics() if self._completions is not None else {}
        return {
            "registrations": self.registrations.statistics(),
            "completions": completions,
            "rings": self.rings.statistics(),
        }

    def cq_failed(self, handle: int) -> None:
        """The device reported an error on CQ ``handle``: no new connection is placed on it."""
        if self._completions is not None:
            self._completions.cq_failed(handle)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.pd.closed

    def close(self, *, unwatch: bool = True) -> None:
        """Take the completion channel off the loop (``unwatch=False``: the loop is gone), deregister the
        cache, deallocate the PD (closing whatever still depends on it, QPs first), then destroy the CQs
        and the completion channel. Idempotent."""
        if self.pd.closed:
            return
        from rdmaio.core.metrics import fold_domain  # (that module imports this one)

        fold_domain(self)  # its counters into the process metrics, before they go
        completions = self._completions
        try:
            if self.shared_receive is not None:
                self.shared_receive.close()
            self.rings.close()
            self.registrations.close()
            self.pd.close()
        finally:
            # After the PD: its QPs are destroyed before the CQs they use (a CQ closes any left anyway).
            if completions is not None:
                completions.close(unwatch=unwatch)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<rdmaio Domain {self.device.name} {state} pinned={self.registrations.pinned}>"
