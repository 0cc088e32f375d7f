"""One-sided RDMA: exported memory, remote keys, RDMA READ / WRITE / atomics on the event loop.

Model (see docs/one-sided.md). The *exporter* calls ``ep.export(buffer, offset, length, access)``: rdmaio
registers exactly that range as its own memory region (MR) with ``IBV_ACCESS_MW_BIND`` and no remote access
flags, and binds a type 2 memory window over all of it, with exactly the access asked for, by a work request
posted on this connection's queue pair; it returns a :class:`RemoteKey` (address, the window's rkey, length,
access and a key id). The *importer* parses it with :meth:`RemoteKey.from_bytes` and calls ``ep.rdma_read``
/ ``rdma_read_into`` / ``rdma_write`` / ``fetch_add`` / ``compare_swap`` on it. Every call is checked
locally (range, access, alignment, revocation) before anything is posted, so a mistake costs a
:class:`~rdmaio.RemoteAccessError` and never the connection; the NIC enforces the same range and access for
peers that do not use rdmaio.

Key scope. Every queue pair of a loop shares the device's protection domain (the per-device Domain), and an
MR's own rkey works on all of them: rkeys are near-sequential, so any other connection of the process
could use a grant by guessing its address. A type 2 window's rkey works only through the queue pair it was
bound on: a key is good on the connection that exported it and refused (a remote access error at the
requester) on every other. ``export(..., scope="domain")`` asks for the old process-wide grant by name (the
MR's own rkey with the remote flags); a device without memory windows (``max_mw`` 0, e.g. siw) raises
:class:`~rdmaio.FeatureNotSupportedError` for the default scope. One MR per grant, not one for many: rxe
(Linux 6.1) checks a window's accesses against its MR's bounds, not the window's, so the window must cover
its whole MR.

Binds are synchronous for the caller: ``export()`` posts the bind and returns. The NIC executes a send
queue in order, so anything posted on the same connection afterwards (``ep.send(bytes(key))``) comes after
the bind: a peer that got the key over this connection finds the window valid. The bind is signalled
(kind 2 wr_id, no op slot: the send queue has :data:`MAX_BINDS_IN_FLIGHT` entries of its own for binds);
its completion is tracked, and a failed bind fails the connection (the NIC moved the QP to the error
state) with a :class:`~rdmaio.VerbsError` naming ``IBV_WR_BIND_MW``.

Revocation. ``await ep.revoke(key)`` sends the peer a REVOKE control message and waits (at most
``Options.close_timeout``) for its REVOKE_ACK, then deallocates the window and deregisters the MR. The
importer marks the key id revoked when the REVOKE arrives, before it answers: every later call on that key
raises :class:`~rdmaio.RemoteKeyRevokedError` without posting, including calls already collected for a
doorbell that has not rung yet (checked again when it rings). Requests it posted earlier precede the ACK on
the same reliable connection, so the exporter's NIC has executed them before the exporter deallocates.
After ``revoke`` returns, the NIC refuses the rkey: the memory is never touched through it again. Key ids
are dense per connection (1, 2, ...), so the importer keeps revoked ids as ranges
(:mod:`rdmaio.core.onesided_revoked`, bounded by ``Options.max_revoked_key_ranges``).

Control messages are SENDs *without* immediate data (rdmaio frames always carry one) and write notices are
RDMA WRITEs *with* immediate data (completion opcode ``IBV_WC_RECV_RDMA_WITH_IMM``); both consume one of the
peer's posted receives, so both are paid for with a send credit like a frame (:meth:`Session.take_slot`).

Work requests of one-sided operations and window binds carry ``wr_id = 2 << 56 | tag << 32 | index``
(kind 2; kind 0 is the send slots of frames, kind 3 is reserved for keepalive; the tag routes the
completion through the Domain's shared CQ; ops and binds draw their indexes from one counter, so the index
tells which) and are always signalled.
"""

from __future__ import annotations

import collections
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any, cast

from rdmaio import verbs
from rdmaio._ffi import ffi
from rdmaio.core.backend import Backend
from rdmaio.core.onesided_base import (
    MAX_BINDS_IN_FLIGHT,
    MAX_OP_BYTES,
    WR_KIND_ONESIDED,
    BindWindow,
    Credits,
    RdmaQueue,
    Region,
    _fresh,
)
from rdmaio.core.onesided_batch import Batches
from rdmaio.core.onesided_grants import CTL_FIRST_EXTERNAL, SCOPES, Exports
from rdmaio.core.onesided_revoked import RevokedKeys
from rdmaio.core.remotekey import (
    ACCESS_ATOMIC,
    ACCESS_READ,
    ACCESS_WRITE,
    KEY_VERSION,
    OneSidedCaps,
    RemoteKey,
    WriteNotice,
    cached_caps,
    parse_access,
    query_caps,
    rd_atomic_depth,
)
from rdmaio.errors import (
    EndpointClosedError,
    VerbsError,
)
from rdmaio.protocol import FEATURE_ONESIDED

log = logging.getLogger("rdmaio.onesided")

__all__ = [
    "ACCESS_ATOMIC",
    "ACCESS_READ",
    "ACCESS_WRITE",
    "CTL_FIRST_EXTERNAL",
    "KEY_VERSION",
    "MAX_BINDS_IN_FLIGHT",
    "MAX_OP_BYTES",
    "SCOPES",
    "WR_KIND_ONESIDED",
    "OneSidedCaps",
    "OneSidedEngine",
    "RemoteKey",
    "WriteNotice",
    "parse_access",
    "query_caps",
    "rd_atomic_depth",
]


class OneSidedEngine(Exports, Batches):
    """The one-sided side of one connection: grants, pending operations, write notices, revocation.

    ``register_local(buffer)`` registers rdmaio-owned or caller memory for local access only (no remote
    flags) and ``register_grant(view, access_bits)`` registers an exported range with exactly the remote
    access of ``access_bits``; ``cache_get(buffer)`` returns a Domain-cached local registration (with
    ``region``/``release()``). ``fail(exc)`` fails the whole connection (used when a cancelled
    ``rdma_read_into`` must stop the NIC writing into the caller's buffer).

    Connection-scoped grants: ``register_bindable(view, readonly)`` registers with ``IBV_ACCESS_MW_BIND``
    and no remote flags, ``bind_window(region, wr_id, access)`` allocates a type 2 window and posts its
    bind on the connection's QP (None: the device has no windows), ``poll()`` polls the completion queue
    now (to free bind entries). ``max_revoked_ranges`` bounds the peer's revoked key ids kept.
    """

    def __init__(
        self,
        io: Backend,
        qp: RdmaQueue,
        credits: Credits,
        *,
        register_local: Callable[[Any], Region],
        register_grant: Callable[[memoryview, int], Region],
        cache_get: Callable[[Any], Any],
        register_bindable: Callable[[memoryview, bool], Region] | None = None,
        bind_window: BindWindow | None = None,
        poll: Callable[[], None] | None = None,
        max_revoked_ranges: int = 4096,
        fail: Callable[[BaseException], None],
        max_ops: int,
        max_inline: int,
        revoke_timeout: float,
        atomics: bool = True,
        stats: collections.Counter[str] | None = None,
        tag: int = 0,
        peer_onesided: bool = True,
        notice_limit: int = 64,
        repost: Callable[[int], None] | None = None,
        post_polled: Callable[[int, int], bool] | None = None,
    ) -> None:
        self._io = io
        # Posts a lone request of a task calling serially and polls the completion queue once right after
        # (see OpLifecycle._post): post_polled(count, wr_id) is True when the request's own successful
        # completion was all the poll found.
        self._post_polled = post_polled
        self._at_post_streak = 0  # calls completed at their post since one last yielded to the loop
        self._last_poster = 0  # id() of the task that posted the previous request (not a reference)
        # The connection's tag routes our completions to us through the Domain's shared CQ.
        self._wr_base = verbs.make_wr_id(WR_KIND_ONESIDED, tag, 0)
        self._qp = qp
        self._wr_entries = ffi.buffer(qp.rdma_array)  # filled with verbs.RDMA_OP.pack_into
        self._credits = credits
        self._register_local = register_local
        self._register_grant = register_grant
        self._register_bindable = register_bindable or (lambda view, readonly: register_local(view))
        self._bind_window = bind_window if register_bindable is not None else None
        self._poll = poll
        self._binds = {}  # window binds posted, by index, until their completion
        self._bind_waiters = collections.deque()  # export_for_read() calls waiting for a bind entry
        self._key_ids = itertools.count(1)
        self._cache_get = cache_get
        self._fail_connection = fail
        self.max_ops = max_ops
        self._max_inline = max_inline
        self._revoke_timeout = revoke_timeout
        self._atomics = atomics
        self._stats = stats if stats is not None else collections.Counter()
        self._index = itertools.count(1)
        self.ops = {}  # posted or waiting for a credit, by op index
        self._in_flight = 0  # work requests of self.ops (a batch op stands for several)
        self._slot_waiters = collections.deque()
        self._credit_queue = collections.deque()
        self._staging = None  # registered rdmaio-owned memory: max_ops slots of _STAGING_SLOT bytes
        self._staging_view = None
        self._free_staging = list(range(max_ops))
        self._doorbell = []  # requests to post together at the end of this loop iteration
        self._ring_handle = None
        self._large_pool = {}  # free large buffers by size class
        self._large_pooled = 0  # bytes in _large_pool
        self.grants = {}  # what we exported, by key id
        self.revoked_ids = RevokedKeys(max_revoked_ranges)  # keys the peer revoked
        self._pending_acks = collections.deque()
        self._notices = collections.deque()
        self._notice_waiter = None
        # The peer announced FEATURE_ONESIDED: it understands write notices and control messages.
        self.peer_onesided = peer_onesided
        # Write notices queued beyond notice_limit keep the receive they consumed (held_slots) until
        # wait_write_notice() takes one: the writer's credit comes back only then (back-pressure).
        self.notice_limit = notice_limit
        self._held_slots = collections.deque()
        self._repost = repost
        self._error = None
        self.closed = False
        # Control messages of kind >= CTL_FIRST_EXTERNAL go here (the rendezvous engine's ACK/CANCEL).
        self.control_handler = None

    @classmethod
    def for_connection(cls, conn: Any, transport: Any, session: Credits, options: Any) -> OneSidedEngine:
        """The engine of a :class:`~rdmaio.core.connection.Connection` (an :class:`~rdmaio.Endpoint`'s core):
        its memory goes into the Domain's protection domain.

        Only grants get remote access flags; staging memory and the caller buffers of ``rdma_read_into``
        are registered for local access only (the latter through the Domain's registration cache).
        """
        domain = transport.domain
        register_local, register_grant = _registrars(transport.pd)
        try:
            windows = cached_caps(transport.device).max_mw > 0
        except VerbsError:
            windows = False
        # A weak reference: a strong one (engine -> connection -> engine) would make every connection a
        # reference cycle, keeping its loop and the loop's Domain (PD, event channel fd) alive until the
        # cyclic GC runs instead of freeing them when the last reference goes.
        fail_ref = weakref.WeakMethod(conn.fail)

        def fail(exc: BaseException) -> None:
            method = fail_ref()
            if method is not None:
                method(exc)

        try:
            atomics = cached_caps(transport.device).atomic_cap != "NONE"
        except VerbsError:
            atomics = False
        conn_ref = weakref.ref(conn)

        def repost(slot: int) -> None:
            # A held receive (write-notice back-pressure) goes back to the NIC through the connection's
            # receiver, the one owner of re-posting; its credit is granted.
            owner = conn_ref()
            if owner is not None:
                owner.receiver.repost(slot)

        peer = getattr(session, "peer", None)
        return cls(
            conn.io,
            transport.qp,
            session,
            register_local=register_local,
            register_grant=register_grant,
            cache_get=lambda view: domain.registrations.get(view, 0),
            register_bindable=_bindable(transport.pd),
            bind_window=_binder(transport.pd, transport.qp) if windows else None,
            poll=transport.poll_completions,
            max_revoked_ranges=options.max_revoked_key_ranges,
            fail=fail,
            max_ops=options.max_rdma_ops,
            max_inline=conn.max_inline,
            revoke_timeout=options.close_timeout,
            atomics=atomics,
            tag=transport.tag or 0,
            stats=conn.stats,
            peer_onesided=peer is None or bool(peer.features & FEATURE_ONESIDED),
            notice_limit=options.max_write_notices,
            repost=repost,
            post_polled=transport.post_rdma_polled,
        )

    def close(self, error: BaseException | None) -> None:
        """The connection is gone (its QP destroyed, so the NIC touches none of our memory any more):
        fail every pending op with ``error``, deregister every grant and the staging memory."""
        if self.closed:
            return
        self.closed = True
        self._error = error or EndpointClosedError("endpoint is closed")
        # Waiting calls release their op's memory when they resume, cancelled ones (orphans) right here.
        for op in list(self.ops.values()):
            self._complete(op, _fresh(self._error))
        self._credit_queue.clear()
        self._doorbell.clear()
        if self._ring_handle is not None:
            self._ring_handle.cancel()
            self._ring_handle = None
        self._held_slots.clear()  # the QP and its receives are gone
        while self._slot_waiters:
            self._slot_waiters.popleft().set()
        while self._bind_waiters:
            self._bind_waiters.popleft().set()
        binds = list(self._binds.values())
        self._binds.clear()
        grants = list(self.grants.values())
        self.grants.clear()
        failures: list[BaseException] = []
        for grant in grants:
            if grant.ack is not None:
                grant.ack.set()
            if grant.scoped is not None and grant.scoped.waiter is not None:
                grant.scoped.waiter.set()
            try:
                # The QP is gone: no bind is left to complete, the windows go now.
                if grant.scoped is not None:
                    grant.scoped.close_now()
                else:
                    grant.mr.close()
            except Exception as exc:
                failures.append(exc)
        for scoped in binds:  # rendezvous buffers whose bind had not completed: it never will now
            scoped.error = self._error
            if scoped.close_pending:
                try:
                    scoped.close_now()
                except Exception as exc:
                    failures.append(exc)
        if self._notice_waiter is not None:
            self._notice_waiter.set()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for pooled in self._large_pool.values():
            for large in pooled:
                large.region.close()
        self._large_pool.clear()
        self._large_pooled = 0
        for failure in failures:
            # Teardown goes on (the connection is gone either way); the memory stays registered.
            self._stats["grant_release_failures"] += 1
            log.error("rdmaio: releasing a grant at the end of the connection failed: %s", failure)

    def statistics(self) -> dict[str, int]:
        """Pending ops, grants, queued notices, window binds in flight and the peer's revoked keys (the
        ranges kept, and the floor below which every id is revoked); requests posted, doorbells (post
        calls), batch waves and serial calls completed at their post (always present, 0 until counted)."""
        stats = self._stats
        return {
            "rdma_ops_posted": stats["rdma_ops_posted"],
            "rdma_doorbells": stats["rdma_doorbells"],
            "rdma_batches": stats["rdma_batches"],
            "rdma_completed_at_post": stats["rdma_completed_at_post"],
            "rdma_ops_pending": len(self.ops),
            "grants": len(self.grants),
            "write_notices_queued": len(self._notices),
            "write_notice_slots_held": len(self._held_slots),
            "keys_revoked_by_peer": len(self.revoked_ids),
            "revoked_key_floor": self.revoked_ids.floor,
            "mw_binds_in_flight": len(self._binds),
        }


def _registrars(pd: Any) -> tuple[Callable[[Any], Region], Callable[[memoryview, int], Region]]:
    """``register_local`` and ``register_grant`` of an engine whose memory goes into ``pd``."""

    def register_local(buffer: Any) -> Region:
        return verbs.MemoryRegion(pd, buffer)

    def register_grant(view: memoryview, bits: int) -> Region:
        return verbs.MemoryRegion(
            pd,
            view,
            remote_read=bool(bits & ACCESS_READ),
            remote_write=bool(bits & ACCESS_WRITE),
            remote_atomic=bool(bits & ACCESS_ATOMIC),
        )

    return register_local, register_grant


def _bindable(pd: Any) -> Callable[[memoryview, bool], Region]:
    """Registration of a connection-scoped grant: ``IBV_ACCESS_MW_BIND`` and no remote flags (its own rkey
    opens nothing); local write unless read-only (a window granting write or atomics needs it)."""

    def register_bindable(view: memoryview, readonly: bool) -> Region:
        return verbs.MemoryRegion(pd, view, readonly=readonly, mw_bind=True)

    return register_bindable


def _binder(pd: Any, qp: Any) -> BindWindow:
    """Bind a type 2 window over a whole region on ``qp`` (see :class:`rdmaio.verbs.MemoryWindow`)."""

    def bind_window(region: Region, wr_id: int, access: int) -> verbs.MemoryWindow:
        window = verbs.MemoryWindow(pd, cast(verbs.MemoryRegion, region), qp)
        try:
            window.bind(wr_id, access)
        except BaseException:
            window.close()
            raise
        return window

    return bind_window
