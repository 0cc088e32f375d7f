"""What the parts of the one-sided engine share: the interfaces it is given, its common state, its errors.

:class:`~rdmaio.core.onesided.OneSidedEngine` is assembled from :class:`~rdmaio.core.onesided_grants.Exports`
(the exporter side, write notices and control messages) and :class:`~rdmaio.core.onesided_batch.Batches`
(batch calls) on :class:`~rdmaio.core.onesided_ops.Operations` (the calls) on
:class:`~rdmaio.core.onesided_life.OpLifecycle` (slots, memory, posting, completions), on top of
:class:`EngineCore`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from rdmaio import verbs
from rdmaio.core.backend import Backend, Waiter
from rdmaio.errors import (
    EndpointClosedError,
    RdmaError,
)

__all__ = ["MAX_OP_BYTES", "WR_KIND_ONESIDED", "Credits", "EngineCore", "RdmaQueue", "Region"]


if TYPE_CHECKING:
    from rdmaio.core.onesided_grants import _Grant
    from rdmaio.core.onesided_life import _Large, _Op
    from rdmaio.core.remotekey import WriteNotice

MAX_OP_BYTES = 1 << 30
"""Largest single READ or WRITE (1 GiB; rxe's limit is 2 GiB - 1)."""
WR_KIND_ONESIDED = verbs.WR_KIND_ONESIDED
"""``wr_id >> 56`` of one-sided work requests (the verbs layer's wr_id layout)."""


class Region(Protocol):
    """A registered memory region: address, keys, close()."""

    addr: int
    lkey: int
    rkey: int

    def close(self) -> None:
        """Deregister."""


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


class EngineCore:
    """The state of a one-sided engine (set by :meth:`OneSidedEngine.__init__
    <rdmaio.core.onesided.OneSidedEngine>`) and the checks every part makes."""

    _io: Backend
    _wr_base: int
    _qp: RdmaQueue
    _credits: Credits
    _register_local: Callable[[Any], Region]
    _register_grant: Callable[[memoryview, int], Region]
    _cache_get: Callable[[Any], Any]
    _fail_connection: Callable[[BaseException], None]
    max_ops: int
    _max_inline: int
    _revoke_timeout: float
    _atomics: bool
    _stats: collections.Counter[str]
    _index: Iterator[int]
    ops: dict[int, _Op]
    _in_flight: int
    _slot_waiters: collections.deque[Waiter]
    _credit_queue: collections.deque[_Op]
    _staging: Any
    _staging_view: memoryview | None
    _free_staging: list[int]
    _doorbell: list[_Op]
    _ring_handle: Any
    _large_pool: dict[int, list[_Large]]
    _large_pooled: int
    grants: dict[int, _Grant]
    revoked_ids: set[int]
    _pending_acks: collections.deque[int]
    _notices: collections.deque[WriteNotice]
    _notice_waiter: Waiter | None
    peer_onesided: bool
    notice_limit: int
    _held_slots: collections.deque[int]
    _repost: Callable[[int], None] | None
    _post_polled: Callable[[int, int], bool] | None
    _wr_entries: Any
    _at_post_streak: int
    _last_poster: int
    _error: BaseException | None
    closed: bool
    control_handler: Callable[[int, int], None] | None

    def pump(self) -> None:
        """Post what waits for a credit: :meth:`rdmaio.core.onesided_life.OpLifecycle.pump`."""
        raise NotImplementedError

    def _check_open(self) -> None:
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise _fresh(self._error)
        error = self._credits.flush_error()
        if error is not None:
            raise error
        if self.closed:
            raise EndpointClosedError("endpoint is closed")


def _fresh(error: BaseException) -> BaseException:
    """A new instance of a stored error (an exception instance raised twice accumulates tracebacks)."""
    if isinstance(error, RdmaError):
        copy = type(error)(error.message, errno=error.errno, call=error.call)
        copy.__cause__ = error.__cause__
        return copy
    return error
