"""The verbs resources of one connection and their teardown order.

A :class:`Transport` owns, for one connected cm id: a ring of receive slots and a ring of send slots
(:class:`~rdmaio.core.rings.SlotRing`, registered in the device's shared protection domain chunk by chunk as
load needs them; in a protection domain of the connection's own where the device has no memory windows, see
:func:`private_pd_needed`), the RC queue pair, and a reservation of CQ entries (send depth + receive depth at
their largest + a margin, so the CQ cannot overflow) on one of its domain's shared CQs
(:mod:`rdmaio.core.dispatch`).
The protection domain (unless it has its own) and the CQs are the domain's. The transport registers its QP
with the domain's completion dispatcher, which gives it the connection tag of its wr_ids, and unregisters
before the QP is destroyed. It knows nothing about framing or credits.
"""

from __future__ import annotations

import functools

from rdmaio import verbs
from rdmaio.core.dispatch import CompletionHandler, CQReservation
from rdmaio.core.domain import RegistrationCache, buffer_address, register_in
from rdmaio.core.onesided import MAX_BINDS_IN_FLIGHT
from rdmaio.core.onesided.caps import cached_caps
from rdmaio.core.reactor import Reactor
from rdmaio.core.rings import SlotRing
from rdmaio.core.shared_receive import SharedMember, shared_pool
from rdmaio.errors import VerbsError
from rdmaio.options import Options
from rdmaio.verbs import (
    WR_KIND_RECV,
    CMId,
    CompletionQueue,
    DeviceContext,
    MemoryRegion,
    ProtectionDomain,
    QueuePair,
    make_wr_id,
)

__all__ = ["OneSidedPort", "Transport", "private_pd_needed"]

CQ_MARGIN = 8
"""CQ entries reserved beyond the send, one-sided and receive depths: control work requests."""


def private_pd_needed(device: DeviceContext, options: Options) -> bool:
    """Whether a connection on ``device`` gets a protection domain of its own: its device has no memory
    windows (``max_mw`` 0, e.g. siw; or ``Options.memory_windows`` is ``"off"``), unless it uses the
    shared receive queue (which lives in the Domain's PD)."""
    if options.shared_receive_queue:
        return False
    if options.memory_windows == "off":
        return True
    try:
        return cached_caps(device).max_mw == 0
    except VerbsError:
        return False  # no capabilities known: the shared PD, and exports say what is missing


class Transport:
    """Slot rings, shared-CQ reservation and QP of one connection (the CQ is the domain's; the PD too, unless
    :attr:`private_pd`: then the PD and a registration cache, :attr:`private_registrations`, are its own).

    ``initial_recv`` receives are registered and posted at first (the handshake's ``initial_depth``; all
    of ``recv_depth`` when the peer cannot grow windows); the send ring starts empty and grows on demand.
    """

    def __init__(
        self, reactor: Reactor, cm_id: CMId, options: Options, initial_recv: int | None = None
    ) -> None:
        device = cm_id.device()
        if device is None:
            raise RuntimeError("cm id has no device yet (address not resolved)")
        self.reactor = reactor
        self.cm_id = cm_id
        self.device: DeviceContext = device
        self.slot_size = options.slot_size
        self.recv_depth = options.recv_depth
        self.send_depth = options.send_depth
        self.max_rdma_ops = options.max_rdma_ops  # one-sided ops in flight
        self.domain = reactor.domain(device, options)  # created with options' per-device settings
        # A protection domain of this connection's own where its device has no memory windows (or
        # Options.memory_windows is "off"): an MR with remote access flags is reachable through every QP
        # of its PD, so with this QP alone in it an export (its MR's own rkey) reaches this connection
        # only, as a type 2 window scopes it where windows exist. Not on a shared receive queue (the SRQ
        # and its buffers are the Domain's PD's): such connections keep the shared PD, and connection-
        # scoped exports raise FeatureNotSupportedError there.
        self.private_pd = private_pd_needed(device, options)
        self.private_registrations: RegistrationCache | None = None
        if self.private_pd:
            self.pd = ProtectionDomain(device)  # closed with this transport
            # Caller buffers of rdma_read_into and rendezvous pulls are registered in this PD: a cache
            # of this connection's own, with the device's bound (the Domain's cache is in its PD).
            self.private_registrations = RegistrationCache(
                functools.partial(register_in, self.pd), buffer_address, self.domain.max_pinned
            )
            self.domain.add_private_registrations(self.private_registrations)  # counted with the device's
        else:
            self.pd = self.domain.pd  # shared by every connection on the device (not closed here)
        # --- shared CQ (sharedcq): the CQ is the domain's; this connection reserves its entries on it.
        self.completions = self.domain.completions
        self.tag: int | None = None  # connection tag (wr_id bits 32..55), set once the QP is registered
        self.recv_wr_base = 0
        self.cq_reservation: CQReservation | None = None
        initial = self.recv_depth if initial_recv is None else initial_recv
        # The rings' memory comes from (and goes back to) the domain's pool: no registration per connection
        # while connections come and go (rdmaio.core.rings). Not with a PD of its own (the pool's memory
        # is registered in the Domain's).
        pool = None if self.private_pd else self.domain.rings
        # Shared receive queue: receives come from the Domain's SRQ; the ring is the pool's.
        self.shared: SharedMember | None = None
        if options.shared_receive_queue:
            shared = shared_pool(self.domain, options, reactor.backend.call_later)
            self.shared = shared.join(initial, self.recv_depth)
            self.shared.reclaim_timeout = options.reclaim_timeout
            self.recv_ring = shared.ring
        else:
            self.recv_ring = SlotRing(self.slot_size, self.recv_depth, self._register, pool=pool)
        self.send_ring = SlotRing(self.slot_size, self.send_depth, self._register, pool=pool)
        try:
            if self.shared is None:
                self.recv_ring.grow(initial)
            # Every posted WR completes at most once: the reservation (for both rings at their largest)
            # bounds this QP's CQ occupancy.
            self.cq_reservation = self.completions.reserve(self.cq_entries)
            self.cq: CompletionQueue = self.cq_reservation.cq
            self.qp = self._create_qp(options)
            #: Inline capacity the device granted (an attribute: read in every connection's setup).
            self.max_inline: int = self.qp.max_inline_data
            # Registered before anything is posted: completions that come before the endpoint's handler
            # is set are kept for it, not dropped.
            self.tag = self.completions.register(self.qp.qp_num)
            self.recv_wr_base = make_wr_id(WR_KIND_RECV, self.tag, 0)
            if self.shared is None:
                self.post_receives(list(range(initial)))
            else:
                self.shared.pool.attach_qp(self.shared, self.qp.qp_num)
            reactor.watch_device(device)
        except BaseException:
            # Close what was created: unregister, QP, MRs, then give the CQ entries back. Left to the
            # cyclic GC instead, the QP and the MRs would outlive this call.
            self._release()
            raise

    @property
    def cq_entries(self) -> int:
        """CQ entries this connection reserves: every WR it can have outstanding completes at most once."""
        # +1: keepalive probe; MAX_BINDS_IN_FLIGHT: memory-window binds of exports (rdmaio.core.onesided)
        return self.send_depth + self.max_rdma_ops + 1 + MAX_BINDS_IN_FLIGHT + self.recv_depth + CQ_MARGIN

    def _register(self, view: memoryview) -> MemoryRegion:
        # Local access only: the slot rings are never remotely accessible.
        return MemoryRegion(self.pd, view)

    def post_receives(self, slots: list[int]) -> None:
        """Post one receive per slot of the receive ring (chained, one call)."""
        if self.shared is not None:
            self.shared.posted(slots)  # back on the SRQ
            return
        ring = self.recv_ring
        arena = ring.arena  # the arena's fields, not the ring's properties: 4 Python calls less per re-post
        if arena is None:
            raise RuntimeError(f"{ring!r} has no memory (never registered, or closed)")
        self.qp.post_ring_slots(arena.lkeys, arena.addr, ring.slot_size, slots, self.recv_wr_base)

    def grow_receives(self, n: int) -> int:
        """Register up to ``n`` more receive slots and post them; return how many were added.

        On a shared receive queue nothing is added now: the pool is asked, and grants the receives (to
        the session directly) when it has them."""
        if self.shared is not None:
            self.shared.pool.ledger.request(self.shared.key, n)
            self.shared.pool.apply()
            return 0
        slots = self.recv_ring.grow(n)
        if slots:
            self.post_receives(list(slots))
        return len(slots)

    @property
    def registered_bytes(self) -> int:
        """Bytes of slot memory this connection pins now (both rings; on a shared receive queue only the
        send ring: the receive buffers are the pool's, ``shared_receive`` in the Domain's statistics)."""
        if self.shared is not None:
            return self.send_ring.registered_bytes
        return self.recv_ring.registered_bytes + self.send_ring.registered_bytes

    def _create_qp(self, options: Options) -> QueuePair:
        """The QP, in one C call: the ack timeout on the cm id first (rdma_cm applies it at RTS, so before
        connect/accept), and smaller inline sizes, then none, when the device refuses ``max_inline``
        (devices cap inline data differently)."""
        return self.cm_id.create_qp(
            self.pd,
            self.cq,
            self.cq,
            # + one-sided ops, +1 the keepalive probe (rdmaio.core.keepalive), + the memory-window binds
            # of exports, which take no one-sided op slot
            max_send_wr=self.send_depth + options.max_rdma_ops + 1 + MAX_BINDS_IN_FLIGHT,
            max_recv_wr=self.recv_depth,
            max_inline_data=options.max_inline,
            srq=self.shared.pool.srq if self.shared is not None else None,
            ack_timeout=options.ack_timeout,
            fit_inline=True,
        )

    # --- shared CQ (sharedcq): completions come through the domain's dispatcher -----------------------

    def set_completion_handler(self, handler: CompletionHandler) -> None:
        """Send this connection's completions to ``handler(records, start, count)`` (those that came
        before go first)."""
        assert self.tag is not None
        self.completions.set_handler(self.qp.qp_num, self.tag, handler)
        if self.shared is not None:  # SRQ receives arrive under the SRQ's tag
            self.shared.pool.set_handler(self.shared, handler)

    def poll_completions(self) -> None:
        """Poll the domain's CQs now and dispatch what is there (deferred when called from a handler)."""
        self.completions.poll_now()

    def onesided_port(self, wr_base: int) -> OneSidedPort:
        """The port of this connection's serial one-sided requests (one C call posts one and takes at most
        one record from the CQ; see :class:`OneSidedPort`); ``wr_base`` carries their kind and tag."""
        return OneSidedPort(self, self.qp.onesided_port(self.cq, wr_base, self.max_inline))

    def close(self) -> None:
        """Tear down in dependency order: unregister from the dispatcher, QP, slot rings (MRs), CQ
        reservation. Idempotent.

        Destroying the QP first guarantees the NIC no longer touches the slot buffers when they are freed;
        unregistering before it makes the destroyed QP's late completions count as dropped, never reach a
        new connection that gets the same QP number.
        """
        self._release()

    def _release(self) -> None:
        qp = getattr(self, "qp", None)
        if self.tag is not None and qp is not None:
            self.completions.unregister(qp.qp_num, self.tag)
        if qp is not None:
            qp.close()
        if self.shared is not None:
            shared, self.shared = self.shared, None
            shared.pool.leave(shared)  # after the QP: nothing consumes its receives any more
        else:
            self.recv_ring.close()
        self.send_ring.close()
        if self.cq_reservation is not None:
            self.cq_reservation.release()  # after the QP: a CQ is destroyed only once its QPs are
        if self.private_pd:
            # The connection's own PD, after its QP: deregisters what is still registered in it (the
            # one-sided engine's and the rendezvous engine's regions close again later: a no-op).
            if self.private_registrations is not None:
                self.domain.close_private_registrations(self.private_registrations)
            self.pd.close()


class OneSidedPort:
    """A connection's port for serial one-sided requests (what the one-sided engine calls a ``SerialPort``):
    :attr:`post_poll` is the verbs port's C call; the rare outcomes go through the Domain's dispatcher."""

    def __init__(self, transport: Transport, port: verbs.OneSidedPort) -> None:
        self._transport = transport
        self._port = port
        self.post_poll = port.post_poll
        """``rdmaio_onesided_post_poll`` bound to the port (see :class:`rdmaio.verbs.OneSidedPort`)."""
        self.post_batch_poll = port.post_batch_poll
        """A wave of a batch and one look at the CQ (:meth:`rdmaio.verbs.OneSidedPort.post_batch_poll`)."""

    def after_poll(self, result: int) -> bool:
        """``POSTED_OTHER``: hand (a copy of) the record the call took to the dispatcher (False: it keeps
        it for its next poll, see :meth:`CompletionDispatcher.deliver`); ``POSTED_POLL_FAILED``: raise the
        poll's error."""
        port = self._port
        if result == verbs.POSTED_POLL_FAILED:
            raise port.poll_error()
        transport = self._transport
        records, key = port.taken()
        return transport.completions.deliver(transport.cq, records, key)

    def post_error(self, result: int) -> BaseException:
        """The error of a failed post: the verbs objects' own (closed, forked) first, else the errno's."""
        return self._port.post_error(result)

    def poll(self) -> None:
        """Poll the Domain's CQs now (delivers what a dispatch in progress kept)."""
        self._transport.poll_completions()
