"""Sender: the send side of one connection - the send calls, the send queue's owner, all posting of frames.

One owner: every frame of a connection reaches the NIC through :class:`Sender`. The send calls
(``send``/``write``/``drain``/``write_eof``, the public docstrings are :class:`rdmaio.Endpoint`'s) put data
into the sans-IO send queue (:class:`rdmaio.protocol.sendqueue.SendQueue`: fragmentation, coalescing,
DATA_BATCH encoding); the rendezvous engine hands its descriptors to :meth:`Sender.queue_rndv`; the EOF and
the CREDIT/RETURN/RECLAIM frames are taken from the session when due. Nobody else touches the queue.

Posting. :meth:`Sender.transmit` runs after every input - a send call that can go at once, a completion batch
(:meth:`Sender.on_batch_end`), the end-of-iteration flush of coalesced writes - as aioquic's asyncio
protocol calls ``transmit()`` after every input: it stages what credits and send slots allow and posts
everything staged with one chained ``ibv_post_send``. A write that must free the caller's buffer at once
stages at once (:meth:`Sender.stage`) and leaves the post to one ``transmit()`` at the end of the loop
iteration: one doorbell for every frame of the iteration (on rxe a system call per post).

The send ring is C (``rdmaio/_ffi/txring.c``, one ``struct rdmaio_txring`` per sender): the free-slot
stack, the entries in flight, the signalling counters and the inline scratch area live there. Staging a
frame is the session's take (its immediate value, in Python) and then one C call,
``rdmaio_txring_stage``: it copies the frame into a free send slot or the inline scratch area of its
send-array entry, fills the work request (wr_id, address, length, key, immediate value, opcode, the
selective signal) and puts it in flight. The EOF and CREDIT/RETURN/RECLAIM frames are one
``rdmaio_txring_stage_empty`` each; before the post ``rdmaio_txring_finish`` signals the chain's last
request when the chain leaves the sender short of slots or send-queue entries; a signalled completion is
``rdmaio_txring_complete`` (release everything up to it). The sender checks room (a send-queue entry, a
slot for a long frame, growing the ring) before the take, so the C call never refuses a frame it took. The
post itself stays ``self._qp.post_sends(count)``: the queue pair's send array is the C ring's output.

**The seam for C.** :meth:`Sender.transmit` is the whole per-post work with plain inputs: the queue's
``txq`` (``(bytes, kind)`` entries), the session's credit counters, the C send ring and the send array of
the queue pair. A fast path can replace it, and :meth:`on_send_completion` (release the slots up to a
signalled wr_id), without changing any caller.

Work requests: ``wr_id`` is ``make_wr_id(WR_KIND_SEND, tag, slot)`` (layout in :mod:`rdmaio.verbs`; the
tag routes the completion to this connection through the domain's shared CQ). A send slot is reused only
after its completion; with selective signalling one signalled completion releases every slot posted
before it (an RC queue completes in order). The slots live in a :class:`~rdmaio.core.rings.SlotRing` that
starts empty: the first frame registers ``initial`` slots and the ring doubles whenever every slot is in
flight and more is queued. Frames of at most ``max_inline`` bytes (control frames, RNDV descriptors, small
messages and replies) take no slot: they are sent inline, their bytes copied into the work request when it
is posted. They still take a send-queue entry (``ring.max_slots`` of them belong to the sender); their wr_id
index is ``_SLOTLESS | sequence``. An idle connection's ring has 4 slots, so signalling had to come every 2
sends to keep slots coming back; a request/reply connection whose frames are all small never registers a
slot and is signalled once per ``signal_interval`` sends.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, Protocol

from rdmaio import verbs
from rdmaio.core.backend import Backend, Handle, Waiter
from rdmaio.errors import EndpointClosedError, ForkError
from rdmaio.options import Options
from rdmaio.protocol import Session
from rdmaio.protocol.frames import BATCH_RECORD_HEADER
from rdmaio.protocol.reclaim import ReclaimSession
from rdmaio.protocol.sendqueue import RECORD_HEADERS, RNDV_FRAME, SendQueue
from rdmaio.verbs import _base as _fork_state  # its _generation is read on every send: no call
from rdmaio.verbs.native import ffi, lib

__all__ = ["RendezvousSends", "SendArray", "SendRing", "Sender", "check_fork"]

log = logging.getLogger("rdmaio")

_SLOTLESS = int(lib.RDMAIO_TX_SLOTLESS)  # wr index bit of a frame that holds no send slot (inline or empty)
_TX_EOF = int(lib.RDMAIO_TX_EOF)
# The send ring's C functions (txring.c), bound once: the per-frame path makes no attribute lookups.
_txring_room = lib.rdmaio_txring_room
_txring_stage = lib.rdmaio_txring_stage
_txring_stage_empty = lib.rdmaio_txring_stage_empty
_txring_stage_frame = lib.rdmaio_txring_stage_frame
_txring_send_now = lib.rdmaio_txring_send_now
_TX_SESSION = int(lib.RDMAIO_TX_SESSION)  # stage_frame: the session did not take the frame
_can_send_data = lib.rdmaio_session_can_send_data
_eof_pending = lib.rdmaio_session_eof_pending
_credit_frame_due = lib.rdmaio_session_credit_frame_due
_take_credit = lib.rdmaio_session_take_credit
_control_frame_due = lib.rdmaio_session_control_frame_due
_CDATA = ffi.CData
_txring_finish = lib.rdmaio_txring_finish
_txring_complete = lib.rdmaio_txring_complete
_from_buffer = ffi.from_buffer
_SMALL_RECORD = len(RECORD_HEADERS)  # a batched message below this size takes its header from the table

_TX_REFUSALS = {
    int(lib.RDMAIO_TX_NO_SQ): "no send-queue entry free",
    int(lib.RDMAIO_TX_NO_SLOT): "no send slot free",
    int(lib.RDMAIO_TX_BAD_INDEX): "an index out of its bound",
    int(lib.RDMAIO_TX_TOO_LONG): "a frame longer than a send slot",
    int(lib.RDMAIO_TX_NO_SCRATCH): "no inline scratch area",
    int(lib.RDMAIO_TX_BAD_ARG): "an argument out of range",
    int(lib.RDMAIO_TX_SESSION): "the session did not take the frame",
}


def _check_tx(rc: int) -> int:
    """``rc`` of a send-ring call if it is not a refusal; a refusal is a broken invariant of the sender (no
    peer value reaches the ring): RuntimeError, which fails the connection."""
    if rc < 0:
        raise RuntimeError(f"rdmaio: the send ring refused: {_TX_REFUSALS.get(rc, rc)}")
    return rc


def check_fork(generation: int) -> None:
    """Raise :class:`~rdmaio.errors.ForkError` if the process forked since ``generation`` was read
    (:func:`rdmaio.verbs.fork_generation`): the connection's verbs objects are unusable in the child."""
    if generation != _fork_state._generation:
        raise ForkError(
            "this Endpoint was created before fork(); RDMA connections cannot be used in "
            "the child process: connect again there"
        )


class SendRing(Protocol):
    """What the sender needs of its slot ring (:class:`~rdmaio.core.rings.SlotRing`)."""

    slots: int
    max_slots: int

    @property
    def view(self) -> memoryview:
        """The ring's bytes (once it has slots)."""

    @property
    def addr(self) -> int:
        """Address of slot 0 (once it has slots)."""

    @property
    def lkeys(self) -> Any:
        """Local key of each registered slot (once it has slots)."""

    def grow(self, n: int) -> range:
        """Register up to ``n`` more slots; return their indices."""


class SendArray(Protocol):
    """What the sender needs of a queue pair."""

    @property
    def send_array(self) -> Any:
        """A cffi ``struct rdmaio_send[]`` (``wr_id``, ``addr``, ``length``, ``lkey``, ...): the C send ring
        fills its entries, so it must be that C array, not a stand-in."""

    def post_sends(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`send_array` as one chain."""

    def post_empty_write(self, wr_id: int) -> None:
        """Post one signalled zero-length RDMA WRITE (a keepalive probe)."""

    def post_empty_read(self, wr_id: int) -> None:
        """Post one signalled zero-length RDMA READ (a keepalive probe on iWARP)."""


class RendezvousSends(Protocol):
    """What the sender needs of the rendezvous engine (:class:`rdmaio.core.rendezvous.RendezvousEngine`)."""

    threshold: int

    async def send(self, view: memoryview) -> bool:
        """Send one message by rendezvous; False: no room to pin it (send it eagerly)."""


def _ignore(exc: BaseException) -> None:
    pass


class Sender:
    """The send side of one connection (see the module docstring).

    ``ring`` holds the send slots of ``slot_size`` bytes; ``initial`` of them are registered by the first
    frame; every ``signal_interval``-th work request is signalled; messages up to ``batch_limit`` bytes are
    batched. ``stats`` is the connection's counter of rare events (``credit_frames``, ``send_ring_grown``);
    the per-message counters are plain int attributes (``messages_sent``, ``bytes_sent``, ``frames_posted``,
    ``post_calls``), which the connection folds into its statistics. ``tag`` is the connection tag the domain
    assigned (bits 32..55 of every wr_id). ``io`` is the loop backend (end-of-iteration callbacks, waiters);
    ``fail(exc)`` fails the connection when a deferred post or flush raises; ``options`` gives the write
    buffer's water marks (replaced by ``Endpoint.set_write_buffer_limits()``). ``rndv`` is the rendezvous
    engine, set by the connection once it exists (None: rendezvous off).
    """

    def __init__(
        self,
        session: Session,
        qp: SendArray,
        ring: SendRing,
        slot_size: int,
        *,
        io: Backend,
        options: Options,
        initial: int = 4,
        max_inline: int,
        signal_interval: int,
        batch_limit: int,
        stats: collections.Counter[str],
        tag: int = 0,
        fail: Callable[[BaseException], None] = _ignore,
        generation: int = 0,
    ) -> None:
        self.session = session
        self.io = io
        self.options = options
        self._fail = fail
        self._generation = generation
        self._close = session.close_state  # its ``clear``: no close fact yet, a send raises nothing
        self.rndv: RendezvousSends | None = None
        # Shared receive queues: a session that answers RECLAIM, or sends it, stages those frames.
        self._reclaim = session if isinstance(session, ReclaimSession) and session.reclaim else None
        # The session's state as a C struct whose rules C may apply (fast), else None: then every rule goes
        # through the session's Python methods (a SharedSession, or a Python SessionState).
        state = session.rules_state
        self._native: Any = state if isinstance(state, _CDATA) and state.fast else None
        # The C state when every rule of this sender's frames is C's (no RETURN/RECLAIM frames to stage),
        # else None: an idle send goes in one C call on it, and the connection asks it whether a control
        # frame is due after a completion batch instead of calling on_batch_end(). None: the general path.
        self.plain_state: Any = self._native if self._reclaim is None else None
        self._qp = qp
        self._sends = qp.send_array
        self._slot_ring = ring
        self._initial = initial
        self._slot_size = slot_size
        self._max_inline = max_inline
        # Send-queue entries the sender may have in flight (slots or not).
        self._sq_depth = ring.max_slots
        self._stats = stats
        # Per-message counters as plain attributes: a Counter's ``+=`` costs a __getitem__/__missing__
        # lookup path several times an attribute's, and these run for every message and post.
        self.messages_sent = 0
        self.bytes_sent = 0
        self.frames_posted = 0
        self.post_calls = 0
        # The send ring's bookkeeping and the per-frame fill live in C (txring.c): free slots, the entries
        # in flight, the signalling counters, the inline scratch area. These cffi arrays are its memory.
        self._free_stack: Any = ffi.new("uint32_t[]", ring.max_slots)
        self._inflight_ring: Any = ffi.new("uint32_t[]", ring.max_slots)
        self._tx: Any = ffi.new("struct rdmaio_txring *")
        # The same ring for the connection: it releases a signalled send's entries with one C call
        # (on_send_completion()'s, inline).
        self.tx = self._tx
        _check_tx(
            lib.rdmaio_txring_init(
                self._tx,
                self._sends,
                len(self._sends),
                self._free_stack,
                ring.max_slots,
                self._inflight_ring,
                self._sq_depth,
                slot_size,
                max_inline,
                signal_interval,
                verbs.make_wr_id(verbs.WR_KIND_SEND, tag, 0),  # | slot
            )
        )
        # The ring's memory (view, keys) exists once it has slots: a pooled ring gets it at its first grow
        # (rdmaio.core.rings). Held here so that the memory the C struct points into outlives it.
        self._ring = memoryview(b"")
        self._lkeys: Any = None
        if ring.slots:
            self._add_slots(range(ring.slots))
        # Inline frames' bytes between staging and the post, one max_inline area per send-array entry; the
        # post copies them into the work requests. Allocated by the first inline frame.
        self._scratch_cdata: Any = None
        # The header framing (rdmaio.protocol.framing): the C ring writes each frame's 4-byte header in
        # front of its bytes and posts plain SENDs, so a frame's bytes fit a slot or the inline limit only
        # without the header; even an empty control frame is 4 bytes (inline: the scratch area at once,
        # or a slot if the device takes fewer inline bytes).
        header = session.framing.header
        self._inline_payload = max_inline - header  # a frame's bytes up to this travel inline
        self._control_needs_slot = header > max_inline
        if header:
            _check_tx(lib.rdmaio_txring_set_header(self._tx, header))
            if max_inline >= header:
                self._alloc_scratch()
        # The peer's maximum message size (its handshake, fixed): a send within it needs no size check call.
        self._peer_max = session.peer.max_message_size
        # The largest message send()'s fast path batches (-1: none until the general path has run once).
        self._batch_max = -1
        max_fragment = min(session.max_fragment, slot_size - header)
        # Stream data has no message boundaries, but every frame of it is a message to the peer: cap it
        # at the peer's maximum message size too (a peer may announce one below its slot size).
        # send() batches messages up to batch_limit (-1: the peer cannot unpack batches).
        self.queue = SendQueue(
            max_fragment,
            min(max_fragment, session.peer.max_message_size),
            min(batch_limit, max_fragment - BATCH_RECORD_HEADER) if session.batching else -1,
        )
        # A small message was just posted at once (the rule for an idle connection): batch the next ones
        # until the connection's next completion batch or end-of-iteration flush clears this.
        self.coalesce_next = False
        self.staged = 0  # entries of the send array filled but not yet posted
        self.eof_done = False  # the EOF frame completed
        self.flush_handle: Handle | None = None  # the end-of-iteration flush of coalesced writes
        self._post_handle: Handle | None = None  # the end-of-iteration transmit of staged frames
        self.waiters: dict[Waiter, None] = {}  # writers waiting: an ordered set, a cancelled wait leaves
        self.closing = False  # no more sends (a close, an abort or the teardown)
        self.stopped = False  # torn down: nothing is staged or posted any more

    # --- state -------------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes accepted and not yet copied into a send slot (what ``drain()`` waits on)."""
        return self.queue.buffered

    @property
    def posted_frames(self) -> int:
        """Frames ever staged (copied into a slot or a work request)."""
        return self.queue.posted_frames

    @property
    def done(self) -> bool:
        """Nothing queued and the EOF frame completed (what a graceful close waits for, with rendezvous)."""
        return not self.queue.txq and self.eof_done

    def room_for(self, length: int) -> bool:
        """Whether a frame of ``length`` bytes could be staged now as far as the send queue and slots go
        (credits aside): an idle connection's first small message is posted at once when it can."""
        return bool(_txring_room(self._tx, length))

    @property
    def free_slots(self) -> list[int]:
        """The free send slots (a copy; the last one is taken first)."""
        return list(ffi.unpack(self._free_stack, self._tx.nfree))

    @property
    def _inflight(self) -> list[int]:
        """The send-queue entries in flight, oldest first (a copy): a slot, or ``_SLOTLESS | sequence``."""
        out = ffi.new("uint32_t *")
        entries = []
        for k in range(self._tx.inflight_count):
            _check_tx(lib.rdmaio_txring_inflight_at(self._tx, k, out))
            entries.append(int(out[0]))
        return entries

    def raise_send_error(self) -> None:
        """Raise what a send call raises now (forked, failed, EOF written, closing)."""
        if self._generation != _fork_state._generation:
            check_fork(self._generation)
        error = self.session.send_error()
        if error is not None:
            raise error
        if self.closing:
            raise EndpointClosedError("endpoint is closing")

    def raise_flush_error(self) -> None:
        """What waiting for data already accepted raises: not a requested EOF, which comes after it."""
        if self._generation != _fork_state._generation:
            check_fork(self._generation)
        error = self.session.flush_error()
        if error is not None:
            raise error
        if self.closing:
            raise EndpointClosedError("endpoint is closing")

    # --- the send calls (Endpoint's) ---------------------------------------------------------------

    async def send(self, data: Any) -> None:
        """:meth:`rdmaio.Endpoint.send` (an endpoint's ``send`` is this bound method): check, and queue a
        small message at once - most end here, with no call to another coroutine; the rest is
        :meth:`send_rest`'s."""
        # The flush test first: an idle connection's send (a request, a reply) pays only that one.
        if (
            self.flush_handle is not None
            and type(data) is bytes
            and (size := len(data)) <= self._batch_max
            and len(mbuf := (queue := self.queue).mbuf) + size <= queue.batch_room
            and self._generation == _fork_state._generation
            and self._close.clear
            and not self.closing
            and not queue.wbuf
        ):
            # The common case of a message sent while others are: a ``bytes`` message that fits the batch
            # being built, on a connection whose end-of-iteration flush is already scheduled, with nothing
            # to raise. The steps of the general path below for it (keep the two the same): its record
            # appended (queue.queue_small(), inline), then the high-water test.
            mbuf += RECORD_HEADERS[size]
            mbuf += data
            queue.mbuf_count += 1
            if queue.txq_bytes + len(mbuf) > self.options.write_high_water:
                await self.drain()
            return
        if self._generation != _fork_state._generation:
            check_fork(self._generation)
        if not self._close.clear or self.closing:  # the close state's fact, no call while none holds
            self.raise_send_error()
        if type(data) is bytes:
            # The common case (a received message echoed, a literal): its length is its size, and C reads
            # it in place (cffi passes a bytes object's buffer to a `const void *`): no memoryview, no
            # from_buffer object. The view the other paths take is made only when one of them runs.
            size = len(data)
            view = None
        else:
            view = memoryview(data)
            if view.ndim != 1 or view.itemsize != 1:
                view = view.cast("B")
            size = view.nbytes
        if size > self._peer_max:
            self.session.check_message_size(size)  # raises MessageTooLargeError
        rndv = self.rndv
        queue = self.queue
        if size > queue.batch_limit or (rndv is not None and size >= rndv.threshold):
            await self.send_rest(memoryview(data) if view is None else view)
            return
        if self.coalesce_next or self.flush_handle is not None or queue.wbuf or queue.mbuf_count or queue.txq:
            # Not idle: batched with the iteration's other small messages (_queue_batched()'s second half,
            # inline: keep the two the same), flushed at the end of the iteration.
            mbuf = queue.mbuf
            if size < _SMALL_RECORD and len(mbuf) + size <= queue.batch_room and not queue.wbuf:
                # queue.queue_small(), inline for a message that fits the batch being built (keep the two
                # the same): its record header from the table, then its bytes.
                mbuf += RECORD_HEADERS[size]
                mbuf += data if view is None else view
                queue.mbuf_count += 1
                buffered = queue.txq_bytes + len(mbuf)
            else:
                buffered = queue.queue_small(data if view is None else view, size)
            if self.flush_handle is None:
                self.flush_handle = self.io.call_soon(self._flush)
                # The largest message the fast path above batches until this flush: within the peer's
                # maximum, the batch limit and the header table, below the rendezvous threshold (set per
                # batch, not in __init__: the connection sets rndv after it).
                self._batch_max = min(
                    self._peer_max,
                    queue.batch_limit,
                    _SMALL_RECORD - 1,
                    rndv.threshold - 1 if rndv is not None else _SMALL_RECORD,
                )
            if buffered > self.options.write_high_water:
                await self.drain()
            return
        native = self.plain_state
        if (
            native is not None
            and not self.staged
            and (size > self._max_inline or self._scratch_cdata is not None)
        ):
            # An idle connection's message goes at once (see _queue_batched): room, credit, the take, the
            # copy and the work request in one C call, then the post. 0: no room or credit now, batched.
            rc = _txring_send_now(self._tx, native, data if view is None else _from_buffer(view), size)
            if rc > 0:
                self.messages_sent += 1
                self.bytes_sent += size
                queue.posted_frames += 1
                self.coalesce_next = True
                if rc == 1:
                    self._qp.post_sends(1)
                    self.frames_posted += 1
                    self.post_calls += 1
                else:  # a control frame is due after it: staged by the general path, one chain
                    self.staged = 1
                    self._stage_queued()
                    self._post()
                return
            if rc < 0:
                self._refused(rc, True, size)
        if self._queue_batched(memoryview(data) if view is None else view, size):
            await self.drain()  # above the high-water mark

    def _refused(self, rc: int, last: bool, length: int) -> None:
        """A C staging call refused a data frame (``rc``): raise the precise error. The session's refusal is
        the Python take's error (C takes every frame the Python rules accept); any other is a broken
        invariant of the sender."""
        if rc != _TX_SESSION:
            _check_tx(rc)  # raises
        self.session.take_data_frame(last, length)
        raise RuntimeError("rdmaio: the C session refused a frame its Python rules accepted")

    async def send_rest(self, view: memoryview) -> None:
        """What :meth:`send` does not do at once, for a message above the batch limit or at the rendezvous
        threshold: a rendezvous, or a large message (or a batched one when rendezvous had no room)."""
        size = view.nbytes
        rndv = self.rndv
        if rndv is not None and size >= rndv.threshold and await rndv.send(view):
            return  # zero-copy: the peer pulled it; False: no room to pin it, sent eagerly
        queue = self.queue
        if size <= queue.batch_limit:
            if self._queue_batched(view, size):
                await self.drain()
            return
        queue.flush_buffers()  # keep the order of earlier stream writes and batched messages
        added = queue.queue_message(view)
        target = queue.queued_frames
        self.stage()
        if queue.txq:
            queue.own_queued(added)
        while queue.posted_frames < target:
            self.raise_send_error()
            await self.wait_writable()

    def _queue_batched(self, view: memoryview, size: int) -> bool:
        """Append one small message to the batch of this loop iteration; True if the caller must then
        drain (above high water).

        The first message on an idle connection is posted at once instead (as a request or a reply usually
        is): waiting for the end of the iteration would cost a round trip one more loop iteration on each
        side, and there is nothing yet to batch it with. The ones after it are batched until the
        connection's next completion batch or flush (:attr:`coalesce_next`).
        """
        queue = self.queue
        if queue.wbuf:
            queue.flush_wbuf()
        if (
            not self.coalesce_next
            and self.flush_handle is None
            and not queue.mbuf_count
            and not queue.txq
            and _txring_room(self._tx, size)  # room_for(size), inline: the hot path
            and self.session.can_send_data()
        ):
            queue.queue_message(view)
            self.transmit()
            if queue.txq:
                queue.own_queued(1)
            # Later sends are batched (and flushed at the end of their iteration) until this connection's
            # next completion batch or flush. No end-of-iteration callback is scheduled for this one: a
            # request/reply connection posts every message here and would pay one per message that finds
            # nothing to flush.
            self.coalesce_next = True
            return False
        buffered = queue.queue_small(view, size)
        self.schedule_flush()
        return buffered > self.options.write_high_water

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """:meth:`rdmaio.Endpoint.write` (an endpoint's ``write`` is this bound method)."""
        if self._generation != _fork_state._generation or not self._close.clear or self.closing:
            self.raise_send_error()  # also refuses a write after write_eof() (the session's send_error)
        if not data:
            return
        queue = self.queue
        added, coalescing = queue.queue_stream(data)
        if added or not coalescing:
            self.stage()
            queue.own_queued(added)
        if coalescing and self.flush_handle is None:  # schedule_flush(), inline
            self.flush_handle = self.io.call_soon(self._flush)

    def must_drain(self) -> bool:
        """:meth:`rdmaio.Endpoint.drain`'s synchronous part: raise the connection's error, or say whether
        there is anything to wait for (above the high-water mark). Most drains end here, so the front calls
        it before it creates the coroutine of :meth:`drain`."""
        if self._generation != _fork_state._generation or not self._close.clear or self.closing:
            self.raise_flush_error()
        queue = self.queue
        return queue.txq_bytes + len(queue.wbuf) + len(queue.mbuf) > self.options.write_high_water

    async def drain(self) -> None:
        """:meth:`rdmaio.Endpoint.drain` (an endpoint's ``drain`` is this bound method): most drains end at
        its first test, :meth:`must_drain`'s, inline (keep the two the same)."""
        if self._generation != _fork_state._generation or not self._close.clear or self.closing:
            self.raise_flush_error()
        queue = self.queue
        if queue.txq_bytes + len(queue.wbuf) + len(queue.mbuf) <= self.options.write_high_water:
            return
        queue.flush_buffers()
        self.stage()
        while queue.txq_bytes > self.options.write_low_water:
            self.raise_flush_error()
            await self.wait_writable()

    def write_eof(self) -> None:
        """:meth:`rdmaio.Endpoint.write_eof`."""
        if self.stopped:
            return
        self.queue.flush_buffers()
        self.session.write_eof()
        self.stage()

    # --- what the rest of the connection hands over ------------------------------------------------

    def queue_rndv(self, descriptor: bytearray) -> int:
        """Queue an RNDV frame (the rendezvous engine's) after everything accepted so far and stage it;
        return its frame number (staged once :attr:`posted_frames` reaches it)."""
        target = self.queue.queue_rndv(descriptor)
        self.stage()
        return target

    def post_probe(self, wr_id: int, read: bool = False) -> None:
        """Post the keepalive's probe (:mod:`rdmaio.core.keepalive`): a zero-length RDMA WRITE, or with
        ``read`` a zero-length RDMA READ (iWARP: a WRITE completes without the peer); no frame, no
        credit and no slot; its send-queue entry is reserved apart from the frames'."""
        if read:
            self._qp.post_empty_read(wr_id)
        else:
            self._qp.post_empty_write(wr_id)

    def close(self) -> None:
        """A graceful close: no more sends; queue what is coalescing and stage it with the EOF (the
        session's close made the EOF due)."""
        self.closing = True
        self.queue.flush_buffers()
        self.stage()

    def abort(self) -> None:
        """Close at once: drop everything not yet staged."""
        self.closing = True
        self.queue.clear()

    def stop(self) -> None:
        """The connection is torn down: stage and post nothing more, wake every writer."""
        self.closing = self.stopped = True
        for handle in (self.flush_handle, self._post_handle):
            if handle is not None:
                handle.cancel()
        self.flush_handle = self._post_handle = None
        self.wake_writers()

    # --- posting -----------------------------------------------------------------------------------

    def transmit(self) -> None:
        """Stage what credits and send slots allow and post it now, in one doorbell with anything staged
        earlier in this iteration (the seam for C: see the module docstring)."""
        if self.stopped:
            return
        if (
            not self.queue.txq
            and not self.staged
            and self._reclaim is None
            and not self.session.control_frame_due()
        ):
            # The common case after a completion batch or a flush: nothing queued, nothing staged, and no
            # EOF or CREDIT frame due (one question to the session).
            return
        self._stage_queued()
        handle = self._post_handle
        if handle is not None:
            self._post_handle = None
            handle.cancel()  # it would find nothing left to post
        self._post()

    def stage(self) -> None:
        """Stage queued frames (and due EOF/credit frames) now, so callers' buffers are free at once, and
        post them with one :meth:`transmit` at the end of the loop iteration: one doorbell for every frame
        of the iteration, which on rxe saves a system call per frame."""
        if self.stopped:
            return
        if self._stage_queued() and self._post_handle is None:
            self._post_handle = self.io.call_soon(self._transmit_soon)

    def _transmit_soon(self) -> None:
        """The end-of-iteration post of what :meth:`stage` staged (a loop callback): a failure fails the
        connection, nothing escapes."""
        self._post_handle = None
        try:
            if not self.stopped:
                self._post()
        except Exception as exc:
            log.exception("rdmaio: posting sends failed")
            self._fail(exc)

    def schedule_flush(self) -> None:
        """Queue, stage and post what was coalesced at the end of this loop iteration (once)."""
        if self.flush_handle is None:
            self.flush_handle = self.io.call_soon(self._flush)

    def _flush(self) -> None:
        """End of a loop iteration's writes (a loop callback): queue what was coalesced and transmit it. A
        failure fails the connection: nothing escapes into the loop's error log."""
        self.flush_handle = None
        self.coalesce_next = False
        try:
            self.queue.flush_buffers()
            self.transmit()
        except Exception as exc:
            log.exception("rdmaio: sending coalesced writes failed")
            self._fail(exc)
        if self.waiters:
            self.wake_writers()

    def on_batch_end(self) -> None:
        """A completion batch of this connection was processed: something came back, so the next small
        message may go at once; transmit what the batch made possible and wake the writers."""
        self.coalesce_next = False
        # transmit()'s early-out, here: after most batches nothing is queued or staged and no control frame
        # is due, and that costs no transmit() call.
        native = self._native
        if (
            self.queue.txq
            or self.staged
            or self._reclaim is not None
            or (_control_frame_due(native) if native is not None else self.session.control_frame_due())
        ):
            self.transmit()
        if self.waiters:
            self.wake_writers()

    def _grow(self) -> bool:
        """Every slot is in flight: register more (the initial count, then doubling). False at the end."""
        ring = self._slot_ring
        added = ring.grow(max(self._initial, ring.slots))
        if not added:
            return False
        self._add_slots(added)
        self._stats["send_ring_grown"] += 1
        return True

    def _add_slots(self, added: range) -> None:
        """Hand newly registered slots to the C ring (free, lowest index first; the signal interval for
        slot frames follows the ring's size: at most half of it)."""
        ring = self._slot_ring
        if added.start == 0:  # the ring's first slots: its memory was just attached
            self._ring = ring.view
            self._lkeys = ring.lkeys
        _check_tx(lib.rdmaio_txring_add_slots(self._tx, ring.addr, self._lkeys, added.start, len(added)))

    def _stage_queued(self) -> bool:
        """Stage queued frames (and a due EOF, CREDIT, RETURN or RECLAIM frame) as far as credits, send-queue
        entries and free slots allow; True if anything was staged (then :meth:`_post` it).

        Per frame: the session takes the frame (its immediate value), then one C call copies it into a
        send slot or the inline scratch area, fills its work request and puts it in flight. With a fast C
        session state one C call does both for a data frame (and C answers the control questions); a frame
        the session refuses there is handed to the Python take, which raises the precise error."""
        session = self.session
        native = self._native
        queue = self.queue
        txq = queue.txq
        tx = self._tx
        stage = _txring_stage
        from_buffer = _from_buffer
        max_inline = self._inline_payload
        sq_depth = self._sq_depth
        first = count = self.staged
        nbytes = 0
        messages = 0
        while (
            txq
            and tx.inflight_count < sq_depth
            and (_can_send_data(native) if native is not None else session.can_send_data())
        ):
            data, kind = txq[0]
            length = len(data)
            if length > max_inline:
                if not tx.nfree and not self._grow():
                    break  # every slot is in flight and the ring is at its size
            elif length and self._scratch_cdata is None:
                self._alloc_scratch()
            if native is not None and kind != RNDV_FRAME:
                # One C call: the ring's checks, the session's take, the copy and the work request. The
                # checks above are the ring's, so only the session can refuse, and then nothing changed.
                rc = _txring_stage_frame(tx, native, count, from_buffer(data), length, kind)
                if rc < 0:
                    if rc != _TX_SESSION:
                        _check_tx(rc)  # raises
                    # The Python take raises the precise error (C takes every frame it would accept).
                    if kind >= 0:
                        session.take_data_frame(bool(kind), length)
                    else:
                        session.take_batch_frame(length, -kind)
                    raise RuntimeError("rdmaio: the C session refused a frame its Python rules accepted")
                messages += kind if kind >= 0 else -kind
                txq.popleft()
                queue.txq_bytes -= length
                count += 1
                nbytes += length
                continue
            # The frame is accounted for first: if that raises, no slot or queued data is lost. The checks
            # above are the C call's, so it cannot refuse the frame once it is taken.
            if kind == RNDV_FRAME:  # a rendezvous descriptor; its message is counted by the rendezvous engine
                imm = session.take_rndv_frame(length)
            elif kind >= 0:
                imm = session.take_data_frame(bool(kind), length)
                messages += kind
            else:
                imm = session.take_batch_frame(length, -kind)
                messages -= kind
            txq.popleft()
            queue.txq_bytes -= length
            rc = stage(tx, count, from_buffer(data), length, imm)
            if rc < 0:
                _check_tx(rc)  # raises: the checks above are the C call's, it cannot refuse
            count += 1
            nbytes += length
        self.messages_sent += messages
        queue.posted_frames += count - first
        # The EOF frame once all data is out, or a CREDIT frame when one is due (or, with a shared receive
        # queue, a RETURN or RECLAIM frame): empty, no slot (the header framing's 4 bytes: a slot only if
        # the device takes fewer inline bytes).
        if tx.inflight_count < sq_depth and (not self._control_needs_slot or tx.nfree or self._grow()):
            if (
                not txq
                and not queue.wbuf
                and not queue.mbuf
                and (_eof_pending(native) if native is not None else session.eof_pending())
                and session.can_send_eof()
            ):
                imm = session.take_eof_frame()
                flags = _TX_EOF
            elif _credit_frame_due(native) if native is not None else session.credit_frame_due():
                imm = _take_credit(native) if native is not None else -1
                if imm < 0:
                    imm = session.take_credit_frame()  # not fast, or refused: the Python rule (or its error)
                flags = 0
                self._stats["credit_frames"] += 1
            elif self._reclaim is not None and (reclaim := self._reclaim_frame()) is not None:
                imm = reclaim  # shared receive queues: RETURN or RECLAIM
                flags = 0
            else:
                flags = -1
            if flags >= 0:
                rc = _txring_stage_empty(tx, count, imm, flags)
                if rc < 0:
                    _check_tx(rc)  # raises: room was checked above
                count += 1
        if count > first:
            self.staged = count
            self.bytes_sent += nbytes
            return True
        return False

    def _reclaim_frame(self) -> int | None:
        """The RETURN frame owed to the peer, else a RECLAIM frame the pool asked for, else None."""
        session = self._reclaim
        assert session is not None
        if session.return_frame_due():
            return session.take_return_frame()
        if session.reclaim_frame_due():
            return session.take_reclaim_frame()
        return None

    def _post(self) -> None:
        """Post every staged work request with one chained ``ibv_post_send`` (the C ring signals the last
        one if the chain leaves the sender short of send slots or send-queue entries)."""
        count = self.staged
        if not count:
            return
        self.staged = 0
        rc = _txring_finish(self._tx, count)
        if rc < 0:
            _check_tx(rc)  # raises: count is what was staged
        self._qp.post_sends(count)
        self.frames_posted += count
        self.post_calls += 1

    def _alloc_scratch(self) -> None:
        # Plain memory, not registered: the post copies inline data into the work request. One area per
        # entry of the send array (a chain's entries are staged before it is posted).
        entries = min(len(self._sends), self._sq_depth + 1)
        cdata = ffi.new("uint8_t[]", entries * self._max_inline)
        _check_tx(lib.rdmaio_txring_set_scratch(self._tx, cdata, entries))
        self._scratch_cdata = cdata  # keeps the memory alive

    def on_send_completion(self, slot: int) -> None:
        """A signalled send completed (``slot``: the index part of its wr_id): RC completes in order, so
        every slot and send-queue entry posted before it is free."""
        if _txring_complete(self._tx, slot):
            self.eof_done = True

    # --- waiting -----------------------------------------------------------------------------------

    def wake_writers(self) -> None:
        """Wake every task waiting in a send call (each looks again at what it waits for)."""
        waiters, self.waiters = self.waiters, {}
        for waiter in waiters:
            waiter.set()

    async def wait_writable(self) -> None:
        """Wait until the next completion batch, flush or teardown."""
        waiter = self.io.waiter()
        self.waiters[waiter] = None
        try:
            await waiter.wait()
        finally:
            self.waiters.pop(waiter, None)  # cancelled: do not pile up until the next wake-up
