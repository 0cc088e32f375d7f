"""Writer: the send calls of one connection - messages (``send``) and the byte stream (``write``/``drain``).

Sends copy the caller's data into send slots before they are posted, so the caller's buffer is free the
moment ``send()`` returns or is cancelled; a send slot is reused only after its completion (selective
signalling: one signalled completion releases every earlier slot, because an RC queue completes in order).
Small messages and stream writes are coalesced by the send engine (:mod:`rdmaio.core.txengine`) and flushed at
the end of the loop iteration; large messages may go by rendezvous (:mod:`rdmaio.core.rndv_engine`). The
public docstrings are :class:`rdmaio.Endpoint`'s; this class is internal.
"""

from __future__ import annotations

from typing import Any

from rdmaio.core.connection import Connection

__all__ = ["Writer"]

_DRAIN = memoryview(b"")
"""What :meth:`Writer.send_nowait` returns for a message it queued when the caller must still drain."""


class Writer:
    """The send side of a :class:`~rdmaio.core.connection.Connection`: decides what to queue and who waits."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._tx = conn.tx

    def send_nowait(self, data: Any) -> memoryview | None:
        """:meth:`rdmaio.Endpoint.send`'s synchronous part: check, and queue a small message at once.
        None: done (most small messages end here, so the front creates no coroutine for them); otherwise
        the view that :meth:`send_rest` must finish (nothing of it queued yet, or :data:`_DRAIN`)."""
        conn = self._conn
        conn.raise_send_error()
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = view.nbytes
        conn.session.check_message_size(size)
        if size > self._tx.batch_limit or (conn.rndv is not None and size >= conn.rndv.threshold):
            return view
        return _DRAIN if self._queue_batched(view, size) else None

    async def send(self, data: Any) -> None:
        """:meth:`rdmaio.Endpoint.send`."""
        view = self.send_nowait(data)
        if view is not None:
            await self.send_rest(view)

    async def send_rest(self, view: memoryview) -> None:
        """What :meth:`send_nowait` left: wait below high water, or a rendezvous or a large message."""
        if view is _DRAIN:
            await self.drain()
            return
        conn = self._conn
        size = view.nbytes
        if conn.rndv is not None and size >= conn.rndv.threshold and await conn.rndv.send(view):
            return  # zero-copy: the peer pulled it; False: no room to pin it, sent eagerly
        tx = self._tx
        if size <= tx.batch_limit:
            if self._queue_batched(view, size):
                await self.drain()
            return
        tx.flush_buffers()  # keep the order of earlier stream writes and batched messages
        added = tx.queue_message(view)
        target = tx.queued_frames
        conn.pump()
        if tx.txq:
            tx.own_queued(added)
        while tx.posted_frames < target:
            conn.raise_send_error()
            await conn.wait_writable()

    def _queue_batched(self, view: memoryview, size: int) -> bool:
        """Append one small message to the batch of this loop iteration; True if the caller must then
        drain (above high water).

        The first message on an idle connection is posted at once instead (as a request or a reply usually
        is): waiting for the end of the iteration would cost a round trip one more loop iteration on each
        side, and there is nothing yet to batch it with. The ones after it are batched until the
        connection's next completion batch or flush (``SendEngine.coalesce_next``).
        """
        conn = self._conn
        tx = self._tx
        if tx.wbuf:
            tx.flush_wbuf()
        if (
            not tx.coalesce_next
            and conn.flush_handle is None
            and not tx.mbuf_count
            and not tx.txq
            and tx.room_for(size)
            and conn.session.can_send_data()
        ):
            tx.queue_message(view)
            conn.pump_and_post()
            if tx.txq:
                tx.own_queued(1)
            # Later sends are batched (and flushed at the end of their iteration) until this connection's
            # next completion batch or flush. No end-of-iteration callback is scheduled for this one: a
            # request/reply connection posts every message here and would pay one per message that finds
            # nothing to flush.
            tx.coalesce_next = True
            return False
        tx.queue_small(view, size)
        conn.schedule_flush()
        return tx.buffered > conn.options.write_high_water

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """:meth:`rdmaio.Endpoint.write`."""
        conn = self._conn
        conn.raise_send_error()  # also refuses a write after write_eof() (the session's send_error)
        if not data:
            return
        added, coalescing = self._tx.queue_stream(data)
        if added or not coalescing:
            conn.pump()
            self._tx.own_queued(added)
        if coalescing:
            conn.schedule_flush()

    def must_drain(self) -> bool:
        """:meth:`rdmaio.Endpoint.drain`'s synchronous part: raise the connection's error, or say whether
        there is anything to wait for (above the high-water mark). Most drains end here, so the front calls
        it before it creates the coroutine of :meth:`drain`."""
        conn = self._conn
        conn.raise_flush_error()
        return self._tx.buffered > conn.options.write_high_water

    async def drain(self) -> None:
        """:meth:`rdmaio.Endpoint.drain`."""
        if not self.must_drain():
            return
        conn = self._conn
        tx = self._tx
        tx.flush_buffers()
        conn.pump()
        while tx.txq_bytes > conn.options.write_low_water:
            conn.raise_flush_error()
            await conn.wait_writable()

    def write_eof(self) -> None:
        """:meth:`rdmaio.Endpoint.write_eof`."""
        conn = self._conn
        if conn.torn_down:
            return
        self._tx.flush_buffers()
        conn.session.write_eof()
        conn.pump()
