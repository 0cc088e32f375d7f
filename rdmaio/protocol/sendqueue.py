"""The send queue of one connection: frames waiting for credits and send slots, fragmentation and coalescing.

The sans-IO half of the send side, beside the receive buffer (:mod:`rdmaio.protocol.rxbuffer`): no verbs,
no fds, no loop. Messages are cut into frames of at most one slot (and the peer's maximum message size for
stream data), stream writes are coalesced into whole frames, and small messages are batched into one
DATA_BATCH frame with the protocol's record encoding (:func:`rdmaio.protocol.frames.append_batch_record`'s,
inline in :meth:`SendQueue.queue_small`).
The core's sender (:mod:`rdmaio.core.send`) owns one queue: it appends through the methods here and takes
frames from the head of :attr:`SendQueue.txq` as credits and slots allow (copying them into its slots).

Entries of :attr:`SendQueue.txq` are ``(data, kind)``: kind True/1 is a DATA_END frame, False/0 a
DATA_MORE frame, :data:`RNDV_FRAME` an RNDV frame (a rendezvous descriptor) and ``-n`` a DATA_BATCH
payload of ``n`` messages. Data may reference a caller's buffer until :meth:`SendQueue.own_queued`.
"""

from __future__ import annotations

import collections
from typing import Final, TypeAlias

from rdmaio.protocol.frames import BATCH_RECORD_HEADER

__all__ = ["RECORD_HEADERS", "RNDV_FRAME", "Payload", "SendQueue"]

RNDV_FRAME = 2
"""Kind of a :attr:`SendQueue.txq` entry that is an RNDV frame (a rendezvous descriptor)."""

Payload: TypeAlias = bytes | bytearray | memoryview
"""The bytes of one queued frame."""

RECORD_HEADERS: Final[tuple[bytes, ...]] = tuple(
    n.to_bytes(BATCH_RECORD_HEADER, "little") for n in range(1024)
)
"""The DATA_BATCH record header (the length as u32 little-endian) of a message of ``n`` bytes, for ``n`` below
``len(RECORD_HEADERS)``: an index instead of an ``int.to_bytes`` call per batched message (about 60 KB)."""


class SendQueue:
    """Frames waiting to be staged, and the stream/message coalescing buffers (see the module docstring).

    ``max_fragment`` is the largest frame (a slot, and the peer's limit); ``stream_fragment`` the largest
    frame of stream data (also at most the peer's maximum message size); ``batch_limit`` the largest
    message batched into a DATA_BATCH frame (-1: the peer cannot unpack batches).
    """

    def __init__(self, max_fragment: int, stream_fragment: int, batch_limit: int) -> None:
        self.max_fragment = max_fragment
        self.stream_fragment = stream_fragment
        self.batch_limit = batch_limit
        self.txq: collections.deque[tuple[Payload, int]] = collections.deque()
        self.txq_bytes = 0
        self.queued_frames = 0  # frames ever queued
        self.posted_frames = 0  # frames ever staged (copied to a slot): the sender counts them
        self.wbuf = bytearray()  # stream writes being coalesced
        self.mbuf = bytearray()  # small messages being batched (DATA_BATCH records)
        self.mbuf_count = 0
        # A message of n bytes fits the batch being built while len(mbuf) + n <= batch_room.
        self.batch_room = max_fragment - BATCH_RECORD_HEADER

    @property
    def buffered(self) -> int:
        """Bytes accepted and not yet copied into a send slot (what ``drain()`` waits on)."""
        return self.txq_bytes + len(self.wbuf) + len(self.mbuf)

    def clear(self) -> None:
        """Drop everything not yet staged (abort)."""
        self.txq.clear()
        self.txq_bytes = 0
        self.wbuf.clear()
        self.mbuf.clear()
        self.mbuf_count = 0

    # --- appending ---------------------------------------------------------------------------------

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

    def queue_rndv(self, descriptor: bytearray) -> int:
        """Queue one RNDV frame (an encoded rendezvous descriptor, kept mutable so a cancellation before it
        is staged can withdraw it in place) after whatever is coalescing; return its frame number (it is
        staged once :attr:`posted_frames` reaches it)."""
        self.flush_buffers()  # earlier stream writes and batched messages go first
        self.txq.append((descriptor, RNDV_FRAME))
        self.queued_frames += 1
        self.txq_bytes += len(descriptor)
        return self.queued_frames

    def queue_stream(self, data: Payload) -> tuple[int, bool]:
        """Add stream bytes: whole frames go straight to the queue (copied into slots when staged, no
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

    def queue_small(self, view: memoryview | bytes, size: int) -> int:
        """Append a small message of ``size`` bytes (a byte view, or a ``bytes`` object as it is) to the batch
        being built (flushing the batch first if it is full); return :attr:`buffered`."""
        if self.wbuf:
            self.flush_wbuf()
        mbuf = self.mbuf
        if len(mbuf) + size > self.batch_room:
            self.flush_mbuf()
            mbuf = self.mbuf
        # append_batch_record(mbuf, view), inline (one call less per message; a unit test holds the two
        # to the same bytes): the length as u32 little-endian, then the bytes. The sender's send() does
        # the same inline for a message below len(RECORD_HEADERS) bytes (keep the two the same).
        mbuf += (
            RECORD_HEADERS[size]
            if size < len(RECORD_HEADERS)
            else size.to_bytes(BATCH_RECORD_HEADER, "little")
        )
        mbuf += view
        self.mbuf_count += 1
        return self.txq_bytes + len(mbuf)  # wbuf is empty

    def own_queued(self, count: int) -> None:
        """Copy the last ``count`` queued frames so no caller buffer is referenced after we return.

        A view of a ``bytes`` object is kept as it is: nobody can change those bytes, and the view keeps the
        object alive until the frame is staged. A stream of ``bytes`` writes that waits for credits is then
        copied once (into the send ring), not twice; a mutable buffer (bytearray, array, mmap, a read-only
        view of a mutable one) is still copied here, since the caller may reuse it as soon as we return."""
        txq = self.txq
        for i in range(len(txq) - min(count, len(txq)), len(txq)):
            data, last = txq[i]
            if type(data) is memoryview and type(data.obj) is not bytes:
                txq[i] = (bytes(data), last)

    # --- coalescing --------------------------------------------------------------------------------

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
            data: bytes | bytearray = bytes(memoryview(self.mbuf)[BATCH_RECORD_HEADER:])
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
