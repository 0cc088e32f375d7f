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
MR's own rkey with the remote flags). A device without memory windows (``max_mw`` 0, e.g. siw; or
``Options.memory_windows="off"``) gives each connection a protection domain of its own
(:func:`rdmaio.core.transport.private_pd_needed`): its QP is the only one there, so a grant is the MR's own
rkey with the remote flags, reaching this connection only, bounded by the MR (one per grant) and revoked by
deregistering it after the REVOKE_ACK; ``scope="domain"`` raises :class:`~rdmaio.FeatureNotSupportedError`
there, and so does the default scope on such a device when the connection shares the loop's PD (a shared
receive queue). One MR per grant, not one for many: rxe
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
(:mod:`~rdmaio.core.onesided.revoked`, bounded by ``Options.max_revoked_key_ranges``).

Control messages are SENDs *without* immediate data (rdmaio frames always carry one) and write notices are
RDMA WRITEs *with* immediate data (completion opcode ``IBV_WC_RECV_RDMA_WITH_IMM``); both consume one of the
peer's posted receives, so both are paid for with a send credit like a frame (:meth:`Session.take_slot`).
Where the connection has no immediate data (``write_notice_by_message``: iWARP devices), a write notice is
an RDMA WRITE followed, on the same queue pair, by a control message of kind ``CTL_WRITE_NOTICE`` carrying
its length and value: RC delivers the SEND after the WRITE's data is placed, so the exporter sees the same
:class:`WriteNotice` after the same data. The exporter takes either form.

Capabilities. Atomics need them on both devices: an ``export(..., access="...a")`` on a device without
remote atomics (``atomic_cap`` NONE, or ``Options.atomics="off"``) raises
:class:`~rdmaio.FeatureNotSupportedError`, and its keys carry :data:`KEY_FLAG_NO_ATOMICS`; an atomic call
on such a key, or from a device without atomics, raises it before anything is posted (the connection stays
usable). Without memory windows (``max_mw`` 0, or ``Options.memory_windows="off"``) see "Key scope".

Work requests of one-sided operations and window binds carry ``wr_id = 2 << 56 | tag << 32 | index``
(kind 2; kind 0 is the send slots of frames, kind 3 is reserved for keepalive; the tag routes the
completion through the Domain's shared CQ; ops and binds draw their indexes from one counter, so the index
tells which) and are always signalled.

The package, one object per concern, composed by the facade :class:`OneSidedEngine` (no object reaches into
another's state; each talks to the others through the methods and plain attributes it documents):

* :mod:`~rdmaio.core.onesided.keys`: remote keys (access bits, wire form) and write notices (values).
* :mod:`~rdmaio.core.onesided.revoked`: the key ids the peer revoked, as bounded ranges.
* :mod:`~rdmaio.core.onesided.caps`: what a device offers one-sided RDMA (atomics, depth, windows).
* :mod:`~rdmaio.core.onesided.interfaces`: what the engine is given (region, window, queue pair, credits).
* :mod:`~rdmaio.core.onesided.operations`: the operation engine: calls, op slots, staging, doorbells,
  completions (:class:`~rdmaio.core.onesided.operations.OperationEngine`).
* :mod:`~rdmaio.core.onesided.batches`: ``fetch_add_many`` / ``rdma_read_many`` in waves, over it.
* :mod:`~rdmaio.core.onesided.exporter`: grants, key scope (memory windows), revocation, write notices,
  the control messages (:class:`~rdmaio.core.onesided.exporter.Exporter`).
* :mod:`~rdmaio.core.onesided.registrars`: the verbs objects behind a connection's engine.
* this module: :class:`OneSidedEngine`, the facade a connection holds, and its wiring to a connection.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable
from typing import Any

from rdmaio import verbs
from rdmaio.core.backend import Backend
from rdmaio.core.onesided.batches import BatchCalls
from rdmaio.core.onesided.caps import OneSidedCaps, cached_caps, query_caps, rd_atomic_depth
from rdmaio.core.onesided.exporter import CTL_FIRST_EXTERNAL, MAX_BINDS_IN_FLIGHT, SCOPES, Exporter, Grant
from rdmaio.core.onesided.interfaces import BindWindow, Credits, RdmaQueue, Region, SerialPort
from rdmaio.core.onesided.keys import (
    ACCESS_ATOMIC,
    ACCESS_READ,
    ACCESS_WRITE,
    KEY_FLAG_NO_ATOMICS,
    KEY_VERSION,
    RemoteKey,
    WriteNotice,
    parse_access,
)
from rdmaio.core.onesided.operations import MAX_OP_BYTES, WR_KIND_ONESIDED, Op, OperationEngine
from rdmaio.core.onesided.registrars import (
    bindable_registrar,
    local_and_grant_registrars,
    read_grant_registrar,
    window_binder,
)
from rdmaio.core.onesided.revoked import RevokedKeys
from rdmaio.errors import VerbsError
from rdmaio.protocol import FEATURE_ONESIDED, Session
from rdmaio.protocol.closestate import CloseState
from rdmaio.verbs import _base as fork_state

# fork_state: the verbs layer's module whose ``_generation`` counts forks; the Endpoint's one-sided calls read
# it inline (no call per request) to refuse use in a forked child, as the message path reads it.

__all__ = [
    "ACCESS_ATOMIC",
    "ACCESS_READ",
    "ACCESS_WRITE",
    "CTL_FIRST_EXTERNAL",
    "KEY_FLAG_NO_ATOMICS",
    "KEY_VERSION",
    "MAX_BINDS_IN_FLIGHT",
    "MAX_OP_BYTES",
    "SCOPES",
    "UNUSED_STATISTICS",
    "WR_KIND_ONESIDED",
    "OneSidedCaps",
    "OneSidedEngine",
    "RemoteKey",
    "WriteNotice",
    "fork_state",
    "parse_access",
    "query_caps",
    "rd_atomic_depth",
]


#: :meth:`OneSidedEngine.statistics` of an engine that never did anything: what a connection reports while
#: its engine was never built (a unit test holds the two equal).
UNUSED_STATISTICS: dict[str, int] = {
    "rdma_ops_posted": 0,
    "rdma_doorbells": 0,
    "rdma_batches": 0,
    "rdma_completed_at_post": 0,
    "rdma_ops_pending": 0,
    "control_replies_queued": 0,
    "rdma_reads": 0,
    "rdma_writes": 0,
    "rdma_fetch_adds": 0,
    "rdma_compare_swaps": 0,
    "grants": 0,
    "write_notices_queued": 0,
    "write_notice_slots_held": 0,
    "keys_revoked_by_peer": 0,
    "revoked_key_floor": 1,
    "mw_binds_in_flight": 0,
}


class OneSidedEngine:
    """The one-sided side of one connection: the facade over its :attr:`operations` (an
    :class:`~rdmaio.core.onesided.operations.OperationEngine`: the calls, op slots, posting, completions),
    its :attr:`batches` (a :class:`~rdmaio.core.onesided.batches.BatchCalls`) and its :attr:`exporter` (an
    :class:`~rdmaio.core.onesided.exporter.Exporter`: grants, revocation, write notices, control messages).

    Its calls are those objects' own bound methods, set here once (a call through the facade costs no
    Python call more than one on the object): ``read``, ``read_into``, ``write``, ``fetch_add``,
    ``compare_swap``, ``read_registered``, ``on_completion`` and ``pump`` (operations); ``fetch_add_many``
    and ``read_many`` (batches); ``export``, ``export_for_read``, ``revoke``, ``wait_write_notice``,
    ``send_control`` and ``on_recv`` (exporter).

    ``register_local(buffer)`` registers rdmaio-owned or caller memory for local access only (no remote
    flags) and ``register_grant(view, access_bits)`` registers an exported range with exactly the remote
    access of ``access_bits``; ``cache_get(buffer)`` returns a Domain-cached local registration (with
    ``region``/``release()``). ``fail(exc)`` fails the whole connection (used when a cancelled
    ``rdma_read_into`` must stop the NIC writing into the caller's buffer).

    Connection-scoped grants: ``register_bindable(view, readonly)`` registers with ``IBV_ACCESS_MW_BIND``
    and no remote flags, ``bind_window(region, wr_id, access)`` allocates a type 2 window and posts its
    bind on the connection's QP (None: the device has no windows), ``poll()`` polls the completion queue
    now (to free bind entries). ``max_revoked_ranges`` bounds the peer's revoked key ids kept,
    ``max_queued_replies`` the answers to the peer's control messages waiting for a send credit.
    ``repost(slot)`` gives a receive held by write-notice back-pressure back to the NIC. ``port`` (a
    :class:`~rdmaio.core.onesided.interfaces.SerialPort`, or ``make_port(wr_base)`` makes it) posts and
    polls a serial request in one C call; ``close_state`` (the Session's
    :class:`~rdmaio.protocol.closestate.CloseState`) tells the engine when the connection starts closing.
    Serial calls take that path only with both.

    A connection calls :attr:`pump` after a batch of completions only while
    ``operations.waiting_for_credit`` is not 0 (otherwise it has nothing to post).
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
        port: SerialPort | None = None,
        make_port: Callable[[int], SerialPort | None] | None = None,
        close_state: CloseState | None = None,
        device_name: str = "this device",
        write_notice_by_message: bool = False,
        private_pd: bool = False,
        register_read_grant: Callable[[memoryview, bool], Region] | None = None,
        max_queued_replies: int = 4096,
        split_page_crossing_reads: bool = False,
    ) -> None:
        stats = stats if stats is not None else collections.Counter()
        # The connection's tag routes our completions to us through the Domain's shared CQ.
        wr_base = verbs.make_wr_id(WR_KIND_ONESIDED, tag, 0)
        if make_port is not None:
            port = make_port(wr_base)
        indexes = itertools.count(1)  # ops and window binds share it: the index tells which
        revoked_ids = RevokedKeys(max_revoked_ranges)  # keys the peer revoked
        operations = OperationEngine(
            io,
            qp,
            credits,
            register_local=register_local,
            cache_get=cache_get,
            fail=fail,
            max_ops=max_ops,
            max_inline=max_inline,
            stats=stats,
            wr_base=wr_base,
            indexes=indexes,
            revoked_ids=revoked_ids,
            peer_onesided=peer_onesided,
            port=port,
            close_state=close_state,
            atomics=atomics,
            device_name=device_name,
            write_notice_by_message=write_notice_by_message,
            max_queued_replies=max_queued_replies,
            split_page_crossing_reads=split_page_crossing_reads,
        )
        exporter = Exporter(
            io,
            credits,
            operations,
            register_grant=register_grant,
            register_bindable=register_bindable or (lambda view, readonly: register_local(view)),
            bind_window=bind_window if register_bindable is not None else None,
            poll=poll,
            fail=fail,
            revoke_timeout=revoke_timeout,
            atomics=atomics,
            stats=stats,
            wr_base=wr_base,
            indexes=indexes,
            revoked_ids=revoked_ids,
            peer_onesided=peer_onesided,
            notice_limit=notice_limit,
            repost=repost,
            private_pd=private_pd,
            register_read_grant=register_read_grant,
        )
        operations.on_other_completion = exporter.on_bind_completion
        operations.notice_message = exporter.write_notice_message
        batches = BatchCalls(operations)
        self.operations = operations
        self.exporter = exporter
        self.batches = batches
        # A peer whose device may be siw: small READs crossing a page go split (the single call included).
        self.read = operations.read_split if split_page_crossing_reads else operations.read
        self.read_into = operations.read_into
        self.write = operations.write
        self.fetch_add = operations.fetch_add
        self.compare_swap = operations.compare_swap
        self.read_registered = operations.read_registered
        self.on_completion = operations.on_completion
        self.pump = operations.pump
        self.fetch_add_many = batches.fetch_add_many
        self.read_many = batches.read_many
        self.export = exporter.export
        self.export_for_read = exporter.export_for_read
        self.revoke = exporter.revoke
        self.wait_write_notice = exporter.wait_write_notice
        self.send_control = exporter.send_control
        self.on_recv = exporter.on_recv

    @classmethod
    def for_connection(cls, conn: Any, transport: Any, session: Session, options: Any) -> OneSidedEngine:
        """The engine of a :class:`~rdmaio.core.connection.Connection` (an :class:`~rdmaio.Endpoint`'s core):
        its memory goes into the Domain's protection domain.

        Only grants get remote access flags; staging memory and the caller buffers of ``rdma_read_into``
        are registered for local access only (the latter through the Domain's registration cache).
        """
        # A connection alone in a protection domain of its own (a device without memory windows, see
        # rdmaio.core.transport.private_pd_needed): its grants are regions of that PD, and caller buffers
        # are registered there too, through the connection's own cache.
        private_pd = bool(getattr(transport, "private_pd", False))
        registrations = transport.private_registrations if private_pd else transport.domain.registrations
        register_local, register_grant = local_and_grant_registrars(transport.pd)
        try:
            caps = cached_caps(transport.device)
        except VerbsError:
            windows = atomics = False
        else:
            # What the device offers, less what Options take away ("off": the behaviour of a device
            # without it, e.g. siw, tested on one that has it).
            windows = caps.max_mw > 0 and options.memory_windows != "off"
            atomics = caps.atomic_cap != "NONE" and options.atomics != "off"
        # A weak reference: a strong one (engine -> connection -> engine) would make every connection a
        # reference cycle, keeping its loop and the loop's Domain (PD, event channel fd) alive until the
        # cyclic GC runs instead of freeing them when the last reference goes.
        fail_ref = weakref.WeakMethod(conn.fail)

        def fail(exc: BaseException) -> None:
            method = fail_ref()
            if method is not None:
                method(exc)

        # --- the repost of a held receive (write-notice back-pressure): built here only, given to the
        # exporter, which calls it when wait_write_notice() takes a notice ---------------------------------
        conn_ref = weakref.ref(conn)

        def repost(slot: int) -> None:
            # A held receive (write-notice back-pressure) goes back to the NIC through the connection's
            # receiver, the one owner of re-posting; its credit is granted.
            owner = conn_ref()
            if owner is not None:
                owner.receiver.repost(slot)

        # --- end of the repost -----------------------------------------------------------------------------

        # An iWARP device (no immediate data is its mark; both sides of a connection are iWARP or neither):
        # the peer's may be siw, whose READ responses of at most 32 bytes crossing a page carry wrong bytes
        # (operations.py, INLINE_READ_MAX); such READs are split at the page boundary.
        local_caps = session.local.caps
        iwarp = local_caps is not None and not local_caps.immediate

        return cls(
            conn.io,
            transport.qp,
            session,
            register_local=register_local,
            register_grant=register_grant,
            cache_get=lambda view: registrations.get(view, 0),
            register_bindable=bindable_registrar(transport.pd),
            bind_window=window_binder(transport.pd, transport.qp) if windows else None,
            poll=transport.poll_completions,
            max_revoked_ranges=options.max_revoked_key_ranges,
            fail=fail,
            max_ops=options.max_rdma_ops,
            max_inline=conn.max_inline,
            revoke_timeout=options.close_timeout,
            atomics=atomics,
            tag=transport.tag or 0,
            stats=conn.stats,
            peer_onesided=bool(session.peer.features & FEATURE_ONESIDED),
            notice_limit=options.max_write_notices,
            repost=repost,
            # None once torn down (an engine first used then is closed at once; the QP is gone)
            make_port=None if conn.torn_down else transport.onesided_port,
            close_state=session.close_state,
            device_name=transport.device.name,
            private_pd=private_pd,
            register_read_grant=read_grant_registrar(transport.pd) if private_pd else None,
            max_queued_replies=options.max_queued_replies,
            split_page_crossing_reads=iwarp,
        )

    @property
    def ops(self) -> dict[int, Op]:
        """The pending ops, by index (the operation engine's)."""
        return self.operations.ops

    @property
    def max_ops(self) -> int:
        """Work requests in flight at most (op slots)."""
        return self.operations.max_ops

    @property
    def grants(self) -> dict[int, Grant]:
        """What this side exported, by key id (the exporter's)."""
        return self.exporter.grants

    @property
    def revoked_ids(self) -> RevokedKeys:
        """The key ids the peer revoked."""
        return self.exporter.revoked_ids

    @property
    def closed(self) -> bool:
        """:meth:`close` ran."""
        return self.operations.closed

    @property
    def write_notice_by_message(self) -> bool:
        """Writes with a notice (``imm=``) go as an RDMA WRITE followed by a control message instead of a
        WRITE with immediate data (a framing without immediate data, e.g. on iWARP; see
        :attr:`OperationEngine.write_notice_by_message
        <rdmaio.core.onesided.operations.OperationEngine.write_notice_by_message>`). The constructor's
        flag; settable (tests force it on a device that has immediate data). The receiving side takes
        both forms whatever this says."""
        return self.operations.write_notice_by_message

    @write_notice_by_message.setter
    def write_notice_by_message(self, by_message: bool) -> None:
        self.operations.write_notice_by_message = bool(by_message)

    @property
    def control_handler(self) -> Callable[[int, int], None] | None:
        """Where control messages of kind >= :data:`CTL_FIRST_EXTERNAL` go (the rendezvous engine's)."""
        return self.exporter.control_handler

    @control_handler.setter
    def control_handler(self, handler: Callable[[int, int], None] | None) -> None:
        self.exporter.control_handler = handler

    def close(self, error: BaseException | None) -> None:
        """The connection is gone (its QP destroyed, so the NIC touches none of our memory any more):
        fail every pending op with ``error``, deregister every grant and the staging memory."""
        if self.operations.closed:
            return
        try:
            self.operations.close(error)
        finally:
            self.exporter.close()

    def statistics(self) -> dict[str, int]:
        """Pending ops, grants, queued notices, window binds in flight and the peer's revoked keys (the
        ranges kept, and the floor below which every id is revoked); requests posted, doorbells (post
        calls), batch waves and serial calls completed at their post (always present, 0 until counted)."""
        return {**self.operations.statistics(), **self.exporter.statistics()}
