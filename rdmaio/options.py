"""Tunables of an rdmaio connection (:class:`Options`), shared by ``connect`` and ``serve``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["Options"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, slots=True)
class Options:
    """Per-connection settings. Both sides announce theirs in the handshake; each obeys the peer's.

    Memory registered per connection starts at ``initial_depth * slot_size`` (256 KiB by default: the
    receive slots posted at first; send slots are registered when the first frame is sent) and grows
    under load to at most ``(recv_depth + send_depth) * slot_size`` (4 MiB by default). It counts against
    ``RLIMIT_MEMLOCK``.
    """

    slot_size: int = 64 * KiB
    """Bytes per receive/send slot: the largest frame. Bigger messages are fragmented."""
    recv_depth: int = 32
    """Receive slots posted; the peer's initial send credits."""
    send_depth: int = 32
    """Send slots (and send-queue entries) in flight before send()/drain() wait."""
    initial_depth: int = 4
    """Receive slots registered and posted at first, and send slots registered by the first send; each
    ring doubles under load up to ``recv_depth``/``send_depth``. Set it to ``recv_depth`` for fixed rings.
    A server gives a peer that does not announce growing windows (no ``FEATURE_GROW``: not rdmaio, or an
    older one) a fixed window of this many receives, since it must post them before it accepts."""
    max_message_size: int = 64 * MiB
    """Largest message accepted from the peer; the peer refuses to send a larger one."""
    recv_buffer_limit: int = 4 * MiB
    """Received-but-unread bytes above which credits are withheld (back-pressure to the sender)."""
    write_high_water: int = 1 * MiB
    """``drain()`` waits while more than this many bytes are queued for sending ..."""
    write_low_water: int = 256 * KiB
    """... until no more than this many remain."""
    read_limit: int = 64 * KiB
    """Line/separator length limit of ``readuntil``/``readline`` (as asyncio's ``limit``)."""
    max_inline: int = 256
    """Frames up to this size are sent inline (copied by the CPU at post time; no DMA read). They hold no
    send slot while in flight, only a send-queue entry, so small messages never register send memory."""
    batch_limit: int = 8 * KiB
    """``send()`` packs messages up to this size several to a frame (DATA_BATCH) if the peer supports it,
    and returns once the message is queued (``drain()`` semantics); 0 turns batching off."""
    signal_interval: int = 8
    """Request a send completion every this many sends (selective signalling)."""
    connect_timeout: float | None = None
    """Default timeout of ``connect`` when none is given."""
    close_timeout: float = 5.0
    """How long a graceful close waits for queued data to be sent before aborting."""
    cm_timeout_ms: int = 2000
    """Address and route resolution timeout of rdma_cm."""
    rnr_retry_count: int = 1
    """Kept low on purpose: credits guarantee a posted receive, so an RNR is a bug to surface."""
    retry_count: int = 6
    """Transport retries before a silent peer fails the QP (RETRY_EXC_ERR). Sent in the connect request;
    the accepting side's QP uses the connecting side's value (rdma_cm/IB CM semantics). 6, the largest
    budget that is finite on every device: Soft-RoCE (rxe) never counts a budget of 7 down (its completer
    skips the decrement at 7, as for the RNR count), so with 7 a dead peer is never detected and the
    keepalive bound does not hold there. rxe counts every go-back-N retry after a lost packet against the
    budget (it starts again when a work request completes), so a small one fails a healthy lossy link now
    and then (5 did, rarely, under 1 % loss in CI)."""
    rndv_threshold: int = 256 * KiB
    """``send()`` of a message of at least this many bytes uses rendezvous if the peer supports it (the
    caller's buffer is registered and the peer pulls it with RDMA READ: no copy; see docs/endpoint.md,
    "Large messages"); 0 turns rendezvous off (and is not announced in the handshake)."""
    max_pinned: int | None = None
    """Bound of the bytes the device's registration cache pins (in use and cached), shared by every
    connection of the loop on that device: a setting of the device's Domain, taken from the first
    connection on that device and loop, which creates the Domain (None there: 256 MiB). A later
    connection does not change it: one asking for another value gets the device's (a warning is logged
    once per value), so no connection alters the bound the others rely on. A rendezvous send that would
    exceed it falls back to copying; a rendezvous receive waits for room."""
    max_rdma_ops: int = 16
    """One-sided operations (READ, WRITE, atomics) in flight per connection; further calls wait. Added to
    the send queue and CQ sizes, and used as the READ/atomic depth negotiated with the peer."""
    max_write_notices: int = 64
    """Write notices (``rdma_write(..., imm=)`` of the peer) queued for ``wait_write_notice()`` with their
    credit returned. Beyond it each further notice keeps the receive it consumed until a notice is taken,
    so the writer's credits, and with them its writes with ``imm`` and its sends, run out and wait: at
    most ``max_write_notices`` + ``recv_depth`` notices are ever queued (docs/one-sided.md)."""
    ack_timeout: int | None = 17
    """Local ACK timeout exponent of the QP: a transmission unacknowledged after ``4.096 us * 2**ack_timeout``
    (17: 0.54 s) is retried, ``retry_count`` times (RDMA_OPTION_ID_ACK_TIMEOUT). None keeps rdma_cm's
    default, derived from the path's packet lifetime."""
    keepalive_interval: float | None = 10.0
    """Seconds without any completion or post after which an idle connection probes its peer with a
    zero-length RDMA WRITE (a READ on iWARP, :mod:`rdmaio.core.keepalive`); None turns keepalive off. A
    peer that vanished is detected within
    ``2 * keepalive_interval + (retry_count + 1) * 4.096 us * 2**ack_timeout`` (23.8 s with the defaults). A
    busy connection sends no probes."""
    shared_receive_queue: bool = False
    """Take receives from one shared receive queue per device and loop instead of a receive
    ring per connection: idle connections pin no receive buffers of their own, and credits are lent from
    the shared pool so that a SEND still never meets an empty queue (docs/protocol.md, "Shared receive
    queue and credits"). Every connection of a device must then use the same ``slot_size``."""
    srq_max_buffers: int = 4096
    """Receive buffers the shared receive queue may grow to (capped by the device's ``max_srq_wr``); with
    four receives reserved per connection, a quarter of it is the number of connections it admits."""
    rndv_timeout: float | None = 60.0
    """Seconds a rendezvous ``send()`` waits for the peer to pull the message. Past it the send is cancelled
    as a cancelled ``send()`` is (withdrawn, or the peer answers; without an answer within
    ``close_timeout`` the connection is failed, which destroys the queue pair, so the peer can never read
    the buffer once it is given back) and raises :class:`~rdmaio.errors.RendezvousTimeoutError`. A
    receiving application that reads nothing for that long makes the sends to it fail (an eager message
    would wait in ``send()``/``drain()`` instead). None: no deadline."""
    rndv_send_budget: int | None = None
    """Bytes of one connection's rendezvous sends registered at once (waiting for the peer to pull them);
    a send beyond it is copied (eager), as when the device's budget (half of ``max_pinned``) is used up.
    None: half of what the other connections leave free of the device's budget (``max_pinned // 2``): a
    quarter of ``max_pinned`` on an idle device (64 MiB by default), and peers which hold sends unanswered
    never take the whole budget from the other connections. 0 turns rendezvous sends off on this
    connection."""
    # --- connection establishment and shared-receive leases (server side) ---
    establish_timeout: float = 10.0
    """Seconds a server keeps a connection it accepted (its receives posted, its QP created, its SRQ lease
    lent) waiting for the client to complete the exchange (rdma_cm ESTABLISHED); past it the request is
    dropped, its resources released and its cm id destroyed (counted in ``StreamServer.statistics()`` as
    ``pending_timed_out``). Generous by default: an emulated device under load has been seen to take
    seconds to establish a connection."""
    max_pending_per_source: int = 64
    """Connections one peer address may have accepted and not yet established at once on a server; a
    further request from that address is rejected at once (the client gets ``ConnectionRefusedError``), so
    one host cannot hold the whole backlog (half of the default backlog of 128). A client that opens more
    connections than this at once (all pending together) has the excess refused: raise it for such
    clients."""
    reclaim_timeout: float = 10.0
    """On a shared receive queue: seconds a peer may leave a RECLAIM unanswered while it holds the credits
    to answer; past it the connection fails (``ProtocolError``) and its lease goes back to the pool."""
    max_revoked_key_ranges: int = 4096
    """Revoked key ids of the peer an importer remembers, as disjoint ranges (one-sided; see
    docs/one-sided.md, "Revocation"): keys revoked in the order they were exported cost nothing, each id
    left between keys still alive costs one range. A peer that needs more (or revokes ids it never issued)
    fails the connection with a ``ProtocolError``."""
    atomics: str = "auto"
    """Remote atomics (``fetch_add``, ``compare_swap``, ``fetch_add_many``, ``export(access="...a")``):
    ``"auto"`` uses them where this side's device offers them (``atomic_cap`` not NONE); ``"off"`` acts as
    on a device without them (siw and other iWARP devices): those calls raise
    ``FeatureNotSupportedError`` before anything is posted, and this side's keys tell the importer so.
    ``"off"`` exists to test that behaviour on devices that have atomics."""
    memory_windows: str = "auto"
    """Memory windows for connection-scoped exports: ``"auto"`` uses them where this side's device offers
    them (``max_mw`` above 0); ``"off"`` acts as on a device without them (siw and other iWARP devices):
    the connection gets a protection domain of its own (its QP alone in it, its rings, exports and
    rendezvous buffers registered there, a registration cache of its own bounded by ``max_pinned``), so
    an export is a region whose own rkey reaches this connection only, revoked by deregistering it;
    ``export(scope="domain")`` raises ``FeatureNotSupportedError`` then. With ``shared_receive_queue``
    (the SRQ is in the device's shared PD) the connection keeps the shared PD and connection-scoped
    exports raise ``FeatureNotSupportedError`` instead. ``"off"`` exists to test that behaviour on devices
    that have windows."""
    framing: str = field(default_factory=lambda: os.environ.get("RDMAIO_FRAMING", "auto"))
    """How frames travel: ``"auto"`` (the default) uses SEND with immediate data (the frame kind and credits
    in the 32-bit immediate value) where both sides' devices offer it, and the header framing where either
    lacks it (iWARP: siw, E810 in iWARP mode, Chelsio); ``"header"`` forces the header framing (plain SENDs
    whose payload starts with a 4-byte header carrying that value, so a slot carries ``slot_size - 4``
    payload bytes). Either side forcing it puts the connection in the header framing; a peer whose rdmaio
    predates the header framing cannot be connected to then (``HandshakeError``). The default is the
    environment variable ``RDMAIO_FRAMING`` when set (read when an Options is made: the test suite's
    ``--framing=header`` runs every test, and the peer processes it starts, in the header framing)."""
    # --- answers the peer's messages make this side queue ---
    max_queued_replies: int = 4096
    """One-sided control messages that answer the peer's (the REVOKE_ACK of each REVOKE, the DONE or
    WITHDRAWN of each rendezvous message) waiting at once for a send credit or an op slot. A peer that keeps
    sending such messages while it withholds our credits (it can: the CREDIT frames that give it its own
    credits back cost us one credit, an answer needs two) would make them pile up without end; one more
    than this fails the connection with :class:`~rdmaio.errors.ReplyQueueFullError`. Answers wait only
    while this side holds fewer than two credits or every op slot (``max_rdma_ops``) is busy."""

    def __post_init__(self) -> None:
        if not 64 <= self.slot_size <= 16 * MiB:
            raise ValueError("slot_size must be between 64 B and 16 MiB")
        if not 4 <= self.recv_depth <= 4096:
            raise ValueError("recv_depth must be between 4 and 4096")
        if not 2 <= self.send_depth <= 4096:
            raise ValueError("send_depth must be between 2 and 4096")
        if not 4 <= self.initial_depth <= 4096:
            raise ValueError("initial_depth must be between 4 and 4096")
        if not 1 <= self.max_message_size <= 2**40:
            raise ValueError("max_message_size must be between 1 B and 1 TiB")
        if self.write_low_water > self.write_high_water or self.write_low_water < 0:
            raise ValueError("need 0 <= write_low_water <= write_high_water")
        if self.batch_limit < 0:
            raise ValueError("batch_limit must be >= 0")
        if self.read_limit <= 0 or self.recv_buffer_limit <= 0:
            raise ValueError("read_limit and recv_buffer_limit must be positive")
        if not 1 <= self.signal_interval <= self.send_depth:
            raise ValueError("signal_interval must be between 1 and send_depth")
        if self.rndv_threshold < 0:
            raise ValueError("rndv_threshold must be >= 0 (0 turns rendezvous off)")
        if self.max_pinned is not None and self.max_pinned < 0:
            raise ValueError("max_pinned must be >= 0")
        if not 1 <= self.max_rdma_ops <= 1024:
            raise ValueError("max_rdma_ops must be between 1 and 1024")
        if self.max_write_notices < 0:
            raise ValueError("max_write_notices must be >= 0")
        if not 0 <= self.rnr_retry_count <= 7 or not 0 <= self.retry_count <= 7:
            raise ValueError("rnr_retry_count and retry_count must be between 0 and 7")
        if self.ack_timeout is not None and not 1 <= self.ack_timeout <= 31:
            # 0 would mean an infinite timeout: a dead peer would never be detected.
            raise ValueError("ack_timeout must be between 1 and 31 (or None for rdma_cm's default)")
        if not 4 <= self.srq_max_buffers <= 1 << 24:
            raise ValueError("srq_max_buffers must be between 4 and 16777216")
        if self.max_revoked_key_ranges < 1:
            raise ValueError("max_revoked_key_ranges must be >= 1")
        if self.keepalive_interval is not None and not self.keepalive_interval > 0:
            raise ValueError("keepalive_interval must be positive (or None to turn keepalive off)")
        if self.rndv_timeout is not None and not self.rndv_timeout > 0:
            raise ValueError("rndv_timeout must be positive (or None for no deadline)")
        if self.rndv_send_budget is not None and self.rndv_send_budget < 0:
            raise ValueError("rndv_send_budget must be >= 0 (or None for a share of max_pinned)")
        if not self.establish_timeout > 0 or not self.reclaim_timeout > 0:
            raise ValueError("establish_timeout and reclaim_timeout must be positive")
        if self.max_pending_per_source < 1:
            raise ValueError("max_pending_per_source must be >= 1")
        if self.atomics not in ("auto", "off") or self.memory_windows not in ("auto", "off"):
            raise ValueError("atomics and memory_windows must be 'auto' or 'off'")
        if self.framing not in ("auto", "header"):
            raise ValueError(f"framing must be 'auto' or 'header', not {self.framing!r}")
        if self.max_queued_replies < 1:
            raise ValueError("max_queued_replies must be >= 1")

    @classmethod
    def coerce(cls, options: Options | dict[str, Any] | None) -> Options:
        """Accept an Options, a dict of field overrides, or None (defaults)."""
        if options is None:
            return _DEFAULTS if cls is Options else cls()
        if isinstance(options, Options):
            return options
        return replace(cls(), **options)


_DEFAULTS = Options()
"""The default Options, made (and validated) once: every connect() without options asks for them, and an
Options is frozen, so one instance serves every connection."""
