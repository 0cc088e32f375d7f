"""The verbs resources of one connection and their teardown order.

A :class:`Transport` owns, for one connected cm id: a ring of receive slots and a ring of send slots
(:class:`~rdmaio.rings.SlotRing`, registered in the device's shared protection domain chunk by chunk as
load needs them), a completion channel with one CQ shared by sends and receives (sized for both queues at
their largest, so it cannot overflow), and the RC queue pair. It knows nothing about framing or credits.
"""

from __future__ import annotations

from collections.abc import Callable

from rdmaio.options import Options
from rdmaio.reactor import Reactor
from rdmaio.rings import SlotRing
from rdmaio.verbs import (
    CMId,
    CompletionChannel,
    CompletionQueue,
    DeviceContext,
    MemoryRegion,
    QueuePair,
)

__all__ = ["Transport"]


class Transport:
    """Slot rings, completion channel, CQ and QP of one connection (the PD is the domain's).

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
        self._watched_fd: int | None = None
        self.domain = reactor.domain(device)
        self.pd = self.domain.pd  # shared by every connection on the device (not closed here)
        comp: CompletionChannel | None = None
        initial = self.recv_depth if initial_recv is None else initial_recv
        self.recv_ring = SlotRing(self.slot_size, self.recv_depth, self._register)
        self.send_ring = SlotRing(self.slot_size, self.send_depth, self._register)
        try:
            self.recv_ring.grow(initial)
            self.comp = comp = CompletionChannel(device)
            # Every posted WR completes at most once: send + recv depth bounds the CQ occupancy.
            cqe = self.send_depth + self.recv_depth + 8 + options.max_rdma_ops  # + one-sided ops (issue 11)
            self.cq = CompletionQueue(device, self.comp, cqe, batch=min(cqe, 512))
            self.qp = self._create_qp(options)
            self.post_receives(list(range(initial)))
            reactor.watch_device(device)
        except BaseException:
            # Close what was created, QP first, then the MRs, then the channel (and its CQ). Left to
            # the cyclic GC instead, the channel's fd and the CQ would outlive this call.
            qp = getattr(self, "qp", None)
            if qp is not None:
                qp.close()
            self.recv_ring.close()
            self.send_ring.close()
            if comp is not None:
                comp.close()
            raise

    def _register(self, view: memoryview) -> MemoryRegion:
        # Local access only: the slot rings are never remotely accessible.
        return MemoryRegion(self.pd, view)

    def post_receives(self, slots: list[int]) -> None:
        """Post one receive per slot of the receive ring (chained, one call)."""
        ring = self.recv_ring
        self.qp.post_ring_slots(ring.lkeys, ring.addr, ring.slot_size, slots)

    def grow_receives(self, n: int) -> int:
        """Register up to ``n`` more receive slots and post them; return how many were added."""
        slots = self.recv_ring.grow(n)
        if slots:
            self.post_receives(list(slots))
        return len(slots)

    @property
    def registered_bytes(self) -> int:
        """Bytes of slot memory this connection pins now (both rings)."""
        return self.recv_ring.registered_bytes + self.send_ring.registered_bytes

    def _create_qp(self, options: Options) -> QueuePair:
        inline = options.max_inline
        while True:
            try:
                return self.cm_id.create_qp(
                    self.pd,
                    self.cq,
                    self.cq,
                    max_send_wr=self.send_depth + options.max_rdma_ops,  # + one-sided ops (issue 11)
                    max_recv_wr=self.recv_depth,
                    max_inline_data=inline,
                )
            except OSError:
                # Devices cap inline data differently; fall back to smaller sizes, then none.
                if inline == 0:
                    raise
                inline = inline // 2 if inline > 32 else 0

    @property
    def max_inline(self) -> int:
        """Inline capacity the device granted."""
        return self.qp.max_inline_data

    def watch(self, callback: Callable[[], None]) -> None:
        """Put the completion channel fd on the loop."""
        self._watched_fd = self.comp.fd
        self.reactor.watch(self.comp.fd, callback)

    def close(self) -> None:
        """Tear down in dependency order: fd off the loop, QP, MRs, CQ, channel. Idempotent.

        Destroying the QP first guarantees the NIC no longer touches the slot buffers when they are freed.
        """
        if self._watched_fd is not None:
            self.reactor.unwatch(self._watched_fd)
            self._watched_fd = None
        self.qp.close()
        self.recv_ring.close()
        self.send_ring.close()
        self.cq.close()
        self.comp.close()
