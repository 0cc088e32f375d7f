"""Sender: the send side of one connection - the send calls, the send queue's owner, all posting of frames.

One owner: every frame of a connection reaches the NIC through :class:`Sender`. The send calls
(``send``/``write``/``drain``/``write_eof``, the public docstrings are :class:`rdmaio.Endpoint`'s) put data
into the sans-IO send queue (:class:`rdmaio.protocol.sendqueue.SendQueue`: fragmentation, coalescing,
DATA_BATCH encoding); the rendezvous engine hands its descriptors to :meth:`Sender.queue_rndv`; the EOF and
the CREDIT/RETURN/RECLAIM frames are taken from the session when due. Nobody else touches the queue.

Posting. :meth:`Sender.transmit` runs after every input - a send call that can go at once, a completion batch
(:meth:`Sender.on_batch_end`), the end-of-iteration flush of coalesced writes - as aioquic's asyncio
protocol calls ``transmit()`` after every input: it stages what credits and send slots allow (copies queued
frames into registered send slots, or inline into the work request, and fills the work requests) and posts
everything staged with one chained ``ibv_post_send``. A write that must free the caller's buffer at once
stages at once (:meth:`Sender.stage`) and leaves the post to one ``transmit()`` at the end of the loop
iteration: one doorbell for every frame of the iteration (on rxe a system call per post).

**The seam for C.** :meth:`Sender.transmit` is the whole per-post work with plain inputs: the queue's
``txq`` (``(bytes, kind)`` entries), the session's credit counters, the free slot list, the in-flight
deque, the slot ring's memory and the send array of the queue pair. A fast path can replace it, and
:meth:`on_send_completion` (release the slots up to a signalled wr_id), without changing any caller.

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
from rdmaio.protocol.sendqueue import RNDV_FRAME, Payload, SendQueue
from rdmaio.verbs import _base as _fork_state  # its _generation is read on every send: no call
from rdmaio.verbs.native import ffi

__all__ = ["RendezvousSends", "SendArray", "SendRing", "Sender", "check_fork"]

log = logging.getLogger("rdmaio")

_WR_SEND_WITH_IMM = verbs.WR_SEND_WITH_IMM
_SEND_SIGNALED = verbs.SEND_SIGNALED
_SEND_INLINE = verbs.SEND_INLINE
_SLOTLESS = 1 << 31  # wr index bit of a frame that holds no send slot (inline or empty)
_SEQ_MASK = _SLOTLESS - 1


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
        """``struct rdmaio_send[]`` scratch entries (``wr_id``, ``addr``, ``length``, ``lkey``, ...)."""

    def post_sends(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`send_array` as one chain."""

    def post_empty_write(self, wr_id: int) -> None:
        """Post one signalled zero-length RDMA WRITE (a keepalive probe)."""


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
    batched. ``stats`` is the connection's counter (``messages_sent``, ``bytes_sent``, ``credit_frames``,
    ``frames_posted``, ``post_calls``, ``send_ring_grown``). ``tag`` is the connection tag the domain
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
        self.rndv: RendezvousSends | None = None
        # Shared receive queues: a session that answers RECLAIM, or sends it, stages those frames.
        self._reclaim = session if isinstance(session, ReclaimSession) and session.reclaim else None
        self._qp = qp
        self._sends = qp.send_array
        self._slot_ring = ring
        # The ring's memory (view, address, keys) exists once it has slots: a pooled ring gets it at its
        # first grow (rdmaio.core.rings), so these are read again by _grow().
        self._ring = ring.view if ring.slots else memoryview(b"")
        self._addr = ring.addr if ring.slots else 0
        self._lkeys: Any = ring.lkeys if ring.slots else None
        self._initial = initial
        self._slot_size = slot_size
        self._max_inline = max_inline
        self._signal_interval = signal_interval
        self._interval = self._effective_interval()
        # Send-queue entries the sender may have in flight (slots or not), and the signal interval for them.
        self._sq_depth = ring.max_slots
        self._sq_interval = min(signal_interval, max(1, self._sq_depth // 2))
        self._seq = 0  # numbers slotless frames (their wr index)
        # Inline frames' bytes between staging and the post, one max_inline area per send-array entry; the
        # post copies them into the work requests. Allocated by the first inline frame.
        self._scratch: memoryview | None = None
        self._scratch_cdata: Any = None
        self._scratch_addr = 0
        self._stats = stats
        self._wr_id_base = verbs.make_wr_id(verbs.WR_KIND_SEND, tag, 0)  # | slot
        # The peer's maximum message size (its handshake, fixed): a send within it needs no size check call.
        self._peer_max = session.peer.max_message_size
        max_fragment = min(session.max_fragment, slot_size)
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
        self.free_slots = list(range(ring.slots))
        self._inflight: collections.deque[int] = collections.deque()  # slot, or _SLOTLESS | sequence
        self._unsignaled = 0
        self.staged = 0  # entries of the send array filled but not yet posted
        self._eof_slot: int | None = None  # send slot of the EOF frame, once staged
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
        if len(self._inflight) >= self._sq_depth:
            return False
        return length <= self._max_inline or bool(self.free_slots)

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
        if self._generation != _fork_state._generation:
            check_fork(self._generation)
        session = self.session
        error = session.send_error()
        if error is not None:
            raise error
        if self.closing:
            raise EndpointClosedError("endpoint is closing")
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = view.nbytes
        if size > self._peer_max:
            session.check_message_size(size)  # raises MessageTooLargeError
        rndv = self.rndv
        if size > self.queue.batch_limit or (rndv is not None and size >= rndv.threshold):
            await self.send_rest(view)
        elif self._queue_batched(view, size):
            await self.drain()  # above the high-water mark

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
            and len(self._inflight) < self._sq_depth  # room_for(size), inline: the hot path
            and (size <= self._max_inline or self.free_slots)
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
        queue.queue_small(view, size)
        self.schedule_flush()
        return queue.buffered > self.options.write_high_water

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """:meth:`rdmaio.Endpoint.write`."""
        self.raise_send_error()  # also refuses a write after write_eof() (the session's send_error)
        if not data:
            return
        queue = self.queue
        added, coalescing = queue.queue_stream(data)
        if added or not coalescing:
            self.stage()
            queue.own_queued(added)
        if coalescing:
            self.schedule_flush()

    def must_drain(self) -> bool:
        """:meth:`rdmaio.Endpoint.drain`'s synchronous part: raise the connection's error, or say whether
        there is anything to wait for (above the high-water mark). Most drains end here, so the front calls
        it before it creates the coroutine of :meth:`drain`."""
        self.raise_flush_error()
        return self.queue.buffered > self.options.write_high_water

    async def drain(self) -> None:
        """:meth:`rdmaio.Endpoint.drain`."""
        if not self.must_drain():
            return
        queue = self.queue
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

    def post_probe(self, wr_id: int) -> None:
        """Post the keepalive's probe (:mod:`rdmaio.core.keepalive`): a zero-length RDMA WRITE, no frame,
        no credit and no slot; its send-queue entry is reserved apart from the frames'."""
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
        if self.queue.txq or self.staged or self._reclaim is not None or self.session.control_frame_due():
            self.transmit()
        if self.waiters:
            self.wake_writers()

    def _grow(self) -> bool:
        """Every slot is in flight: register more (the initial count, then doubling). False at the end."""
        ring = self._slot_ring
        added = ring.grow(max(self._initial, ring.slots))
        if not added:
            return False
        if added.start == 0:  # the ring's first slots: its memory was just attached
            self._ring = ring.view
            self._addr = ring.addr
            self._lkeys = ring.lkeys
        self.free_slots.extend(reversed(added))  # pop() takes the lowest index first
        self._interval = self._effective_interval()
        self._stats["send_ring_grown"] += 1
        return True

    def _effective_interval(self) -> int:
        """The signal interval for the ring as it is: ``signal_interval``, but at most half the ring. A ring
        smaller than the interval (an idle connection's 4 first slots) would otherwise be "short of slots"
        on every post, and every send would be signalled: one more loop wake-up per message for a
        request/reply connection."""
        return min(self._signal_interval, max(1, self._slot_ring.slots // 2))

    def _stage_queued(self) -> bool:
        """Copy queued frames (and a due EOF or CREDIT frame) into send slots and fill their work requests
        as far as credits and free slots allow; True if anything was staged (then :meth:`_post` it)."""
        session = self.session
        queue = self.queue
        txq = queue.txq
        free = self.free_slots
        sends = self._sends
        slot_size = self._slot_size
        max_inline = self._max_inline
        sq_depth = self._sq_depth
        inflight = self._inflight
        first = count = self.staged
        nbytes = 0
        messages = 0
        while txq and len(inflight) < sq_depth and session.can_send_data():
            data, kind = txq[0]
            length = len(data)
            if length > max_inline and not free and not self._grow():
                break  # every slot is in flight and the ring is at its size
            # The frame is accounted for first: if that raises, no slot or queued data is lost.
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
            if length > max_inline:
                slot = free.pop()
                off = slot * slot_size
                self._ring[off : off + length] = data
                self._fill(sends[count], slot, self._addr + off, length, self._lkeys[slot], imm, 0)
                inflight.append(slot)
            else:
                self._fill_slotless(sends[count], count, data, imm)
            count += 1
            nbytes += length
        self._stats["messages_sent"] += messages
        queue.posted_frames += count - first
        count = self._stage_control(count)
        if count > first:
            self.staged = count
            self._stats["bytes_sent"] += nbytes
            return True
        return False

    def _stage_control(self, count: int) -> int:
        """Stage the EOF frame once all data is out, or a CREDIT frame when one is due."""
        session = self.session
        if len(self._inflight) >= self._sq_depth:
            return count
        wr = self._sends[count]
        queue = self.queue
        if (
            not queue.txq
            and not queue.wbuf
            and not queue.mbuf
            and session.eof_pending()
            and session.can_send_eof()
        ):
            self._eof_slot = self._fill_slotless(wr, count, b"", session.take_eof_frame())
            wr.send_flags = _SEND_SIGNALED
            self._unsignaled = 0
        elif session.credit_frame_due():
            self._fill_slotless(wr, count, b"", session.take_credit_frame())
            self._stats["credit_frames"] += 1
        elif self._reclaim is not None and (imm := self._reclaim_frame()) is not None:
            self._fill_slotless(wr, count, b"", imm)  # shared receive queues: RETURN or RECLAIM
        else:
            return count
        return count + 1

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
        """Post every staged work request with one chained ``ibv_post_send``."""
        count = self.staged
        if not count:
            return
        self.staged = 0
        # Whatever runs short of send slots or send-queue entries must get a completion to release them
        # (slots count only while some are in flight: a completion releases no slot otherwise).
        free = len(self.free_slots)
        if (free < self._interval and free < self._slot_ring.slots) or (
            self._sq_depth - len(self._inflight) < self._sq_interval
        ):
            self._sends[count - 1].send_flags |= _SEND_SIGNALED
            self._unsignaled = 0
        self._qp.post_sends(count)
        self._stats["frames_posted"] += count
        self._stats["post_calls"] += 1

    def _fill(self, wr: Any, index: int, addr: int, length: int, lkey: int, imm: int, inline: int) -> None:
        """Fill one SEND_WITH_IMM work request (``inline``: 0 or ``SEND_INLINE``). It is signalled every
        ``interval`` requests: the slot ring's for a frame in a slot, the send queue's for a slotless one."""
        wr.wr_id = self._wr_id_base | index
        wr.addr = addr
        wr.length = length
        wr.lkey = lkey
        wr.imm_data = imm
        wr.opcode = _WR_SEND_WITH_IMM
        self._unsignaled += 1
        if self._unsignaled >= (self._sq_interval if index & _SLOTLESS else self._interval):
            inline |= _SEND_SIGNALED
            self._unsignaled = 0
        wr.send_flags = inline

    def _fill_slotless(self, wr: Any, count: int, data: Payload, imm: int) -> int:
        """Fill the work request of a frame that needs no slot: empty (no SGE), or inline from the scratch
        area of send-array entry ``count``. Put it in flight and return its wr index."""
        index = _SLOTLESS | self._seq
        self._seq = (self._seq + 1) & _SEQ_MASK
        length = len(data)
        if length:
            scratch = self._scratch
            if scratch is None:
                scratch = self._alloc_scratch()
            off = count * self._max_inline
            scratch[off : off + length] = data
            self._fill(wr, index, self._scratch_addr + off, length, 0, imm, _SEND_INLINE)
        else:
            self._fill(wr, index, 0, 0, 0, imm, 0)
        self._inflight.append(index)
        return index

    def _alloc_scratch(self) -> memoryview:
        # Plain memory, not registered: the post copies inline data into the work request.
        cdata = ffi.new("char[]", (self._sq_depth + 1) * self._max_inline)
        self._scratch_cdata = cdata  # keeps the memory alive
        self._scratch = memoryview(ffi.buffer(cdata)).cast("B")
        self._scratch_addr = int(ffi.cast("uintptr_t", cdata))
        return self._scratch

    def on_send_completion(self, slot: int) -> None:
        """A signalled send completed (``slot``: the index part of its wr_id): RC completes in order, so
        every slot and send-queue entry posted before it is free."""
        inflight = self._inflight
        free = self.free_slots
        while inflight:
            done = inflight.popleft()
            if done < _SLOTLESS:
                free.append(done)
            if done == slot:
                break
        if slot == self._eof_slot:
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
