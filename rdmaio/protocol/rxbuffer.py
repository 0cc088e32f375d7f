"""ReceiveBuffer: what one connection received and the application has not read yet, and back-pressure.

Sans-IO (no verbs, no loop): the endpoint feeds it the payloads of received frames and asks it which
receive slots may be posted again; the read calls of the endpoint take their data from it. The
simulation in ``tests/unit/test_protocol.py`` drives the same class, so the rule that the liveness
argument of :mod:`rdmaio.protocol` depends on is the rule the endpoint runs.

Back-pressure rule. A slot that carried data (DATA_MORE, DATA_END, DATA_BATCH) is *held* - not posted
again, so the peer gets no credit for it - while all three hold:

* the buffered bytes (complete unread messages plus the message being reassembled) exceed ``limit``;
* at least one complete message is waiting to be read (so the application can release the slots by
  reading: a reader waiting for the rest of a message larger than ``limit`` is never starved);
* no reader is waiting for more data (as asyncio's ``StreamReader`` resumes reading when a read needs
  more: ``readexactly(n)`` with ``n`` above the limit completes).

Slots of frames without payload (CREDIT, EOF) are never held: they are reposted as soon as they are seen,
which is what keeps credits flowing in both directions while one side's application does not read.

Worst case per connection: ``max(limit, max_message_size) + recv_depth * slot_size`` bytes buffered. A
complete message of up to ``max_message_size`` is always accepted, even when it alone exceeds the limit;
once holding starts, the frames the peer already holds credits for (at most ``recv_depth``) still arrive
and are buffered. While the last fragment of a large message is joined, a second copy of it exists.
"""

from __future__ import annotations

import collections

__all__ = ["ReceiveBuffer"]


class ReceiveBuffer:
    """Complete messages not yet read, the message being reassembled, and the slots held back."""

    __slots__ = (
        "_held",
        "_messages",
        "_offset",
        "_parts",
        "assembling",
        "limit",
        "pending",
        "reader_waiting",
        "unread",
    )

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"receive buffer limit must be positive, not {limit}")
        self.limit = limit
        self._messages: collections.deque[bytes] = collections.deque()
        self._offset = 0  # bytes of _messages[0] already read by stream reads
        self.unread = 0  # bytes of complete messages not read yet
        self._parts: list[bytes] = []  # fragments of the message being reassembled
        self.assembling = 0  # their total size
        self._held: list[int] = []
        self.reader_waiting = False
        # Rendezvous (rdmaio.core.rndv_engine): placeholders of messages the peer announced and we have not
        # pulled yet sit in _messages in arrival order; they count in neither unread nor buffered. Stream
        # reads resolve them all first (the endpoint's job), so take()/find() never meet one.
        self.pending = 0

    # --- receiving ---------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes held in memory for the application: unread messages plus the one being reassembled."""
        return self.unread + self.assembling

    @property
    def held(self) -> int:
        """Receive slots held back (not posted again) for back-pressure."""
        return len(self._held)

    def add_fragment(self, data: bytes) -> None:
        """A DATA_MORE payload: part of a message whose last fragment is still to come."""
        self._parts.append(data)
        self.assembling += len(data)

    def add_message(self, data: bytes) -> bytes:
        """A DATA_END payload: completes (or is) a message; return the complete message."""
        if self._parts:
            self._parts.append(data)
            data = b"".join(self._parts)
            self._parts.clear()
            self.assembling = 0
        self._messages.append(data)
        self.unread += len(data)
        return data

    def add_messages(self, messages: list[bytes]) -> int:
        """The messages of a DATA_BATCH payload; return their total size."""
        self._messages.extend(messages)
        size = sum(map(len, messages))
        self.unread += size
        return size

    # --- rendezvous placeholders ---------------------------------------------------------------------

    def add_pending(self, placeholder: object) -> None:
        """A rendezvous message was announced: keep its place in the order until it is pulled."""
        self._messages.append(placeholder)  # type: ignore[arg-type]
        self.pending += 1

    def head(self) -> object | None:
        """The next message or placeholder (None if there is none)."""
        return self._messages[0] if self._messages else None

    def placeholders(self) -> list[object]:
        """The placeholders still waiting, in order."""
        return [m for m in self._messages if not isinstance(m, bytes | bytearray)]

    def resolve(self, placeholder: object, data: bytes) -> None:
        """Replace a placeholder by its pulled message."""
        messages = self._messages
        index = next(i for i, m in enumerate(messages) if m is placeholder)
        messages[index] = data
        self.pending -= 1
        self.unread += len(data)

    def withdraw(self, placeholder: object) -> None:
        """Remove a placeholder: the message was withdrawn (consumed straight into a caller's buffer, or
        cancelled by the sender before it was pulled)."""
        messages = self._messages
        index = next(i for i, m in enumerate(messages) if m is placeholder)
        del messages[index]
        if index == 0:
            self._offset = 0
        self.pending -= 1

    def admit(self, slot: int) -> bool:
        """Decide about the slot of a data frame just added: True to post it again now, False if held."""
        if self.buffered > self.limit and self.unread and not self.reader_waiting:
            self._held.append(slot)
            return False
        return True

    def releasable(self) -> list[int]:
        """The held slots that may be posted again now (they are no longer held once returned)."""
        if self._held and (self.buffered <= self.limit or not self.unread or self.reader_waiting):
            held, self._held = self._held, []
            return held
        return []

    # --- reading -----------------------------------------------------------------------------------

    def has_message(self) -> bool:
        """True if a complete message (possibly empty, possibly partly read) is waiting."""
        return bool(self._messages)

    def pop_message(self) -> bytes:
        """The rest of the next message (``IndexError`` if there is none)."""
        data = self._messages.popleft()
        if self._offset:
            data = data[self._offset :]
            self._offset = 0
        self.unread -= len(data)
        return data

    def read_message_into(self, target: memoryview) -> int:
        """Copy as much of the next message as fits into ``target``; the rest stays for the next read."""
        data = self._messages[0]
        start = self._offset
        n = min(len(data) - start, target.nbytes)
        target[:n] = memoryview(data)[start : start + n]
        if start + n == len(data):
            self._messages.popleft()
            self._offset = 0
        else:
            self._offset = start + n
        self.unread -= n
        return n

    def skip_empty(self) -> None:
        """Drop empty (or fully read) messages at the head: a byte stream does not see them."""
        messages = self._messages
        while messages and len(messages[0]) == self._offset:
            messages.popleft()
            self._offset = 0

    def take(self, n: int) -> bytes:
        """Take up to ``n`` bytes of the stream (across message boundaries, one join)."""
        messages = self._messages
        parts: list[bytes] = []
        remaining = n
        while messages and remaining:
            head = messages[0]
            start = self._offset
            end = min(len(head), start + remaining)
            parts.append(head if start == 0 and end == len(head) else head[start:end])
            if end == len(head):
                messages.popleft()
                self._offset = 0
            else:
                self._offset = end
            remaining -= end - start
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.unread -= len(data)
        return data

    def take_all(self) -> bytes:
        """Take every unread byte."""
        return self.take(self.unread)

    def find(self, separator: bytes) -> int:
        """Index of ``separator`` in the unread bytes (merged into one message first), or -1."""
        messages = self._messages
        if self._offset or len(messages) > 1:
            merged = b"".join([messages[0][self._offset :], *list(messages)[1:]])
            messages.clear()
            self._offset = 0
            if merged:
                messages.append(merged)
        return messages[0].find(separator) if messages else -1

    def startswith(self, prefix: bytes, start: int) -> bool:
        """True if the unread bytes (as merged by :meth:`find`) have ``prefix`` at ``start``."""
        return bool(self._messages) and self._messages[0].startswith(prefix, self._offset + start)

    def clear(self) -> int:
        """Drop every unread byte; return how many."""
        n = self.unread
        self._messages.clear()
        self._offset = 0
        self.unread = 0
        return n
