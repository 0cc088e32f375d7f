"""What the one-sided engine is given by its connection: the interfaces of a registered memory region, a
memory window and its bind, the queue pair, and the send credits.

The engine's objects (:mod:`~rdmaio.core.onesided.operations`, :mod:`~rdmaio.core.onesided.exporter`) are
written against these protocols only: :meth:`OneSidedEngine.for_connection
<rdmaio.core.onesided.OneSidedEngine.for_connection>` gives them the verbs objects of a connection, the unit
tests give fakes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["BindWindow", "Credits", "RdmaQueue", "Region", "SerialPort", "Window"]


class Region(Protocol):
    """A registered memory region: address, keys, close()."""

    addr: int
    lkey: int
    rkey: int

    def close(self) -> None:
        """Deregister."""


class Window(Protocol):
    """A memory window bound on the connection's queue pair: its rkey, close() (deallocates it)."""

    rkey: int

    def close(self) -> None:
        """Deallocate: the NIC refuses the rkey from then on."""


class BindWindow(Protocol):
    """Allocate a type 2 window over all of ``region`` and post its signalled bind (``wr_id``) with the
    remote ``access`` bits (``IBV_ACCESS_REMOTE_*``) on the connection's queue pair."""

    def __call__(self, region: Region, wr_id: int, access: int) -> Window:
        """Bind; raises VerbsError if the post fails (nothing was bound then)."""


class RdmaQueue(Protocol):
    """What the engine needs of a queue pair."""

    @property
    def rdma_array(self) -> Any:
        """``struct rdmaio_rdma_op[]`` scratch entries."""

    def post_rdma(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`rdma_array`."""

    def post_batch(
        self, wr_id: int, opcode: int, local_addr: int, lkey: int, rkey: int, remote_addr: Any, **arrays: Any
    ) -> None:
        """Post a batch of requests as one chain, only the last signalled (``QueuePair.post_batch``)."""


class Credits(Protocol):
    """The credit side of :class:`rdmaio.protocol.Session` that one-sided requests use."""

    def can_take_slot(self) -> bool:
        """Two credits are held and the wire is up."""

    def take_slot(self) -> None:
        """Spend one credit on a request that consumes a peer receive."""

    def on_slot_used(self) -> None:
        """The peer consumed one of our receives with such a request."""

    def flush_error(self) -> BaseException | None:
        """The error of the connection, or None while it is usable."""


class SerialPort(Protocol):
    """A connection's port for serial requests (``rdmaio.core.transport.Transport.onesided_port``): fill,
    post and poll one request in one C call (``rdmaio.verbs.OneSidedPort``)."""

    @property
    def post_poll(self) -> Callable[..., int]:
        """``post_poll(index, local_addr, lkey, length, opcode, remote_addr, rkey, compare_add, swap)``:
        post the request ``wr_id = wr_base | index`` and take at most one record from the CQ; ``-errno``
        (nothing posted) or one of ``rdmaio.verbs.POSTED``, ``POSTED_DONE``, ``POSTED_OTHER``,
        ``POSTED_POLL_FAILED``."""

    def after_poll(self, result: int) -> bool:
        """``POSTED_OTHER``: dispatch the record taken (True), or keep it for the next poll of the
        dispatcher (False: the caller makes sure one comes); ``POSTED_POLL_FAILED``: raise its error."""

    def post_error(self, result: int) -> BaseException:
        """The error of a failed post (``result`` is ``-errno``)."""

    def poll(self) -> None:
        """Poll the completion queues now (delivers records a dispatch in progress kept)."""

    def post_batch_poll(
        self, wr_id: int, opcode: int, local_addr: int, lkey: int, rkey: int, remote_addr: Any, **arrays: Any
    ) -> int:
        """A wave of a batch (``QueuePair.post_batch``'s arguments) and one look at the CQ in one C call;
        the results of :attr:`post_poll` (``POSTED_DONE``: the wave's last request completed)."""
