"""The rendezvous engine of one connection: zero-copy large messages on top of the one-sided engine.

The protocol and the per-message states are :mod:`rdmaio.protocol.rendezvous`'s; this module does the I/O:

* **Send** (:meth:`RendezvousEngine.send`): the caller's buffer is registered for remote READ as its own
  memory region for this transfer only (never through the registration cache: an rkey is valid on every
  queue pair of the protection domain, so a remotely readable region must not outlive its transfer), its
  size is counted against the Domain cache's ``max_pinned`` (:meth:`RegistrationCache.try_reserve`; over
  the bound, the message goes the eager way, copied), the descriptor is queued as an RNDV frame in the
  send engine's queue (so it keeps its place among eager frames), and ``send()`` waits for the peer's DONE;
  the region is closed before ``send()`` returns or raises.
* **Receive**: the RNDV frame becomes a placeholder in the receive buffer
  (:class:`rdmaio.protocol.rendezvous.Incoming`) that keeps the message's place in the order. A
  ``recv_into()`` that finds it at the head pulls the data straight into the caller's buffer (registered,
  local access only, through the Domain's cache: a buffer used again is registered once); ``recv()`` and the
  stream reads pull it into a pooled bounce buffer of rdmaio and copy it out once. A message nobody claims is
  pulled into rdmaio's memory two loop iterations after it arrived (so a reader woken by the same batch gets
  to claim it first), unless the receive buffer is over its limit: then it waits for the application to read
  (back-pressure: the sender waits in ``send()``). Pulling without a reader keeps two peers that both
  ``send()`` before they ``recv()`` from deadlocking, as eager messages do.
* READs go through :class:`rdmaio.core.onesided.OneSidedEngine` (its op slots bound the READs in flight with
  the one-sided ones, within the send queue and CQ sizes) in chunks of at most a quarter of
  ``max_pinned``; registrations wait while the cache has no room, woken by the cache when a registration
  falls out of use or a reservation is given back (:meth:`RegistrationCache.call_when_room`), not by polling.

A cancelled ``recv_into()`` whose READ is in flight waits for it (the NIC writes into the caller's buffer),
then leaves the message, copied, for the next read: a cancelled read takes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref
from typing import Any

from rdmaio import verbs
from rdmaio._ffi import lib
from rdmaio.core.onesided import ACCESS_READ, MAX_OP_BYTES, OneSidedEngine, RemoteKey
from rdmaio.core.txengine import RNDV_FRAME
from rdmaio.errors import EndpointClosedError, ProtocolError
from rdmaio.protocol.rendezvous import (
    CTL_CANCEL,
    CTL_DONE,
    CTL_WITHDRAWN,
    DESCRIPTOR_SIZE,
    Descriptor,
    Incoming,
    Outgoing,
    RecvState,
    RecvTable,
    SendState,
    SendTable,
)

__all__ = ["RendezvousEngine", "wait_shielded"]

log = logging.getLogger("rdmaio.rndv")

_WR_READ: int = lib.IBV_WR_RDMA_READ
_MIN_BOUNCE = 64 * 1024
_POOL = 1  # bounce buffers kept registered per connection (dropped when the pin bound is reached)


async def wait_shielded(io: Any, waiter: Any, timeout: float) -> bool:  # noqa: ASYNC109
    """Wait for the event ``waiter`` (``Backend.event()``) even if the calling task is cancelled meanwhile (at
    most ``timeout`` seconds); True if it was set. For waits that must end before a cancellation may
    propagate: memory lent to the NIC is not given back to the caller before the NIC is done with it."""
    if getattr(io, "name", "") == "trio":
        import trio

        with trio.CancelScope(shield=True), trio.move_on_after(timeout):
            await waiter.wait()
        return bool(waiter.is_set())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    task = asyncio.ensure_future(waiter.wait())
    try:
        while not task.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                await asyncio.wait([task], timeout=remaining)
            except asyncio.CancelledError:
                continue  # cancelled again: the caller re-raises its cancellation once the wait is over
    finally:
        if not task.done():
            task.cancel()
    return bool(waiter.is_set())


class _Bounce:
    __slots__ = ("buf", "region")

    def __init__(self, buf: bytearray, region: Any) -> None:
        self.buf = buf
        self.region = region


class RendezvousEngine:
    """Rendezvous sends and receives of one :class:`~rdmaio.Endpoint` (see the module docstring).

    ``endpoint`` is the endpoint's :class:`~rdmaio.core.connection.Connection`, held weakly (no reference
    cycle); ``onesided`` posts the READs and carries the control messages; ``cache`` is the Domain's
    :class:`~rdmaio.core.domain.RegistrationCache`.
    """

    def __init__(
        self,
        endpoint: Any,
        *,
        onesided: OneSidedEngine,
        pd: Any,
        cache: Any,
        threshold: int,
        max_message_size: int,
        close_timeout: float,
        stats: collections.Counter[str],
    ) -> None:
        self._endpoint = weakref.ref(endpoint)
        self._io = endpoint.io
        self._rxbuf = endpoint.rxbuf
        self._session = endpoint.session
        self._onesided = onesided
        self._pd = pd
        self._cache = cache
        self.threshold = threshold
        self._close_timeout = close_timeout
        self._stats = stats
        self.sends = SendTable()
        self.recvs = RecvTable(max_message_size)
        self._bounces: list[_Bounce] = []
        self._room_events: set[Any] = set()  # pulls waiting for registration room (close() wakes them)
        self._owned_inflight = 0
        self._auto_handle: Any = None
        self.closed = False
        self._error: BaseException | None = None
        onesided.control_handler = self.on_control

    @classmethod
    def for_connection(cls, conn: Any, transport: Any, options: Any) -> RendezvousEngine | None:
        """The engine of a connection (an endpoint's core), or None if rendezvous is off or the peer does
        not support it."""
        session = conn.session
        if not options.rndv_threshold or not session.rendezvous:
            return None
        cache = transport.domain.registrations
        if options.max_pinned is not None:
            cache.max_pinned = options.max_pinned
        return cls(
            conn,
            onesided=conn.onesided,
            pd=transport.pd,
            cache=cache,
            threshold=max(options.rndv_threshold, DESCRIPTOR_SIZE + 1),
            max_message_size=options.max_message_size,
            close_timeout=options.close_timeout,
            stats=conn.stats,
        )

    @property
    def _chunk(self) -> int:
        """Bytes registered and read at a time: a quarter of the pin bound (at least 1 MiB)."""
        return min(MAX_OP_BYTES, max(1 << 20, int(self._cache.max_pinned) // 4))

    @property
    def sending(self) -> int:
        """Rendezvous sends waiting for the peer (a graceful close waits for them)."""
        return len(self.sends.active)

    # --- sending --------------------------------------------------------------------------------------------

    async def send(self, view: memoryview) -> bool:
        """Send ``view`` (one message) by rendezvous; False if the pin bound leaves no room (send it
        eagerly then)."""
        ep = self._endpoint()
        if ep is None or self.closed:
            raise EndpointClosedError("endpoint is closed")
        size = view.nbytes
        cache = self._cache
        if not cache.try_reserve(size, cache.max_pinned // 2):  # half: the pulls keep the other half
            self._stats["rndv_fallback_eager"] += 1
            return False
        start = time.perf_counter_ns()
        try:
            # Readable by the peer through this connection only (a window bound on its queue pair).
            region = await self._onesided.export_for_read(view)
        except BaseException:
            cache.unreserve(size)
            raise
        if region is None:  # no memory windows on this device: by copy, never readable by others
            cache.unreserve(size)
            self._stats["rndv_fallback_eager"] += 1
            return False
        self._stats["rndv_register_ns"] += time.perf_counter_ns() - start
        out = self.sends.start(size)
        out.region = region
        # An Event, not a one-shot waiter: a cancelled wait on an asyncio future cancels the future itself,
        # and the cancellation path must wait on the same object again.
        out.waiter = self._io.event()
        desc = Descriptor(out.msg_id, region.addr, size, region.rkey)
        encoded = bytearray(desc.encode())  # mutable: a cancellation before posting withdraws it in place
        tx = ep.tx
        tx.flush_buffers()  # earlier stream writes and batched messages go first
        tx.txq.append((encoded, RNDV_FRAME))
        tx.queued_frames += 1
        tx.txq_bytes += len(encoded)
        target = tx.queued_frames
        log.debug("rndv send %d: %d bytes rkey %#x frame %d", out.msg_id, size, region.rkey, target)
        ep.pump()
        try:
            try:
                await out.waiter.wait()
            except BaseException:
                if not out.finished:
                    await self._cancel(ep, out, desc, encoded, target)
                raise
        finally:
            self._release_send(out)
            if ep.closing:
                ep.finish_close()  # a graceful close may have been waiting for this send only
        if out.state is not SendState.DONE:
            raise self._failure()
        stats = self._stats
        stats["rndv_sent"] += 1
        stats["messages_sent"] += 1
        stats["bytes_sent"] += size - DESCRIPTOR_SIZE  # the stage counted the descriptor's bytes
        return True

    async def _cancel(
        self, ep: Any, out: Outgoing, desc: Descriptor, encoded: bytearray, target: int
    ) -> None:
        """A ``send()`` was cancelled before the peer answered: make sure the peer will never read the
        buffer again before it goes back to the caller (see rdmaio.protocol.rendezvous)."""
        log.debug(
            "rndv send %d cancelled in %s (frames staged %d, ours %d)",
            out.msg_id,
            out.state.value,
            ep.tx.posted_frames,
            target,
        )
        if ep.tx.posted_frames >= target:
            self.sends.posted(out)
        if not self.sends.cancel(out):
            if out.state is SendState.WITHDRAWN:
                desc.withdraw_in_place(encoded)  # still queued: the peer never learns the rkey
                self._stats["rndv_withdrawn_before_post"] += 1
            return
        ep.post_staged()  # the descriptor goes out before the CANCEL
        self._onesided.send_control(CTL_CANCEL, out.msg_id)
        self._stats["rndv_cancels_sent"] += 1
        if not await wait_shielded(self._io, out.waiter, self._close_timeout) and not out.finished:
            # No answer: destroying the queue pair is the only way to stop the peer's READs for sure.
            self.sends.finish(out)
            ep.fail(EndpointClosedError("a cancelled rendezvous send() was not answered in time"))

    def _release_send(self, out: Outgoing) -> None:
        region, out.region = out.region, None
        if region is not None:
            log.debug("rndv send %d ends %s: region closed", out.msg_id, out.state.value)
            region.close()
            self._cache.unreserve(out.length)

    def _failure(self) -> BaseException:
        error: BaseException | None = self._session.flush_error()
        if error is not None:
            return error
        if self._error is None:
            return EndpointClosedError("endpoint is closed")
        return self._error

    # --- control messages -----------------------------------------------------------------------------------

    def on_control(self, kind: int, msg_id: int) -> None:
        """A rendezvous control message from the peer (the one-sided engine's ``control_handler``)."""
        log.debug("rndv control %d for %d", kind, msg_id)
        if kind == CTL_CANCEL:
            msg = self.recvs.on_cancel(msg_id)
            if msg is not None:  # not pulled yet: withdrawn, never read
                self._rxbuf.withdraw(msg)
                msg.event.set()
                self._onesided.send_control(CTL_WITHDRAWN, msg_id)
                self._stats["rndv_withdrawn_by_peer"] += 1
            return
        if kind in (CTL_DONE, CTL_WITHDRAWN):
            out = self.sends.on_control(kind, msg_id)
            out.waiter.set()
            return
        raise ProtocolError(f"unknown rendezvous control message kind {kind}")

    # --- receiving ------------------------------------------------------------------------------------------

    def on_request(self, payload: memoryview) -> None:
        """An RNDV frame arrived (its slot may be reposted once this returns: the descriptor is parsed)."""
        msg = self.recvs.on_descriptor(payload)
        if msg is None:
            self._stats["rndv_withdrawn_frames"] += 1
            return
        msg.event = self._io.event()  # several reads may wait on it, and a cancelled one must not spoil it
        log.debug("rndv announced %d: %d bytes rkey %#x", msg.desc.msg_id, msg.length, msg.desc.rkey)
        self._rxbuf.add_pending(msg)
        self._stats["rndv_announced"] += 1
        self.kick()

    def kick(self) -> None:
        """Pull unclaimed messages soon (after a reader woken now had its chance to claim one)."""
        if self._auto_handle is None and not self.closed:
            self._auto_handle = self._io.call_soon(self._auto_pull_later)

    def _auto_pull_later(self) -> None:
        self._auto_handle = self._io.call_soon(self._auto_pull)

    def _auto_pull(self) -> None:
        self._auto_handle = None
        if self.closed:
            return
        rxbuf = self._rxbuf
        for msg in rxbuf.placeholders():
            assert isinstance(msg, Incoming)
            if msg.state is not RecvState.QUEUED:
                continue
            held = rxbuf.buffered + self._owned_inflight
            if held and held + msg.length > rxbuf.limit and not rxbuf.reader_waiting:
                self._stats["rndv_deferred"] += 1
                return  # back-pressure: the sender waits until the application reads (kick() again)
            self._start_pull(msg, None)

    def _start_pull(self, msg: Incoming, into: memoryview | None) -> None:
        log.debug("rndv pull %d (%s)", msg.desc.msg_id, "direct" if into is not None else "owned")
        self.recvs.start_pull(msg)
        msg.into = into
        if into is None:
            self._owned_inflight += msg.length
        self._io.spawn(self._pull(msg), name=f"rdmaio rendezvous pull {msg.desc.msg_id}")

    async def _pull(self, msg: Incoming) -> None:
        into = msg.into
        data: bytes | None = None
        try:
            if into is not None:
                await self._read_into(msg, into)
                self._stats["rndv_zero_copy"] += 1
            else:
                data = await self._read_owned(msg)
        except BaseException as exc:
            msg.state = RecvState.FAILED
            msg.error = exc
            msg.event.set()
            self._wake_reader()
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            if into is None:
                self._owned_inflight -= msg.length
        self._onesided.send_control(self.recvs.pulled(msg), msg.desc.msg_id)
        stats = self._stats
        stats["rndv_received"] += 1
        stats["messages_received"] += 1
        stats["bytes_received"] += msg.length
        if data is not None:
            self._rxbuf.resolve(msg, data)
        if into is not None and msg.data is not None:
            # The recv_into() that claimed it was cancelled while the READ ran: the message stays, copied.
            self._rxbuf.resolve(msg, bytes(into[: msg.length]))
        msg.event.set()
        self._wake_reader()

    def _wake_reader(self) -> None:
        ep = self._endpoint()
        if ep is not None:
            ep.wake_reader()

    async def _read_into(self, msg: Incoming, into: memoryview) -> None:
        """READ the whole message into the caller's buffer (registered through the cache)."""
        length = msg.length
        if into.nbytes <= self._chunk:
            registration = await self._registration(into)
            try:
                pos = 0
                while pos < length:
                    n = min(length - pos, MAX_OP_BYTES)
                    await self._read_op(msg, pos, n, registration.addr + pos, registration.lkey)
                    pos += n
            finally:
                registration.release()
            return
        pos = 0
        while pos < length:
            n = min(length - pos, self._chunk)
            registration = await self._registration(into[pos : pos + n])
            try:
                await self._read_op(msg, pos, n, registration.addr, registration.lkey)
            finally:
                registration.release()
            pos += n

    async def _read_owned(self, msg: Incoming) -> bytes:
        """READ the message into a bounce buffer and copy it out (the one copy of ``recv()``)."""
        length = msg.length
        step = min(length, self._chunk)
        bounce = await self._bounce(step)
        parts: list[bytes] = []
        try:
            view = memoryview(bounce.buf)
            pos = 0
            while pos < length:
                n = min(length - pos, step)
                await self._read_op(msg, pos, n, bounce.region.addr, bounce.region.lkey)
                parts.append(bytes(view[:n]))
                pos += n
        finally:
            self._return_bounce(bounce)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_op(self, msg: Incoming, offset: int, n: int, addr: int, lkey: int) -> None:
        desc = msg.desc
        key = RemoteKey(desc.addr, desc.rkey, desc.length, ACCESS_READ, desc.msg_id)
        engine = self._onesided
        op = await engine._start(key, _WR_READ, n, staging=False)
        engine._post(op, desc.addr + offset, desc.rkey, local=(addr, lkey))
        try:
            await engine._wait(op)
        except BaseException:
            op.orphan = True  # the run is ending: its completion (or the teardown) releases it
            raise
        engine._release(op)
        if op.error is not None:
            raise op.error

    async def _registration(self, view: memoryview) -> Any:
        """A local registration of ``view`` from the cache, waiting while the pin bound leaves no room."""
        while True:
            if self.closed:
                raise self._failure()
            registration = self._cache.try_get(view, 0)
            if registration is not None:
                return registration
            await self._wait_for_room()

    async def _bounce(self, size: int) -> _Bounce:
        for i, bounce in enumerate(self._bounces):
            if len(bounce.buf) >= size:
                return self._bounces.pop(i)
        capacity = max(_MIN_BOUNCE, 1 << (size - 1).bit_length())
        while not self._cache.try_reserve(capacity):
            pool, self._bounces = self._bounces, []
            for idle in pool:  # our own idle buffers go first
                self._close_bounce(idle)
            if pool:
                continue
            if self.closed:
                raise self._failure()
            await self._wait_for_room()
        buf = bytearray(capacity)
        try:
            region = verbs.MemoryRegion(self._pd, buf)
        except BaseException:
            self._cache.unreserve(capacity)
            raise
        self._stats["rndv_bounce_registered"] += 1
        return _Bounce(buf, region)

    async def _wait_for_room(self) -> None:
        """Sleep until the Domain's registration cache may have room (a registration fell out of use, a
        reservation was given back) or this engine closes; the caller then tries again."""
        self._stats["rndv_pin_waits"] += 1
        event = self._io.event()
        self._room_events.add(event)
        self._cache.call_when_room(event.set)
        try:
            await event.wait()
        finally:
            self._room_events.discard(event)

    def _return_bounce(self, bounce: _Bounce) -> None:
        pool = self._bounces
        pool.append(bounce)
        pool.sort(key=lambda b: len(b.buf))
        while pool and (len(pool) > _POOL or self.closed):
            self._close_bounce(pool.pop(0))  # keep the largest

    def _close_bounce(self, bounce: _Bounce) -> None:
        bounce.region.close()
        self._cache.unreserve(len(bounce.buf))

    # --- the read calls' side ------------------------------------------------------------------------------

    async def take_head(self, into: memoryview | None) -> int | None:
        """The receive buffer's head is a placeholder: pull it (straight into ``into`` if given and the
        message fits, else into rdmaio's memory) and wait. Return the bytes delivered into ``into`` (the
        message is consumed), or None: the placeholder became an ordinary message in the buffer."""
        msg = self._rxbuf.head()
        assert isinstance(msg, Incoming)
        if msg.state is RecvState.QUEUED:
            direct = into is not None and msg.length <= into.nbytes
            self._start_pull(msg, into if direct else None)
        try:
            await msg.event.wait()
        except BaseException:
            if into is not None and msg.into is into:
                if msg.event.is_set():
                    if msg.state is RecvState.DONE:  # pulled, not consumed: it stays for the next read
                        self._rxbuf.resolve(msg, bytes(into[: msg.length]))
                else:
                    # The NIC is writing into the caller's buffer: wait for it; the pull then leaves the
                    # message, copied, in the buffer (msg.data marks the claim as abandoned).
                    msg.data = b""
                    if not await wait_shielded(self._io, msg.event, self._close_timeout):
                        ep = self._endpoint()
                        if ep is not None:
                            ep.fail(EndpointClosedError("a rendezvous READ did not complete in time"))
            raise
        if msg.state is not RecvState.DONE:
            if msg.state is RecvState.WITHDRAWN:
                return None  # withdrawn by the sender: the next message is the head now
            raise self._recv_failure(msg)
        if into is not None and msg.into is into:
            self._rxbuf.withdraw(msg)
            return msg.length
        return None

    async def settle(self) -> None:
        """Resolve every placeholder (stream reads see the data as bytes): pull what is not pulled yet and
        wait for all of it."""
        rxbuf = self._rxbuf
        while rxbuf.pending:
            waiting = rxbuf.placeholders()
            for msg in waiting:
                assert isinstance(msg, Incoming)
                if msg.state is RecvState.QUEUED:
                    self._start_pull(msg, None)
            msg = waiting[0]
            assert isinstance(msg, Incoming)
            if msg.event.is_set():
                if msg.state in (RecvState.FAILED,) or self.closed:
                    raise self._recv_failure(msg)
                await self._io.sleep(0)  # its claimant resolves it
                continue
            await msg.event.wait()
            if msg.state is RecvState.FAILED:
                raise self._recv_failure(msg)

    def _recv_failure(self, msg: Incoming) -> BaseException:
        outcome = self._session.recv_outcome()
        if isinstance(outcome, BaseException):
            return outcome
        if msg.error is not None and isinstance(msg.error, Exception):
            return msg.error
        return EndpointClosedError("endpoint is closed")

    # --- teardown -------------------------------------------------------------------------------------------

    def close(self, error: BaseException | None) -> None:
        """The connection is gone and its queue pair destroyed (the NIC touches none of the memory any
        more): fail the sends and pulls in progress, release the bounce buffers."""
        if self.closed:
            return
        self.closed = True
        self._error = error
        if self._auto_handle is not None:
            self._auto_handle.cancel()
            self._auto_handle = None
        for out in self.sends.fail_all():
            out.waiter.set()  # each send() closes its region when it resumes
        for msg in self.recvs.fail_all():
            if msg.error is None:
                msg.error = error
            if msg.event is not None:
                msg.event.set()
        pool, self._bounces = self._bounces, []
        for bounce in pool:
            self._close_bounce(bounce)
        for event in list(self._room_events):  # waiting for registration room: they see `closed` now
            event.set()

    def statistics(self) -> dict[str, int]:
        """Sends waiting for the peer, announced messages not answered, bounce buffers kept."""
        return {
            "rndv_sending": len(self.sends.active),
            "rndv_receiving": len(self.recvs.active),
            "rndv_bounce_buffers": len(self._bounces),
        }
