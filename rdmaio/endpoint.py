"""Endpoint: one RDMA connection with a message API and an asyncio-streams-style byte API.

This class is the public front of one started connection (set up by :mod:`rdmaio.core.dial` or
:mod:`rdmaio.core.acceptor`); the work is done below it, one job per class:
:class:`rdmaio.core.connection.Connection` owns the verbs resources, the protocol session, the one-sided and
rendezvous engines, demultiplexes completions and handles the connection's lifetime and events; its
:class:`rdmaio.core.send.Sender` does the send calls and all posting, its
:class:`rdmaio.core.receive.Receiver` the read calls and all re-posting of receives.

Data path. Every frame travels as one SEND-with-immediate from a registered send slot into a registered
receive slot of the peer; the immediate value carries the frame kind and piggybacked credits
(:mod:`rdmaio.protocol`). Sends copy the caller's data into send slots before they are posted, so the
caller's buffer is free the moment ``send()`` returns or is cancelled. A send never meets an empty receive
queue: a receive slot the application has not read yet is held back (no credit), and the sender waits.

How the two APIs meet: the peer's messages form an ordered sequence; ``recv()`` returns the next one and
the stream calls (``read*``) see the same data as one byte stream, so ``write()`` on one side pairs with
``read*()`` on the other and ``send()`` with ``recv()``. Stream writes are coalesced into frames of up to
``slot_size`` bytes, so ``recv()`` on stream data returns chunks whose boundaries carry no meaning. A
``recv()`` after a partial stream read returns the rest of that message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Self

from rdmaio.core.connection import Connection
from rdmaio.core.onesided import OneSidedEngine, RemoteKey, WriteNotice
from rdmaio.core.onesided import fork_state as _fork_state  # _generation read per one-sided call: no call
from rdmaio.core.path import query_connection_path
from rdmaio.errors import VerbsError
from rdmaio.options import Options

__all__ = ["Endpoint"]


class Endpoint:
    """A connected RDMA endpoint. Create one with :func:`rdmaio.connect` or receive one in a server handler.

    Message API: :meth:`send`, :meth:`recv`, :meth:`recv_into`. Stream API (as ``asyncio.StreamReader`` /
    ``StreamWriter``): :meth:`write`, :meth:`writelines`, :meth:`drain`, :meth:`write_eof`, :meth:`read`,
    :meth:`readexactly`, :meth:`readuntil`, :meth:`readline`, :meth:`at_eof`, ``async for line in ep``.
    Lifetime: :meth:`close`, :meth:`wait_closed`, :meth:`aclose`, :meth:`abort`, ``async with``.

    One task may wait in a read call and one in a send/drain call at a time; concurrent sends from several
    tasks are allowed and are queued in call order.
    """

    def __init__(self, connection: Connection) -> None:
        """The front of ``connection``, a started connection (:func:`rdmaio.core.dial.dial`, or a server's
        :class:`~rdmaio.core.acceptor.Acceptor`); applications get endpoints from :func:`rdmaio.connect`
        and servers, they do not make them."""
        # Every part of the connection this front calls is taken here, once: the read side, the write
        # side, the one-sided engine and the verbs resources.
        self._conn = (
            connection  # internal: the connection core (tests and tools reach the resources through it)
        )
        self._reader = connection.receiver  # the read calls
        self._writer = connection.sender  # the send calls
        # The one-sided engine: the connection builds it on first use (most connections never use it).
        self._onesided: OneSidedEngine | None = None
        self._transport = connection.transport
        # send() and recv() are the sender's and the receiver's own bound methods, set here once (as the
        # one-sided facade's calls are): a message costs one coroutine, not this front's and one below it.
        # A subclass that overrides them, or a class patched (a test's mock) before the endpoint was made,
        # keeps its own.
        cls = type(self)
        if cls.send is _FRONT_SEND:
            self.send = self._writer.send  # type: ignore[method-assign]
        if cls.recv is _FRONT_RECV:
            self.recv = self._reader.recv  # type: ignore[method-assign]
        # The same for the stream's hot calls: a write, a drain, a readexactly() is one call of the core.
        if cls.write is _FRONT_WRITE:
            self.write = self._writer.write  # type: ignore[method-assign]
        if cls.drain is _FRONT_DRAIN:
            self.drain = self._writer.drain  # type: ignore[method-assign]
        if cls.readexactly is _FRONT_READEXACTLY:
            self.readexactly = self._reader.readexactly  # type: ignore[method-assign]

    # --- information -------------------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """Return ``peername``, ``sockname``, ``device``, ``port``, ``qp_num``, ``mtu``, ``max_inline``,
        ``options``, ``peer_max_message_size`` (the largest message the peer accepts), ``framing``
        (``"immediate"``, or ``"header"`` where a device lacks immediate data or a side forced it) or
        ``rdma`` by name.

        ``"rdma"`` is the connection's path record, a :class:`rdmaio.PathInfo` (device, port, transport,
        GIDs, MTU, credits, features, the peer's version: docs/monitoring.md): read from the device on the
        first request and kept; ``default`` if the connection was closed before it was first asked for."""
        extra = self._conn.extra
        if name == "rdma":
            path = extra.get("rdma")
            if path is None:
                # Queried on first use only (system calls), then kept with the connection's information.
                try:
                    path = extra["rdma"] = query_connection_path(self._conn)
                except VerbsError:
                    return default
            return path
        if name == "mtu" and "mtu" not in extra:
            # Queried on first use, not in every connection's setup (ibv_query_port is a system call; the
            # device context is rdma_cm's, open as long as the process).
            try:
                extra["mtu"] = self._transport.device.query_port(extra["port"]).active_mtu
            except VerbsError:
                return default
        return extra.get(name, default)

    def statistics(self) -> dict[str, float]:
        """Counters of this connection: bytes/messages sent and received, wake-ups, batches, credits."""
        return self._conn.statistics()

    def is_closing(self) -> bool:
        """True once close() or abort() was called or the connection failed."""
        return self._conn.closing or self._conn.torn_down

    @property
    def options(self) -> Options:
        """The options this endpoint was created with."""
        return self._conn.options

    # --- message API --------------------------------------------------------------------------------

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` as one message (any bytes-like object, up to the peer's ``max_message_size``).

        ``data`` is copied, so the caller may reuse it at once - except a message of at least
        ``Options.rndv_threshold`` bytes to a peer that supports rendezvous: it is registered and pulled by
        the peer (zero-copy, :mod:`rdmaio.core.rendezvous`), and ``send()`` returns once the peer has it (a
        cancelled one waits until the peer withdrew or finished reading it); the buffer is free when
        ``send()`` returns or raises. A message up to ``Options.batch_limit``
        (8 KiB) is packed with the other small messages of the same loop iteration into one frame, and
        ``send()`` returns once it is queued, waiting only while more than ``write_high_water`` bytes are
        queued (as ``write()`` + ``drain()``); a larger message returns once every fragment is posted to
        the NIC. Either way a failure of the connection is raised by the next call. A cancelled
        ``send()`` may still deliver the whole message (never a part of it) and leaves the endpoint
        usable.
        """
        # An endpoint's send is the sender's (see __init__): this runs only through the class or a subclass.
        await self._writer.send(data)

    async def recv(self) -> bytes | None:
        """Return the next message, or ``None`` at a clean end of stream (the peer closed or wrote EOF).

        Raises :class:`~rdmaio.ConnectionResetError` if the peer went away without closing cleanly. A
        cancelled ``recv()`` takes nothing: the message stays for the next read.
        """
        # An endpoint's recv is the receiver's (see __init__): this runs only through the class or a subclass.
        return await self._reader.recv()

    async def recv_into(self, buffer: bytearray | memoryview) -> int:
        """Copy the next message into ``buffer`` and return its size (0 at end of stream).

        A rendezvous message that fits is read by the NIC straight into ``buffer`` (no copy; ``buffer`` is
        registered through the Domain's cache, local access only). A cancelled call takes nothing.

        A message larger than ``buffer`` fills it; the rest is returned by the next read call.
        """
        return await self._reader.recv_into(memoryview(buffer).cast("B"))

    # --- stream API: writing ------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data`` on the byte stream; small writes are coalesced into large frames."""
        # An endpoint's write is the sender's (see __init__): this runs only through the class or a subclass.
        self._writer.write(data)

    def writelines(self, data: Any) -> None:
        """Write every bytes-like object of an iterable."""
        for chunk in data:
            self.write(chunk)

    async def drain(self) -> None:
        """Wait until the send buffer is at or below the low-water mark, if it is above the high one.

        Below the high-water mark this returns at once and leaves small writes to be coalesced. After
        :meth:`write_eof` it still waits for the data written before (as asyncio's ``drain()``): only new
        writes are refused.
        """
        # An endpoint's drain is the sender's (see __init__): this runs only through the class or a subclass.
        if self._writer.must_drain():
            await self._writer.drain()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Set the high- and low-water marks of :meth:`drain`, with ``WriteTransport``'s defaults.

        No arguments: 64 KiB and 16 KiB; only ``low``: high is ``4 * low``; only ``high``: low is
        ``high // 4``.
        """
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not 0 <= low <= high:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._conn.options = dataclasses.replace(
            self._conn.options, write_high_water=high, write_low_water=low
        )

    def get_write_buffer_size(self) -> int:
        """Bytes queued for sending and not yet posted to the NIC."""
        return self._writer.buffered

    def can_write_eof(self) -> bool:
        """Always True: half-close is supported."""
        return True

    def write_eof(self) -> None:
        """Close the sending direction after the queued data; the peer reads EOF, we can still read."""
        self._writer.write_eof()

    # --- stream API: reading ------------------------------------------------------------------------
    # Every read call takes its data only once it can return: a cancelled read consumes nothing.

    async def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (``n < 0``: until EOF). Returns b"" at EOF."""
        return await self._reader.read(n)

    async def readexactly(self, n: int) -> bytes:
        """Read exactly ``n`` bytes; raise ``asyncio.IncompleteReadError`` if EOF comes first.

        As asyncio's: nothing is consumed until ``n`` bytes are there (a cancelled call loses nothing);
        at EOF the partial data is consumed and carried by the error.
        """
        # An endpoint's readexactly is the receiver's (see __init__): this runs only through the class or a
        # subclass.
        return await self._reader.readexactly(n)

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        """Read up to and including ``separator`` (asyncio semantics, including ``LimitOverrunError``)."""
        return await self._reader.readuntil(separator)

    async def readline(self) -> bytes:
        """Read one line (asyncio semantics: at EOF the partial line; b"" when nothing is left)."""
        return await self._reader.readline()

    def at_eof(self) -> bool:
        """True when the buffer is empty and the peer sent EOF (or the connection ended)."""
        return self._reader.at_eof()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[bytes]:
        while line := await self.readline():
            yield line

    # --- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Start a graceful close: queued data is sent, then EOF, then the connection is released.

        Returns immediately; await :meth:`wait_closed` (or use :meth:`aclose`) to wait for the end.
        """
        self._conn.close()

    async def wait_closed(self) -> None:
        """Wait until the connection is fully released."""
        await self._conn.closed.wait()

    async def aclose(self) -> None:
        """Close gracefully and wait until released."""
        self.close()
        await self.wait_closed()

    def abort(self) -> None:
        """Close at once: queued data is dropped, and pending and later calls fail with
        :class:`~rdmaio.EndpointClosedError` ("endpoint was aborted"). A connection that rdmaio aborts
        itself, on a protocol violation by the peer, raises :class:`~rdmaio.ConnectionAbortedError`."""
        self._conn.abort()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _add_close_callback(self, callback: Callable[[Endpoint], None]) -> None:
        """Call ``callback(self)`` once every resource is released (at once if that already happened)."""
        # A strong reference to this endpoint, dropped at teardown (as the reactor's to the endpoint was).
        self._conn.add_close_callback(lambda: callback(self))

    # --- one-sided RDMA (the work is rdmaio.core.onesided.OneSidedEngine's) ---------------------------

    def _one_sided(self) -> OneSidedEngine:
        """The connection's one-sided engine, built at this first one-sided call (then kept here)."""
        engine = self._onesided = self._conn.onesided
        return engine

    def export(
        self,
        buffer: Any,
        offset: int = 0,
        length: int | None = None,
        access: str = "rw",
        *,
        scope: str = "connection",
    ) -> RemoteKey:
        """Let the peer access ``buffer[offset:offset+length]`` with one-sided operations; return the key.

        ``buffer`` is any writable buffer (bytearray, memoryview, mmap, numpy array); ``length=None`` means
        to its end. ``access`` is a string of ``"r"`` (RDMA READ), ``"w"`` (RDMA WRITE) and ``"a"``
        (atomics). Exactly that range is registered (its own memory region) and stays registered, with
        ``buffer`` kept alive, until :meth:`revoke` or the end of the connection. Send ``bytes(key)`` (at
        most 64 bytes) to the peer, which rebuilds the key with :meth:`RemoteKey.from_bytes`.

        ``scope="connection"`` (the default): the key works through this connection only (a type 2 memory
        window bound on its queue pair; every other connection of the process, on any loop, is refused by
        the NIC). The bind is posted now, so whatever this endpoint sends afterwards, ``bytes(key)``
        included, reaches the peer after the key became valid; a key sent by another path may arrive
        first. On a device without memory windows (siw) the connection has a protection domain of its
        own, and the key is its region's own rkey, which works through this connection only too.
        ``scope="domain"`` grants the range to every connection of this loop's device (the region's own
        rkey), as one must ask for by name; it raises :class:`~rdmaio.FeatureNotSupportedError` on a
        device without memory windows. Access ``"a"`` raises it on a device without atomics. See
        docs/one-sided.md, "Key scope".
        """
        self._conn.check_fork()
        return (self._onesided or self._one_sided()).export(buffer, offset, length, access, scope)

    async def revoke(self, key: RemoteKey) -> None:
        """Revoke a key this side exported: when this returns, the peer can no longer touch that memory.

        The peer is told first (its later calls on the key raise :class:`~rdmaio.RemoteKeyRevokedError`
        without posting) and answers once the requests it posted before have run; then the memory is
        deregistered, so the NIC refuses the key even to a peer that ignores the message. Waits at most
        ``Options.close_timeout`` for the answer; cancelled or failed, it still deregisters.
        """
        self._conn.check_fork()
        await (self._onesided or self._one_sided()).revoke(key)

    async def wait_write_notice(self) -> WriteNotice:
        """Wait for the next :class:`~rdmaio.WriteNotice`: the peer did ``rdma_write(..., imm=...)`` into
        memory we exported (the data is in place when the notice arrives)."""
        self._conn.check_fork()
        return await (self._onesided or self._one_sided()).wait_write_notice()

    async def rdma_read(self, key: RemoteKey, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset`` of the peer's exported memory (RDMA READ).

        Raises :class:`~rdmaio.RemoteAccessError` before posting if the range is outside the key or the key
        lacks ``"r"``. The NIC writes into rdmaio-owned registered memory, so a cancelled call is safe and
        leaves the endpoint usable.
        """
        if self._conn.generation != _fork_state._generation:  # check_fork()'s test, inline: no call
            self._conn.check_fork()
        return await (self._onesided or self._one_sided()).read(key, offset, length)

    async def rdma_read_into(self, key: RemoteKey, offset: int, buffer: Any) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` of the peer's memory straight into ``buffer``.

        Zero-copy: ``buffer`` is registered (local access only, cached in the Domain). **Cancellation fails
        the endpoint**: if the call is cancelled while the READ is in flight, the connection is aborted
        (its queue pair destroyed, so the NIC can no longer write into ``buffer``) before the cancellation
        propagates; use :meth:`rdma_read` where cancellation must leave the connection usable.
        """
        self._conn.check_fork()
        return await (self._onesided or self._one_sided()).read_into(key, offset, buffer)

    async def rdma_write(self, key: RemoteKey, offset: int, data: Any, imm: int | None = None) -> None:
        """Write ``data`` at ``offset`` of the peer's exported memory (RDMA WRITE); returns once it is done.

        ``data`` is copied first, so it may be reused at once. With ``imm`` (an unsigned 32-bit value) the
        write carries immediate data and the peer gets a :class:`~rdmaio.WriteNotice` from
        :meth:`wait_write_notice`; such a write uses a send credit, like a message. Where the connection has
        no immediate data (iWARP, ``Options(framing="header")``) the notice is a message sent after the
        WRITE, and the call returns once the WRITE completed and the notice took its send credit. A
        cancelled call may still perform the write, and without immediate data it may do so without
        sending its notice.
        """
        if self._conn.generation != _fork_state._generation:  # check_fork()'s test, inline: no call
            self._conn.check_fork()
        await (self._onesided or self._one_sided()).write(key, offset, data, imm)

    async def fetch_add(self, key: RemoteKey, offset: int, add: int) -> int:
        """Atomically add ``add`` (modulo 2**64) to the u64 at ``offset`` (8-byte aligned, in the
        exporter's byte order); return the old value. The key needs ``"a"``."""
        if self._conn.generation != _fork_state._generation:  # check_fork()'s test, inline: no call
            self._conn.check_fork()
        return await (self._onesided or self._one_sided()).fetch_add(key, offset, add)

    async def compare_swap(self, key: RemoteKey, offset: int, expected: int, desired: int) -> int:
        """Atomically store ``desired`` in the u64 at ``offset`` if it equals ``expected``; return the old
        value (the swap happened if it equals ``expected``). 8-byte aligned; the key needs ``"a"``."""
        if self._conn.generation != _fork_state._generation:  # check_fork()'s test, inline: no call
            self._conn.check_fork()
        return await (self._onesided or self._one_sided()).compare_swap(key, offset, expected, desired)

    async def fetch_add_many(
        self, key: RemoteKey, offsets: Iterable[int], add: int | Iterable[int] = 1
    ) -> list[int]:
        """Atomically add to many u64s of one key; return their old values, in the order of ``offsets``.

        ``add`` is one value for every offset or one per offset (each modulo 2**64); offsets may repeat
        (each addition is its own atomic, applied in order). Every offset is checked first, as by
        :meth:`fetch_add`: one out of range or misaligned raises :class:`~rdmaio.RemoteAccessError` and
        nothing is posted. The additions go out in waves of up to ``Options.max_rdma_ops`` requests, each
        posted as one chain that completes once: the way to pipeline atomics (a call per atomic costs a
        wake-up of its task each). If it raises after posting (a lost connection, a cancellation), some
        additions may have been applied: their old values are lost with the call, as a single
        :meth:`fetch_add`'s would be.
        """
        self._conn.check_fork()
        return await (self._onesided or self._one_sided()).fetch_add_many(key, offsets, add)

    async def rdma_read_many(self, key: RemoteKey, ranges: Iterable[tuple[int, int]]) -> list[bytes]:
        """Read many ``(offset, length)`` ranges of one key; return their bytes, in order (RDMA READs).

        Every range is checked first (:class:`~rdmaio.RemoteAccessError` before anything is posted); each
        is at most 64 KiB (:class:`~rdmaio.MessageTooLargeError`: use :meth:`rdma_read` for larger ones).
        The READs go out in waves of up to ``Options.max_rdma_ops`` requests and 64 KiB, each posted as one
        chain that completes once. Like :meth:`rdma_read`, the NIC writes into rdmaio-owned memory: a
        cancelled call is safe and leaves the endpoint usable.
        """
        self._conn.check_fork()
        return await (self._onesided or self._one_sided()).read_many(key, ranges)

    def __repr__(self) -> str:
        conn = self._conn
        state = "closed" if conn.torn_down else "closing" if conn.closing else "open"
        extra = conn.extra
        return f"<rdmaio.Endpoint {state} {extra['sockname']} -> {extra['peername']} qp={extra['qp_num']}>"


# The fronts as defined here: Endpoint.__init__ binds the sender's and receiver's methods only while the
# class still has these (not a subclass's override, not a patch).
_FRONT_SEND = Endpoint.send
_FRONT_RECV = Endpoint.recv
_FRONT_WRITE = Endpoint.write
_FRONT_DRAIN = Endpoint.drain
_FRONT_READEXACTLY = Endpoint.readexactly
