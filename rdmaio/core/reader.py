"""Reader: the read calls of one connection - messages (``recv``) and the byte stream (``read*``).

The peer's messages form an ordered sequence in the connection's receive buffer
(:mod:`rdmaio.protocol.rxbuffer`); ``recv()`` returns the next one and the stream reads see the same data as
one byte stream. Every read call takes its data only once it can return: a cancelled read consumes nothing.
Rendezvous (zero-copy) messages are placeholders until pulled by :mod:`rdmaio.core.rndv_engine`. The public
docstrings are :class:`rdmaio.Endpoint`'s; this class is internal.
"""

from __future__ import annotations

import asyncio
import sys

from rdmaio.core.connection import Connection
from rdmaio.errors import EndpointClosedError
from rdmaio.protocol import EOF

__all__ = ["Reader"]


class Reader:
    """The read side of a :class:`~rdmaio.core.connection.Connection` (asyncio ``StreamReader`` semantics)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._rxbuf = conn.rxbuf

    # --- messages -----------------------------------------------------------------------------------

    def recv_nowait(self) -> bytes | None:
        """The next message if one is here and needs no pulling, else None (nothing taken)."""
        rxbuf = self._rxbuf
        if not rxbuf.has_message() or (rxbuf.pending and not isinstance(rxbuf.head(), bytes)):
            return None
        data = rxbuf.pop_message()
        self._after_read()
        return data

    async def recv(self) -> bytes | None:
        """The next message, or None at a clean end of stream (:meth:`rdmaio.Endpoint.recv`)."""
        rxbuf = self._rxbuf
        while True:
            while not rxbuf.has_message():
                if not await self._wait_more():
                    return None
            if not rxbuf.pending or isinstance(rxbuf.head(), bytes):
                break
            assert self._conn.rndv is not None
            await self._conn.rndv.take_head(None)  # zero-copy: pulled, then popped as any message
        data = rxbuf.pop_message()
        self._after_read()
        return data

    async def recv_into(self, target: memoryview) -> int:
        """The next message copied (or READ) into ``target`` (:meth:`rdmaio.Endpoint.recv_into`)."""
        rxbuf = self._rxbuf
        while True:
            while not rxbuf.has_message():
                if not await self._wait_more():
                    return 0
            if not rxbuf.pending or isinstance(rxbuf.head(), bytes):
                break
            assert self._conn.rndv is not None
            n = await self._conn.rndv.take_head(target)  # zero-copy: READ straight into target
            if n is not None:
                self._after_read()
                return n
        n = rxbuf.read_message_into(target)
        self._after_read()
        return n

    # --- waiting ------------------------------------------------------------------------------------

    async def _wait_more(self) -> bool:
        """Wait for more received data; False if none will ever come (the peer's EOF); raise if the
        connection failed or was closed here."""
        conn = self._conn
        conn.check_fork()
        outcome = conn.session.recv_outcome()
        if outcome is EOF:
            return False
        if isinstance(outcome, BaseException):
            raise outcome
        if conn.torn_down:
            raise EndpointClosedError("endpoint is closed")
        await conn.wait_readable()
        return True

    async def _more_bytes(self, need: int) -> bool:
        """A stream read needs ``need`` bytes readable and has fewer: pull the announced messages among
        them if there are any (only those, in order: the rest waits for the automatic pull, within the
        buffer's limit), else wait for more data. False if no more will ever come (EOF)."""
        if self._rxbuf.pending:
            assert self._conn.rndv is not None
            await self._conn.rndv.pull_for(need)  # zero-copy
            return True
        return await self._wait_more()

    def _after_read(self) -> None:
        """The application took data: post the held slots again once the buffer allows it."""
        if self._rxbuf.held:
            self._conn.repost_released()
        if self._rxbuf.pending and self._conn.rndv is not None:
            self._conn.rndv.kick()  # zero-copy: pulls held back by the buffer's limit may go now

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
        """:meth:`rdmaio.Endpoint.readexactly`."""
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
        self._after_read()
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        """:meth:`rdmaio.Endpoint.readuntil`."""
        if not separator:
            raise ValueError("Separator should be at least one-byte string")
        limit = self._conn.options.read_limit
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
        return (
            self._rxbuf.unread == 0
            and not self._rxbuf.pending
            and (self._conn.session.peer_eof or self._conn.torn_down)
        )
