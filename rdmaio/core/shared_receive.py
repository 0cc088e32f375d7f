"""The shared receive queue of a Domain (``Options(shared_receive_queue=True)``).

One :class:`SharedReceivePool` per Domain (device and loop), created by the first connection that asks for
it (:func:`shared_pool`): an SRQ, one :class:`~rdmaio.core.rings.SlotRing` of receive buffers registered
chunk by chunk as the pool grows, and the :class:`~rdmaio.protocol.credit_ledger.SharedCreditLedger` that
lends the posted receives to connections as credits. A connection on it (:class:`SharedMember`, owned by its
:class:`~rdmaio.core.transport.Transport`) has no receive queue or ring of its own; its session is a
:class:`~rdmaio.protocol.shared_session.SharedSession`, which reports every reposted receive and RETURN frame
to the ledger through callbacks bound here (:func:`new_session`), so the endpoint's receive path is the same
in both modes. (This module knows a Transport only as "something with a ``shared`` member", so that
:mod:`rdmaio.core.transport`, which imports it, is not imported back.)

Completions: a receive posted on the SRQ cannot carry a connection's tag in its ``wr_id`` (nobody knows
which QP will take it), so SRQ receives carry tag 0 (never a connection's) and each QP on the SRQ registers
the alias ``(qp_num, 0)`` with the dispatcher, routed to its endpoint's handler like its own completions.
Completions of a QP that is gone go to the pool's orphan handler, which puts their buffers back.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

from rdmaio.core.dispatch import CompletionHandler
from rdmaio.core.rings import SlotRing
from rdmaio.errors import FrameError, RdmaError
from rdmaio.protocol import FEATURE_RECLAIM, Handshake, Session
from rdmaio.protocol.credit_ledger import SharedCreditLedger
from rdmaio.protocol.reclaim import ReclaimSession
from rdmaio.protocol.shared_session import SharedSession
from rdmaio.verbs import WR_INDEX_MASK, WR_KIND_RECV, MemoryRegion, SharedReceiveQueue, make_wr_id
from rdmaio.verbs.native import ffi

if TYPE_CHECKING:
    from rdmaio.core.domain import Domain
    from rdmaio.options import Options

__all__ = [
    "SRQ_TAG",
    "OnSharedQueue",
    "SharedMember",
    "SharedReceivePool",
    "SharedReceiveQueueFullError",
    "SharedSession",
    "new_session",
    "new_session_state",
    "shared_pool",
]

log = logging.getLogger("rdmaio")


class SharedReceiveQueueFullError(RdmaError, OSError):
    """The shared receive queue cannot lend a new connection its initial receives (the pool is at
    ``Options.srq_max_buffers`` and lent out): the connection is refused (a server rejects it)."""


SRQ_TAG = 0
"""The connection tag of SRQ receives' wr_ids: the dispatcher never gives a connection tag 0."""
_RECV_BASE = make_wr_id(WR_KIND_RECV, SRQ_TAG, 0)
_TICK = 1.0  # seconds between idle checks (windows of idle connections go back to the reserve)


class SharedMember:
    """One connection's place on the pool: its QP number, lease key, session and handler."""

    def __init__(self, pool: SharedReceivePool, key: int) -> None:
        self.pool = pool
        self.key = key
        self.qp_num = 0
        self.session: SharedSession | None = None
        self.handler: CompletionHandler | None = None
        self.slots: set[int] = set()  # buffers its frames took that were not posted again
        #: Fails the connection (set by its Connection once established): an overrun, a RECLAIM unanswered.
        self.on_failure: Callable[[BaseException], None] | None = None
        #: Seconds a RECLAIM may stay unanswered while the peer holds the credits to answer it.
        self.reclaim_timeout = 10.0
        self.reclaim_waited = 0.0  # seconds (in ticks) the current RECLAIM has been unanswered so far
        self.overruns = 0  # receives its peer consumed beyond its credits

    def fail(self, exc: BaseException) -> None:
        """Fail this connection (its teardown gives the lease back: :meth:`SharedReceivePool.leave`)."""
        if self.on_failure is not None:
            self.on_failure(exc)

    def attach(self, session: SharedSession) -> None:
        """``session`` is this connection's (its handshakes say whether the peer answers RECLAIM)."""
        self.session = session
        self.pool.ledger.set_reclaimable(self.key, session.reclaim)
        self.pool.ledger.set_max_window(self.key, session.local.recv_depth)

    def grant(self, n: int) -> None:
        """The pool lent this connection ``n`` more receives: grow its window and let it send the credit."""
        if self.session is not None:
            self.session.grow_receives(n)
            self.wake()

    def reclaim(self) -> None:
        """Ask the peer for its unused credits back (a RECLAIM frame)."""
        if self.session is not None:
            self.session.request_reclaim()
            self.wake()

    def wake(self) -> None:
        """Let the endpoint stage what became due (not while its own completions are being processed:
        it stages at the end of that anyway)."""
        # An empty completion group: the endpoint processes nothing, then stages and posts what is due.
        if self.handler is not None and self.pool.current is not self:
            self.handler(self.pool.empty, 0, 0)

    def posted(self, slots: list[int]) -> None:
        """The endpoint put these buffers back on the SRQ."""
        self.pool.post(slots)
        self.slots.difference_update(slots)

    def on_completions(self, records: Any, start: int, count: int) -> None:
        """The alias handler: every SRQ receive this QP took is consumed from the ledger here (whatever
        the endpoint then makes of it), then the endpoint's handler runs."""
        ledger = self.pool.ledger
        slots = self.slots
        overruns = 0
        for i in range(start, start + count):
            slots.add(records[i].wr_id & WR_INDEX_MASK)
            if not ledger.on_consumed(self.key):
                overruns += 1
        if overruns:
            # The peer sent without credits: those receives were lent to other connections, whose SENDs
            # may now find the queue short. The ledger counted them (the SRQ really holds fewer); the
            # connection fails before its frames are processed, its QP goes, and its teardown reposts
            # every buffer it took, so the shortfall lasts no longer than this batch.
            self.overruns += overruns
            log.warning(
                "rdmaio: QP %d consumed %d shared receives beyond its credits; failing it",
                self.qp_num,
                overruns,
            )
            if self.on_failure is not None:
                self.fail(FrameError(f"the peer consumed {overruns} shared receives beyond its credits"))
                return
        pool = self.pool
        previous, pool.current = pool.current, self
        try:
            if self.handler is not None:
                self.handler(records, start, count)
        finally:
            pool.current = previous


class SharedReceivePool:
    """The SRQ, its buffers and its ledger on one Domain (see the module docstring)."""

    def __init__(
        self,
        domain: Domain,
        options: Options,
        call_later: Callable[[float, Callable[[], None]], Any] | None = None,
    ) -> None:
        self.domain = domain
        self.slot_size = options.slot_size
        device_max = domain.device.query().max_srq_wr
        self.max_buffers = max(4, min(options.srq_max_buffers, device_max or options.srq_max_buffers))
        self.srq = SharedReceiveQueue(domain.pd, self.max_buffers)
        self.ring = SlotRing(self.slot_size, self.max_buffers, self._register)
        self.ledger = SharedCreditLedger(buffers=0, max_buffers=self.max_buffers)
        self.members: dict[Hashable, SharedMember] = {}  # lease key -> member
        self.by_qp: dict[int, SharedMember] = {}  # QP number -> member, until retired
        self._next_key = 0
        self.empty = domain.completions  # any object: the handlers ignore records when count is 0
        domain.completions.set_orphan_handler(SRQ_TAG, self._on_orphans)
        self._tick_handle: Any = None
        self._call_later = call_later
        self.limit_armed = 0
        self.current: SharedMember | None = None  # whose completions are being processed
        self.closed = False

    def _register(self, view: memoryview) -> MemoryRegion:
        return MemoryRegion(self.domain.pd, view)  # local access only, like every slot ring

    @property
    def registered_bytes(self) -> int:
        """Bytes of receive buffers the pool pins now."""
        return self.ring.registered_bytes

    # -- buffers --------------------------------------------------------------------------------------

    def add_buffers(self, n: int) -> int:
        """Register up to ``n`` more buffers and post them on the SRQ; return how many."""
        slots = self.ring.grow(n)
        if slots:
            self.srq.post_ring_slots(self.ring.lkeys, self.ring.addr, self.slot_size, list(slots), _RECV_BASE)
            self.ledger.on_buffers_added(len(slots))
            self._arm_limit()
        return len(slots)

    def post(self, slots: list[int]) -> None:
        """Put consumed buffers back on the SRQ (the session reports them to the ledger right after)."""
        self.srq.post_ring_slots(self.ring.lkeys, self.ring.addr, self.slot_size, slots, _RECV_BASE)

    def _arm_limit(self) -> None:
        limit = min(self.ledger.srq_limit, self.srq.max_wr)
        if limit != self.limit_armed:
            self.srq.arm_limit(limit)
            self.limit_armed = limit

    def on_limit_event(self) -> None:
        """``IBV_EVENT_SRQ_LIMIT_REACHED`` for this SRQ (it disarmed itself): pressure, then re-arm."""
        self.ledger.on_limit_event()
        self.limit_armed = 0
        self.apply()
        self._arm_limit()

    def apply(self) -> None:
        """Carry out what the ledger decided: post wanted buffers, grow windows, ask for credits back."""
        ledger = self.ledger
        want = ledger.want_buffers()
        if want:
            self.add_buffers(want)
        for key, n in ledger.take_grants():
            member = self.members.get(key)
            if member is not None:
                member.grant(n)
        for key in ledger.take_reclaims():
            member = self.members.get(key)
            if member is not None:
                member.reclaim()

    # -- connections ------------------------------------------------------------------------------------

    def join(self, initial: int, max_window: int) -> SharedMember:
        """Lend ``initial`` receives to a new connection (growing the pool first if it must); raises
        :class:`SharedReceiveQueueFullError` if the pool cannot lend them now."""
        key = self._next_key
        self._next_key += 1
        if self.ledger.free < initial:  # grow first: open() counts only real refusals
            self.add_buffers(initial - self.ledger.free)
        if not self.ledger.open(key, initial, max_window, reclaimable=False):
            self.apply()  # idle windows shrink toward the reserve: a later connection may fit
            raise SharedReceiveQueueFullError(
                f"the shared receive queue cannot lend {initial} receives to a new connection "
                f"({self.ledger.connections} connections on {self.ledger.buffers} of at most "
                f"{self.max_buffers} buffers; raise Options.srq_max_buffers)"
            )
        member = SharedMember(self, key)
        self.members[key] = member
        self._schedule_tick()
        return member

    def attach_qp(self, member: SharedMember, qp_num: int) -> None:
        member.qp_num = qp_num
        self.by_qp[qp_num] = member
        self.domain.completions.register_alias(qp_num, SRQ_TAG)

    def set_handler(self, member: SharedMember, handler: CompletionHandler) -> None:
        member.handler = handler
        self.domain.completions.set_handler(member.qp_num, SRQ_TAG, member.on_completions)

    def leave(self, member: SharedMember) -> None:
        """The connection's QP is destroyed: put back the buffers its endpoint still held, poll the CQs (a
        completion already generated may still name the QP: the orphan handler puts its buffer back), then
        retire its lease."""
        self.members.pop(member.key, None)
        member.handler = None
        member.session = None
        if member.qp_num:
            self.domain.completions.unregister_alias(member.qp_num, SRQ_TAG)
        self.ledger.close(member.key)
        self._give_back(member, list(member.slots))
        try:
            self.domain.completions.poll_now()
        finally:
            self._retire(member)

    def _give_back(self, member: SharedMember, slots: list[int]) -> None:
        member.slots.clear()
        if not slots or self.closed:
            return
        self.post(slots)
        # What the lease counts as taken goes back to it; the rest were taken beyond its credits (counted
        # as lost from the SRQ by on_consumed), and are posted again now.
        counted = min(len(slots), self.ledger.unreturned(member.key))
        self.ledger.on_reposted(member.key, counted)
        self.ledger.on_overrun_reposted(len(slots) - counted)

    def _retire(self, member: SharedMember) -> None:
        self.by_qp.pop(member.qp_num, None)
        if not self.closed:
            self.ledger.retire(member.key)
            self.apply()

    def _on_orphans(self, records: Any, start: int, count: int) -> None:
        """Completions of a QP that left (or never got a handler): put their buffers back."""
        if self.closed:
            return
        for i in range(start, start + count):
            wc = records[i]
            member = self.by_qp.get(int(wc.qp_num))
            self.post([wc.wr_id & WR_INDEX_MASK])
            if member is not None and self.ledger.on_consumed(member.key):  # a closing lease: to the pool
                self.ledger.on_reposted(member.key, 1)
            elif member is not None:  # beyond its credits: on_consumed counted it, the post restores it
                self.ledger.on_overrun_reposted(1)
            # else: a retired QP's late completion (its CQ was polled before it retired): the buffer is
            # posted again and the ledger, which counted it as posted all along, is right once more.
        self.apply()

    def _schedule_tick(self) -> None:
        if self._tick_handle is None and self._call_later is not None and not self.closed:
            self._tick_handle = self._call_later(_TICK, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        if self.closed:
            return
        self._check_reclaims()
        self.ledger.tick()
        self.apply()
        if self.members:
            self._schedule_tick()

    def _check_reclaims(self) -> None:
        """Fail the connections whose peers left a RECLAIM unanswered for ``reclaim_timeout`` seconds while
        they held at least two credits (enough to send the RETURN, whatever else they were doing): such a
        peer keeps its lease, receives other connections could use, for as long as it likes."""
        for member in list(self.members.values()):
            session = member.session
            if session is None or not session.reclaim_pending or session.posted - session.ungranted < 2:
                member.reclaim_waited = 0.0
                continue
            member.reclaim_waited += _TICK
            if member.reclaim_waited >= member.reclaim_timeout:
                member.reclaim_waited = 0.0
                log.warning(
                    "rdmaio: QP %d left a RECLAIM unanswered for %s s; failing it",
                    member.qp_num,
                    member.reclaim_timeout,
                )
                member.fail(FrameError(f"the peer did not answer RECLAIM within {member.reclaim_timeout} s"))

    def statistics(self) -> dict[str, int]:
        """Buffers, posted receives, free credits, connections, registered bytes and limit events."""
        ledger = self.ledger
        return {
            "buffers": ledger.buffers,
            "posted": ledger.posted,
            "free": ledger.free,
            "connections": ledger.connections,
            "registered_bytes": self.registered_bytes,
            "limit_events": ledger.limit_events,
            "refused": ledger.refused,
            "overruns": ledger.overruns,
        }

    def close(self) -> None:
        """Destroy the SRQ (its QPs first) and deregister the buffers. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self.domain.completions.set_orphan_handler(SRQ_TAG, None)
        self.srq.close()
        self.ring.close()


_pools: weakref.WeakKeyDictionary[Domain, SharedReceivePool] = weakref.WeakKeyDictionary()


def shared_pool(
    domain: Domain, options: Options, call_later: Callable[[float, Callable[[], None]], Any] | None = None
) -> SharedReceivePool:
    """The shared receive pool of ``domain`` (created on first use; one slot size per domain)."""
    pool = _pools.get(domain)
    if pool is None or pool.closed:
        pool = _pools[domain] = SharedReceivePool(domain, options, call_later)
        domain.shared_receive = pool
    elif pool.slot_size != options.slot_size:
        raise ValueError(
            f"the shared receive queue of {domain!r} has {pool.slot_size}-byte slots, not {options.slot_size}"
        )
    return pool


class OnSharedQueue(Protocol):
    """What :func:`new_session` needs of a connection's transport: its place on a shared receive queue."""

    @property
    def shared(self) -> SharedMember | None:
        """The connection's :class:`SharedMember`, or None if it has a receive queue of its own."""


def new_session(local: Handshake, peer: Handshake, transport: OnSharedQueue) -> Session:
    """The session of a new connection: a :class:`~rdmaio.protocol.shared_session.SharedSession` on a shared
    receive queue (reporting to its pool's ledger), a :class:`~rdmaio.protocol.reclaim.ReclaimSession` (to
    answer RECLAIM) if both sides announced ``FEATURE_RECLAIM``, else a plain
    :class:`~rdmaio.protocol.Session`.

    Its state is a C ``struct rdmaio_session`` (the fields of
    :class:`~rdmaio.protocol.sessionstate.SessionState`): the receiver applies the hot frame rules to it in
    C (:meth:`rdmaio.core.receive.Receiver.on_batch`), and the session's own methods work on the same
    fields. A :class:`SharedSession` marks it not fast, so its frames all go through its methods."""
    state = ffi.new("struct rdmaio_session *")  # new_session_state(), inlined: no call per connection
    member = transport.shared
    if member is not None:
        pool = member.pool
        session = SharedSession(
            local,
            peer,
            state=state,
            # Partials of the ledger's own methods: no Python call of ours between a repost and the ledger.
            reposted=functools.partial(pool.ledger.on_reposted, member.key),
            returned=functools.partial(pool.ledger.on_returned, member.key),
            settled=pool.apply,
        )
        member.attach(session)
        return session
    if local.features & peer.features & FEATURE_RECLAIM:
        return ReclaimSession(local, peer, state=state)
    return Session(local, peer, state=state)


def new_session_state() -> Any:
    """A zeroed C ``struct rdmaio_session``, the state a session of the core works on (kept alive by the
    session that holds it)."""
    return ffi.new("struct rdmaio_session *")
