"""Frame intake of a :class:`~rdmaio.protocol.session.Session` (sans-IO): every received frame is validated
against the credit rules and the framing rules before it is counted, and the receive window's accounting
(reposts, growth) lives here. A frame that breaks the protocol aborts the session with the error it commits.
"""

from __future__ import annotations

from typing import NoReturn

from rdmaio.errors import (
    FrameError,
    ProtocolError,
)
from rdmaio.protocol.closestate import CloseState
from rdmaio.protocol.frames import (
    _BAD_IMM_BITS,
    _CREDIT,
    _CREDIT_MASK,
    _DATA_BATCH,
    _DATA_END,
    _DATA_MORE,
    _EOF_KIND,
    _K_BATCH,
    _K_CREDIT,
    _K_END,
    _K_EOF,
    _K_MORE,
    _K_RNDV,
    _KIND_SHIFT,
    _RNDV,
    BATCH_RECORD_HEADER,
    BytesLike,
    FrameKind,
    ReceivedMessageTooLargeError,
    decode_imm,
    unpack_batch,
)

__all__ = ["FrameIntake"]


class FrameIntake(CloseState):
    """What we receive: frames validated and counted, receives reposted and grown (a part of the Session)."""

    __slots__ = ()

    @property
    def recv_depth(self) -> int:
        """Receives added so far (posted, or consumed by frames not yet reposted): the current window."""
        return self._recv_depth

    @property
    def can_grow(self) -> int:
        """How many more receives :meth:`grow_receives` may add (0 unless we announced FEATURE_GROW)."""
        return self._recv_max - self._recv_depth

    def grow_receives(self, n: int) -> None:
        """The I/O layer posted ``n`` receives on new slots: the window grows and they become credits owed
        to the peer (the next frame grants them).

        The credit argument of the module docstring holds for the current window at every moment:
        ``peer.ungranted == recv_depth - our.send_credits`` when nothing is in flight keeps holding because
        growth raises both sides of it by ``n``, and the default threshold follows the window (half of it),
        staying in ``2..recv_depth-1``.
        """
        if not 0 < n <= self._recv_max - self._recv_depth:
            raise ValueError(f"cannot grow by {n}: {self._recv_depth} of at most {self._recv_max} posted")
        self._recv_depth += n
        self._posted += n
        self._ungranted += n
        self._grown += n
        if self._default_threshold:
            self._threshold = self._recv_depth // 2

    def on_recv_reposted(self, n: int) -> None:
        """The I/O layer posted ``n`` receive buffers again; they become credits owed to the peer."""
        posted = self._posted + n
        if n < 0 or posted > self._recv_depth:
            if n < 0:
                raise ValueError(f"reposted count {n} is negative")
            raise RuntimeError(f"{posted} receives posted, more than recv_depth {self._recv_depth}")
        self._posted = posted
        self._ungranted += n

    def on_frame(self, imm: int, byte_len: int) -> FrameKind:
        """Validate and apply one received frame; return its kind (DATA_END completes a message).

        The kind returned is a :class:`FrameKind` member (an int): compare it with ``is`` or ``==``. After
        DATA_BATCH, hand the payload to :meth:`on_batch`. Raises a :class:`~rdmaio.errors.ProtocolError`
        (:class:`FrameError`, or :class:`ReceivedMessageTooLargeError`) if the peer broke the protocol; the
        session is then aborted with that error, as its accounting can no longer be trusted.
        """
        # Fast path: one combined test of what every frame must satisfy (imm well-formed, a slot posted and
        # granted for it, credits not overflowing, length within the slot), then the kind's own rules. Any
        # failure goes to _reject(), which re-checks in the documented order to pick the error message.
        # Nothing is changed before every check passed, so a rejected frame leaves the counters intact.
        send_credits = self._send_credits + (imm & _CREDIT_MASK)
        if (
            imm & _BAD_IMM_BITS
            # posted - ungranted = the peer's credits + frames and grants in flight: this frame must be one
            # of them. (ungranted >= 0, so this also means a receive is posted: no RNR.)
            or self._posted <= self._ungranted
            or send_credits > self._peer_depth
            or not 0 <= byte_len <= self._slot_size
        ):
            self._reject(imm, byte_len)
        kind = imm >> _KIND_SHIFT
        if kind == _K_END:
            if self._peer_eof or self._recv_message_bytes + byte_len > self._local_max:
                self._reject(imm, byte_len)
            self._bytes_received += byte_len
            self._messages_received += 1
            if self._recv_in_message:
                self._recv_in_message = False
                self._recv_message_bytes = 0
            result = _DATA_END
        elif kind == _K_MORE:
            size = self._recv_message_bytes + byte_len
            if self._peer_eof or size > self._local_max:
                self._reject(imm, byte_len)
            self._bytes_received += byte_len
            self._recv_in_message = True
            self._recv_message_bytes = size
            result = _DATA_MORE
        elif kind == _K_CREDIT:
            if byte_len:
                self._reject(imm, byte_len)
            self._credit_frames_received += 1
            self._ungranted_ctl += 1  # its slot is re-posted at once: owed, but no reason for a CREDIT frame
            result = _CREDIT
        elif kind == _K_BATCH:
            if (
                not self._batching
                or self._peer_eof
                or self._recv_in_message
                or byte_len < BATCH_RECORD_HEADER
            ):
                self._reject(imm, byte_len)
            self._batch_frames_received += 1
            self._batch_pending = byte_len
            result = _DATA_BATCH
        elif kind == _K_EOF:
            if byte_len or self._peer_eof or self._recv_in_message:
                self._reject(imm, byte_len)
            self._peer_eof = True
            result = _EOF_KIND
        elif kind == _K_RNDV:
            if not self._rndv or self._peer_eof or self._recv_in_message or not byte_len:
                self._reject(imm, byte_len)
            result = _RNDV
        else:
            self._reject(imm, byte_len)
        self._posted -= 1
        self._send_credits = send_credits
        self._frames_received += 1
        return result

    def on_batch(self, payload: BytesLike) -> list[bytes]:
        """Unpack the payload of the DATA_BATCH frame :meth:`on_frame` just accepted; return its messages.

        ``payload`` is the frame's ``byte_len`` bytes of the receive slot (a memoryview slice is fine; the
        messages are copied, so the slot may be reposted at once). Raises :class:`FrameError` (or
        :class:`ReceivedMessageTooLargeError` for a message above our ``max_message_size``) if the payload is
        malformed - the session is then aborted - and RuntimeError if no DATA_BATCH frame is waiting for
        it or ``payload`` has a different length.
        """
        expected = self._batch_pending
        if expected < 0:
            raise RuntimeError("on_batch() called without a DATA_BATCH frame from on_frame()")
        if len(payload) != expected:
            raise RuntimeError(f"on_batch() got {len(payload)} bytes, the DATA_BATCH frame had {expected}")
        self._batch_pending = -1
        try:
            messages = unpack_batch(payload, self._local_max)
        except ProtocolError as exc:
            self.abort(exc)
            raise
        count = len(messages)
        self._messages_received += count
        self._batched_messages_received += count
        self._bytes_received += expected - BATCH_RECORD_HEADER * count
        return messages

    def _reject(self, imm: int, byte_len: int) -> NoReturn:
        """Abort with the protocol violation the received frame commits, and raise it (slow path only)."""
        exc = self._frame_error(imm, byte_len)
        self.abort(exc)
        raise exc

    def _frame_error(self, imm: int, byte_len: int) -> ProtocolError:
        """The error that an invalid received frame commits: the first failing check, in a fixed order."""
        try:
            kind, credits = decode_imm(imm)
        except FrameError as exc:
            return exc
        name = kind.name
        if kind is FrameKind.RECLAIM or kind is FrameKind.RETURN:  # shared receive queues (FEATURE_RECLAIM)
            return FrameError(f"{name} frame although FEATURE_RECLAIM was not negotiated")
        is_data = kind in (_DATA_MORE, _DATA_END, _DATA_BATCH, _RNDV)
        if self._posted <= 0:
            return FrameError(
                f"{name} frame arrived with no receive posted (RNR): the peer overran its credits"
            )
        # Stricter than posted > 0, which misses a peer that uses slots we reposted but never granted.
        if self._posted - self._ungranted <= 0:
            return FrameError(f"{name} frame arrived although the peer held no credit for it")
        if not 0 <= byte_len <= self._slot_size:
            return FrameError(f"{name} frame of {byte_len} bytes exceeds the slot size of {self._slot_size}")
        if not is_data and byte_len != 0:
            return FrameError(f"{name} frame carries {byte_len} payload bytes, it must carry none")
        if self._send_credits + credits > self._peer_depth:
            return FrameError(
                f"peer granted {credits} credits, more than its recv_depth {self._peer_depth} allows "
                f"(we hold {self._send_credits})"
            )
        if is_data and self._peer_eof:
            return FrameError(f"{name} frame after the peer's EOF")
        if kind is _DATA_BATCH:
            if not self._batching:
                return FrameError("DATA_BATCH frame although batching was not negotiated")
            if self._recv_in_message:
                return FrameError("DATA_BATCH frame in the middle of a message (DATA_END missing)")
            if byte_len < BATCH_RECORD_HEADER:
                return FrameError(f"DATA_BATCH frame of {byte_len} bytes is too short for one record")
        elif kind is _RNDV:
            if not self._rndv:
                return FrameError("RNDV frame although rendezvous was not negotiated")
            if self._recv_in_message:
                return FrameError("RNDV frame in the middle of a message (DATA_END missing)")
            if not byte_len:
                return FrameError("RNDV frame without a descriptor")
        elif is_data:
            size = self._recv_message_bytes + byte_len
            if size > self._local_max:
                return ReceivedMessageTooLargeError(
                    f"peer sent a message of at least {size} bytes, more than our maximum message size "
                    f"of {self._local_max} bytes"
                )
        elif kind is _EOF_KIND:
            if self._peer_eof:
                return FrameError("second EOF frame from the peer")
            if self._recv_in_message:
                return FrameError("EOF frame in the middle of a message (DATA_END missing)")
        # Unreachable while the fast path in on_frame and these checks agree (the tests hold them to it).
        return ProtocolError(f"frame {imm:#010x} of {byte_len} bytes rejected")  # pragma: no cover

    def on_slot_used(self) -> None:
        """A receive completed for a WRITE-with-immediate or a one-sided control message of the peer.

        Raises :class:`FrameError` (and aborts) if the peer held no credit for it.
        """
        if self._posted - self._ungranted <= 0:
            exc = FrameError("a one-sided request consumed a receive the peer held no credit for")
            self.abort(exc)
            raise exc
        self._posted -= 1
        self._onesided_received += 1
