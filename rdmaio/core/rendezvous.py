"""The rendezvous engine of one connection: zero-copy large messages on top of the one-sided engine.

The protocol and the per-message states are :mod:`rdmaio.protocol.rendezvous`'s; this module does the I/O:

* **Send** (:meth:`RendezvousEngine.send`): the caller's buffer is registered as its own memory region for
  this transfer only (never through the registration cache: a remotely readable region must not outlive
  its transfer) and made readable through this connection's queue pair only, by a type 2 memory window
  (:meth:`rdmaio.core.onesided.OneSidedEngine.export_for_read`; on a device without windows, by the
  connection's own protection domain, or copied where the connection shares the loop's); its size is
  counted against the connection's share (``Options.rndv_send_budget``, by default half of what the
  other connections leave free, :data:`SEND_SHARE`) and the Domain cache's ``max_pinned``
  (:meth:`RegistrationCache.try_reserve`; the Domain's also for a connection with a protection domain and
  a registration cache of its own, so that the budget is the device's; over either bound, the message
  goes the eager way, copied), the descriptor is queued as an RNDV frame in
  the sender's queue (so it keeps its place among eager frames), and ``send()`` waits for the peer's
  DONE, at most ``Options.rndv_timeout``: then it cancels itself as a cancelled ``send()`` does (so the
  buffer is never given back while the peer may still read it) and raises
  :class:`~rdmaio.errors.RendezvousTimeoutError`. The region is closed before ``send()`` returns or raises.
* **Receive**: the RNDV frame becomes a placeholder in the receive buffer
  (:class:`rdmaio.protocol.rendezvous.Incoming`) that keeps the message's place in the order. A
  ``recv_into()`` that finds it at the head pulls the data straight into the caller's buffer (registered,
  local access only, through the Domain's cache: a buffer used again is registered once); ``recv()`` and the
  stream reads pull it into a pooled bounce buffer of rdmaio and copy it out once (a stream read pulls
  only the messages within the bytes it needs: :meth:`RendezvousEngine.pull_for`). The placeholder's
  announced length counts against ``recv_buffer_limit``, and past it the RNDV frame's slot is held like a
  data frame's (:class:`rdmaio.protocol.rxbuffer.ReceiveBuffer`): the sender runs out of credits. A message
  nobody claims is pulled into rdmaio's memory two loop iterations after it arrived (so a reader woken by
  the same batch gets to claim it first), in arrival order, unless the receive buffer is over its limit:
  then it waits for the application to read (back-pressure: the sender waits in ``send()``). Pulling
  without a reader keeps two peers that both ``send()`` before they ``recv()`` from deadlocking, as eager
  messages do.
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
from rdmaio.core.onesided import ACCESS_READ, MAX_OP_BYTES, OneSidedEngine, RemoteKey
from rdmaio.errors import EndpointClosedError, ProtocolError, RendezvousTimeoutError, ReplyQueueFullError
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

__all__ = ["SEND_SHARE", "RendezvousEngine", "wait_shielded"]

log = logging.getLogger("rdmaio.rndv")

_MIN_BOUNCE = 64 * 1024
_POOL = 1  # bounce buffers kept registered per connection (dropped when the pin bound is reached)
SEND_SHARE = 2
"""Without ``Options.rndv_send_budget``, a connection's rendezvous sends keep at most ``1 / SEND_SHARE`` of
what the other connections leave free of the device's send budget (``max_pinned // 2``) registered. An
idle device lets one connection pin a quarter of ``max_pinned`` (64 MiB by default: one message of the
default ``max_message_size`` goes zero-copy), and peers that hold our sends unanswered until
``rndv_timeout`` never take the whole budget: each one that fills its share leaves half of the rest, so
after ``k`` of them ``1 / 2**k`` of the budget is still there for the next connection."""


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
        onesided: OneSidedEngine | None,
        pd: Any,
        cache: Any,
        threshold: int,
        max_message_size: int,
        close_timeout: float,
        stats: collections.Counter[str],
        timeout: float | None = None,
        send_budget: int | None = None,
        send_cache: Any = None,
    ) -> None:
        self._endpoint = weakref.ref(endpoint)
        self._io = endpoint.io
        self._rxbuf = endpoint.rxbuf
        self._session = endpoint.session
        self._onesided = onesided
        self._pd = pd
        self._cache = cache
        # The device's budget for sends waiting for their peers is counted in the Domain's cache even where
        # this connection registers in a cache of its own (a device without memory windows): with a
        # budget per connection, N peers that never answer would hold N times max_pinned / 4.
        self._send_cache = cache if send_cache is None else send_cache
        self.threshold = threshold
        self._close_timeout = close_timeout
        self._timeout = timeout  # Options.rndv_timeout
        self._send_budget = send_budget  # Options.rndv_send_budget (None: a share of max_pinned)
        self._send_pinned = 0  # bytes of this connection's sends registered and waiting for the peer
        self._stats = stats
        self.sends = SendTable()
        self.recvs = RecvTable(max_message_size)
        self._bounces: list[_Bounce] = []
        self._room_events: set[Any] = set()  # pulls waiting for registration room (close() wakes them)
        self._owned_inflight = 0
        self._auto_handle: Any = None
        self.closed = False
        self._error: BaseException | None = None
        if onesided is not None:  # else the connection sets it when it builds its engine (first use)
            onesided.control_handler = self.on_control

    def _build_onesided(self) -> OneSidedEngine:
        """The connection's one-sided engine, built now if it was not yet (its first use)."""
        endpoint = self._endpoint()
        if endpoint is None:
            raise EndpointClosedError("endpoint is closed")  # its connection is gone
        engine: OneSidedEngine = endpoint.onesided
        self._onesided = engine
        return engine

    @classmethod
    def for_connection(cls, conn: Any, transport: Any, options: Any) -> RendezvousEngine | None:
        """The engine of a connection (an endpoint's core), or None if rendezvous is off or the peer does
        not support it."""
        session = conn.session
        if not options.rndv_threshold or not session.rendezvous:
            return None
        # A connection with a protection domain of its own (a device without memory windows) registers
        # in it, through its own cache (rdmaio.core.transport.private_pd_needed).
        private = getattr(transport, "private_registrations", None)
        cache = private if private is not None else transport.domain.registrations
        return cls(
            conn,
            onesided=None,  # the connection's, built on first use (it routes our control messages to us)
            pd=transport.pd,
            cache=cache,
            threshold=max(options.rndv_threshold, DESCRIPTOR_SIZE + 1),
            max_message_size=options.max_message_size,
            close_timeout=options.close_timeout,
            stats=conn.stats,
            timeout=options.rndv_timeout,
            send_budget=options.rndv_send_budget,
            send_cache=transport.domain.registrations,
        )

    @property
    def _chunk(self) -> int:
        """Bytes registered and read at a time: a quarter of the pin bound (at least 1 MiB)."""
        return min(MAX_OP_BYTES, max(1 << 20, int(self._cache.max_pinned) // 4))

    @property
    def send_budget(self) -> int:
        """Bytes this connection's rendezvous sends may keep registered at once (waiting for the peer):
        ``Options.rndv_send_budget``, or a share of what the other connections leave free
        (:data:`SEND_SHARE`)."""
        if self._send_budget is not None:
            return self._send_budget
        cache = self._send_cache
        others = int(cache.send_pinned) - self._send_pinned
        return max(0, int(cache.max_pinned) // 2 - others) // SEND_SHARE

    @property
    def send_pinned(self) -> int:
        """Bytes of this connection's rendezvous sends registered now (within :attr:`send_budget`)."""
        return self._send_pinned

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
        cache = self._send_cache
        # This connection's share first (a peer that never answers holds at most that much of the
        # device's budget), then the device's: half of max_pinned, the pulls keep the other half.
        if self._send_pinned + size > self.send_budget or not cache.try_reserve(size, cache.max_pinned // 2):
            self._stats["rndv_fallback_eager"] += 1
            return False
        start = time.perf_counter_ns()
        try:
            # Readable by the peer through this connection only (a window bound on its queue pair).
            region = await (self._onesided or self._build_onesided()).export_for_read(view)
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
        # After earlier stream writes and batched messages, staged as credits allow.
        self._send_pinned += size  # given back with the region (_release_send)
        cache.send_pinned += size
        target = ep.sender.queue_rndv(encoded)
        log.debug("rndv send %d: %d bytes rkey %#x frame %d", out.msg_id, size, region.rkey, target)
        timer = None
        if self._timeout is not None:
            # The deadline sets the same event as the peer's answer; the send then cancels itself.
            timer = self._io.call_later(self._timeout, out.waiter.set)
        try:
            try:
                await out.waiter.wait()
            except BaseException:
                if not out.finished:
                    await self._cancel(ep, out, desc, encoded, target)
                raise
            if not out.finished:  # the deadline: the peer did not pull the message in time
                self._stats["rndv_timeouts"] += 1
                await self._cancel(ep, out, desc, encoded, target)
                if out.state is not SendState.DONE:  # (the peer may still have delivered it whole)
                    raise RendezvousTimeoutError(
                        f"the peer did not take a rendezvous message of {size} bytes within "
                        f"rndv_timeout ({self._timeout} s); "
                        + (
                            "it was withdrawn"
                            if out.state is SendState.WITHDRAWN
                            else "the connection was failed to stop the peer reading the buffer"
                        )
                    )
        finally:
            if timer is not None:
                timer.cancel()
            self._release_send(out)
            if ep.closing:
                ep.finish_close()  # a graceful close may have been waiting for this send only
        if out.state is not SendState.DONE:
            raise self._failure()
        stats = self._stats
        stats["rndv_sent"] += 1
        stats["rndv_bytes_sent"] += size  # per zero-copy message, never per frame (process metrics)
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
            ep.sender.posted_frames,
            target,
        )
        if out.waiter.is_set():
            out.waiter = self._io.event()  # set by the deadline, not by an answer: wait for the answer
        if ep.sender.posted_frames >= target:
            self.sends.posted(out)
        if not self.sends.cancel(out):
            if out.state is SendState.WITHDRAWN:
                desc.withdraw_in_place(encoded)  # still queued: the peer never learns the rkey
                self._stats["rndv_withdrawn_before_post"] += 1
            return
        ep.sender.transmit()  # the descriptor goes out before the CANCEL
        (self._onesided or self._build_onesided()).send_control(CTL_CANCEL, out.msg_id)
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
            self._send_pinned -= out.length
            self._send_cache.send_pinned -= out.length
            self._send_cache.unreserve(out.length)

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
                # An answer: past Options.max_queued_replies waiting, it raises ReplyQueueFullError, which
                # the receive path fails the connection with.
                (self._onesided or self._build_onesided()).send_control(CTL_WITHDRAWN, msg_id, reply=True)
                self._stats["rndv_withdrawn_by_peer"] += 1
                ep = self._endpoint()
                if ep is not None and self._rxbuf.held:
                    ep.receiver.repost_released()  # its announced bytes no longer count against the limit
            return
        if kind in (CTL_DONE, CTL_WITHDRAWN):
            out = self.sends.on_control(kind, msg_id)
            out.waiter.set()
            return
        raise ProtocolError(f"unknown rendezvous control message kind {kind}")

    # --- receiving ------------------------------------------------------------------------------------------

    def on_request(self, payload: memoryview) -> None:
        """An RNDV frame arrived: its placeholder goes to the receive buffer, where its announced length
        counts against the limit (the caller then asks the buffer whether the frame's slot is held, as for
        data: the descriptor is parsed, so the slot may be reposted once this returns)."""
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
        recvs = self.recvs
        # In arrival order, from the index of the messages not pulled yet: O(1) per message, however many
        # are announced.
        while (msg := recvs.next_queued()) is not None:
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
        kind = self.recvs.pulled(msg)
        try:
            (self._onesided or self._build_onesided()).send_control(kind, msg.desc.msg_id, reply=True)
        except ReplyQueueFullError as exc:
            # The peer announces messages and withholds the credits their DONEs need.
            # The data was read: it is delivered all the same, and the connection fails with that error.
            ep = self._endpoint()
            if ep is not None:
                ep.fail(exc)
        stats = self._stats
        stats["rndv_received"] += 1
        stats["rndv_bytes_received"] += msg.length
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
            ep.receiver.wake_reader()

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
        # Cancelled, the op is left to its completion (or the teardown), which releases it.
        await (self._onesided or self._build_onesided()).read_registered(
            key, desc.addr + offset, n, (addr, lkey)
        )

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

    async def pull_for(self, need: int) -> None:
        """A stream read needs the first ``need`` bytes of the stream: pull the announced messages among
        them (in order; those already pulling are not pulled again) and wait for the first one to be
        settled. The caller looks at the buffer again: more may be needed. Nothing beyond what the read
        needs is pulled here (the automatic pull, within ``recv_buffer_limit``, does the rest); a read
        that needs more than the limit still gets it, as asyncio's ``StreamReader`` does."""
        needed = self._rxbuf.needed(need)
        if not needed:
            return
        for msg in needed:
            if msg.state is RecvState.QUEUED:
                assert isinstance(msg, Incoming)
                self._start_pull(msg, None)
        first = needed[0]
        assert isinstance(first, Incoming)
        if not first.event.is_set():
            await first.event.wait()
        if first.state is RecvState.FAILED or (self.closed and not first.settled):
            raise self._recv_failure(first)
        if not first.settled:
            await self._io.sleep(0)  # pulled straight into a recv_into() buffer: its claimant settles it

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
        """Sends waiting for the peer and their registered bytes, announced messages not answered, the
        placeholders in the receive buffer and their announced bytes, bounce buffers kept."""
        return {
            "rndv_sending": len(self.sends.active),
            "rndv_send_pinned": self._send_pinned,
            "rndv_receiving": len(self.recvs.active),
            "recv_placeholders": self._rxbuf.pending,
            "recv_announced_bytes": self._rxbuf.announced,
            "rndv_bounce_buffers": len(self._bounces),
        }
