"""Per-domain completion dispatch: one completion channel on the loop, a pool of shared CQs, completions
routed to connections by QP number and connection tag.

A :class:`CompletionDispatcher` belongs to a :class:`~rdmaio.core.domain.Domain` (one per device per loop). It
owns ONE completion channel, whose fd sits on the loop, and a pool of CQs on that channel. A CQ has a fixed
capacity (the device's ``max_cqe`` bounds it), so a connection :meth:`~CompletionDispatcher.reserve`\\ s the
entries it can have outstanding (send depth + receive depth + a margin for control and one-sided work
requests) on the first CQ with room, or on a new CQ when none has room; it releases them once its QP is
destroyed. An empty CQ beyond the first is destroyed at that point (the first stays for the next
connection). A CQ can therefore never overflow: every posted work request completes at most once, and the
sum of reservations is at most the CQ's capacity.

One wake-up of the channel fd serves every connection of the domain:

1. ``CompletionChannel.drain_events`` (one C call, GIL released) reads every pending channel event, acks
   them grouped per CQ and re-arms each CQ that fired (re-arming before the poll is what prevents a lost
   wake-up);
2. each fired CQ is polled in batches by ``CompletionQueue.poll_grouped`` (one C call per batch), which
   groups the batch stably by the dispatch key ``(qp_num << 24) | tag`` (CQ order is kept within a key: RC
   completes in order and the send engine relies on it);
3. the handler of each key is called once per group: ``handler(records, start, count)``; a batch that
   came back full is polled again.

The connection tag is bits 32..55 of every ``wr_id`` (layout in :mod:`rdmaio.verbs`: ``make_wr_id``). QP
numbers are reused as soon as a QP is destroyed, and rxe may leave a destroyed QP's late completions in a
shared CQ: the tag, unique among the live connections of the domain, keeps them from reaching a new
connection that got the same QP number. A completion whose key has no live handler is counted
(``dropped``) and dropped.

A connection is registered (:meth:`~CompletionDispatcher.register`) as soon as its QP exists, before it
posts anything; until its handler is set (:meth:`~CompletionDispatcher.set_handler`, when the endpoint
exists) its completions are kept, in order, and delivered first once the handler is there: the peer may
send as soon as the connection is established, and another connection's wake-up may poll the shared CQ in
between.

This module is part of the core: it imports the verbs layer (for the wr_id layout and, through the
``Domain``, the verbs objects) and nothing above it. The verbs objects are passed in as factories so that
the unit tests drive the dispatcher with fakes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from rdmaio.errors import VerbsError
from rdmaio.verbs import WR_TAG_MASK, dispatch_key

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_CQ_CAPACITY",
    "CQReservation",
    "CompletionDispatcher",
    "CompletionHandler",
]

log = logging.getLogger("rdmaio")

CompletionHandler = Callable[[Any, int, int], None]
"""``handler(records, start, count)``: ``records[start:start + count]`` are one connection's completions,
in CQ order (``struct rdmaio_wc``: ``wr_id``, ``status``, ``opcode``, ``byte_len``, ``imm_data``, ``flags``,
``vendor_err``, ``qp_num``). The records are only valid during the call."""

DEFAULT_CQ_CAPACITY = 4096
"""Entries of a pooled CQ (capped by the device's ``max_cqe``; a larger reservation gets a CQ its size)."""
DEFAULT_BATCH = 512
"""Completions polled per C call."""


class Channel(Protocol):
    """What the dispatcher needs of a completion channel (:class:`rdmaio.verbs.CompletionChannel`)."""

    fd: int

    @property
    def closed(self) -> bool:
        """True once closed."""

    def drain_events(self) -> tuple[list[int], bool, int]:
        """Read, ack and re-arm: (handles of the CQs that fired, overflow, events read)."""

    def close(self) -> None:
        """Destroy the channel."""


class Queue(Protocol):
    """What the dispatcher needs of a CQ (:class:`rdmaio.verbs.CompletionQueue`)."""

    handle: int
    cqe: int

    @property
    def closed(self) -> bool:
        """True once closed."""

    def poll_grouped(self, batch: Any) -> int:
        """Poll a batch into ``batch.records``, grouped by key into ``batch.groups``."""

    def close(self) -> None:
        """Destroy the CQ (and first whatever still depends on it)."""


class Batch(Protocol):
    """What the dispatcher needs of a poll buffer (:class:`rdmaio.verbs.CompletionBatch`)."""

    size: int
    records: Any
    groups: Any
    ngroups: int

    def copy_records(self, start: int, count: int) -> Any:
        """A copy of ``records[start:start + count]`` that outlives the next poll."""


class _PooledCQ:
    __slots__ = ("capacity", "cq", "failed", "reserved", "users")

    def __init__(self, cq: Queue, capacity: int) -> None:
        self.cq = cq
        self.capacity = capacity
        self.reserved = 0
        self.users = 0
        self.failed = False


class CQReservation:
    """``entries`` reserved on one shared CQ (:attr:`cq`) by one connection.

    :meth:`release` them once the connection's QP is destroyed (idempotent).
    """

    __slots__ = ("_dispatcher", "_pooled", "entries", "released")

    def __init__(self, dispatcher: CompletionDispatcher, pooled: _PooledCQ, entries: int) -> None:
        self._dispatcher = dispatcher
        self._pooled = pooled
        self.entries = entries
        self.released = False

    @property
    def cq(self) -> Any:
        """The CQ to create the QP on (send and receive)."""
        return self._pooled.cq

    def release(self) -> None:
        """Give the entries back; call after the QP using them is destroyed. Idempotent."""
        if not self.released:
            self.released = True
            self._dispatcher._release(self._pooled, self.entries)


class CompletionDispatcher:
    """One completion channel on the loop, a pool of CQs on it, and the handlers completions go to.

    ``create_channel()`` and ``create_cq(channel, cqe)`` make the verbs objects (the CQ armed);
    ``watch(fd, callback)``/``unwatch(fd)`` put the channel fd on the loop and take it off; ``batch`` is
    the poll buffer; ``cq_capacity`` the size of a pooled CQ and ``max_cqe`` the device's limit.
    """

    def __init__(
        self,
        *,
        create_channel: Callable[[], Channel],
        create_cq: Callable[[Channel, int], Queue],
        watch: Callable[[int, Callable[[], None]], None],
        unwatch: Callable[[int], None],
        batch: Batch,
        max_cqe: int,
        cq_capacity: int = DEFAULT_CQ_CAPACITY,
        first_cq_entries: int = 0,
    ) -> None:
        if max_cqe < 1 or cq_capacity < 1:
            raise ValueError("max_cqe and cq_capacity must be >= 1")
        #: Entries of the pool's first CQ (the one kept while the dispatcher lives) at least: a device's
        #: workaround may need it large (Soft-iWARP: rdmaio.verbs.siw_key_guard); 0: no minimum.
        self.first_cq_entries = min(first_cq_entries, max_cqe)
        self._create_channel = create_channel
        self._create_cq = create_cq
        self._watch = watch
        self._unwatch = unwatch
        self._batch = batch
        self.max_cqe = max_cqe
        self.cq_capacity = min(cq_capacity, max_cqe)
        self._channel: Channel | None = None
        self._pool: list[_PooledCQ] = []
        self._by_handle: dict[int, _PooledCQ] = {}
        self._handlers: dict[int, CompletionHandler] = {}
        self._tags: dict[int, int] = {}  # live tag -> QP number
        self._next_tag = 1
        self._stash: dict[int, list[Any]] = {}  # key -> copies of records that came before the handler
        self._replay: set[int] = set()  # keys whose handler is set and whose stash is not delivered yet
        # Shared receive queue: a receive posted on an SRQ carries the SRQ's tag, not a
        # connection's, so each QP on it registers an alias key (qp_num, srq tag); completions of a key
        # without a live handler go to the tag's orphan handler (their buffers must go back to the SRQ).
        self._aliases: set[int] = set()
        self._orphans: dict[int, CompletionHandler] = {}
        self._dispatching = False
        self._again = False
        self._closed = False
        self.wakeups = 0  # fd readiness callbacks
        self.events = 0  # channel events read
        self.polls = 0  # poll_grouped calls
        self.completions = 0
        self.dispatched = 0  # handler calls (one per group)
        self.dropped = 0  # completions with no live handler (a destroyed connection's late ones)
        self.stashed = 0  # completions kept until their connection's handler was set
        self.cqs_created = 0
        self.cqs_destroyed = 0

    # --- state -----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    @property
    def fd(self) -> int | None:
        """The completion channel's fd (on the loop), or None before the first reservation."""
        return None if self._channel is None else self._channel.fd

    @property
    def cqs(self) -> list[Any]:
        """The CQs of the pool, oldest first."""
        return [p.cq for p in self._pool]

    def statistics(self) -> dict[str, int]:
        """Counters: ``wakeups`` (fd callbacks), ``events`` (channel events), ``polls``, ``completions``,
        ``dispatched`` (handler calls), ``dropped``, ``stashed``, ``cqs``, ``cqs_created``,
        ``cqs_destroyed``, ``capacity`` and ``reserved`` (CQ entries), ``connections``."""
        return {
            "wakeups": self.wakeups,
            "events": self.events,
            "polls": self.polls,
            "completions": self.completions,
            "dispatched": self.dispatched,
            "dropped": self.dropped,
            "stashed": self.stashed,
            "cqs": len(self._pool),
            "cqs_created": self.cqs_created,
            "cqs_destroyed": self.cqs_destroyed,
            "capacity": sum(p.capacity for p in self._pool),
            "reserved": sum(p.reserved for p in self._pool),
            "connections": len(self._tags),
        }

    # --- CQ reservations -------------------------------------------------------------------------

    def reserve(self, entries: int) -> CQReservation:
        """Reserve ``entries`` CQ entries on the first CQ with room (a new CQ when none has room).

        Raises :class:`~rdmaio.errors.VerbsError` when ``entries`` exceeds the device's ``max_cqe`` or the
        CQ cannot be created.
        """
        self._check_open()
        if entries < 1:
            raise ValueError("a reservation needs at least one entry")
        if entries > self.max_cqe:
            raise VerbsError(
                f"a connection needs {entries} CQ entries, the device allows {self.max_cqe} per CQ",
                errno=22,
                call="ibv_create_cq",
            )
        for pooled in self._pool:
            if not pooled.failed and pooled.capacity - pooled.reserved >= entries:
                break
        else:
            size = max(self.cq_capacity, entries)
            pooled = self._new_cq(size if self._pool else max(size, self.first_cq_entries))
        pooled.reserved += entries
        pooled.users += 1
        return CQReservation(self, pooled, entries)

    def _new_cq(self, cqe: int) -> _PooledCQ:
        channel = self._channel
        if channel is None:
            channel = self._create_channel()
            try:
                self._watch(channel.fd, self._on_readable)
            except BaseException:
                channel.close()
                raise
            self._channel = channel
        cq = self._create_cq(channel, cqe)
        # The device may round cqe up; the reservation bound uses what was asked (never more than granted).
        pooled = _PooledCQ(cq, min(cqe, cq.cqe) if cq.cqe > 0 else cqe)
        self._pool.append(pooled)
        self._by_handle[cq.handle] = pooled
        self.cqs_created += 1
        return pooled

    def _release(self, pooled: _PooledCQ, entries: int) -> None:
        pooled.reserved -= entries
        pooled.users -= 1
        if self._closed or pooled.users or pooled.cq.closed:
            return
        # Every QP on it is destroyed (a reservation is released after its QP). Keep the first CQ for the
        # next connection; destroy the others (and any failed one). Events of the CQ still unread on the
        # channel are discarded by the kernel with the CQ; everything read was acked already.
        if pooled is not self._pool[0] or pooled.failed:
            self._pool.remove(pooled)
            self._by_handle.pop(pooled.cq.handle, None)
            pooled.cq.close()
            self.cqs_destroyed += 1

    def cq_failed(self, handle: int) -> None:
        """The device reported a CQ error (``IBV_EVENT_CQ_ERR``) on CQ ``handle``: reserve nothing more
        on it (its connections are failed through their async-event handlers)."""
        pooled = self._by_handle.get(handle)
        if pooled is not None:
            pooled.failed = True

    # --- connections -----------------------------------------------------------------------------

    def register(self, qp_num: int) -> int:
        """Register the connection of QP ``qp_num`` and return its tag (unique among live connections).

        Call it after the QP exists and before anything is posted on it. Completions for it are kept
        until :meth:`set_handler`.
        """
        self._check_open()
        if len(self._tags) >= WR_TAG_MASK:
            raise VerbsError("no connection tag left in this domain", errno=28, call="register")
        tag = self._next_tag
        while tag in self._tags:
            tag = tag % WR_TAG_MASK + 1
        self._next_tag = tag % WR_TAG_MASK + 1
        self._tags[tag] = qp_num
        key = dispatch_key(qp_num, tag)
        self._handlers[key] = functools.partial(self._keep, key)
        return tag

    def set_handler(self, qp_num: int, tag: int, handler: CompletionHandler) -> None:
        """Send the completions of the connection ``(qp_num, tag)`` to ``handler`` from now on; those kept
        since :meth:`register` go first (at the next dispatch or :meth:`poll_now`)."""
        key = dispatch_key(qp_num, tag)
        if self._tags.get(tag) != qp_num and key not in self._aliases:
            raise KeyError(f"no live connection with QP {qp_num} and tag {tag}")
        self._handlers[key] = handler
        if key in self._stash:
            self._replay.add(key)

    def unregister(self, qp_num: int, tag: int) -> None:
        """Forget the connection ``(qp_num, tag)``: its later completions are dropped. Call it before its
        QP is destroyed. Idempotent."""
        if self._tags.get(tag) == qp_num:
            del self._tags[tag]
        key = dispatch_key(qp_num, tag)
        self._handlers.pop(key, None)
        self._replay.discard(key)
        kept = self._stash.pop(key, None)
        if kept:
            self.dropped += sum(len(records) for records in kept)

    def register_alias(self, qp_num: int, tag: int) -> None:
        """Route completions of ``(qp_num, tag)``, a tag shared by many QPs (an SRQ's), like a registered
        connection's: kept until :meth:`set_handler`, then delivered to that handler."""
        self._check_open()
        key = dispatch_key(qp_num, tag)
        self._aliases.add(key)
        self._handlers[key] = functools.partial(self._keep, key)

    def unregister_alias(self, qp_num: int, tag: int) -> None:
        """Forget an alias; completions kept for it go to the tag's orphan handler. Idempotent."""
        key = dispatch_key(qp_num, tag)
        self._aliases.discard(key)
        self._handlers.pop(key, None)
        self._replay.discard(key)
        kept = self._stash.pop(key, None)
        orphan = self._orphans.get(tag)
        for records in kept or ():
            if orphan is None:
                self.dropped += len(records)
            else:
                self._call(orphan, records, 0, len(records))

    def set_orphan_handler(self, tag: int, handler: CompletionHandler | None) -> None:
        """Send completions whose key has no live handler and whose tag is ``tag`` to ``handler``."""
        if handler is None:
            self._orphans.pop(tag, None)
        else:
            self._orphans[tag] = handler

    def _keep(self, key: int, records: Any, start: int, count: int) -> None:
        """The handler of a registered connection whose own handler is not set yet: keep a copy."""
        self._stash.setdefault(key, []).append(self._batch.copy_records(start, count))
        self.stashed += count

    def _deliver_kept(self, key: int) -> None:
        self._replay.discard(key)
        handler = self._handlers.get(key)
        kept = self._stash.pop(key, None)
        if handler is None or not kept:
            return
        for records in kept:
            self._call(handler, records, 0, len(records))

    # --- dispatch --------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        """The channel fd is readable: ack and re-arm what fired, poll it, dispatch."""
        channel = self._channel
        if channel is None or channel.closed:
            return
        self.wakeups += 1
        try:
            handles, overflow, events = channel.drain_events()
        except VerbsError:
            # Everything read was acked and re-armed; poll every CQ so nothing read is left behind.
            log.exception("rdmaio: reading the completion channel failed")
            handles, overflow, events = [], True, 0
        self.events += events
        if overflow:
            pooled = list(self._pool)
        else:
            # A loop, not a comprehension: on Python 3.11 a comprehension is a function call of its own.
            by_handle = self._by_handle
            pooled = []
            for handle in handles:
                entry = by_handle.get(handle)
                if entry is not None:
                    pooled.append(entry)
        self._poll(pooled)

    def poll_now(self) -> None:
        """Poll every CQ of the pool and dispatch, without waiting for the fd (completions may be waiting
        that raised no event yet, or whose event another wake-up consumed). Called during a dispatch (by a
        handler), it only makes the running dispatch poll every CQ once more when it is done."""
        if self._closed:
            return
        if self._replay and not self._dispatching:
            for key in list(self._replay):
                self._deliver_kept(key)
        self._poll(list(self._pool))

    def deliver(self, cq: Queue, records: Any, key: int) -> bool:
        """``records`` (the caller's own array, every record of dispatch key ``key``) were taken from ``cq``
        by a caller (a serial one-sided request's post-and-poll in one C call keeps its own successful
        completion and hands anything else here). Dispatched as :meth:`poll_now` would: True. During a
        dispatch (the caller ran inside a handler) they are kept, in order, as records that came before
        their handler was set are, and False is returned: the caller makes sure a :meth:`poll_now` comes
        soon (later records of the same key are delivered after them in any case)."""
        n = len(records)
        self.polls += 1
        if not n:
            return True
        self.completions += n
        if self._closed:
            self.dropped += n
            return True
        if self._dispatching:
            self._stash.setdefault(key, []).append(records)
            self._replay.add(key)
            self._again = True
            return False
        if self._replay:
            for kept in list(self._replay):
                self._deliver_kept(kept)
        self._dispatching = True
        try:
            self._dispatch(records, [_Run(key, 0, n)], 1)
        finally:
            self._dispatching = False
        if self._again:
            self._poll(list(self._pool))
        else:
            self._poll([p for p in self._pool if p.cq is cq])  # records were taken: more may be there
        return True

    def _poll(self, pooled: list[_PooledCQ]) -> None:
        """Drain each CQ of ``pooled`` (poll in batches until one comes back short) and dispatch; again over
        the whole pool while a handler asked for it (:meth:`poll_now` during the dispatch)."""
        if self._dispatching:
            self._again = True  # the records being dispatched must not be overwritten: poll later
            return
        self._dispatching = True
        batch = self._batch
        size = batch.size
        try:
            while True:
                self._again = False
                for entry in pooled:
                    cq = entry.cq
                    while not cq.closed:  # a handler may have closed it (its last connection went)
                        n = cq.poll_grouped(batch)
                        self.polls += 1
                        if not n:
                            break
                        self.completions += n
                        self._dispatch(batch.records, batch.groups, batch.ngroups)
                        if n < size:
                            break
                if not self._again or self._closed:
                    return
                pooled = list(self._pool)
        finally:
            self._dispatching = False

    def _dispatch(self, records: Any, groups: Any, ngroups: int) -> None:
        handlers = self._handlers
        replay = self._replay
        for g in range(ngroups):
            group = groups[g]
            key = group.key
            handler = handlers.get(key)
            if handler is None:
                orphan = self._orphans.get(key & WR_TAG_MASK) if self._orphans else None
                if orphan is not None:
                    self._call(orphan, records, group.start, group.count)
                else:
                    self.dropped += group.count
                continue
            if replay and key in replay:
                self._deliver_kept(key)  # what came before the handler was set goes first
                handler = handlers.get(key)
                if handler is None:
                    self.dropped += group.count
                    continue
            # _call(), inline: one handler call per group is the whole per-wake-up cost of a connection.
            self.dispatched += 1
            try:
                handler(records, group.start, group.count)
            except Exception:
                log.exception("rdmaio: completion handler %r failed", handler)

    def _call(self, handler: CompletionHandler, records: Any, start: int, count: int) -> None:
        self.dispatched += 1
        try:
            handler(records, start, count)
        except Exception:
            # A handler fails its own connection; one connection's bug must not starve the others (the
            # same in _dispatch, which does this inline).
            log.exception("rdmaio: completion handler %r failed", handler)

    # --- lifetime --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise VerbsError("the domain's completion dispatcher is closed", call="ibv_destroy_cq")

    def close(self, *, unwatch: bool = True) -> None:
        """Take the fd off the loop (unless ``unwatch`` is False: the loop is gone), destroy every CQ
        (each closes the QPs still on it first), then the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        channel, self._channel = self._channel, None
        pool, self._pool = self._pool, []
        self._by_handle.clear()
        self._handlers.clear()
        self._tags.clear()
        self._stash.clear()
        self._replay.clear()
        if channel is not None and unwatch:
            try:
                self._unwatch(channel.fd)
            except Exception:
                log.debug("rdmaio: removing the completion channel from the loop failed", exc_info=True)
        try:
            for pooled in pool:
                pooled.cq.close()
                self.cqs_destroyed += 1
        finally:
            if channel is not None:
                channel.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<rdmaio CompletionDispatcher {state} cqs={len(self._pool)} connections={len(self._tags)}>"


class _Run:
    """One run of records of one dispatch key (what :meth:`CompletionDispatcher.deliver` dispatches)."""

    __slots__ = ("count", "key", "start")

    def __init__(self, key: int, start: int, count: int) -> None:
        self.key = key
        self.start = start
        self.count = count
