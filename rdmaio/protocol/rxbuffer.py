"""ReceiveBuffer: what one connection received and the application has not read yet, and back-pressure.

Sans-IO (no verbs, no loop): the endpoint feeds it the payloads of received frames and asks it which
receive slots may be posted again; the read calls of the endpoint take their data from it. The
simulation in ``tests/unit/test_protocol.py`` drives the same class, so the rule that the liveness
argument of :mod:`rdmaio.protocol` depends on is the rule the endpoint runs.

What counts. :attr:`ReceiveBuffer.committed` is the bytes buffered (complete unread messages plus the
message being reassembled) plus, for every rendezvous message announced and not received yet (a
:class:`Placeholder`), its announced length and :data:`PLACEHOLDER_CHARGE` bytes for the bookkeeping: what
the peer has made us commit to.

Back-pressure rule. A slot that carried data (DATA_MORE, DATA_END, DATA_BATCH) or an announcement (RNDV) is
*held* - not posted again, so the peer gets no credit for it - while all three hold:

* :attr:`~ReceiveBuffer.committed` exceeds ``limit``;
* something is waiting to be read (a complete message or a placeholder, which the next read pulls), so
  the application can release the slots by reading: a reader waiting for the rest of a message larger than
  ``limit`` is never starved;
* no reader is waiting for more data (as asyncio's ``StreamReader`` resumes reading when a read needs
  more: ``readexactly(n)`` with ``n`` above the limit completes).

Slots of frames without payload (CREDIT, EOF) are never held: they are reposted as soon as they are seen,
which is what keeps credits flowing in both directions while one side's application does not read.

Worst case per connection: ``max(limit, max_message_size) + recv_depth * slot_size`` bytes buffered. A
complete message of up to ``max_message_size`` is always accepted, even when it alone exceeds the limit;
once holding starts, the frames the peer already holds credits for (at most ``recv_depth``) still arrive
and are buffered. While the last fragment of a large message is joined, a second copy of it exists.
Placeholders: at most ``limit // PLACEHOLDER_CHARGE + 1 + recv_depth`` at a time (each one commits at
least ``PLACEHOLDER_CHARGE + 1`` bytes, and past the limit only the ``recv_depth`` frames already granted
arrive).

Placeholders keep their place among the messages and are settled (given their data, or dropped) in any
order; :attr:`ReceiveBuffer.ready` is the part of the stream before the first unsettled one, which is what
the stream reads may take. Every operation costs O(1) amortized (settling walks over placeholders settled
earlier, once each), whatever the number of messages and placeholders buffered.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Final

__all__ = ["PLACEHOLDER_CHARGE", "Placeholder", "ReceiveBuffer"]

PLACEHOLDER_CHARGE: Final = 1024
"""Bytes each unsettled placeholder counts against the limit on top of its announced length (its Python
objects take about half of it): a flood of tiny announcements is bounded as a flood of data is."""


class Placeholder:
    """A message announced but not received yet (a rendezvous descriptor): it keeps the message's place in
    the order, and counts against the limit with its announced ``length`` until it is settled."""

    __slots__ = ("_data", "_settled", "_trailing", "length")

    def __init__(self, length: int) -> None:
        self.length = length
        self._settled = False
        self._data: bytes | None = None  # the message, once settled with data
        self._trailing = 0  # bytes of complete messages after it, up to the next placeholder of the index

    @property
    def settled(self) -> bool:
        """True once the buffer got its data or dropped it (:meth:`ReceiveBuffer.resolve`/``withdraw``)."""
        return self._settled


class ReceiveBuffer:
    """Complete messages not yet read, the message being reassembled, placeholders and the slots held back.

    Plain attributes the per-message path reads without a call: :attr:`held` (receive slots held back for
    back-pressure), :attr:`messages` (the queue of complete messages and placeholders, read-only: a head
    that is not a :class:`Placeholder` is what :meth:`pop_message` returns next, from :attr:`offset` on),
    :attr:`offset`, :attr:`unread`, :attr:`ready`, :attr:`pending`, :attr:`announced`, :attr:`assembling`.
    A reader may pop a complete message at the head itself when :attr:`offset` is 0, as
    :meth:`pop_message` would: ``messages.popleft()`` and its length off :attr:`unread` and :attr:`ready`
    (:meth:`rdmaio.core.receive.Receiver.recv` does, keep the two the same). Likewise a receiver may do
    :meth:`add_admitted` itself while :attr:`parts` and :attr:`unsettled` are empty (no fragment to join, no
    placeholder to charge): ``messages.append(data)``, its length onto :attr:`unread` and :attr:`ready`,
    then the admit rule, and :meth:`hold` of the slot when it says so
    (:meth:`rdmaio.core.receive.Receiver.on_batch` does, keep the two the same).
    """

    __slots__ = (
        "_held",
        "_messages",
        "_parts",
        "_unsettled",
        "announced",
        "assembling",
        "held",
        "limit",
        "messages",
        "offset",
        "parts",
        "pending",
        "reader_waiting",
        "ready",
        "unread",
        "unsettled",
    )

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"receive buffer limit must be positive, not {limit}")
        self.limit = limit
        # Complete messages (bytes) and placeholders, in order. A settled placeholder stays until it
        # reaches the head, where it is replaced by its data (or dropped): settling costs no search.
        self._messages: collections.deque[bytes | Placeholder] = collections.deque()
        # The same deque, for the readers' fast test: a head that is not a Placeholder is a complete message
        # (bytes) that pop_message() returns as it is, with no settling to do. Read it, never change it.
        self.messages = self._messages
        self.offset = 0  # bytes of _messages[0] already read by stream reads (read it, never change it)
        self.unread = 0  # bytes of complete messages not read yet (settled placeholders' data included)
        self.ready = 0  # of them, the bytes before the first unsettled placeholder (what stream reads see)
        self._parts: list[bytes] = []  # fragments of the message being reassembled
        self.parts = self._parts  # the same list, for the receiver's fast test (read it, never change it)
        self.assembling = 0  # their total size
        self._held: list[int] = []
        self.held = 0  # len(_held): receive slots held back (not posted again) for back-pressure
        self.reader_waiting = False
        # Placeholders in order, from the first unsettled one on (settled ones behind it stay until it is
        # settled): each carries the bytes of complete messages between it and the next one.
        self._unsettled: collections.deque[Placeholder] = collections.deque()
        self.unsettled = self._unsettled  # the same deque, for the receiver's fast test (read it only)
        self.pending = 0  # unsettled placeholders
        self.announced = 0  # their announced bytes

    # --- receiving ---------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes held in memory for the application: unread messages plus the one being reassembled."""
        return self.unread + self.assembling

    @property
    def committed(self) -> int:
        """What the back-pressure rule compares with ``limit``: :attr:`buffered` plus the announced bytes
        of the unsettled placeholders plus :data:`PLACEHOLDER_CHARGE` for each."""
        return self.unread + self.assembling + self.announced + self.pending * PLACEHOLDER_CHARGE

    def _added(self, size: int) -> None:
        self.unread += size
        if self._unsettled:
            self._unsettled[-1]._trailing += size
        else:
            self.ready += size

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
        # _added(), inline: this runs once per message received.
        size = len(data)
        self.unread += size
        if self._unsettled:
            self._unsettled[-1]._trailing += size
        else:
            self.ready += size
        return data

    def add_admitted(self, data: bytes, slot: int) -> bool:
        """:meth:`add_message` of a DATA_END payload and then :meth:`admit` of its ``slot``, in one call (the
        receiver's per-message path): True to post the slot again now, False if held."""
        if self._parts:
            self._parts.append(data)
            data = b"".join(self._parts)
            self._parts.clear()
            self.assembling = 0
        self._messages.append(data)
        size = len(data)
        unread = self.unread = self.unread + size
        if self._unsettled:
            self._unsettled[-1]._trailing += size
        else:
            self.ready += size
        # admit(), inline: keep the two the same.
        if (
            unread + self.assembling + self.announced + self.pending * PLACEHOLDER_CHARGE > self.limit
            and (unread or self.pending)
            and not self.reader_waiting
        ):
            self._held.append(slot)
            self.held += 1
            return False
        return True

    def hold(self, slot: int) -> None:
        """Hold back the slot of a data frame the admit rule refused (what :meth:`admit` does then)."""
        self._held.append(slot)
        self.held += 1

    def add_messages(self, messages: list[bytes]) -> int:
        """The messages of a DATA_BATCH payload; return their total size."""
        self._messages.extend(messages)
        size = sum(map(len, messages))
        self._added(size)
        return size

    def add_batch(self, messages: Iterable[bytes], size: int) -> None:
        """The messages of a DATA_BATCH payload whose total size is known: ``size`` bytes (the payload less
        its record headers). :meth:`add_messages` without its sum."""
        self._messages.extend(messages)
        # _added(), inline.
        self.unread += size
        if self._unsettled:
            self._unsettled[-1]._trailing += size
        else:
            self.ready += size

    # --- placeholders ------------------------------------------------------------------------------

    def add_pending(self, placeholder: Placeholder) -> None:
        """A message was announced: keep its place in the order until it is settled."""
        if placeholder._settled:
            raise ValueError("a settled placeholder cannot be added")
        self._messages.append(placeholder)
        self._unsettled.append(placeholder)
        self.pending += 1
        self.announced += placeholder.length

    def head(self) -> bytes | Placeholder | None:
        """The next message or unsettled placeholder (None if there is none)."""
        self._settle_head()
        return self._messages[0] if self._messages else None

    def needed(self, n: int) -> list[Placeholder]:
        """The unsettled placeholders within the first ``n`` bytes of the stream, in order: what a stream
        read that needs ``n`` bytes must wait for (announced lengths count as their bytes)."""
        pos = self.ready
        found: list[Placeholder] = []
        for entry in self._unsettled:
            if pos >= n:
                break
            if entry._settled:
                pos += len(entry._data) if entry._data is not None else 0
            else:
                found.append(entry)
                pos += entry.length
            pos += entry._trailing
        return found

    def resolve(self, placeholder: Placeholder, data: bytes) -> None:
        """Settle a placeholder with its message (pulled): it takes the placeholder's place."""
        self._settle(placeholder, data)

    def withdraw(self, placeholder: Placeholder) -> None:
        """Settle a placeholder without data: the message was withdrawn (consumed straight into a caller's
        buffer, or cancelled by the sender before it was pulled)."""
        self._settle(placeholder, None)

    def _settle(self, placeholder: Placeholder, data: bytes | None) -> None:
        if placeholder._settled:
            return
        placeholder._settled = True
        placeholder._data = data
        self.pending -= 1
        self.announced -= placeholder.length
        if data is not None:
            self.unread += len(data)
        unsettled = self._unsettled
        while unsettled and unsettled[0]._settled:  # the stream is readable up to the next unsettled one
            entry = unsettled.popleft()
            self.ready += (len(entry._data) if entry._data is not None else 0) + entry._trailing
        self._settle_head()

    def _settle_head(self) -> None:
        """Replace settled placeholders at the head by their data (drop those without)."""
        messages = self._messages
        while messages:
            head = messages[0]
            if not isinstance(head, Placeholder) or not head._settled:
                return
            if head._data is None:
                messages.popleft()
                self.offset = 0
            else:
                messages[0] = head._data
                head._data = None
                return

    # --- back-pressure ------------------------------------------------------------------------------

    def admit(self, slot: int) -> bool:
        """Decide about the slot of a data or RNDV frame just added: True to post it again now, False if
        held."""
        unread = self.unread
        # committed, inline: this runs once per data frame received.
        if (
            unread + self.assembling + self.announced + self.pending * PLACEHOLDER_CHARGE > self.limit
            and (unread or self.pending)
            and not self.reader_waiting
        ):
            self._held.append(slot)
            self.held += 1
            return False
        return True

    def releasable(self) -> list[int]:
        """The held slots that may be posted again now (they are no longer held once returned)."""
        if self._held and (
            self.committed <= self.limit or not (self.unread or self.pending) or self.reader_waiting
        ):
            held, self._held = self._held, []
            self.held = 0
            return held
        return []

    # --- reading -----------------------------------------------------------------------------------

    def has_message(self) -> bool:
        """True if a complete message (possibly empty, possibly partly read) or a placeholder is waiting."""
        self._settle_head()
        return bool(self._messages)

    def pop_message(self) -> bytes:
        """The rest of the next message (``IndexError`` if there is none; the head must not be an unsettled
        placeholder). Receiver.recv does the common case inline (see the class docstring)."""
        data = self._messages.popleft()
        if isinstance(data, Placeholder):
            self._messages.appendleft(data)
            self._settle_head()
            data = self._messages.popleft()
            if isinstance(data, Placeholder):
                self._messages.appendleft(data)
                raise IndexError("the next message is announced, not received yet")
        if self.offset:
            data = data[self.offset :]
            self.offset = 0
        self.unread -= len(data)
        self.ready -= len(data)
        return data

    def read_message_into(self, target: memoryview) -> int:
        """Copy as much of the next message as fits into ``target``; the rest stays for the next read."""
        self._settle_head()
        data = self._messages[0]
        if isinstance(data, Placeholder):
            raise IndexError("the next message is announced, not received yet")
        start = self.offset
        n = min(len(data) - start, target.nbytes)
        target[:n] = memoryview(data)[start : start + n]
        if start + n == len(data):
            self._messages.popleft()
            self.offset = 0
        else:
            self.offset = start + n
        self.unread -= n
        self.ready -= n
        return n

    def skip_empty(self) -> None:
        """Drop empty (or fully read) messages at the head: a byte stream does not see them."""
        messages = self._messages
        self._settle_head()
        while messages:
            head = messages[0]
            if isinstance(head, Placeholder) or len(head) != self.offset:
                return
            messages.popleft()
            self.offset = 0
            self._settle_head()

    def take(self, n: int) -> bytes:
        """Take up to ``n`` bytes of the stream (across message boundaries, one join), never past the first
        unsettled placeholder."""
        messages = self._messages
        parts: list[bytes] = []
        remaining = min(n, self.ready)
        while messages and remaining:
            head = messages[0]
            if isinstance(head, Placeholder):
                if not head._settled:
                    break  # (cannot happen: `ready` ends at the first unsettled one)
                self._settle_head()
                continue
            start = self.offset
            end = min(len(head), start + remaining)
            parts.append(head if start == 0 and end == len(head) else head[start:end])
            if end == len(head):
                messages.popleft()
                self.offset = 0
            else:
                self.offset = end
            remaining -= end - start
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.unread -= len(data)
        self.ready -= len(data)
        return data

    def take_all(self) -> bytes:
        """Take every byte before the first unsettled placeholder."""
        return self.take(self.ready)

    def _merge_ready(self) -> None:
        """Join the messages before the first unsettled placeholder into one (what :meth:`find` searches)."""
        messages = self._messages
        self._settle_head()
        if not messages or isinstance(messages[0], Placeholder):
            return
        first = messages[0]
        if not self.offset and (len(messages) == 1 or isinstance(messages[1], Placeholder)):
            return
        parts = [first[self.offset :]]
        messages.popleft()
        self.offset = 0
        while messages:
            self._settle_head()
            if not messages or isinstance(messages[0], Placeholder):
                break
            parts.append(messages.popleft())  # type: ignore[arg-type]
        merged = b"".join(parts)
        if merged or messages:
            messages.appendleft(merged)

    def find(self, separator: bytes) -> int:
        """Index of ``separator`` in the bytes before the first unsettled placeholder (merged into one
        message first), or -1."""
        self._merge_ready()
        messages = self._messages
        if not messages or isinstance(messages[0], Placeholder):
            return -1
        return messages[0].find(separator)

    def startswith(self, prefix: bytes, start: int) -> bool:
        """True if the ready bytes (as merged by :meth:`find`) have ``prefix`` at ``start``."""
        head = self.head()
        return isinstance(head, bytes | bytearray) and head.startswith(prefix, self.offset + start)

    def clear(self) -> int:
        """Drop every byte before the first unsettled placeholder; return how many."""
        return len(self.take(self.ready))
