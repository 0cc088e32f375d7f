"""The operation engine of one connection's one-sided RDMA: the requests (READ, WRITE with or without
immediate data, atomics), their op slots, local memory, posting, completions and release.

Every call is checked locally (range, access, alignment, revocation) before anything is posted. An op then
takes ``count`` of ``max_ops`` slots (one per work request: the send queue has room for that many) and
local memory (a staging slot, a pooled large buffer, or the caller's buffer registered through the
Domain's cache), is posted alone or with others of the same loop iteration in one doorbell (writes with
immediate data and control messages after a send credit), and completes through
:meth:`OperationEngine.on_completion`. A cancelled call leaves its op orphaned: the completion frees it.
The batch calls (:mod:`~rdmaio.core.onesided.batches`) and the exporter's control messages
(:mod:`~rdmaio.core.onesided.exporter`) go through this engine's methods.

Work requests carry ``wr_id = 2 << 56 | tag << 32 | index`` (:data:`WR_KIND_ONESIDED`); ops and window
binds draw their indexes from one counter, so the index tells which: a completion whose index is no op of
this engine goes to :attr:`OperationEngine.on_other_completion` (the exporter's window binds).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import struct
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from rdmaio import verbs
from rdmaio.core.backend import AsyncioBackend, Backend, Waiter
from rdmaio.core.onesided.interfaces import Credits, RdmaQueue, Region, SerialPort
from rdmaio.core.onesided.keys import ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, RemoteKey, access_str
from rdmaio.core.onesided.revoked import RevokedKeys
from rdmaio.errors import (
    EndpointClosedError,
    FeatureNotSupportedError,
    MessageTooLargeError,
    RdmaError,
    RemoteAccessError,
    RemoteAccessRefusedError,
    RemoteKeyRevokedError,
    ReplyQueueFullError,
)
from rdmaio.protocol.closestate import CloseState
from rdmaio.verbs.native import ffi, lib

__all__ = [
    "INLINE_READ_MAX",
    "MAX_OP_BYTES",
    "READ_PAGE",
    "STAGING_SLOT",
    "U64",
    "WR_FADD",
    "WR_KIND_ONESIDED",
    "WR_READ",
    "Op",
    "OperationEngine",
    "crosses_page",
    "to_page_end",
]

MAX_OP_BYTES = 1 << 30
"""Largest single READ or WRITE (1 GiB; rxe's limit is 2 GiB - 1)."""
WR_KIND_ONESIDED = verbs.WR_KIND_ONESIDED
"""``wr_id >> 56`` of one-sided work requests (the verbs layer's wr_id layout)."""
STAGING_SLOT = 64 * 1024
"""Bytes of rdmaio-owned registered memory per op; larger ops get their own MR (and batches fit one)."""
U64 = (1 << 64) - 1
"""The largest u64 (atomics' operands and results)."""
READ_PAGE = 4096
"""The page size a READ is split at on a connection with :attr:`OperationEngine.split_page_crossing_reads`."""
INLINE_READ_MAX = 32
"""The largest READ that is split where it crosses a :data:`READ_PAGE` boundary of the remote address on
such a connection. Linux's siw (6.1: ``siw_qp_tx.c``) sends a payload of at most ``MAX_HDR_INLINE`` (32)
bytes inside its frame header, copied by ``siw_try_1seg()``; for user memory (an exported region, sent
from siw's transmit path) that copy splits a payload crossing a page at the wrong place (it copies
``bytes - (PAGE_SIZE - off)`` bytes from the first page where ``PAGE_SIZE - off`` are left there, and
takes the second page at ``laddr + part``), so the READ returns other bytes of the exporter's memory in
place of the right ones, with a successful completion. Each part of a split READ stays within one page."""
WR_READ: int = lib.IBV_WR_RDMA_READ
"""Opcode of an RDMA READ work request."""
WR_FADD: int = lib.IBV_WR_ATOMIC_FETCH_AND_ADD
"""Opcode of an atomic fetch-and-add work request."""

_INDEX_MASK = verbs.WR_INDEX_MASK  # bits 32..55 are the connection's tag (shared-CQ dispatch)
# Larger ops' MRs are kept for reuse, in power-of-two size classes, up to this many bytes per connection:
# registering (pinning) 1 MiB per op cost more than the op itself (docs/benchmarks.md, "One-sided").
_LARGE_POOL_BYTES = 32 << 20
_WR_WRITE: int = lib.IBV_WR_RDMA_WRITE
_WR_WRITE_IMM: int = lib.IBV_WR_RDMA_WRITE_WITH_IMM
_WR_SEND: int = lib.IBV_WR_SEND
_WR_CSWAP: int = lib.IBV_WR_ATOMIC_CMP_AND_SWP
_SEND_SIGNALED: int = lib.IBV_SEND_SIGNALED
_SEND_INLINE: int = lib.IBV_SEND_INLINE
_WC_REM_ACCESS_ERR = int(verbs.WcStatus.REM_ACCESS_ERR)
_WC_FLUSH = int(verbs.WcStatus.WR_FLUSH_ERR)
_PACK_OP = verbs.RDMA_OP.pack_into
_OP_SIZE = verbs.RDMA_OP.size
_INLINE_OPCODES = frozenset((_WR_WRITE, _WR_WRITE_IMM, _WR_SEND))
# The Counter key of each request kind posted by the general paths (process metrics: rdmaio.metrics); a
# serial call completed at its post counts in an int of its own kind instead (no Counter update there).
_KIND_KEY = {
    WR_READ: "rdma_reads",
    _WR_WRITE: "rdma_writes",
    _WR_WRITE_IMM: "rdma_writes",
    WR_FADD: "rdma_fetch_adds",
    _WR_CSWAP: "rdma_compare_swaps",
    _WR_SEND: "rdma_control_sends",
}
_DOORBELL = 16  # requests per ibv_post_send at most (the QP's scratch array has 16 entries)
# Calls completed at their post that may return in a row without yielding to the loop (see _wait).
_AT_POST_BUDGET = 16
_POSTED_DONE = verbs.POSTED_DONE
_POSTED_OTHER = verbs.POSTED_OTHER
_U64_AT = struct.Struct("=Q").unpack_from  # an atomic's old value: a u64 in this host's byte order
_running_loop = asyncio.get_running_loop  # C
# The running task of an asyncio loop, in C (no Python frame: a serial call asks for it once). From Python
# 3.12 on this is asyncio.current_task itself (C; it takes the loop). Python 3.11 has no public C function
# that returns the task (asyncio.current_task is Python code there, and _asyncio has no current_task until
# 3.12), so there it is the lookup asyncio.current_task makes: the dict the C task machinery keeps per loop
# (_enter_task/_leave_task), asyncio.tasks._current_tasks, read and never written. Unavoidable there: the
# public function is one more Python call per operation, and the ways to know the caller without its task
# do not tell tasks apart (a task created by the caller inherits its context variables; the engine does
# not see a caller yield to the loop outside its calls), which would let concurrent tasks take the serial
# path, each request its own post and poll instead of sharing a doorbell and a wake-up.
_task_of_loop: Callable[[Any], object]
if isinstance(asyncio.current_task, types.BuiltinFunctionType):
    _task_of_loop = asyncio.current_task
else:
    _task_of_loop = getattr(asyncio.tasks, "_current_tasks").get  # noqa: B009 (Python 3.11: see above)


class Op:
    """One pending request (or one wave of a batch): its slots, local memory, work request and outcome.

    ``count`` is the work requests it stands for, ``buffer`` the local memory the NIC reads or writes (a
    memoryview; None once released), ``error`` its failure once ``done``. The engine that made it owns
    it; batch calls read ``count`` and ``buffer`` and hand it back to the engine's methods.

    Every field but ``index`` has a class-level default that an instance shadows once it is set, so that
    the concurrent path makes an op with ``object.__new__`` (:data:`_new_op_object`: no Python call) and
    sets only what differs (no ``__slots__``, which would leave unset fields unreadable).
    """

    index: int
    count = 1  # work requests (send queue entries) it stands for: a batch has several
    # Made when a caller has to wait: an asyncio.Future on asyncio, else the backend's Waiter.
    waiter: Any = None
    done = False
    posted = False
    orphan = False  # nobody waits for it any more: its completion releases its memory
    error: BaseException | None = None
    result: Any = None
    staging: int | None = None  # staging slot index, or None
    mr: Any = None  # a Registration (rdma_read_into)
    pooled: _Large | None = None  # a large op's registered memory, from the pool
    buffer: Any = None  # memoryview of the local memory the NIC reads or writes
    key_id: int | None = None
    length = 0
    opcode = 0
    wr: tuple[int, ...] = ()

    def __init__(self, index: int) -> None:
        self.index = index


_new_op_object = object.__new__
"""An :class:`Op` without its ``__init__`` (C): its fields read their class-level defaults until set."""


class _Large:
    """A registered rdmaio-owned buffer for ops above the staging slot (reused through the pool)."""

    __slots__ = ("region", "size", "view")

    def __init__(self, region: Region, view: memoryview) -> None:
        self.region = region
        self.view = view
        self.size = view.nbytes


def _fresh(error: BaseException) -> BaseException:
    """A new instance of a stored error (an exception instance raised twice accumulates tracebacks)."""
    if isinstance(error, RdmaError):
        copy = type(error)(error.message, errno=error.errno, call=error.call)
        copy.__cause__ = error.__cause__
        return copy
    return error


class OperationEngine:
    """The requests of one connection's one-sided engine: calls, op slots, memory, posting, completions.

    Given: the loop backend ``io``, the queue pair ``qp``, the session's ``credits``, ``register_local``
    (local-access registration of rdmaio-owned memory), ``cache_get`` (the Domain's registration cache,
    for ``read_into``), ``fail`` (fails the whole connection), ``wr_base`` (kind and tag of our wr_ids),
    ``indexes`` (the counter shared with the window binds), ``revoked_ids`` (the keys the peer revoked,
    kept by the exporter), the connection's ``stats`` counter, ``port`` (a
    :class:`~rdmaio.core.onesided.interfaces.SerialPort`: fill, post and poll one request in one C call)
    and ``close_state`` (the connection's :class:`~rdmaio.protocol.closestate.CloseState`, the Session's:
    the engine registers with it to learn when the connection starts closing). Without a port or a close
    state, no call takes the serial path.

    A serial call (one task calling one request at a time, nothing else of this engine in flight) on a
    device that completes at the post (rxe does) runs as ONE Python call: its checks, the C call that posts
    and polls, and its result, inline, with no op object (the staging slot is used and given back at once).
    Otherwise the op is tracked and its completion wakes the caller directly (:meth:`on_completion`).

    Documented plain attributes: :attr:`ops` (pending ops by index), :attr:`in_flight` (work requests of
    those ops), :attr:`max_ops`, :attr:`revoked_ids`, :attr:`peer_onesided`, :attr:`error` and
    :attr:`closed` (the state every part checks, set by :meth:`close`), :attr:`on_other_completion`.
    """

    #: Bytes in front of every control message's payload: empty in the immediate framing; the header
    #: framing's control-message header (rdmaio.protocol.framing.CONTROL_WORD), set by the connection, there.
    control_header: bytes = b""

    def __init__(
        self,
        io: Backend,
        qp: RdmaQueue,
        credits: Credits,
        *,
        register_local: Callable[[Any], Region],
        cache_get: Callable[[Any], Any],
        fail: Callable[[BaseException], None],
        max_ops: int,
        max_inline: int,
        stats: collections.Counter[str],
        wr_base: int,
        indexes: Iterator[int],
        revoked_ids: RevokedKeys,
        peer_onesided: bool,
        port: SerialPort | None,
        close_state: CloseState | None = None,
        atomics: bool = True,
        device_name: str = "this device",
        write_notice_by_message: bool = False,
        max_queued_replies: int = 4096,
        split_page_crossing_reads: bool = False,
    ) -> None:
        self._io = io
        self._qp = qp
        self._wr_entries = ffi.buffer(qp.rdma_array)  # filled with verbs.RDMA_OP.pack_into
        self._credits = credits
        self._register_local = register_local
        self._cache_get = cache_get
        self._fail_connection = fail
        self.max_ops = max_ops
        """Work requests in flight at most (op slots): the send queue has room for that many."""
        self._max_inline = max_inline
        self._stats = stats
        # The connection's tag routes our completions to us through the Domain's shared CQ.
        self._wr_base = wr_base
        self._index = indexes
        self.revoked_ids = revoked_ids
        """The key ids the peer revoked (the exporter adds them when a REVOKE arrives)."""
        # The peer announced FEATURE_ONESIDED: it understands write notices.
        self.peer_onesided = peer_onesided
        """The peer understands write notices and control messages (FEATURE_ONESIDED)."""
        # Posts a lone request of a task calling serially and polls the completion queue once right after,
        # in one C call (see _post).
        self._port = port
        self._post_poll: Callable[..., int] = port.post_poll if port is not None else _no_port
        self._post_batch_poll: Callable[..., int] = port.post_batch_poll if port is not None else _no_port
        # asyncio (and uvloop): an op's waiter is a bare asyncio.Future (made, resolved and awaited in C).
        # Other backends: their Waiter.
        self._futures = isinstance(io, AsyncioBackend)
        # The running task is self._task_of(self._running()): the running loop's task in C calls on
        # asyncio (see _task_of_loop); the backend's current_task() elsewhere (trio).
        self._running: Callable[[], Any] = _running_loop if self._futures else io.current_task
        self._task_of: Callable[[Any], object] = _task_of_loop if self._futures else _itself
        self._close_state = close_state
        self.atomics = atomics
        """This side's device can issue remote atomics (``atomic_cap`` not NONE, nor forced off)."""
        self.device_name = device_name
        """This side's device (named in the errors of what it lacks)."""
        self.write_notice_by_message = write_notice_by_message
        """A write with a notice (``imm=``) is an RDMA WRITE followed by a control message carrying the
        notice (:attr:`notice_message`), not a WRITE with immediate data: for a connection whose framing
        has no immediate data (iWARP devices have none). Both go out on this queue pair in that order, and
        RC places the WRITE's data before the SEND is delivered, so the peer sees the notice after the data.
        The notice is an op of its own that waits for a send credit, as a WRITE with immediate data does,
        and its writer waits until it has taken one: a peer that withholds credits holds the writers back,
        and at most ``max_ops`` notices wait (each holds an op slot)."""
        self.split_page_crossing_reads = split_page_crossing_reads
        """READs of at most :data:`INLINE_READ_MAX` bytes that cross a :data:`READ_PAGE` boundary of the
        remote address go as two READs, one per page (:func:`crosses_page`): for a peer whose device may
        be siw, which returns such a READ with wrong bytes (see :data:`INLINE_READ_MAX`). Set on
        an iWARP device (its handshake capabilities: no immediate data); :meth:`read_split` is then the
        connection's ``rdma_read``, and :meth:`read_into` and the batches split such ranges too."""
        self.notice_message: Callable[[int, int], bytes] | None = None
        """The control message of a write notice (``length``, ``imm``): the exporter's, set by the engine
        that composes both."""
        # The access bit an atomic's serial path tests a key for: none on a device without atomics, so
        # such calls take the general path, which raises FeatureNotSupportedError (no Python call more).
        self._atomic_bit = ACCESS_ATOMIC if atomics else 0
        # Serial calls and batch waves completed at their post, by kind (no op, no Counter update:
        # statistics() adds them).
        self._reads_at_post = 0
        self._writes_at_post = 0
        self._fetch_adds_at_post = 0
        self._compare_swaps_at_post = 0
        self._waves_done_at_post = 0
        self._wave_ops_at_post = dict.fromkeys(_KIND_KEY, 0)  # requests of those waves, by opcode
        self._at_post_streak = 0  # calls completed at their post since one last yielded to the loop
        self._last_poster = 0  # id() of the task that posted the previous request (not a reference)
        # The serial path's flag: one attribute a call checks instead of the engine's state (see
        # _update_serial). id() of the task whose next call may take the serial path, 0 while none may.
        self._serial_task = 0
        # The part of its facts that changes rarely: a port and a close state, the connection open (not
        # closing, not closed), staging registered, nobody waiting for an op slot.
        self._serial_open = False
        self.ops: dict[int, Op] = {}
        """Posted or waiting for a credit, by op index."""
        self.in_flight = 0
        """Work requests of :attr:`ops` (a batch op stands for several)."""
        self._slot_waiters: collections.deque[Waiter] = collections.deque()
        self._credit_queue: collections.deque[Op] = collections.deque()
        # Control messages to post, each with whether it answers one of the peer's (see queue_send).
        self._pending_sends: collections.deque[tuple[bytes, bool]] = collections.deque()
        self.waiting_for_credit = 0
        """Control messages and writes with immediate data waiting for a send credit: while 0,
        :meth:`pump` has nothing to do (a connection may skip calling it)."""
        self.replies_waiting = 0
        """Control messages queued that answer one of the peer's (``queue_send(..., reply=True)``: a
        REVOKE_ACK, a rendezvous DONE or WITHDRAWN) and wait for a send credit or an op slot."""
        self.max_queued_replies = max_queued_replies
        """The most :attr:`replies_waiting` there may be (``Options.max_queued_replies``). The peer pays for
        each message it answers with a credit, but it gets those credits back on every CREDIT frame we send,
        which needs one credit where a reply needs two: a peer that grants us one credit at a time keeps us
        granting it credits while no reply ever goes out. Past this bound the connection fails
        (:class:`~rdmaio.errors.ReplyQueueFullError`)."""
        self._staging: Any = None  # a Region: registered rdmaio-owned memory, max_ops slots of STAGING_SLOT
        self._staging_view = memoryview(b"")  # all of it, once registered
        self._staging_buf: bytearray | None = None
        self._staging_addr = 0
        self._staging_lkey = 0
        self._free_staging = list(range(max_ops))
        self._doorbell: list[Op] = []  # requests to post together at the end of this loop iteration
        self._ring_handle: Any = None
        self._large_pool: dict[int, list[_Large]] = {}  # free large buffers by size class
        self._large_pooled = 0  # bytes in _large_pool
        self.error: BaseException | None = None
        """Why the engine closed (set by :meth:`close`), or None."""
        self.closed = False
        """:meth:`close` ran: the connection is gone."""
        self.on_other_completion: Callable[[int, int, int], bool] = _not_ours
        """Called with ``(index, status, vendor_err)`` for a completion whose index is no op of ours (the
        exporter's window binds); returns whether it was one."""

    # --- the serial path's flag -----------------------------------------------------------------------------

    def on_closing(self) -> None:
        """The connection started closing (its close state tells the engine once the staging memory is
        registered): no call takes the serial path from now on; the general path raises the connection's
        error."""
        self._serial_open = False
        self._serial_task = 0

    def _update_serial(self) -> None:
        """Recompute the serial path's flag from the engine's state, where a rarely changing fact changed.

        A call takes the serial path (post and poll in one C call, no op while it completes at its post)
        when ``_serial_task`` is its task's id: the task that posted the previous request, while the engine
        has a port and the connection's close state, the connection is open (not closing, not closed), the
        staging memory is registered, nobody waits for an op slot (``_serial_open``), nothing is in flight
        (:attr:`ops` empty) and a staging slot is free. Each place that makes one of these facts false
        clears the flag; each place that makes one true sets it again if all hold: this method where a fact
        of ``_serial_open`` changed, an inline assignment where an op comes or goes and where a staging slot
        comes back (on the paths that must not cost a Python call)."""
        state = self._close_state
        self._serial_open = (
            self._port is not None
            and state is not None
            and not state.closing
            and not self.closed
            and self._staging is not None
            and not self._slot_waiters
        )
        self._serial_task = (
            self._last_poster if self._serial_open and not self.ops and self._free_staging else 0
        )

    # --- the state every part checks ------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the engine's error (a fresh copy), the connection's, or EndpointClosedError once closed."""
        if self.error is not None:
            raise _fresh(self.error)
        error = self._credits.flush_error()
        if error is not None:
            raise error
        if self.closed:
            raise EndpointClosedError("endpoint is closed")

    def check_key(self, key: RemoteKey, offset: int, length: int, need: int) -> None:
        """Raise unless ``key`` grants the ``need`` access bits on ``[offset, offset + length)`` and was not
        revoked by the peer (the local checks before anything is posted)."""
        if not isinstance(key, RemoteKey):
            raise TypeError(f"expected a RemoteKey, got {type(key).__name__}")
        # No id from revoked_ids.top up is revoked: most keys in use pass without a look at the ranges.
        if key.key_id < self.revoked_ids.top and key.key_id in self.revoked_ids:
            raise RemoteKeyRevokedError(f"{key!r} was revoked by the peer")
        if not key.access_bits & need:
            raise RemoteAccessError(f"{key!r} does not grant {access_str(need)!r} access")
        if not isinstance(offset, int) or not isinstance(length, int):
            raise TypeError("offset and length must be ints")
        if offset < 0 or length < 0 or offset + length > key.length:
            raise RemoteAccessError(
                f"range offset={offset} length={length} is outside {key!r} (0..{key.length})"
            )

    # --- the calls ------------------------------------------------------------------------------------------

    async def read(self, key: RemoteKey, offset: int, length: int) -> bytes:
        """RDMA READ into rdmaio-owned memory; see ``Endpoint.rdma_read``."""
        if (
            isinstance(key, RemoteKey)
            and isinstance(offset, int)
            and isinstance(length, int)
            and key.access_bits & ACCESS_READ
            and offset >= 0
            and 0 < length <= STAGING_SLOT
            and offset + length <= key.length
            and key.key_id >= self.revoked_ids.top
        ):
            # The call's own checks (check_key's, the arguments'), made once for the two fast paths: a call
            # that fails one takes the general path below, which raises the precise error.
            if (
                self._serial_open
                and self._free_staging
                and (self.ops or self._doorbell)
                and self.in_flight < self.max_ops
                and self._futures
            ):
                # The concurrent path (see _queue): these tests stand for raise_if_failed's and _start_now's
                # checks.
                slot = self._free_staging.pop()
                op = self._queue(slot, WR_READ, length, key.addr + offset, key.rkey, 0, key.key_id)
                try:
                    await op.waiter
                except BaseException:
                    if op.done:
                        self.release(op)
                    else:
                        op.orphan = True  # the NIC may still write into its staging: its completion frees it
                    raise
                if op.error is not None:
                    self.release(op)
                    raise op.error
                at = slot * STAGING_SLOT
                data = bytes(self._staging_view[at : at + length])
                # release(), inline: a staging slot is all it holds
                self._free_staging.append(slot)
                op.staging = None
                self._serial_task = self._last_poster if self._serial_open and not self.ops else 0
                if self._slot_waiters or self._pending_sends:
                    self._wake_slot_waiter()
                return data
            if self._serial_task == id(self._task_of(self._running())):
                # The serial path (see _post and _update_serial): the flag stands for raise_if_failed's and
                # _start_now's checks.
                at = self._free_staging[-1] * STAGING_SLOT
                index = next(self._index) & _INDEX_MASK
                result = self._post_poll(
                    index, self._staging_addr + at, self._staging_lkey, length, WR_READ, key.addr + offset,
                    key.rkey, 0, 0,
                )  # fmt: skip
                if result == _POSTED_DONE:
                    data = bytes(self._staging_view[at : at + length])
                    self._reads_at_post += 1
                    self._at_post_streak += 1
                    if self._at_post_streak >= _AT_POST_BUDGET:
                        self._at_post_streak = 0
                        await self._io.sleep(0)
                    return data
                read: bytes = await self._serial_rest(index, result, WR_READ, length, key.key_id)
                return read
        self.check_key(key, offset, length, ACCESS_READ)
        if length > MAX_OP_BYTES:
            raise MessageTooLargeError(f"one RDMA READ is at most {MAX_OP_BYTES} bytes")
        if length == 0:
            self.raise_if_failed()
            return b""
        op = self._start_now(key, WR_READ, length) or await self.start(key, WR_READ, length)
        self._post(op, key.addr + offset, key.rkey)
        if self._must_await(op):
            await self.finish(op)
        assert op.buffer is not None
        data = bytes(op.buffer[:length])
        self.release(op)
        return data

    async def read_split(self, key: RemoteKey, offset: int, length: int) -> bytes:
        """:meth:`read` on a connection with :attr:`split_page_crossing_reads`: a READ that
        :func:`crosses_page` goes as one READ per page (at most 32 bytes: two small round trips), any
        other as :meth:`read` does it."""
        if (
            isinstance(key, RemoteKey)
            and isinstance(offset, int)
            and isinstance(length, int)
            and offset >= 0
            and crosses_page(key.addr + offset, length)
        ):
            self.check_key(key, offset, length, ACCESS_READ)
            first = to_page_end(key.addr + offset)
            head = await self.read(key, offset, first)
            return head + await self.read(key, offset + first, length - first)
        return await self.read(key, offset, length)

    async def read_into(self, key: RemoteKey, offset: int, buffer: Any) -> int:
        """RDMA READ straight into a caller buffer; see ``Endpoint.rdma_read_into``."""
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError("rdma_read_into() needs a writable buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        length = view.nbytes
        self.check_key(key, offset, length, ACCESS_READ)
        if length > MAX_OP_BYTES:
            raise MessageTooLargeError(f"one RDMA READ is at most {MAX_OP_BYTES} bytes")
        if length == 0:
            self.raise_if_failed()
            return 0
        if self.split_page_crossing_reads and crosses_page(key.addr + offset, length):
            view[:] = await self.read_split(key, offset, length)  # at most 32 bytes: staged and copied
            return length
        op = await self.start(key, WR_READ, length, staging=False)
        try:
            registration = self._cache_get(view)
        except BaseException:
            self._abandon(op)
            raise
        op.mr = registration
        op.buffer = view
        self._post(op, key.addr + offset, key.rkey, local=(registration.addr, registration.lkey))
        try:
            await self._wait(op)
        except BaseException:
            if not op.done:
                # The NIC may still write into the caller's buffer: the only way to stop it before we
                # return is to destroy the queue pair. Documented in Endpoint.rdma_read_into.
                self._fail_connection(
                    EndpointClosedError("rdma_read_into() was cancelled with the READ in flight")
                )
            self.release(op)
            raise
        self.release(op)
        if op.error is not None:
            raise op.error
        return length

    async def read_registered(
        self, key: RemoteKey, remote_addr: int, length: int, local: tuple[int, int]
    ) -> None:
        """RDMA READ of ``length`` bytes at ``remote_addr`` of ``key`` into memory the caller registered
        (``local`` is its address and lkey; no local checks: a rendezvous pull of a descriptor it checked).
        Cancelled, the op is left to its completion (or the teardown), which releases it."""
        op = await self.start(key, WR_READ, length, staging=False)
        self._post(op, remote_addr, key.rkey, local=local)
        try:
            await self._wait(op)
        except BaseException:
            op.orphan = True  # the caller is ending: its completion (or the teardown) releases it
            raise
        self.release(op)
        if op.error is not None:
            raise op.error

    async def write(self, key: RemoteKey, offset: int, data: Any, imm: int | None = None) -> None:
        """RDMA WRITE (with immediate data when ``imm`` is given); see ``Endpoint.rdma_write``."""
        if (
            imm is None
            and type(data) is bytes
            and isinstance(key, RemoteKey)
            and isinstance(offset, int)
            and key.access_bits & ACCESS_WRITE
            and offset >= 0
            and 0 < len(data) <= STAGING_SLOT
            and offset + len(data) <= key.length
            and key.key_id >= self.revoked_ids.top
        ):
            # The call's own checks (check_key's, the arguments'), made once for the two fast paths: a call
            # that fails one takes the general path below, which raises the precise error.
            if (
                self._serial_open
                and self._free_staging
                and (self.ops or self._doorbell)
                and self.in_flight < self.max_ops
                and self._futures
            ):
                # The concurrent path (see read()): the data is copied into staging before the post, as below.
                length = len(data)
                slot = self._free_staging.pop()
                at = slot * STAGING_SLOT
                self._staging_view[at : at + length] = data
                op = self._queue(slot, _WR_WRITE, length, key.addr + offset, key.rkey, 0, key.key_id)
                try:
                    await op.waiter
                except BaseException:
                    if op.done:
                        self.release(op)
                    else:
                        op.orphan = True  # the NIC may still read its staging: its completion frees it
                    raise
                if op.error is not None:
                    self.release(op)
                    raise op.error
                # release(), inline: a staging slot is all it holds
                self._free_staging.append(slot)
                op.staging = None
                self._serial_task = self._last_poster if self._serial_open and not self.ops else 0
                if self._slot_waiters or self._pending_sends:
                    self._wake_slot_waiter()
                return
            if self._serial_task == id(self._task_of(self._running())):
                # The serial path (see read()): the data is copied into staging before the post, as below.
                length = len(data)
                at = self._free_staging[-1] * STAGING_SLOT
                self._staging_view[at : at + length] = data
                index = next(self._index) & _INDEX_MASK
                result = self._post_poll(
                    index, self._staging_addr + at, self._staging_lkey, length, _WR_WRITE, key.addr + offset,
                    key.rkey, 0, 0,
                )  # fmt: skip
                if result == _POSTED_DONE:
                    self._writes_at_post += 1
                    self._at_post_streak += 1
                    if self._at_post_streak >= _AT_POST_BUDGET:
                        self._at_post_streak = 0
                        await self._io.sleep(0)
                    return
                await self._serial_rest(index, result, _WR_WRITE, length, key.key_id)
                return
        view = memoryview(data)
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        length = view.nbytes
        self.check_key(key, offset, length, ACCESS_WRITE)
        if imm is not None and not (isinstance(imm, int) and 0 <= imm <= 0xFFFF_FFFF):
            raise ValueError(f"imm must be an int in 0..2**32-1, not {imm!r}")
        if imm is not None and not self.peer_onesided:
            raise FeatureNotSupportedError(
                "rdma_write(imm=...) needs a peer that understands write notices (FEATURE_ONESIDED in "
                "its handshake); this peer's rdmaio does not: write without imm and notify it with send()"
            )
        if length > MAX_OP_BYTES:
            raise MessageTooLargeError(f"one RDMA WRITE is at most {MAX_OP_BYTES} bytes")
        if length == 0 and imm is None:
            self.raise_if_failed()
            return
        if imm is not None and self.write_notice_by_message:
            await self._write_then_notice(key, offset, view, imm)
            return
        opcode = _WR_WRITE if imm is None else _WR_WRITE_IMM
        op = self._start_now(key, opcode, length) or await self.start(key, opcode, length)
        if length:
            assert op.buffer is not None
            op.buffer[:length] = view  # copied: the caller's buffer is free when this call returns
        self._post(op, key.addr + offset, key.rkey, imm=imm or 0)
        if self._must_await(op):
            await self.finish(op)
        self.release(op)

    async def _write_then_notice(self, key: RemoteKey, offset: int, view: memoryview, imm: int) -> None:
        """A write with a notice where there is no immediate data: an RDMA WRITE (none when ``view`` is
        empty), then the notice as a control message once the WRITE is posted (it follows it on this queue
        pair: RC delivers it after the WRITE's data is placed). A WRITE that fails to post, or whose key
        the peer revoked before the doorbell rang, sends no notice. Returns when the WRITE completed (as a
        WRITE with immediate data does) and its notice took its send credit (see :meth:`_send_notice`)."""
        notice_message = self.notice_message
        assert notice_message is not None
        length = view.nbytes
        if not length:
            self.raise_if_failed()
            await self._send_notice(notice_message(0, imm))
            return
        op = self._start_now(key, _WR_WRITE, length) or await self.start(key, _WR_WRITE, length)
        assert op.buffer is not None
        op.buffer[:length] = view  # copied: the caller's buffer is free when this call returns
        self._post(op, key.addr + offset, key.rkey)
        if not op.posted and not op.done:
            self._ring()  # collected for this iteration's doorbell: post it now, before the notice
        if not op.posted or self.error is not None or (op.done and op.error is not None):
            # It never went (its error is raised), or the connection failed meanwhile: no notice.
            if self._must_await(op):
                await self.finish(op)
            self.release(op)
            self.raise_if_failed()
            return
        if op.done:
            self.release(op)  # completed at its post
        else:
            # Its completion frees its staging slot: the notice may need that slot (max_ops 1), and a
            # writer cancelled from here on leaves it to the completion (the NIC may still read it).
            op.orphan = True
        await self._send_notice(notice_message(length, imm))
        await self._wait(op)
        if op.error is not None:
            raise op.error

    async def _send_notice(self, message: bytes) -> None:
        """Send the control message of a write notice as an op: it waits for an op slot and a staging slot
        (:meth:`start`), then for a send credit in the queue of writes with immediate data; returns once
        it took its credit and is posted. So a peer that withholds credits holds the writer back, and the
        notices waiting for a credit are bounded by ``max_ops``. Cancelled while it waits for its credit,
        the notice stays queued (holding its op slot) and goes out later, as a cancelled WRITE with
        immediate data does; its completion (or the teardown) frees its staging slot. Raises the
        connection's error if it fails or closes first."""
        op = await self.start(None, _WR_SEND, len(message) + len(self.control_header))
        assert op.buffer is not None
        op.buffer[:] = self.control_header + message
        addr, lkey = self._local_of(op)
        op.wr = (addr, lkey, 0, 0, 0, 0, 0)
        self._credit_queue.append(op)
        self.waiting_for_credit += 1
        self.pump()
        if not op.posted and not op.done:
            try:
                await self._wait(op)  # woken by pump() at its post, or by its failure
            except BaseException:
                if op.done:
                    self.release(op)
                else:
                    op.orphan = True  # posted later or flushed: its completion frees its memory
                raise
        if op.done:
            self.release(op)
            if op.error is not None:
                raise op.error
        else:
            op.orphan = True  # posted: its completion frees its staging slot

    async def fetch_add(self, key: RemoteKey, offset: int, add: int) -> int:
        """Atomic fetch-and-add on a u64; see ``Endpoint.fetch_add``."""
        if (
            isinstance(key, RemoteKey)
            and isinstance(offset, int)
            and isinstance(add, int)
            and key.access_bits & self._atomic_bit
            and offset >= 0
            and offset + 8 <= key.length
            and not (key.addr + offset) & 7
            and -(1 << 63) <= add <= U64
            and key.key_id >= self.revoked_ids.top
        ):
            # The call's own checks (check_key's, the arguments'), made once for the two fast paths: a call
            # that fails one takes the general path below, which raises the precise error.
            if (
                self._serial_open
                and self._free_staging
                and (self.ops or self._doorbell)
                and self.in_flight < self.max_ops
                and self._futures
            ):
                # The concurrent path (see read()).
                slot = self._free_staging.pop()
                op = self._queue(slot, WR_FADD, 8, key.addr + offset, key.rkey, add & U64, key.key_id)
                try:
                    await op.waiter
                except BaseException:
                    if op.done:
                        self.release(op)
                    else:
                        op.orphan = True  # the NIC may still write into its staging: its completion frees it
                    raise
                if op.error is not None:
                    self.release(op)
                    raise op.error
                # The NIC stores the original value as a u64 in this host's byte order.
                old: int = _U64_AT(self._staging_view, slot * STAGING_SLOT)[0]
                # release(), inline: a staging slot is all it holds
                self._free_staging.append(slot)
                op.staging = None
                self._serial_task = self._last_poster if self._serial_open and not self.ops else 0
                if self._slot_waiters or self._pending_sends:
                    self._wake_slot_waiter()
                return old
            if self._serial_task == id(self._task_of(self._running())):
                # The serial path (see read()).
                at = self._free_staging[-1] * STAGING_SLOT
                index = next(self._index) & _INDEX_MASK
                result = self._post_poll(
                    index, self._staging_addr + at, self._staging_lkey, 8, WR_FADD, key.addr + offset,
                    key.rkey, add & U64, 0,
                )  # fmt: skip
                if result == _POSTED_DONE:
                    old = _U64_AT(self._staging_view, at)[0]
                    self._fetch_adds_at_post += 1
                    self._at_post_streak += 1
                    if self._at_post_streak >= _AT_POST_BUDGET:
                        self._at_post_streak = 0
                        await self._io.sleep(0)
                    return old
                old = await self._serial_rest(index, result, WR_FADD, 8, key.key_id)
                return old
        self._check_atomic(key, offset, "fetch_add")
        if not isinstance(add, int) or not -(1 << 63) <= add <= U64:
            raise ValueError(f"add must be an int in -2**63..2**64-1, not {add!r}")
        op = self._start_now(key, WR_FADD, 8) or await self.start(key, WR_FADD, 8)
        self._post(op, key.addr + offset, key.rkey, compare_add=add & U64)
        return await self._atomic_result(op)

    async def compare_swap(self, key: RemoteKey, offset: int, expected: int, desired: int) -> int:
        """Atomic compare-and-swap on a u64; see ``Endpoint.compare_swap``."""
        if (
            self._serial_task == id(self._task_of(self._running()))
            and isinstance(key, RemoteKey)
            and isinstance(offset, int)
            and isinstance(expected, int)
            and isinstance(desired, int)
            and key.access_bits & self._atomic_bit
            and offset >= 0
            and offset + 8 <= key.length
            and not (key.addr + offset) & 7
            and 0 <= expected <= U64
            and 0 <= desired <= U64
            and key.key_id >= self.revoked_ids.top
        ):
            # The serial path (see read()).
            at = self._free_staging[-1] * STAGING_SLOT
            index = next(self._index) & _INDEX_MASK
            result = self._post_poll(
                index, self._staging_addr + at, self._staging_lkey, 8, _WR_CSWAP, key.addr + offset,
                key.rkey, expected, desired,
            )  # fmt: skip
            if result == _POSTED_DONE:
                old: int = _U64_AT(self._staging_view, at)[0]
                self._compare_swaps_at_post += 1
                self._at_post_streak += 1
                if self._at_post_streak >= _AT_POST_BUDGET:
                    self._at_post_streak = 0
                    await self._io.sleep(0)
                return old
            old = await self._serial_rest(index, result, _WR_CSWAP, 8, key.key_id)
            return old
        self._check_atomic(key, offset, "compare_swap")
        for name, value in (("expected", expected), ("desired", desired)):
            if not isinstance(value, int) or not 0 <= value <= U64:
                raise ValueError(f"{name} must be an int in 0..2**64-1, not {value!r}")
        op = self._start_now(key, _WR_CSWAP, 8) or await self.start(key, _WR_CSWAP, 8)
        self._post(op, key.addr + offset, key.rkey, compare_add=expected, swap=desired)
        return await self._atomic_result(op)

    def _queue(
        self, slot: int, opcode: int, length: int, remote_addr: int, rkey: int, compare_add: int, key_id: int
    ) -> Op:
        """The concurrent path's op (a READ, WRITE or fetch-and-add of a call made while others of this
        engine are in flight, on asyncio): its staging ``slot`` already taken (and filled, for a WRITE),
        tracked in :attr:`ops` with a bare future as its waiter, and collected for this iteration's
        doorbell, as :meth:`_post` collects such a request. What :meth:`_start_now`, :meth:`_new_op`,
        :meth:`_give_memory` and :meth:`_post` do for it, in one call. The caller checked what they check:
        the connection open (``_serial_open``), an op slot and a staging slot free, the key's grant."""
        op: Op = _new_op_object(Op)
        op.index = next(self._index) & _INDEX_MASK
        op.key_id = key_id
        op.length = length
        op.opcode = opcode
        op.staging = slot
        op.wr = (
            self._staging_addr + slot * STAGING_SLOT,
            self._staging_lkey,
            remote_addr,
            rkey,
            0,
            compare_add,
            0,
        )
        op.waiter = asyncio.Future()  # resolved by on_completion (or _complete), awaited by the caller
        self.ops[op.index] = op
        self._serial_task = 0  # something is in flight
        self.in_flight += 1
        self._last_poster = id(self._task_of(self._running()))
        doorbell = self._doorbell
        doorbell.append(op)
        if len(doorbell) >= _DOORBELL:
            self._ring()
        elif self._ring_handle is None:
            self._ring_handle = _running_loop().call_soon(self._ring)
        return op

    async def _serial_rest(
        self,
        index: int,
        result: int,
        opcode: int,
        length: int,
        key_id: int,
        count: int = 1,
        wave: bool = False,
    ) -> Any:
        """The rest of a serial request that the C call posted without finding its own successful
        completion (or failed to post: raises its error, failing the connection): tracked as any posted
        op (its staging slot taken, in :attr:`ops`), the record the poll took dispatched first (it may be
        its own failure), then its completion awaited (what :meth:`finish` does, in one coroutine), its
        result read from its staging slot and the slot given back. Returns what the call returns: the
        bytes the NIC wrote (a READ, a ``wave`` of a batch), the old value (an atomic) or None (a WRITE).
        ``count`` requests (a wave: counted as one) or one."""
        port = self._port
        assert port is not None
        if result < 0:
            exc = port.post_error(result)
            self._fail_connection(exc)
            raise exc
        op = Op(index)
        op.key_id = key_id
        op.length = length
        op.opcode = opcode
        op.count = count
        op.posted = True
        slot = op.staging = self._free_staging.pop()
        at = slot * STAGING_SLOT
        op.buffer = self._staging_view[at : at + length]
        self.ops[index] = op
        self._serial_task = 0  # something is in flight
        self.in_flight += count
        stats = self._stats
        stats["rdma_ops_posted"] += count
        stats[_KIND_KEY[opcode]] += count
        stats["rdma_doorbells"] += 1
        if wave:
            stats["rdma_batches"] += 1
        if result != verbs.POSTED:
            try:
                if not port.after_poll(result):
                    self._io.call_soon(port.poll)  # kept by a dispatch in progress: delivered by a poll
            except Exception as exc:
                self._complete(op, exc)
                self._fail_connection(exc)
        if op.done:
            if not wave:
                stats["rdma_completed_at_post"] += 1
            self._at_post_streak += 1
            if self._at_post_streak >= _AT_POST_BUDGET:
                self._at_post_streak = 0
                await self._io.sleep(0)
        else:
            self._at_post_streak = 0
            try:
                if self._futures:
                    future = op.waiter = asyncio.Future()
                    await future
                else:
                    waiter = op.waiter = self._io.waiter()
                    await waiter.wait()
            except BaseException:
                if op.done:
                    self.release(op)
                else:
                    op.orphan = True  # the NIC may still write into its staging: its completion frees it
                raise
        if op.error is not None:
            self.release(op)
            raise op.error
        if wave or opcode == WR_READ:
            value: Any = bytes(self._staging_view[at : at + length])
        elif opcode == _WR_WRITE:
            value = None
        else:  # the NIC stores an atomic's original value as a u64 in this host's byte order
            value = _U64_AT(self._staging_view, at)[0]
        # release(), inline: a staging slot is all it holds
        self._free_staging.append(slot)
        op.staging = op.buffer = None
        self._serial_task = self._last_poster if self._serial_open and not self.ops else 0
        if self._slot_waiters or self._pending_sends:
            self._wake_slot_waiter()  # they may wait for a staging slot
        return value

    def check_atomics_possible(self, key: RemoteKey, call: str) -> None:
        """Raise :class:`~rdmaio.FeatureNotSupportedError` when this side's device, or the device that
        exported ``key`` (its wire form says so), has no remote atomics: checked before anything else of an
        atomic call, nothing is posted and the connection stays usable."""
        if not self.atomics:
            raise FeatureNotSupportedError(
                f"{call}() needs remote atomics, which {self.device_name} does not offer (atomic_cap NONE, "
                "as on iWARP devices such as siw): use rdma_read/rdma_write and messages instead",
                errno=errno.EOPNOTSUPP,
            )
        if isinstance(key, RemoteKey) and not key.exporter_atomics:
            raise FeatureNotSupportedError(
                f"{call}() on {key!r}: the peer's device that exported it has no remote atomics (atomic_cap "
                "NONE, as on iWARP devices such as siw), so no key of it grants them",
                errno=errno.EOPNOTSUPP,
            )

    def _check_atomic(self, key: RemoteKey, offset: int, call: str) -> None:
        self.check_atomics_possible(key, call)
        self.check_key(key, offset, 8, ACCESS_ATOMIC)
        if (key.addr + offset) % 8:
            raise RemoteAccessError(
                f"atomic at offset {offset} of {key!r} is not 8-byte aligned (remote address "
                f"{key.addr + offset:#x})"
            )

    async def _atomic_result(self, op: Op) -> int:
        if self._must_await(op):
            await self.finish(op)
        assert op.buffer is not None
        # The NIC stores the original value as a u64 in this host's byte order.
        old = int.from_bytes(op.buffer[:8], sys.byteorder)
        self.release(op)
        return old

    # --- slots and memory -----------------------------------------------------------------------------------

    async def start(
        self, key: RemoteKey | None, opcode: int, length: int, *, staging: bool = True, count: int = 1
    ) -> Op:
        """Wait for ``count`` op slots (at most ``max_ops`` work requests in flight: the send queue has
        room for that many), then give the op its local memory (a staging slot or a pooled large buffer,
        unless ``staging`` is False). ``key`` is None for a request that reaches no remote memory (a write
        notice's control message). A staging slot stays taken until its op is released, which may be
        after its completion gave its op slot back (the caller has not resumed yet): an op that needs one
        also waits for a free staging slot."""
        self.raise_if_failed()
        # Needs a staging slot: ops that fit one (batches fit one by construction).
        slot = staging and 0 < length <= STAGING_SLOT
        woken = False
        while (
            self.in_flight + count > self.max_ops or (slot and not self._free_staging) or self._slot_waiters
        ):
            waiter = self._io.waiter()
            if woken:
                self._slot_waiters.appendleft(waiter)  # woken first but no room yet: still first in line
            else:
                self._slot_waiters.append(waiter)
            self._serial_open = False  # somebody waits for a slot: no call may go ahead of it
            self._serial_task = 0
            try:
                await waiter.wait()
            except BaseException:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
                    self._update_serial()
                else:
                    self._wake_slot_waiter()  # we were woken but give up: pass the wake-up on
                raise
            self.raise_if_failed()
            if self.in_flight + count <= self.max_ops and (self._free_staging or not slot):
                break
            woken = True
        if key is None:
            return self._new_op(None, opcode, length, staging, count)
        # Re-checked after the wait: a REVOKE may have arrived meanwhile.
        if key.key_id < self.revoked_ids.top and key.key_id in self.revoked_ids:
            self._wake_slot_waiter()
            raise RemoteKeyRevokedError(f"{key!r} was revoked by the peer")
        return self._new_op(key.key_id, opcode, length, staging, count)

    def _start_now(self, key: RemoteKey, opcode: int, length: int) -> Op | None:
        """The op of a single request at once when a slot is free and nobody waits for one (the common
        case, without the cost of awaiting :meth:`start`); None when the caller must await ``start``."""
        if self.in_flight >= self.max_ops or self._slot_waiters:
            return None
        if 0 < length <= STAGING_SLOT and not self._free_staging:
            return None  # every staging slot is held by a completed op its caller has not released yet
        self.raise_if_failed()
        return self._new_op(key.key_id, opcode, length, True, 1)

    def _new_op(self, key_id: int | None, opcode: int, length: int, staging: bool, count: int) -> Op:
        """A new op in :attr:`ops`, taking ``count`` slots (:meth:`_forget` gives them back)."""
        op = Op(next(self._index) & _INDEX_MASK)
        op.key_id = key_id
        op.length = length
        op.opcode = opcode
        op.count = count
        if staging and length:
            self._give_memory(op, length)
        self.ops[op.index] = op
        self._serial_task = 0  # something is in flight
        self.in_flight += count
        return op

    def _give_memory(self, op: Op, length: int) -> None:
        if length <= STAGING_SLOT:
            if self._staging is None:
                buf = bytearray(STAGING_SLOT * self.max_ops)
                self._staging = self._register_local(buf)
                self._staging_view = memoryview(buf)
                self._staging_addr = self._staging.addr
                self._staging_lkey = self._staging.lkey
                if self._close_state is not None:
                    # From now on the serial path may open: be told when the connection starts closing
                    # (on_closing; a graceful close() included, which leaves the engine open until the
                    # teardown). Not before: a connection that makes no such call costs no watcher.
                    self._close_state.watch(self)
                self._update_serial()  # (the op is not in ops yet: _new_op clears the flag right after)
            slot = self._free_staging.pop()
            op.staging = slot
            op.buffer = self._staging_view[slot * STAGING_SLOT : slot * STAGING_SLOT + length]
        else:
            size = 1 << (length - 1).bit_length()  # size class: the next power of two
            free = self._large_pool.get(size)
            if free:
                large = free.pop()
                self._large_pooled -= size
                self._stats["rdma_large_reused"] += 1
            else:
                buf = bytearray(size)
                large = _Large(self._register_local(buf), memoryview(buf))
                self._stats["rdma_large_registered"] += 1
            op.pooled = large
            op.buffer = large.view[:length]

    def _local_of(self, op: Op) -> tuple[int, int]:
        if op.staging is not None:
            return self._staging.addr + op.staging * STAGING_SLOT, self._staging.lkey
        if op.pooled is not None:
            return op.pooled.region.addr, op.pooled.region.lkey
        if op.mr is not None:
            return op.mr.addr, op.mr.lkey
        return 0, 0

    # --- posting --------------------------------------------------------------------------------------------

    def _post(
        self,
        op: Op,
        remote_addr: int,
        rkey: int,
        *,
        imm: int = 0,
        compare_add: int = 0,
        swap: int = 0,
        local: tuple[int, int] | None = None,
    ) -> None:
        addr, lkey = local if local is not None else self._local_of(op)
        op.wr = (addr, lkey, remote_addr, rkey, imm, compare_add, swap)
        if op.opcode == _WR_WRITE_IMM:
            self._credit_queue.append(op)  # consumes a peer receive: needs a credit
            self.waiting_for_credit += 1
            self.pump()
        elif len(self.ops) == 1 and not self._doorbell:
            # Alone in flight: post at once (nothing to share a doorbell with).
            poster = id(self._task_of(self._running()))
            serial = poster == self._last_poster
            self._last_poster = poster
            if not serial or self._port is None:
                self._post_now(op)
            else:
                # One task calling one request at a time: look once before sleeping, as asyncio's
                # sock_recv tries the call before it waits for the fd. A device may have completed the
                # request before ibv_post_send returned (rxe runs a whole loopback READ inside the call),
                # and then the caller resumes without a sleep in epoll and a wake-up of the completion
                # channel (which still fires later and finds the CQ empty). One non-blocking poll of the
                # shared CQ, no spinning: on a NIC that has not finished yet it costs one look at the CQ.
                # Not when another task posted the previous request: several tasks calling concurrently
                # are served better by waiting, so that their requests share doorbells (one system call
                # for up to 16 on rxe) and one wake-up, than by completing one by one.
                # The post and the look are one C call; when the request's own completion is all there
                # was, it is completed right here rather than through the dispatcher and the
                # connection's completion processing.
                self._post_now(op, polled=True)
        else:
            # Others are in flight: more calls are likely in this same loop iteration (tasks woken by
            # one batch of completions). Post them together at its end: one ibv_post_send (on rxe one
            # system call that runs the requester) for up to _DOORBELL requests.
            self._last_poster = id(self._task_of(self._running()))
            self._doorbell.append(op)
            if len(self._doorbell) >= _DOORBELL:
                self._ring()
            elif self._ring_handle is None:
                self._ring_handle = self._io.call_soon(self._ring)

    def _ring(self) -> None:
        """Post the requests collected for one doorbell, as one chain."""
        if self._ring_handle is not None:
            self._ring_handle.cancel()
            self._ring_handle = None
        ops = [op for op in self._doorbell if not op.done]
        self._doorbell.clear()
        if not ops or self.error is not None or self.closed:
            return
        revoked = self.revoked_ids
        if revoked.top > 1:  # anything revoked at all (no id from top up is)
            # A REVOKE may have arrived since these calls checked their key (its ACK is already queued or
            # posted): a request posted after the ACK would meet a deallocated window, a remote access
            # error that ends the connection. Fail such calls as if they had found the key revoked.
            kept = []
            for op in ops:
                if op.key_id is not None and op.key_id in revoked:
                    self._stats["rdma_revoked_at_post"] += 1
                    self._complete(op, RemoteKeyRevokedError("the key was revoked by the peer"))
                else:
                    kept.append(op)
            ops = kept
            if not ops:
                return
        # _fill() of each, inline (one Python call less per request)
        entries, wr_base, max_inline = self._wr_entries, self._wr_base, self._max_inline
        for i, op in enumerate(ops):
            addr, lkey, remote_addr, rkey, imm, compare_add, swap = op.wr
            opcode = op.opcode
            flags = _SEND_SIGNALED
            if opcode in _INLINE_OPCODES and 0 < op.length <= max_inline:
                flags |= _SEND_INLINE
            _PACK_OP(
                entries, i * _OP_SIZE, wr_base | op.index, addr, op.length, lkey, opcode, flags, imm, rkey,
                remote_addr, compare_add, swap,
            )  # fmt: skip
        try:
            self._qp.post_rdma(len(ops))
        except Exception as exc:
            # Requests before the failing one may have been posted; the connection fails either way
            # (its QP is destroyed), which completes every op.
            self._fail_connection(exc)
            for op in ops:
                self._complete(op, exc)
            return
        stats = self._stats
        for op in ops:
            op.posted = True
            stats[_KIND_KEY[op.opcode]] += 1
        stats["rdma_ops_posted"] += len(ops)
        self._stats["rdma_doorbells"] += 1

    def _post_now(self, op: Op, *, polled: bool = False) -> None:
        """Post ``op`` alone; ``polled``: and look at the CQ in the same C call (a serial call, see
        :meth:`_post`), completing ``op`` here when its own completion is all the look found."""
        if polled:
            port = self._port
            assert port is not None
            addr, lkey, remote_addr, rkey, _imm, compare_add, swap = op.wr
            result = port.post_poll(
                op.index, addr, lkey, op.length, op.opcode, remote_addr, rkey, compare_add, swap
            )
            if result < 0:
                exc = port.post_error(result)
                self._complete(op, exc)
                self._fail_connection(exc)
                return
            op.posted = True
            self._stats["rdma_ops_posted"] += 1
            self._stats[_KIND_KEY[op.opcode]] += 1
            self._stats["rdma_doorbells"] += 1
            if result == _POSTED_DONE:
                self._complete(op, None)
            elif result != verbs.POSTED:
                try:
                    if not port.after_poll(result):
                        self._io.call_soon(port.poll)  # kept by a dispatch in progress: a poll delivers it
                except Exception as exc:
                    self._complete(op, exc)
                    self._fail_connection(exc)
        else:
            self._fill(0, op)
            try:
                self._qp.post_rdma(1)
            except Exception as exc:
                self._complete(op, exc)
                self._fail_connection(exc)
                return
            op.posted = True
            self._stats["rdma_ops_posted"] += 1
            self._stats[_KIND_KEY[op.opcode]] += 1
            self._stats["rdma_doorbells"] += 1
            return
        if op.done:
            self._stats["rdma_completed_at_post"] += 1
            self._at_post_streak += 1
        else:
            self._at_post_streak = 0

    def _fill(self, index: int, op: Op) -> None:
        """Write ``op``'s work request into entry ``index`` of the QP's scratch array (one ``pack_into``)."""
        addr, lkey, remote_addr, rkey, imm, compare_add, swap = op.wr
        opcode = op.opcode
        flags = _SEND_SIGNALED
        if opcode in _INLINE_OPCODES and 0 < op.length <= self._max_inline:
            flags |= _SEND_INLINE
        _PACK_OP(
            self._wr_entries,
            index * _OP_SIZE,
            self._wr_base | op.index,
            addr,
            op.length,
            lkey,
            opcode,
            flags,
            imm,
            rkey,
            remote_addr,
            compare_add,
            swap,
        )

    async def wave(self, key: RemoteKey, opcode: int, nbytes: int, remote: Any, **arrays: Any) -> bytes:
        """One wave of a batch: ``len(remote)`` requests of ``opcode`` on ``key`` at the ``remote`` addresses
        (with the per-request ``arrays`` of ``QueuePair.post_batch``), ``nbytes`` bytes of staging for all
        of them, posted as one chain of which only the last is signalled, and awaited; returns a copy of
        the staging (what the NIC wrote) or raises the wave's error. What :meth:`start`, a post and
        :meth:`finish` do, in one coroutine. Posted by a task calling serially with nothing else in
        flight, the post and one look at the CQ are one C call, and a wave completed at its post (rxe
        runs loopback atomics inside ``ibv_post_send``) returns without an op; otherwise its completion
        resolves the wait directly. A cancelled wait leaves the wave to its completion, which releases
        its memory."""
        count = len(remote)
        if (
            self._serial_task == id(self._task_of(self._running()))
            and count <= self.max_ops
            and nbytes <= STAGING_SLOT
            and key.key_id >= self.revoked_ids.top
        ):
            # The serial path (see read()): the flag stands for start()'s and raise_if_failed's checks.
            at = self._free_staging[-1] * STAGING_SLOT
            index = next(self._index) & _INDEX_MASK
            result = self._post_batch_poll(
                self._wr_base | index, opcode, self._staging_addr + at, self._staging_lkey, key.rkey, remote,
                **arrays,
            )  # fmt: skip
            if result == _POSTED_DONE:
                data = bytes(self._staging_view[at : at + nbytes])
                self._waves_done_at_post += 1
                self._wave_ops_at_post[opcode] += count
                self._at_post_streak += 1
                if self._at_post_streak >= _AT_POST_BUDGET:
                    self._at_post_streak = 0
                    await self._io.sleep(0)
                return data
            written: bytes = await self._serial_rest(
                index, result, opcode, nbytes, key.key_id, count, wave=True
            )
            return written
        op = await self.start(key, opcode, nbytes, count=count)
        self._last_poster = id(self._task_of(self._running()))
        addr, lkey = self._local_of(op)
        try:
            self._qp.post_batch(self._wr_base | op.index, opcode, addr, lkey, key.rkey, remote, **arrays)
        except Exception as exc:
            self._complete(op, exc)
            self._fail_connection(exc)
        else:
            op.posted = True
            stats = self._stats
            stats["rdma_ops_posted"] += count
            stats[_KIND_KEY[opcode]] += count
            stats["rdma_doorbells"] += 1
            stats["rdma_batches"] += 1
        await self.finish(op)
        assert op.buffer is not None
        data = bytes(op.buffer[:nbytes])
        self.release(op)
        return data

    def queue_send(self, payload: bytes, *, reply: bool = False) -> None:
        """Queue a SEND without immediate data of ``payload`` (a one-sided control message, a few bytes):
        posted in call order once an op slot and a send credit are free (it consumes a peer receive).

        ``reply``: the message answers one the peer sent (a REVOKE_ACK, a rendezvous DONE or WITHDRAWN),
        so the peer, not this side's application, decides how many there are: if more than
        :attr:`max_queued_replies` of them still wait once this one was queued and the queue pumped, raises
        :class:`~rdmaio.errors.ReplyQueueFullError` (a :class:`~rdmaio.errors.ProtocolError`), which the
        caller fails the connection with (the receive path does so for every ProtocolError)."""
        self._pending_sends.append((self.control_header + payload, reply))
        self.waiting_for_credit += 1
        if not reply:
            self.pump()
            return
        self.replies_waiting += 1
        self.pump()
        if self.replies_waiting > self.max_queued_replies:
            raise ReplyQueueFullError(
                f"{self.replies_waiting} answers to the peer's one-sided control messages (REVOKE_ACK, "
                "rendezvous DONE/WITHDRAWN) wait for a send credit, more than Options.max_queued_replies "
                f"({self.max_queued_replies}): the peer keeps sending messages that need an answer while it "
                "withholds the credits the answers need"
            )

    def pump(self) -> None:
        """Post what waits for a credit: control messages first, then writes with immediate data and write
        notices (in call order).

        Called after every batch of completions (credits may have arrived) and when something is queued.
        """
        if self.error is not None or self.closed:
            return
        credits = self._credits
        while (
            self._pending_sends
            and self.in_flight < self.max_ops
            and self._free_staging
            and credits.can_take_slot()
        ):
            payload, reply = self._pending_sends.popleft()
            self.waiting_for_credit -= 1
            if reply:
                self.replies_waiting -= 1
            op = self._new_op(None, _WR_SEND, len(payload), True, 1)
            op.orphan = True
            assert op.buffer is not None
            op.buffer[:] = payload
            addr, lkey = self._local_of(op)
            op.wr = (addr, lkey, 0, 0, 0, 0, 0)
            credits.take_slot()
            self._post_now(op)
            self._stats["control_sent"] += 1
        while self._credit_queue and credits.can_take_slot():
            op = self._credit_queue.popleft()
            self.waiting_for_credit -= 1
            if op.done:
                continue
            if op.key_id in self.revoked_ids:
                self._complete(op, RemoteKeyRevokedError("the key was revoked by the peer"))
                continue
            credits.take_slot()
            self._post_now(op)
            if op.opcode == _WR_SEND:
                # A write notice's control message: its writer waits for this post, not the completion.
                self._stats["control_sent"] += 1
                waiter, op.waiter = op.waiter, None
                if waiter is not None and not op.done:
                    if not self._futures:
                        waiter.set()
                    elif not waiter.done():
                        waiter.set_result(None)

    # --- completion -----------------------------------------------------------------------------------------

    def _must_await(self, op: Op) -> bool:
        """False for a call that completed successfully at its post within the budget (see :meth:`_wait`):
        it returns without awaiting :meth:`finish` (whose coroutine would only return at once)."""
        return not op.done or op.error is not None or self._at_post_streak >= _AT_POST_BUDGET

    async def finish(self, op: Op) -> None:
        """Wait for the op's completion and raise its error (its memory released then). A cancelled wait
        leaves the op to complete on its own: its memory is rdmaio's (staging or a private MR) and is
        released only by the completion. After a successful one, the caller reads ``op.buffer`` and
        calls :meth:`release`."""
        try:
            await self._wait(op)
        except BaseException:
            if op.done:
                self.release(op)
            else:
                op.orphan = True
            raise
        if op.error is not None:
            self.release(op)
            raise op.error

    async def _wait(self, op: Op) -> None:
        """Wait for the op's completion. An op that completed at its post returns at once, without a
        waiter (on any loop), so a task calling in a loop would never let the event loop run: after
        ``_AT_POST_BUDGET`` such calls in a row on this engine, one yields to the loop first (a
        cooperative budget, as Tokio gives each task)."""
        if op.done:
            if self._at_post_streak >= _AT_POST_BUDGET:
                self._at_post_streak = 0
                await self._io.sleep(0)
            return
        if self._futures:
            # A bare future: made, resolved (on_completion) and awaited without Python code.
            future = op.waiter = asyncio.Future()
            await future
        else:
            waiter = op.waiter = self._io.waiter()
            await waiter.wait()

    def on_completion(self, wr_id: int, status: int, vendor_err: int = 0) -> None:
        """A completion of one of our work requests (``wr_id >> 56 == 2``), successful or not: an op's,
        or another's of the same kind (a window bind's: :attr:`on_other_completion`)."""
        op = self.ops.pop(wr_id & _INDEX_MASK, None)
        if op is None:
            self.on_other_completion(wr_id & _INDEX_MASK, status, vendor_err)
            return
        self.in_flight -= op.count  # what _forget does (ops hold no done op: _complete takes it out)
        if not self.ops:  # nothing in flight any more (see _update_serial)
            self._serial_task = self._last_poster if self._serial_open and self._free_staging else 0
        if status == 0:
            # _complete, inline: the one Python call of a completion that wakes its caller.
            op.done = True
            if op.orphan:  # a cancelled call or a control message: nobody will release its memory
                self.release(op)
            waiter = op.waiter
            if waiter is not None:
                if not self._futures:
                    waiter.set()
                elif not waiter.done():  # done: cancelled with its caller
                    waiter.set_result(None)
            if self._slot_waiters or self._pending_sends:
                self._wake_slot_waiter()
            return
        if status == _WC_REM_ACCESS_ERR:
            error: BaseException = RemoteAccessRefusedError(
                "the peer's NIC refused the request (remote access error: a stale or forged key, or a "
                "peer that is dying); the connection is lost",
                errno=errno.ECONNRESET,
                call="ibv_poll_cq",
            )
        elif status == _WC_FLUSH:
            error = self.error or EndpointClosedError("the request was flushed: the connection is closing")
        else:
            error = EndpointClosedError(
                f"one-sided request failed: {verbs.wc_status_str(status)} (vendor {vendor_err})",
                call="ibv_poll_cq",
            )
        self._complete(op, error)

    def _complete(self, op: Op, error: BaseException | None) -> None:
        if op.done:
            return
        op.done = True
        op.error = error
        self._forget(op)
        if op.orphan:  # a cancelled call or a control message: nobody will release its memory
            self.release(op)
        waiter = op.waiter
        if waiter is not None:
            if not self._futures:
                waiter.set()
            elif not waiter.done():  # done: cancelled with its caller
                waiter.set_result(None)
        self._wake_slot_waiter()

    def _wake_slot_waiter(self) -> None:
        # The first waiter, once it can go on: an op slot and a staging slot are free (a staging slot comes
        # back when a completed op's caller releases it, which wakes the next waiter then).
        if self._slot_waiters and self.in_flight < self.max_ops and self._free_staging:
            self._slot_waiters.popleft().set()
            self._update_serial()
        if self._pending_sends:
            self.pump()

    def release(self, op: Op) -> None:
        """Give back the op's local memory (only once the NIC is done with it)."""
        if op.staging is not None:
            self._free_staging.append(op.staging)
            op.staging = None
            self._serial_task = self._last_poster if self._serial_open and not self.ops else 0
            if self._slot_waiters or self._pending_sends:
                self._wake_slot_waiter()  # a caller or a control message may wait for a staging slot
        if op.pooled is not None:
            large, op.pooled = op.pooled, None
            if not self.closed and self._large_pooled + large.size <= _LARGE_POOL_BYTES:
                self._large_pool.setdefault(large.size, []).append(large)
                self._large_pooled += large.size
            else:
                large.region.close()
        if op.mr is not None:
            mr, op.mr = op.mr, None
            if hasattr(mr, "release"):
                mr.release()
            else:
                mr.close()
        op.buffer = None

    def _forget(self, op: Op) -> None:
        """Take ``op`` out of :attr:`ops` and give back its slots (once: a second call does nothing)."""
        if self.ops.pop(op.index, None) is not None:
            self.in_flight -= op.count
            if not self.ops:  # nothing in flight any more (see _update_serial)
                self._serial_task = self._last_poster if self._serial_open and self._free_staging else 0

    def _abandon(self, op: Op) -> None:
        self._forget(op)
        self.release(op)
        self._wake_slot_waiter()

    # --- the end --------------------------------------------------------------------------------------------

    def close(self, error: BaseException | None) -> None:
        """The connection is gone (its QP destroyed, so the NIC touches none of our memory any more): fail
        every pending op with ``error`` and deregister the staging memory and the pooled large buffers."""
        if self.closed:
            return
        self.closed = True
        self.error = error or EndpointClosedError("endpoint is closed")
        # Waiting calls release their op's memory when they resume, cancelled ones (orphans) right here.
        for op in list(self.ops.values()):
            self._complete(op, _fresh(self.error))
        self._credit_queue.clear()
        self._pending_sends.clear()
        self.waiting_for_credit = 0
        self.replies_waiting = 0
        self._doorbell.clear()
        if self._ring_handle is not None:
            self._ring_handle.cancel()
            self._ring_handle = None
        while self._slot_waiters:
            self._slot_waiters.popleft().set()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for pooled in self._large_pool.values():
            for large in pooled:
                large.region.close()
        self._large_pool.clear()
        self._large_pooled = 0
        self._serial_open = False  # closed: no serial path any more
        self._serial_task = 0

    @property
    def _done_at_post(self) -> int:
        """Serial calls completed at their post, of every kind (the sum of the per-kind counters)."""
        serial_reads_writes = self._reads_at_post + self._writes_at_post
        return serial_reads_writes + self._fetch_adds_at_post + self._compare_swaps_at_post

    def statistics(self) -> dict[str, int]:
        """Requests posted, doorbells (post calls), batch waves, serial calls completed at their post, and
        ops pending; requests posted by kind: ``rdma_reads``, ``rdma_writes`` (with immediate data too),
        ``rdma_fetch_adds``, ``rdma_compare_swaps`` (always present, 0 until counted); answers to the peer's
        control messages waiting for a send credit (``control_replies_queued``, at most
        :attr:`max_queued_replies`)."""
        stats = self._stats
        get = stats.get
        reads, writes = self._reads_at_post, self._writes_at_post
        fetch_adds, compare_swaps = self._fetch_adds_at_post, self._compare_swaps_at_post
        done_at_post = reads + writes + fetch_adds + compare_swaps
        wave = self._wave_ops_at_post
        return {
            "rdma_ops_posted": stats["rdma_ops_posted"] + done_at_post + sum(wave.values()),
            "rdma_doorbells": stats["rdma_doorbells"] + done_at_post + self._waves_done_at_post,
            "rdma_batches": stats["rdma_batches"] + self._waves_done_at_post,
            "rdma_completed_at_post": stats["rdma_completed_at_post"] + done_at_post,
            "rdma_ops_pending": len(self.ops),
            "control_replies_queued": self.replies_waiting,
            "rdma_reads": get("rdma_reads", 0) + reads + wave[WR_READ],
            "rdma_writes": get("rdma_writes", 0) + writes + wave[_WR_WRITE] + wave[_WR_WRITE_IMM],
            "rdma_fetch_adds": get("rdma_fetch_adds", 0) + fetch_adds + wave[WR_FADD],
            "rdma_compare_swaps": get("rdma_compare_swaps", 0) + compare_swaps + wave[_WR_CSWAP],
        }


def crosses_page(remote_addr: int, length: int) -> bool:
    """A READ of ``length`` bytes at ``remote_addr`` that siw would return wrong (see
    :data:`INLINE_READ_MAX`): at most 32 bytes, crossing a :data:`READ_PAGE` boundary."""
    return 0 < length <= INLINE_READ_MAX and length > to_page_end(remote_addr)


def to_page_end(remote_addr: int) -> int:
    """The bytes from ``remote_addr`` to the end of its :data:`READ_PAGE`: the first part of a split READ."""
    return READ_PAGE - (remote_addr & (READ_PAGE - 1))


def _no_port(*args: Any, **kwargs: Any) -> int:
    """The serial post of an engine without a port: never called (without a port no call is serial)."""
    raise AssertionError("this engine has no serial port")


def _itself(task: object) -> object:
    """The task, as its own key (backends other than asyncio: see ``OperationEngine._task_of``)."""
    return task


def _not_ours(index: int, status: int, vendor_err: int) -> bool:
    """The default :attr:`OperationEngine.on_other_completion`: nothing else shares our indexes."""
    return False
