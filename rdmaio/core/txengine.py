"""SendEngine: the send side of one connection - queue, coalescing, send slots, work requests, posting.

No loop and no waiting here: the endpoint decides *when* to stage and post (once per loop iteration, or at
once for the first small send of an idle endpoint) and who waits; the engine does *what*: it turns messages
and stream bytes into frames, copies them into registered send slots as far as credits
(:class:`~rdmaio.protocol.Session`) and free slots allow, fills the work requests and posts them in one
chained call. It talks to the queue pair through :class:`SendQueue` (``send_array`` + ``post_sends``), so
the unit tests drive it with a fake one.

Work requests: ``wr_id`` is ``make_wr_id(WR_KIND_SEND, tag, slot)`` (layout in :mod:`rdmaio.verbs`; the
tag routes the completion to this connection through the domain's shared CQ), and
:meth:`SendEngine.on_send_completion` takes the slot index (``wr_id & WR_INDEX_MASK``). A send slot is
reused only after its completion; with selective signalling one signalled completion releases every slot
posted before it (an RC queue completes in order). The slots live in a
:class:`~rdmaio.core.rings.SlotRing` that starts empty: the first frame registers ``initial`` slots and
the ring doubles whenever every slot is in flight and more is queued.

Frames of at most ``max_inline`` bytes (control frames, RNDV descriptors, small messages and replies) take
no slot: they are sent inline, their bytes copied into the work request when it is posted, so nothing
registered is held while they are in flight. They still take a send-queue entry (``ring.max_slots`` of them
belong to the engine); their wr_id index is ``_SLOTLESS | sequence``. Why: an idle connection's ring has 4
slots, so signalling had to come every 2 sends to keep slots coming back, and every signalled completion can
wake the loop once more; a request/reply connection whose frames are all small never registers a slot and is
signalled once per ``signal_interval`` sends, as with the full ring.
"""

from __future__ import annotations

import collections
import struct
from typing import Any, Protocol

from rdmaio import verbs
from rdmaio._ffi import ffi
from rdmaio.protocol import Session
from rdmaio.protocol.reclaim import ReclaimSession

__all__ = ["RNDV_FRAME", "SendEngine", "SendQueue"]

RNDV_FRAME = 2
"""Kind of a :attr:`SendEngine.txq` entry that is an RNDV frame (a rendezvous descriptor)."""

_WR_SEND_WITH_IMM = verbs.WR_SEND_WITH_IMM
_SEND_SIGNALED = verbs.SEND_SIGNALED
_SEND_INLINE = verbs.SEND_INLINE
_RECORD_HEADER = struct.Struct("<I")  # DATA_BATCH record: u32 little-endian length, then the message
_SLOTLESS = 1 << 31  # wr index bit of a frame that holds no send slot (inline or empty)
_SEQ_MASK = _SLOTLESS - 1

Payload = bytes | bytearray | memoryview


class SendRing(Protocol):
    """What the engine needs of its slot ring (:class:`~rdmaio.core.rings.SlotRing`)."""

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


class SendQueue(Protocol):
    """What the engine needs of a queue pair."""

    @property
    def send_array(self) -> Any:
        """``struct rdmaio_send[]`` scratch entries (``wr_id``, ``addr``, ``length``, ``lkey``, ...)."""

    def post_sends(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`send_array` as one chain."""


class SendEngine:
    """Frames waiting for credits and slots, the stream/message coalescing buffers, and the send slots.

    ``ring`` holds the send slots of ``slot_size`` bytes; ``initial`` of them are registered by the first
    frame. ``stats`` is the endpoint's counter (``messages_sent``, ``bytes_sent``, ``credit_frames``,
    ``frames_posted``, ``post_calls``, ``send_ring_grown``). ``tag`` is the connection tag the domain
    assigned (bits 32..55 of every wr_id).
    """

    def __init__(
        self,
        session: Session,
        qp: SendQueue,
        ring: SendRing,
        slot_size: int,
        *,
        initial: int = 4,
        max_inline: int,
        signal_interval: int,
        batch_limit: int,
        stats: collections.Counter[str],
        tag: int = 0,
    ) -> None:
        self.session = session
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
        # Send-queue entries the engine may have in flight (slots or not), and the signal interval for them.
        self._sq_depth = ring.max_slots
        self._sq_interval = min(signal_interval, max(1, self._sq_depth // 2))
        self._seq = 0  # numbers slotless frames (their wr index)
        # Inline frames' bytes between stage() and post(), one max_inline area per send-array entry; the
        # post copies them into the work requests. Allocated by the first inline frame.
        self._scratch: memoryview | None = None
        self._scratch_cdata: Any = None
        self._scratch_addr = 0
        self._stats = stats
        self._wr_id_base = verbs.make_wr_id(verbs.WR_KIND_SEND, tag, 0)  # | slot
        self.max_fragment = min(session.max_fragment, slot_size)
        # Stream data has no message boundaries, but every frame of it is a message to the peer: cap it
        # at the peer's maximum message size too (a peer may announce one below its slot size).
        self.stream_fragment = min(self.max_fragment, session.peer.max_message_size)
        # send() batches messages up to this size (-1: the peer cannot unpack batches)
        self.batch_limit = (
            min(batch_limit, self.max_fragment - _RECORD_HEADER.size) if session.batching else -1
        )
        # Frames to post, in order: (data, kind) with kind True/1 = DATA_END, False/0 = DATA_MORE,
        # RNDV_FRAME = an RNDV frame and -n = a DATA_BATCH payload of n messages. Data may reference a
        # caller's buffer until own_queued().
        self.txq: collections.deque[tuple[Payload, int]] = collections.deque()
        self.txq_bytes = 0
        self.queued_frames = 0  # frames ever queued
        self.posted_frames = 0  # frames ever staged (copied to a slot)
        self.wbuf = bytearray()  # stream writes being coalesced
        self.mbuf = bytearray()  # small messages being batched ([u32 length][bytes] records)
        self.mbuf_count = 0
        # A small message was just posted at once (the writer's rule for an idle connection): batch the next
        # ones until the connection's next completion batch or end-of-iteration flush clears this.
        self.coalesce_next = False
        self.free_slots = list(range(ring.slots))
        self._inflight: collections.deque[int] = collections.deque()  # slot, or _SLOTLESS | sequence
        self._unsignaled = 0
        self.staged = 0  # entries of the send array filled but not yet posted
        self._eof_slot: int | None = None  # send slot of the EOF frame, once staged
        self.eof_done = False  # the EOF frame completed

    # --- state ----------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes accepted and not yet copied into a send slot (what ``drain()`` waits on)."""
        return self.txq_bytes + len(self.wbuf) + len(self.mbuf)

    def room_for(self, length: int) -> bool:
        """Whether a frame of ``length`` bytes could be staged now as far as the send queue and slots go
        (credits aside): the writer posts an idle connection's first small message at once when it can."""
        if len(self._inflight) >= self._sq_depth:
            return False
        return length <= self._max_inline or bool(self.free_slots)

    def clear(self) -> None:
        """Drop everything not yet staged (abort)."""
        self.txq.clear()
        self.txq_bytes = 0
        self.wbuf.clear()
        self.mbuf.clear()
        self.mbuf_count = 0

    # --- queueing -------------------------------------------------------------------------------

    def queue_message(self, view: memoryview) -> int:
        """Queue one message (fragmented); return how many frames were added. The data is referenced until
        :meth:`own_queued` copies it."""
        size = view.nbytes
        step = self.max_fragment
        txq = self.txq
        if size <= step:
            txq.append((view, True))
            added = 1
        else:
            added = 0
            for start in range(0, size, step):
                end = start + step
                txq.append((view[start:end], end >= size))
                added += 1
        self.queued_frames += added
        self.txq_bytes += size
        return added

    def queue_stream(self, data: Payload) -> tuple[int, bool]:
        """Add stream bytes: whole frames go straight to the queue (copied into slots by :meth:`stage`, no
        staging copy), the rest is coalesced. Return ``(frames queued by reference, coalescing)``: the
        caller stages, then calls :meth:`own_queued` for those frames; ``coalescing`` means bytes wait in
        the coalescing buffer for a later :meth:`flush_buffers`."""
        if self.mbuf_count:
            self.flush_mbuf()  # batched messages come first
        step = self.stream_fragment
        added = 0
        if not self.wbuf and len(data) >= step:
            view = memoryview(data).cast("B")
            whole = len(view) - len(view) % step
            for start in range(0, whole, step):
                self.txq.append((view[start : start + step], True))
            added = whole // step
            self.queued_frames += added
            self.txq_bytes += whole
            data = view[whole:]
            if not data:
                return added, False
        self.wbuf += data
        if len(self.wbuf) >= step:
            self.flush_wbuf()
            return added, False
        return added, True

    def queue_small(self, view: memoryview, size: int) -> None:
        """Append a small message to the batch being built (flushing the batch first if it is full)."""
        if self.wbuf:
            self.flush_wbuf()
        if len(self.mbuf) + _RECORD_HEADER.size + size > self.max_fragment:
            self.flush_mbuf()
        self.mbuf += _RECORD_HEADER.pack(size)
        self.mbuf += view
        self.mbuf_count += 1

    def own_queued(self, count: int) -> None:
        """Copy the last ``count`` queued frames so no caller buffer is referenced after we return."""
        txq = self.txq
        for i in range(len(txq) - min(count, len(txq)), len(txq)):
            data, last = txq[i]
            if isinstance(data, memoryview):
                txq[i] = (bytes(data), last)

    def flush_wbuf(self) -> None:
        """Queue the coalesced stream bytes as frames."""
        wbuf = self.wbuf
        if wbuf:
            data = bytes(wbuf)
            wbuf.clear()
            step = self.stream_fragment
            for start in range(0, len(data), step):
                self.txq.append((data[start : start + step], True))
                self.queued_frames += 1
            self.txq_bytes += len(data)

    def flush_mbuf(self) -> None:
        """Queue the batched messages as one frame (a lone message goes as a plain DATA_END frame)."""
        count = self.mbuf_count
        if not count:
            return
        if count == 1:
            data: bytes | bytearray = bytes(memoryview(self.mbuf)[_RECORD_HEADER.size :])
            self.txq.append((data, True))
        else:
            data = self.mbuf
            self.txq.append((data, -count))
        self.mbuf = bytearray()
        self.mbuf_count = 0
        self.queued_frames += 1
        self.txq_bytes += len(data)

    def flush_buffers(self) -> None:
        """Queue whatever is coalescing. At most one of the two buffers holds data: appending to one
        flushes the other first, which keeps the order."""
        self.flush_wbuf()
        self.flush_mbuf()

    # --- staging and posting --------------------------------------------------------------------

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

    def has_work(self) -> bool:
        """False when :meth:`stage` and :meth:`post` would find nothing to do: no queued frame, nothing
        staged, no EOF or CREDIT frame due and no shared-receive control frame possible. Checked before the
        pump after every completion batch and flush, where most calls of a request/reply connection find
        nothing."""
        if self.txq or self.staged or self._reclaim is not None:
            return True
        session = self.session
        return session.eof_pending() or session.credit_frame_due()

    def stage(self) -> bool:
        """Copy queued frames (and a due EOF or CREDIT frame) into send slots and fill their work requests
        as far as credits and free slots allow; True if anything was staged (then :meth:`post` it)."""
        session = self.session
        txq = self.txq
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
            if kind == RNDV_FRAME:  # a rendezvous descriptor; its message is counted by rndv_engine
                imm = session.take_rndv_frame(length)
            elif kind >= 0:
                imm = session.take_data_frame(bool(kind), length)
                messages += kind
            else:
                imm = session.take_batch_frame(length, -kind)
                messages -= kind
            txq.popleft()
            self.txq_bytes -= length
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
        self.posted_frames += count - first
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
        if (
            not self.txq
            and not self.wbuf
            and not self.mbuf
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

    def post(self) -> None:
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
