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

__all__ = [
    "MAX_BINDS_IN_FLIGHT",
    "MAX_OP_BYTES",
    "WR_KIND_ONESIDED",
    "BindWindow",
    "Credits",
    "EngineCore",
    "RdmaQueue",
    "Region",
    "Window",
]


if TYPE_CHECKING:
    from rdmaio.core.onesided_grants import _Grant, _Scoped
    from rdmaio.core.onesided_life import _Large, _Op
    from rdmaio.core.onesided_revoked import RevokedKeys
    from rdmaio.core.remotekey import WriteNotice

MAX_OP_BYTES = 1 << 30
"""Largest single READ or WRITE (1 GiB; rxe's limit is 2 GiB - 1)."""
WR_KIND_ONESIDED = verbs.WR_KIND_ONESIDED
"""``wr_id >> 56`` of one-sided work requests (the verbs layer's wr_id layout)."""
MAX_BINDS_IN_FLIGHT = 16
"""Memory-window binds (``IBV_WR_BIND_MW``) a connection may have posted and not yet seen complete: the
send queue and the CQ reservation are enlarged by that many entries (rdmaio.core.transport), apart from
the ``max_rdma_ops`` of the one-sided requests, so that an ``export()`` never waits for an op slot."""


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


class EngineCore:
    """The state of a one-sided engine (set by :meth:`OneSidedEngine.__init__
    <rdmaio.core.onesided.OneSidedEngine>`) and the checks every part makes."""

    _io: Backend
    _wr_base: int
    _qp: RdmaQueue
    _credits: Credits
    _register_local: Callable[[Any], Region]
    _register_grant: Callable[[memoryview, int], Region]
    _register_bindable: Callable[[memoryview, bool], Region]
    _bind_window: BindWindow | None
    _poll: Callable[[], None] | None
    _binds: dict[int, _Scoped]
    _bind_waiters: collections.deque[Waiter]
    _key_ids: Iterator[int]
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
    revoked_ids: RevokedKeys
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

    def on_bind_completion(self, index: int, status: int, vendor_err: int = 0) -> bool:
        """A window bind completed: :meth:`rdmaio.core.onesided_grants.Exports.on_bind_completion`."""
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
