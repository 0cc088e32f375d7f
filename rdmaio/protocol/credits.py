"""Send-side credit accounting of a :class:`~rdmaio.protocol.session.Session` (sans-IO): every frame we send
takes a credit (the last one is reserved for CREDIT and EOF frames) and piggybacks the credits we owe; the
one-sided requests that consume a peer receive take one too.
"""

from __future__ import annotations

from typing import NoReturn

from rdmaio.errors import (
    EndpointClosedError,
    MessageTooLargeError,
)
from rdmaio.protocol.closestate import CloseState
from rdmaio.protocol.frames import (
    _CREDIT_MASK,
    _IMM_BATCH,
    _IMM_CREDIT,
    _IMM_END,
    _IMM_EOF,
    _IMM_MORE,
    _IMM_RNDV,
    BATCH_RECORD_HEADER,
)
from rdmaio.protocol.handshake import MAX_CREDITS

__all__ = ["SendCredits"]


class SendCredits(CloseState):
    """What we send: frames' immediate values taken against credits (a part of the Session)."""

    __slots__ = ()

    def check_message_size(self, n: int) -> None:
        """Raise :class:`MessageTooLargeError` if the peer does not accept a message of ``n`` bytes."""
        if n < 0:
            raise ValueError(f"message size {n} is negative")
        if n > self._peer_max:
            raise MessageTooLargeError(
                f"message of {n} bytes exceeds the peer's maximum message size of {self._peer_max} bytes"
            )

    def fragment_count(self, n: int) -> int:
        """Number of frames a message of ``n`` bytes needs (an empty message still needs one)."""
        if n < 0:
            raise ValueError(f"message size {n} is negative")
        return max(1, -(-n // self._max_fragment))

    def can_send_data(self) -> bool:
        """True if a DATA frame may be posted now (transport usable, EOF not sent, two credits held).

        The same holds for a DATA_BATCH frame (which also needs :attr:`batching` and no message in progress).
        Data accepted before ``write_eof()``/``close()`` may still be flushed; whether the application may
        hand over *new* data is :meth:`send_error`'s business.
        """
        return self._send_credits >= 2 and not (self._eof_sent or self._wire_down)

    def take_data_frame(self, last: bool, nbytes: int = 0) -> int:
        """Account for one DATA frame about to be posted and return its immediate value.

        ``last`` selects DATA_END (end of message) over DATA_MORE. ``nbytes`` (the payload size) is
        optional; when given it is checked against :attr:`max_fragment` and the peer's maximum message
        size and counted in :meth:`statistics`. Raises the connection's error if the transport is unusable,
        :class:`EndpointClosedError` after the EOF frame, RuntimeError without two credits.
        """
        send_credits = self._send_credits - 1
        if self._wire_down or self._eof_sent or send_credits < 1 or not 0 <= nbytes <= self._max_fragment:
            self._raise_send_error(nbytes, 2)
        message_bytes = self._send_message_bytes + nbytes
        if message_bytes > self._peer_max:
            raise MessageTooLargeError(
                f"message exceeds the peer's maximum message size of {self._peer_max} bytes"
            )
        # Every frame piggybacks everything we owe: fewer standalone CREDIT frames. The cap is a guard only:
        # ungranted <= posted <= recv_depth <= MAX_CREDITS as long as on_frame accepts the frames.
        grant = self._ungranted
        if grant:
            if grant > _CREDIT_MASK:
                grant = _CREDIT_MASK
            self._ungranted -= grant
            if self._ungranted_ctl > self._ungranted:
                self._ungranted_ctl = self._ungranted
        self._send_credits = send_credits
        if send_credits < self._min_send_credits:
            self._min_send_credits = send_credits
        self._frames_sent += 1
        self._bytes_sent += nbytes
        if last:
            self._messages_sent += 1
            if self._send_in_message:
                self._send_in_message = False
                self._send_message_bytes = 0
            return _IMM_END | grant
        self._send_in_message = True
        self._send_message_bytes = message_bytes
        return _IMM_MORE | grant

    def take_batch_frame(self, nbytes: int, messages: int) -> int:
        """Account for one DATA_BATCH frame about to be posted and return its immediate value.

        ``nbytes`` is the payload size (the value :func:`pack_batch_into` returned, at most
        :attr:`max_fragment`), ``messages`` the number of messages in it (at least one). The frame costs one
        credit and needs two, like a DATA_END frame, and may not be sent in the middle of a fragmented
        message. Each message's size must have passed :meth:`check_message_size`. Raises the connection's
        error if the transport is unusable, :class:`EndpointClosedError` after the EOF frame, RuntimeError
        if batching was not negotiated (:attr:`batching`), in the middle of a message or without two
        credits, ValueError for an impossible ``nbytes``/``messages``.
        """
        if self._wire_down or self._eof_sent:
            self._raise_send_error(nbytes, 2)
        if not self._batching:
            raise RuntimeError("cannot send a DATA_BATCH frame: batching was not negotiated")
        if self._send_in_message:
            raise RuntimeError("cannot send a DATA_BATCH frame in the middle of a message (DATA_END missing)")
        if not 1 <= messages <= nbytes // BATCH_RECORD_HEADER:
            raise ValueError(f"{messages} messages cannot make a DATA_BATCH payload of {nbytes} bytes")
        if nbytes > self._max_fragment:
            raise ValueError(f"DATA_BATCH frame of {nbytes} bytes out of range 0..{self._max_fragment}")
        if self._send_credits < 2:
            raise RuntimeError(f"no credit for a DATA frame (send_credits={self._send_credits}, need 2)")
        self._batch_frames_sent += 1
        self._batched_messages_sent += messages
        self._messages_sent += messages
        self._bytes_sent += nbytes - BATCH_RECORD_HEADER * messages
        return self._take(_IMM_BATCH)

    def take_rndv_frame(self, nbytes: int) -> int:
        """Account for one RNDV frame (a rendezvous descriptor, ``nbytes`` of payload) about to be posted and
        return its immediate value. It follows the rules of a DATA_END frame (two credits, not after EOF, not
        in the middle of a message); the message it announces is counted by the rendezvous layer."""
        if (
            self._wire_down
            or self._eof_sent
            or self._send_credits < 2
            or not 0 < nbytes <= self._max_fragment
        ):
            self._raise_send_error(nbytes, 2)
        if not self._rndv:
            raise RuntimeError("cannot send an RNDV frame: rendezvous was not negotiated")
        if self._send_in_message:
            raise RuntimeError("cannot send an RNDV frame in the middle of a message (DATA_END missing)")
        return self._take(_IMM_RNDV)

    def credit_frame_due(self) -> bool:
        """True if a standalone CREDIT frame should be sent now: ``threshold`` credits are owed for slots that
        data (or EOF) frames consumed, or the peer may be stuck (``recv_depth - 1`` owed in all).

        Credits owed for the slots of the peer's own CREDIT frames do not count towards the threshold: with
        a 4-slot window (threshold 2) one request plus the slot of the requester's CREDIT frame made a CREDIT
        frame due before the reply could carry the credits, and a request/reply connection once out of step
        sent a CREDIT frame with every message in both directions. They are granted on the next frame, and
        the liveness rule (a peer with fewer than two credits is owed ``recv_depth - 1``) still sends one.
        """
        owed = self._ungranted
        return (
            (owed - self._ungranted_ctl >= self._threshold or owed >= self._recv_depth - 1)
            and self._send_credits >= 1
            and not self._wire_down
        )

    def take_credit_frame(self) -> int:
        """Account for one CREDIT frame about to be posted and return its immediate value.

        Allowed with a single credit left, but only if it grants at least one credit (the liveness argument
        relies on that). Send it when :meth:`credit_frame_due` says so to keep idle peers quiet.
        """
        grant = self._ungranted
        send_credits = self._send_credits - 1
        if self._wire_down or send_credits < 0 or grant < 1:
            self._raise_wire_error()
            if send_credits < 0:
                raise RuntimeError("no credit left for a CREDIT frame")
            raise RuntimeError("a CREDIT frame must grant at least one credit (ungranted is 0)")
        if grant > _CREDIT_MASK:
            grant = _CREDIT_MASK
        self._ungranted -= grant
        if self._ungranted_ctl > self._ungranted:
            self._ungranted_ctl = self._ungranted
        self._send_credits = send_credits
        if send_credits < self._min_send_credits:
            self._min_send_credits = send_credits
        self._frames_sent += 1
        self._credit_frames_sent += 1
        return _IMM_CREDIT | grant

    def write_eof(self) -> None:
        """Half-close: request an EOF frame after the pending data; new data is refused from now on."""
        self._eof_requested = True

    def eof_pending(self) -> bool:
        """True if ``write_eof()``/``close()`` asked for an EOF frame that was not sent yet.

        False once the transport is gone, as there is no one left to tell.
        """
        return self._eof_requested and not (self._eof_sent or self._wire_down)

    def can_send_eof(self) -> bool:
        """True if the pending EOF frame may be posted now as far as credits and framing go.

        EOF may use the last credit only if it grants one too (see the module docstring).
        """
        return self.eof_pending() and not self._send_in_message and self._eof_credit_ok()

    def _eof_credit_ok(self) -> bool:
        # The last credit may go to EOF only if EOF grants one back; otherwise both sides could end up
        # holding zero credits with nothing in flight.
        return self._send_credits >= 2 or (self._send_credits == 1 and self._ungranted >= 1)

    def take_eof_frame(self) -> int:
        """Account for the EOF frame about to be posted and return its immediate value (once only)."""
        self._raise_wire_error()
        if self._eof_sent:
            raise RuntimeError("EOF was already sent")
        if self._send_in_message:
            raise RuntimeError("cannot send EOF in the middle of a message (DATA_END missing)")
        if not self._eof_credit_ok():
            raise RuntimeError(
                f"no credit for the EOF frame "
                f"(send_credits={self._send_credits}, ungranted={self._ungranted})"
            )
        self._eof_requested = True
        self._eof_sent = True
        return self._take(_IMM_EOF)

    def _grant_owed(self, limit: int) -> int:
        """Take up to ``limit`` owed credits for a frame about to be posted and return them (the part owed
        for CREDIT-frame slots shrinks with them). take_data_frame/take_credit_frame inline it."""
        grant = min(self._ungranted, limit)
        self._ungranted -= grant
        if self._ungranted_ctl > self._ungranted:
            self._ungranted_ctl = self._ungranted
        return grant

    def _take(self, kind_bits: int) -> int:
        # Shared by the less frequent frames (EOF, DATA_BATCH); take_data_frame/take_credit_frame inline it.
        grant = self._grant_owed(MAX_CREDITS)
        self._send_credits -= 1
        self._min_send_credits = min(self._min_send_credits, self._send_credits)
        self._frames_sent += 1
        return kind_bits | grant

    def _raise_send_error(self, nbytes: int, needed: int) -> NoReturn:
        """Raise what a DATA/DATA_BATCH take must raise, in the order of the checks (slow path only)."""
        self._raise_wire_error()
        if self._eof_sent:
            raise EndpointClosedError("cannot send data: EOF was already sent (write_eof() was called)")
        if not 0 <= nbytes <= self._max_fragment:
            raise ValueError(f"fragment of {nbytes} bytes out of range 0..{self._max_fragment}")
        # The last credit is reserved so that a CREDIT/EOF frame can always be sent.
        raise RuntimeError(f"no credit for a DATA frame (send_credits={self._send_credits}, need {needed})")

    # -- one-sided operations -----------------------------------------------------------------------------
    # An RDMA WRITE with immediate data and a one-sided control message (a SEND without immediate data)
    # consume one of the peer's posted receives exactly as a frame does, so they are paid for with a
    # credit like one. They grant nothing (their immediate value belongs to the user, or there is none), and
    # they follow the DATA rule of two credits, so the reserve for CREDIT/EOF frames is never touched.

    def can_take_slot(self) -> bool:
        """True if a one-sided request that consumes a peer receive may be posted now (two credits)."""
        return self._send_credits >= 2 and not self._wire_down

    def take_slot(self) -> None:
        """Account for one WRITE-with-immediate or one-sided control message about to be posted.

        Raises the connection's error if the transport is unusable, RuntimeError without two credits.
        """
        if self._wire_down:
            self._raise_wire_error()
        if self._send_credits < 2:
            raise RuntimeError(f"no credit for a one-sided request (send_credits={self._send_credits})")
        self._send_credits -= 1
        self._onesided_sent += 1
        if self._send_credits < self._min_send_credits:
            self._min_send_credits = self._send_credits
