"""The verbs resources of one connection and their teardown order.

A :class:`Transport` owns, for one connected cm id: a protection domain, one registered buffer of receive
slots and one of send slots, a completion channel with one CQ shared by sends and receives (sized for
both queues, so it cannot overflow), and the RC queue pair. It knows nothing about framing or credits.
"""

from __future__ import annotations

from collections.abc import Callable

from rdmaio.options import Options
from rdmaio.reactor import Reactor
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
    """PD, slot buffers and MRs, completion channel, CQ and QP of one connection."""

    def __init__(self, reactor: Reactor, cm_id: CMId, options: Options) -> None:
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
        try:
            self.recv_buf = bytearray(self.slot_size * self.recv_depth)
            self.send_buf = bytearray(self.slot_size * self.send_depth)
            self.recv_view = memoryview(self.recv_buf)
            self.send_view = memoryview(self.send_buf)
            self.recv_mr = MemoryRegion(self.pd, self.recv_buf)
            self.send_mr = MemoryRegion(self.pd, self.send_buf)
            self.comp = comp = CompletionChannel(device)
            # Every posted WR completes at most once: send + recv depth bounds the CQ occupancy.
            # +1: the keepalive probe (rdmaio.keepalive), at most one in flight.
            cqe = self.send_depth + 1 + self.recv_depth + 8
            self.cq = CompletionQueue(device, self.comp, cqe, batch=min(cqe, 512))
            if options.ack_timeout is not None:  # before connect/accept: rdma_cm applies it at RTS
                cm_id.set_ack_timeout(options.ack_timeout)
            self.qp = self._create_qp(options)
            self.qp.post_recv_slots(self.recv_mr, self.slot_size, list(range(self.recv_depth)))
            reactor.watch_device(device)
        except BaseException:
            # Close what was created, QP first, then the MRs, then the channel (and its CQ). Left to
            # the cyclic GC instead, the channel's fd and the CQ would outlive this call.
            for name in ("qp", "recv_mr", "send_mr"):
                resource = getattr(self, name, None)
                if resource is not None:
                    resource.close()
            if comp is not None:
                comp.close()
            raise

    def _create_qp(self, options: Options) -> QueuePair:
        inline = options.max_inline
        while True:
            try:
                return self.cm_id.create_qp(
                    self.pd,
                    self.cq,
                    self.cq,
                    max_send_wr=self.send_depth + 1,  # +1: the keepalive probe (rdmaio.keepalive)
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
        self.recv_mr.close()
        self.send_mr.close()
        self.cq.close()
        self.comp.close()
