"""Receiver: the receive side of one connection - received frames, the read calls, and all re-posting of
receive slots.

One owner: every receive completion's frame goes through :meth:`Receiver.on_batch` into the receive buffer
(:class:`rdmaio.protocol.rxbuffer.ReceiveBuffer`) or to an engine (one-sided write notices and control
messages, rendezvous descriptors); every receive slot goes back to the NIC through this class - at the end
of a batch, when a read releases held slots (:meth:`Receiver.repost_released`), and when the one-sided
engine lets a held write notice's slot go (:meth:`Receiver.repost`, injected into it). A slot the buffer
holds back (back-pressure) earns the peer no credit, and the peer's sender waits.

The read calls (``recv``/``recv_into`` for messages, ``read``/``readexactly``/``readuntil``/``readline``/
``at_eof`` for the byte stream; the public docstrings are :class:`rdmaio.Endpoint`'s) take data from the
buffer only once they can return: a cancelled read consumes nothing. Rendezvous (zero-copy) messages are
placeholders until pulled by :mod:`rdmaio.core.rendezvous`.

**The seam for C.** :meth:`Receiver.on_batch` is the whole per-batch work with plain inputs: the
completion records (``wr_id``, ``status``, ``opcode``, ``byte_len``, ``imm_data``, ``flags``) of one
connection's group, the receive ring's memory, the session's credit counters and the receive buffer; it
copies each frame out of its slot (one copy), re-posts the slots in one chained post and wakes the reader.
The frame rules themselves run in C on the session's C state (``rdmaio_rx_run`` in
rdmaio/_ffi/session.c); what C leaves (EOF, RNDV, one-sided receives, extension frames, violations) goes to
the Python :class:`~rdmaio.protocol.Session`, in CQ order. A DATA_BATCH payload is checked, counted and
described in C too (``rdmaio_session_on_batch``: a ``struct`` format of its records), so its messages are
one ``struct.unpack_from``; a payload C refuses goes to :meth:`~rdmaio.protocol.Session.on_batch`, which
raises the precise error.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import sys
from collections.abc import Callable
from typing import Any, Protocol

from rdmaio import verbs
from rdmaio.core.backend import Backend, OneShot
from rdmaio.core.send import check_fork
from rdmaio.errors import EndpointClosedError
from rdmaio.options import Options
from rdmaio.protocol import BATCH_RECORD_HEADER, EOF, FrameKind, Session
from rdmaio.protocol.rxbuffer import PLACEHOLDER_CHARGE, Placeholder, ReceiveBuffer
from rdmaio.verbs import WR_INDEX_MASK
from rdmaio.verbs import _base as _fork_state  # its _generation is read on every wait: no call
from rdmaio.verbs.native import ffi, lib

__all__ = ["OneSidedReceives", "Receiver", "RendezvousReceives", "SlotPoster"]

_RECV_FLAG = 0x80  # IBV_WC_RECV bit of a completion opcode
_DATA_MORE = FrameKind.DATA_MORE
_DATA_END = FrameKind.DATA_END
_DATA_BATCH = FrameKind.DATA_BATCH
_EOF = FrameKind.EOF
_RNDV = FrameKind.RNDV  # zero-copy: a rendezvous descriptor, handled by rdmaio.core.rendezvous
_RECV_RDMA_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)  # one-sided: a write notice
_WC_WITH_IMM = verbs.WC_WITH_IMM  # one-sided: a receive without it is a control message
# The session rules in C (rdmaio/_ffi/session.c), bound once: each is one C call, no Python frame.
_CDATA = ffi.CData
# The frames of a run of records in small plain integers (no struct field to read, no big int): the return
# value is frames | consumed << _RX_CONSUMED_SHIFT | stop << _RX_STOP_SHIFT; frame k is two words,
# kind << _RX_KIND_SHIFT | slot and its length.
_rx_run = lib.rdmaio_rx_run
_RX_FRAMES_MASK = (1 << lib.RDMAIO_RX_CONSUMED_SHIFT) - 1
_RX_CONSUMED_MASK = lib.RDMAIO_RX_RUN_MAX
_RX_CONSUMED_SHIFT = lib.RDMAIO_RX_CONSUMED_SHIFT
_RX_STOP_SHIFT = lib.RDMAIO_RX_STOP_SHIFT
_RX_KIND_SHIFT = lib.RDMAIO_RX_KIND_SHIFT
_RX_SLOT_MASK = lib.RDMAIO_RX_SLOT_MAX
_rx_unframe = lib.rdmaio_rx_unframe  # the header framing: each receive made into an immediate one
_reposted = lib.rdmaio_session_reposted
_grow = lib.rdmaio_session_grow
_RX_DEFER = lib.RDMAIO_RX_DEFER
_RX_FRAMES = 256  # frames one rdmaio_rx_run call describes at most (it is called again for more)
# A DATA_BATCH payload's rule and split in C (rdmaio_session_on_batch): it checks every record and writes a
# struct format ("4x<n>s" per record) that splits the payload in one C call, struct.unpack_from. A payload
# of more records than this many bytes of format describe (over 1,600 of up to 9,999 bytes each) goes to the
# Python rule; the bound also bounds the struct module's cache of such formats (100 of them).
_on_batch = lib.rdmaio_session_on_batch
_BATCH_FMT_CAP = 8192
_unpack_from = struct.unpack_from
_string = ffi.string
_WC_FIELDS = ("wr_id", "status", "opcode", "byte_len", "imm_data", "flags", "vendor_err", "qp_num")


def _wc_array(records: Any, start: int, count: int) -> Any:
    """``records[start:start + count]`` copied into a ``struct rdmaio_wc`` array (records that are not one
    already, e.g. built one by one): what the C frame rules read."""
    array = ffi.new("struct rdmaio_wc[]", max(count, 1))
    for k in range(count):
        wc = records[start + k]
        array[k] = {name: int(getattr(wc, name, 0)) for name in _WC_FIELDS}
    return array


class SlotPoster(Protocol):
    """What the receiver needs of the transport (:class:`rdmaio.core.transport.Transport`)."""

    slot_size: int

    def post_receives(self, slots: list[int]) -> None:
        """Post these receive slots again (one chained post)."""

    def grow_receives(self, n: int) -> int:
        """Register and post up to ``n`` more receive slots; return how many."""


class OneSidedReceives(Protocol):
    """What the receiver needs of the one-sided engine (:class:`rdmaio.core.onesided.OneSidedEngine`)."""

    def on_recv(self, opcode: int, imm: int, length: int, view: memoryview, slot: int) -> bool:
        """A write notice or control message arrived in ``slot``; True: repost it now, False: held."""


class RendezvousReceives(Protocol):
    """What the receiver needs of the rendezvous engine (:class:`rdmaio.core.rendezvous.RendezvousEngine`)."""

    def on_request(self, payload: memoryview) -> None:
        """An RNDV frame arrived: its placeholder goes to the receive buffer."""

    async def take_head(self, into: memoryview | None) -> int | None:
        """Pull the placeholder at the buffer's head (into ``into`` if it fits)."""

    async def pull_for(self, need: int) -> None:
        """Pull the announced messages among the first ``need`` bytes of the stream."""

    def kick(self) -> None:
        """Pull unclaimed messages soon."""


class Receiver:
    """The receive side of one connection (see the module docstring; asyncio ``StreamReader`` semantics).

    ``transport`` posts the receive slots (and grows the window); ``recv_view`` is the receive ring's
    memory; ``stage()`` lets the sender stage what re-posted slots made due (their credits);
    ``options.recv_buffer_limit`` bounds the buffer and ``options.read_limit`` a ``readuntil()``;
    ``generation`` is the process's fork generation at connect. The one-sided engine (``onesided``) and
    the rendezvous engine (``rndv``, None when off) are set by the connection once they exist: they are
    built on this receiver's buffer and :meth:`repost`.
    """

    def __init__(
        self,
        session: Session,
        transport: SlotPoster,
        recv_view: memoryview,
        *,
        io: Backend,
        options: Options,
        stats: collections.Counter[str],
        stage: Callable[[], None],
        generation: int = 0,
    ) -> None:
        self.io = io
        self.session = session
        self.options = options
        self.rxbuf = ReceiveBuffer(options.recv_buffer_limit)
        self._rxbuf = self.rxbuf
        self._transport = transport
        self._recv_view = recv_view
        self._stats = stats  # rare events (recv_ring_grown)
        # Per-message counters as plain attributes (cheaper than the Counter's ``+=``); the connection folds
        # them into its statistics.
        self.messages_received = 0
        self.bytes_received = 0
        self._stage = stage
        self._generation = generation
        self.onesided: OneSidedReceives | None = None
        self.rndv: RendezvousReceives | None = None
        self._slot_size = transport.slot_size
        self._big_frame = transport.slot_size // 2  # frames at least this long count towards growth
        self._big_frames = 0  # such frames received since the receive window last grew
        # The read call's wake-up while it waits (on asyncio a future: made, woken and tested without a
        # Python call but io.one_shot()); None when no read waits or it was woken.
        self._waiter: OneShot | None = None
        # What makes that wake-up: the backend's one-shot factory (asyncio: the future class, no Python
        # call), bound at the first wait (the loop is running then).
        self._new_one_shot: Callable[[], OneShot] = self._bind_one_shot
        self._close = session.close_state  # its ``clear``: no close fact yet, an empty read just waits
        self.stopped = False  # torn down: nothing is re-posted any more, reads raise
        # The session's state: a C struct the hot rules run on in C (native), unless the session is not
        # fast (its methods must see every frame) or its state is a Python object (C cannot read it).
        state = self._state = session.rules_state
        self._native: Any = state if isinstance(state, _CDATA) and state.fast else None
        # The header framing (rdmaio.protocol.framing): every batch's receives are first made into what the
        # immediate framing delivers (the header word as the immediate value, the payload moved to the
        # slot's start), in C, so that everything below is the same in both framings. None: immediate.
        # The ring's address as a plain pointer: a from_buffer object held here could be released after
        # its memoryview by the cyclic collector (a crash); recv_view keeps the memory alive.
        self._unframe_ring: Any = None
        self._unframe_len = 0
        if session.framing.header:
            ring = ffi.from_buffer(recv_view)
            self._unframe_ring = ffi.cast("uint8_t *", ring)
            self._unframe_len = len(ring)
            del ring
        self._frames = ffi.new("uint32_t[]", 2 * _RX_FRAMES)  # what C applied: two words per frame
        # What the C batch rule reads and writes: the ring as a plain pointer (as the unframe ring) and its
        # length, and the struct format it writes (allocated by the first DATA_BATCH frame). One attribute:
        # a few more would make every attribute read of this class slower (CPython's shared-key instance
        # dictionaries hold at most 30 names).
        self._batch_c: tuple[Any, int, Any] | None = None
        # The ring again, as a cffi buffer over its address: slicing it makes the payload's bytes in one step
        # (a memoryview slice and then bytes() is two objects). Over a plain pointer, as the unframe ring,
        # so that no buffer export outlives the ring's memoryview; recv_view keeps the memory alive.
        ring = ffi.from_buffer(recv_view)
        self._recv_bytes: Any = ffi.buffer(ffi.cast("char *", ring), len(ring))
        del ring

    # --- completions (the connection hands each batch's receives here) ------------------------------

    def on_batch(self, records: Any, start: int, count: int) -> None:
        """Process the successful receive completions among ``records[start:start + count]`` (others are
        the connection's): each frame to the buffer or its engine, then re-post the slots not held (one
        chained post), grow the window when the peer is credit-bound, and wake the reader.

        With a C session state, the frame rules run in C over the run of records
        (``rdmaio_rx_run``), which stops at the first record it leaves to the session's Python methods
        (a one-sided receive, EOF, RNDV, an extension's frame, any frame that breaks a rule): that one is
        handled here, then C goes on with the rest, so the frames are applied in CQ order. ``records`` is
        the poll's ``struct rdmaio_wc`` array; any other sequence of records is copied into one first.

        The batch of a request/reply connection is one message in one frame: when C applied every record
        and found exactly one frame, a DATA_END, that frame takes a short path, with none of the loop's
        bookkeeping (the same steps, for that frame alone)."""
        native = self._native
        run = -1  # rdmaio_rx_run's answer for the records from start on, once asked
        if native is not None and self._unframe_ring is None and isinstance(records, _CDATA):
            frames = self._frames
            run = _rx_run(native, records, start, count, frames, _RX_FRAMES)
            # One frame, every record consumed, done (consumed == count: the records were all looked at).
            if run == 1 | count << _RX_CONSUMED_SHIFT and frames[0] >> _RX_KIND_SHIFT == _DATA_END:
                # The loop's steps below, its re-post and its ending for that frame alone: keep them the same.
                slot = frames[0] & _RX_SLOT_MASK
                length = frames[1]
                if length >= self._big_frame:
                    self._big_frames += 1
                rxbuf = self._rxbuf
                self.messages_received += 1
                self.bytes_received += length + rxbuf.assembling
                off = slot * self._slot_size
                data = self._recv_bytes[off : off + length]
                if rxbuf.parts or rxbuf.unsettled:
                    admitted = rxbuf.add_admitted(data, slot)
                else:
                    # add_admitted(), inline (as ReceiveBuffer's docstring allows): keep the two the same.
                    rxbuf.messages.append(data)
                    unread = rxbuf.unread = rxbuf.unread + length
                    rxbuf.ready += length
                    admitted = (
                        unread + rxbuf.assembling + rxbuf.announced + rxbuf.pending * PLACEHOLDER_CHARGE
                        <= rxbuf.limit
                        or not (unread or rxbuf.pending)
                        or rxbuf.reader_waiting
                    )
                    if not admitted:
                        rxbuf.hold(slot)  # back-pressure: no credit for it yet
                if admitted:
                    self._transport.post_receives([slot])
                    if _reposted(native, 1):
                        self.session.on_recv_reposted(1)  # the Python rule (or its error)
                if not rxbuf.held:  # else no growth: the application, not the window, is the limit
                    threshold = native.threshold  # the threshold first: it alone rules out most batches
                    if (
                        threshold < 1 or self._big_frames > threshold
                    ) and native.recv_max > native.recv_depth:
                        self._grow_receives()
                waiter = self._waiter  # wake_reader(), inline: keep the two the same
                if waiter is not None:
                    self._waiter = None
                    if not waiter.done():  # done: its task was cancelled (asyncio) and has not cleaned up yet
                        waiter.set_result(None)
                return
            if run < 0:
                raise RuntimeError("rdmaio: rdmaio_rx_run refused its arguments")
        repost: list[int] = []
        got_data = False
        data_frames = 0
        session = self.session
        rxbuf = self._rxbuf
        recv_view = self._recv_view
        recv_bytes = self._recv_bytes
        slot_size = self._slot_size
        big_frame = self._big_frame
        if native is not None and not isinstance(records, _CDATA):
            records, start = _wc_array(records, start, count), 0
        unframe = self._unframe_ring
        if unframe is not None:
            if not isinstance(records, _CDATA):
                records, start = _wc_array(records, start, count), 0
            if _rx_unframe(records, start, count, unframe, self._unframe_len, slot_size) < 0:
                raise RuntimeError("rdmaio: rdmaio_rx_unframe refused its arguments")
        frames = self._frames
        i = start
        end = start + count
        while i < end:
            if native is not None:
                # C applies the frames it can (state changed in C), up to the first it must leave to us.
                if run < 0:  # else the first run was asked above
                    run = _rx_run(native, records, i, end - i, frames, _RX_FRAMES)
                    if run < 0:
                        raise RuntimeError("rdmaio: rdmaio_rx_run refused its arguments")
                n = run & _RX_FRAMES_MASK
                i += run >> _RX_CONSUMED_SHIFT & _RX_CONSUMED_MASK
                python = (
                    run >> _RX_STOP_SHIFT == _RX_DEFER
                )  # records[i]: the session's Python methods apply it
                run = -1
            else:
                n = 0
                python = True
            for j in range(n + python):
                if j < n:
                    slot = frames[2 * j]
                    kind = slot >> _RX_KIND_SHIFT
                    slot &= _RX_SLOT_MASK
                    length = frames[2 * j + 1]
                    off = slot * slot_size
                else:
                    wc = records[i]
                    i += 1
                    if wc.status or not wc.opcode & _RECV_FLAG:
                        continue
                    slot = wc.wr_id & WR_INDEX_MASK
                    length = wc.byte_len
                    off = slot * slot_size
                    if wc.opcode == _RECV_RDMA_IMM or not wc.flags & _WC_WITH_IMM:  # one-sided
                        assert self.onesided is not None
                        if self.onesided.on_recv(
                            wc.opcode, wc.imm_data, length, recv_view[off : off + length], slot
                        ):
                            repost.append(slot)  # else held: write-notice back-pressure
                        continue
                    kind = session.on_frame(wc.imm_data, length)
                if length >= big_frame:
                    self._big_frames += 1
                if kind == _DATA_END:
                    # add_message() and admit() in one call; the message is this frame and the fragments
                    # before it (assembling: their bytes).
                    self.messages_received += 1
                    self.bytes_received += length + rxbuf.assembling
                    got_data = True
                    data_frames += 1
                    if rxbuf.add_admitted(recv_bytes[off : off + length], slot):
                        repost.append(slot)  # else held: back-pressure, no credit for it yet
                    continue
                elif kind == _DATA_BATCH:
                    got = 0
                    if native is not None:
                        # The rule and the split in C: checked and counted there, then the messages are
                        # one struct.unpack_from (no Python step per message).
                        batch_c = self._batch_c
                        if batch_c is None:
                            batch_c = self._batch_c = self._batch_args()
                        ring, ring_len, fmt = batch_c
                        got = _on_batch(native, ring, ring_len, off, length, fmt, _BATCH_FMT_CAP)
                    if got > 0:
                        size = length - BATCH_RECORD_HEADER * got
                        rxbuf.add_batch(_unpack_from(_string(fmt), recv_bytes, off), size)
                    else:
                        # Deferred, or a violation: the Python rule (unpack_batch's) raises the precise error.
                        messages = session.on_batch(recv_view[off : off + length])
                        if got < 0:
                            raise RuntimeError(
                                "rdmaio: the C batch rule refused a payload its Python rule accepted"
                            )
                        size = rxbuf.add_messages(messages)
                        got = len(messages)
                    self.messages_received += got
                    self.bytes_received += size
                    got_data = True
                elif kind == _DATA_MORE:
                    rxbuf.add_fragment(recv_bytes[off : off + length])
                elif kind == _RNDV:  # zero-copy: a placeholder now, the data is pulled later
                    assert self.rndv is not None  # on_frame refuses RNDV frames unless negotiated
                    self.rndv.on_request(recv_view[off : off + length])
                    # The announced bytes count against the limit: past it the slot is held as a data
                    # frame's is, so a peer cannot queue announcements faster than the application reads.
                    if rxbuf.admit(slot):
                        repost.append(slot)
                    got_data = True
                    continue
                else:
                    # CREDIT and EOF carry no payload and never hold their slot: holding it would
                    # withhold the credit the peer needs to keep granting ours (two-way liveness).
                    repost.append(slot)
                    if kind == _EOF:
                        got_data = True
                    continue
                data_frames += 1
                if rxbuf.admit(slot):  # else held: back-pressure, no credit for it yet
                    repost.append(slot)
        if repost:
            self._transport.post_receives(repost)
            if native is None or _reposted(native, len(repost)):
                session.on_recv_reposted(len(repost))  # the Python rule (or its error)
        if data_frames and not rxbuf.held:
            # The session's own fields (no property call), the threshold first: it alone rules out most
            # batches, and each field read is a C struct's.
            state = self._state
            threshold = state.threshold
            if (
                data_frames > threshold or self._big_frames > threshold
            ) and state.recv_max > state.recv_depth:
                self._grow_receives()
        if got_data:
            # wake_reader(), inline: keep the two the same.
            waiter = self._waiter
            if waiter is not None:
                self._waiter = None
                if not waiter.done():  # done: its task was cancelled (asyncio) and has not cleaned up yet
                    waiter.set_result(None)

    def _batch_args(self) -> tuple[Any, int, Any]:
        """The C batch rule's ring pointer, ring length and format buffer (made by the first batch)."""
        ring = ffi.from_buffer(self._recv_view)
        return ffi.cast("uint8_t *", ring), len(ring), ffi.new("char[]", _BATCH_FMT_CAP)

    def _grow_receives(self) -> None:
        """Double the receive window (the next frame or a CREDIT frame grants the new slots) when the peer is
        sending as fast as our credits let it: one wake-up brought more than half a window of data frames, or
        more than half a window of big frames (at least half a slot) arrived since the window last grew. The
        second rule is for a loop that wakes for every frame (a VM, a busy host): it never sees half a 4-slot
        window at once, and a bulk sender stayed at 3 frames per round trip. It asked for two whole windows
        of big frames at first, so a stream reached the full window only after 56 frames (3.5 MiB of 64 KiB
        writes, about ten credit round trips at 3-15 frames each), most of a short transfer; now the window
        is full after 17. Small messages never add up to it, so a request/reply connection keeps its small
        window. Not while slots are held: then the application, not the window, is the limit."""
        self._big_frames = 0
        added = self._transport.grow_receives(max(self._state.recv_depth, 1))
        if added:
            native = self._native
            if native is None or _grow(native, added):
                self.session.grow_receives(added)
            self._stats["recv_ring_grown"] += 1

    def _bind_one_shot(self) -> OneShot:
        """The first wait's wake-up: bind the backend's factory for the next ones, and make one."""
        self._new_one_shot = self.io.one_shot_factory()
        return self._new_one_shot()

    # --- re-posting ---------------------------------------------------------------------------------

    def repost_released(self) -> None:
        """Post the receive slots the buffer no longer holds (their credits go to the peer)."""
        slots = self._rxbuf.releasable()
        if slots and not self.stopped:
            self._transport.post_receives(slots)
            native = self._native
            if native is None or _reposted(native, len(slots)):
                self.session.on_recv_reposted(len(slots))
            self._stage()

    def repost(self, slot: int) -> None:
        """Post one held receive slot again (a write notice the application consumed: the one-sided
        engine's back-pressure); its credit is granted."""
        if not self.stopped:
            self._transport.post_receives([slot])
            native = self._native
            if native is None or _reposted(native, 1):
                self.session.on_recv_reposted(1)
            self._stage()

    # --- waiting ------------------------------------------------------------------------------------

    def wake_reader(self) -> None:
        """Wake the task waiting in a read call (it looks again at the buffer)."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: its task was cancelled (asyncio) and has not cleaned up yet
                waiter.set_result(None)

    def stop(self) -> None:
        """The connection is torn down: re-post nothing more; the waiting read call wakes and raises."""
        self.stopped = True
        self.wake_reader()

    # --- messages -----------------------------------------------------------------------------------

    def recv_nowait(self) -> bytes | None:
        """The next message if one is here and needs no pulling, else None (nothing taken)."""
        rxbuf = self._rxbuf
        messages = rxbuf.messages
        # Fast test, no call: a head that is not a placeholder is a complete message to pop as it is.
        if (not messages or isinstance(messages[0], Placeholder)) and (
            not rxbuf.has_message() or (rxbuf.pending and not isinstance(rxbuf.head(), bytes))
        ):
            return None
        data = rxbuf.pop_message()
        if rxbuf.held or rxbuf.pending:
            self._after_read()
        return data

    async def recv(self) -> bytes | None:
        """The next message, or None at a clean end of stream (:meth:`rdmaio.Endpoint.recv`).

        The hot path of a request/reply connection: one coroutine (this one) with the wait of
        :meth:`_wait_more` inline, and the buffer's fast test (a complete message at the head) made on its
        attributes, without a call."""
        rxbuf = self._rxbuf
        messages = rxbuf.messages
        while not messages or isinstance(messages[0], Placeholder):
            if messages and rxbuf.has_message():  # a placeholder at the head (settled ones are replaced now)
                if not rxbuf.pending or isinstance(rxbuf.head(), bytes):
                    break
                assert self.rndv is not None
                await self.rndv.take_head(None)  # zero-copy: pulled, then popped as any message
                continue
            # Nothing to read: wait for more (as _wait_more(), inline; keep the two the same).
            if self._generation != _fork_state._generation:
                check_fork(self._generation)
            if not self._close.clear:  # a close fact holds: the close state's answer
                outcome = self.session.recv_outcome()
                if outcome is EOF:
                    return None
                if isinstance(outcome, BaseException):
                    raise outcome
            if self.stopped:
                raise EndpointClosedError("endpoint is closed")
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                raise RuntimeError("another task is already waiting to read from this endpoint")
            waiter = self._waiter = self._new_one_shot()
            rxbuf.reader_waiting = True
            if rxbuf.held:
                self.repost_released()
            try:
                await waiter
            finally:
                rxbuf.reader_waiting = False
                if self._waiter is waiter:
                    self._waiter = None
        # The head is a complete message now (bytes).
        if rxbuf.offset:
            data = rxbuf.pop_message()  # the rest of a message a stream read began
        else:
            # pop_message(), inline (as ReceiveBuffer's docstring allows): take it whole, count it read.
            data = messages.popleft()  # type: ignore[assignment]
            size = len(data)
            rxbuf.unread -= size
            rxbuf.ready -= size
        if rxbuf.held or rxbuf.pending:
            self._after_read()
        return data

    async def recv_into(self, target: memoryview) -> int:
        """The next message copied (or READ) into ``target`` (:meth:`rdmaio.Endpoint.recv_into`)."""
        rxbuf = self._rxbuf
        messages = rxbuf.messages
        # As recv(): the buffer's fast test first (a complete message at the head), no call.
        while not messages or isinstance(messages[0], Placeholder):
            if messages and rxbuf.has_message():  # a placeholder at the head (settled ones are replaced now)
                if not rxbuf.pending or isinstance(rxbuf.head(), bytes):
                    break
                assert self.rndv is not None
                n = await self.rndv.take_head(target)  # zero-copy: READ straight into target
                if n is not None:
                    self._after_read()
                    return n
                continue
            if not await self._wait_more():
                return 0
        n = rxbuf.read_message_into(target)
        self._after_read()
        return n

    async def _wait_more(self) -> bool:
        """Wait for more received data or a state change; False if none will ever come (the peer's EOF);
        raise if the connection failed or was closed here. A reader that waits needs more than is
        buffered, so held slots are released while it waits (as asyncio's StreamReader resumes reading)."""
        if self._generation != _fork_state._generation:
            check_fork(self._generation)
        if not self._close.clear:  # a close fact holds: the close state's answer
            outcome = self.session.recv_outcome()
            if outcome is EOF:
                return False
            if isinstance(outcome, BaseException):
                raise outcome
        if self.stopped:
            raise EndpointClosedError("endpoint is closed")
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            raise RuntimeError("another task is already waiting to read from this endpoint")
        waiter = self._waiter = self._new_one_shot()
        rxbuf = self._rxbuf
        rxbuf.reader_waiting = True
        if rxbuf.held:
            self.repost_released()
        try:
            await waiter
        finally:
            rxbuf.reader_waiting = False
            if self._waiter is waiter:
                self._waiter = None
        return True

    async def _more_bytes(self, need: int) -> bool:
        """A stream read needs ``need`` bytes readable and has fewer: pull the announced messages among
        them if there are any (only those, in order: the rest waits for the automatic pull, within the
        buffer's limit), else wait for more data. False if no more will ever come (EOF)."""
        if self._rxbuf.pending:
            assert self.rndv is not None
            await self.rndv.pull_for(need)  # zero-copy
            return True
        return await self._wait_more()

    def _after_read(self) -> None:
        """The application took data: post the held slots again once the buffer allows it."""
        if self._rxbuf.held:
            self.repost_released()
        if self._rxbuf.pending and self.rndv is not None:
            self.rndv.kick()  # zero-copy: pulls held back by the buffer's limit may go now

    # --- the byte stream ----------------------------------------------------------------------------
    # The stream reads see the bytes before the first message announced and not pulled yet (rxbuf.ready);
    # each pulls announced messages only as far as it needs them.

    async def _read_some(self, n: int) -> bytes:
        """Up to ``n`` bytes (n > 0) of the stream; b"" at EOF. Skips empty messages."""
        rxbuf = self._rxbuf
        while not rxbuf.ready:
            rxbuf.skip_empty()
            if not await self._more_bytes(1):
                return b""
        data = rxbuf.take(n)
        self._after_read()
        return data

    async def read(self, n: int = -1) -> bytes:
        """:meth:`rdmaio.Endpoint.read`."""
        if n == 0:
            return b""
        if n > 0:
            return await self._read_some(n)
        while await self._more_bytes(sys.maxsize):
            pass
        data = self._rxbuf.take_all()
        self._after_read()
        return data

    async def readexactly(self, n: int) -> bytes:
        """:meth:`rdmaio.Endpoint.readexactly` (an endpoint's ``readexactly`` is this bound method)."""
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        if n == 0:
            return b""
        rxbuf = self._rxbuf
        while rxbuf.ready < n:
            if not await self._more_bytes(n):
                partial = rxbuf.take_all()
                self._after_read()
                raise asyncio.IncompleteReadError(partial, n)
        data = rxbuf.take(n)
        if rxbuf.held or rxbuf.pending:  # _after_read() has something to do
            self._after_read()
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        """:meth:`rdmaio.Endpoint.readuntil`."""
        if not separator:
            raise ValueError("Separator should be at least one-byte string")
        limit = self.options.read_limit
        seplen = len(separator)
        rxbuf = self._rxbuf
        while True:
            index = rxbuf.find(separator)
            if index >= 0:
                end = index + seplen
                if end > limit:
                    raise asyncio.LimitOverrunError(
                        "Separator is found, but chunk is longer than limit", index
                    )
                data = rxbuf.take(end)
                self._after_read()
                return data
            if rxbuf.ready > limit:
                raise asyncio.LimitOverrunError(
                    "Separator is not found, and chunk exceed the limit", rxbuf.ready - seplen + 1
                )
            if not await self._more_bytes(rxbuf.ready + 1):
                partial = rxbuf.take_all()
                self._after_read()
                raise asyncio.IncompleteReadError(partial, None)

    async def readline(self) -> bytes:
        """:meth:`rdmaio.Endpoint.readline`."""
        try:
            return await self.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial
        except asyncio.LimitOverrunError as exc:
            if self._rxbuf.startswith(b"\n", exc.consumed):
                self._rxbuf.take(exc.consumed + 1)
            else:
                self._rxbuf.clear()
            self._after_read()
            raise ValueError(exc.args[0]) from exc

    def at_eof(self) -> bool:
        """:meth:`rdmaio.Endpoint.at_eof`."""
        return self._rxbuf.unread == 0 and not self._rxbuf.pending and (self.session.peer_eof or self.stopped)
