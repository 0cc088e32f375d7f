"""Sans-IO core of one rdmaio connection: handshake, frame encoding, credit flow control and close states.

Nothing in this module does I/O. The I/O layer posts RDMA SEND-with-immediate work requests and receive
buffers; it asks a :class:`Session` which 32-bit immediate value to attach to every frame it sends and feeds
it every received ``(imm, byte_len)``. Keeping the rules here makes them testable without an RDMA device.

Wire format
-----------
A frame is one SEND with immediate data. The immediate value (host order) is laid out as::

    bits 31..28  kind      (FrameKind)
    bits 27..16  reserved  (must be 0)
    bits 15..0   credits   granted to the receiver of this frame

Every SEND consumes one receive buffer ("slot") that the peer posted. The peer advertises ``recv_depth``
slots of ``slot_size`` bytes each in the :class:`Handshake` (rdma_cm private data); a message larger than
one slot travels as DATA_MORE fragments followed by one DATA_END.

If both handshakes announce :data:`FEATURE_BATCH`, a DATA_BATCH frame may carry several complete messages in
one slot: its payload is a sequence of records ``[u32 little-endian length][bytes]`` (see
:func:`pack_batch_into` and :func:`unpack_batch`). A DATA_BATCH frame is a frame like any other (one slot,
one credit, the two-credit rule of DATA frames) and may not arrive between a DATA_MORE and its DATA_END:
messages are never interleaved.

Flow control and liveness
-------------------------
A sender holds one credit per peer slot it knows to be posted and free. Whenever the I/O layer reposts slots
(:meth:`Session.on_recv_reposted`) they become *ungranted* credits; every frame we send piggybacks all of
them, and a standalone CREDIT frame is sent once ``credit_threshold`` have accumulated.

* No RNR: a frame is only sent while holding a credit, and a credit only exists for a posted slot.
* Reserve: DATA frames need two credits, so one credit is always left for a control frame. A frame may use
  the *last* credit only if it grants at least one credit itself (CREDIT frames always do; EOF must).
* No deadlock: suppose nothing is in flight and both applications have consumed everything, so every slot
  is reposted. Then ``peer.ungranted == peer.recv_depth - our.send_credits``. If we are stuck (fewer than
  two credits), the peer owes us at least ``recv_depth - 1 >= threshold`` credits, so its CREDIT frame is
  due as soon as it holds one credit. Both sides cannot hold zero: a side left with zero received no grant
  after its last send, and that send, having taken the last credit, granted at least one. Whichever of
  the two last sends came later delivers its grant after the other's last send - a contradiction. So one
  side can always send a CREDIT frame, and the other side's answer (it then owes ``recv_depth``) unblocks.
* No ping-pong: a CREDIT frame costs its sender at least ``threshold >= 2`` owed credits and makes the
  receiver owe exactly one more (the slot it consumed, once reposted). While no data flows the total owed
  by both sides therefore drops by at least one per CREDIT frame, so idle peers exchange at most
  ``local.recv_depth + peer.recv_depth`` CREDIT frames and then stop. A threshold of 1 would allow an
  endless exchange, a threshold of ``recv_depth`` could deadlock; hence ``2 <= threshold <= recv_depth-1``
  and the default ``recv_depth // 2`` (``recv_depth >= 4``).

Growing windows
---------------
A side that announces :data:`FEATURE_GROW` posts only ``initial_depth`` receives at first (an idle
connection then pins few buffers) and adds more up to its ``recv_depth`` when it sees load
(:meth:`Session.grow_receives`); the new slots are granted like reposted ones. The peer starts with
``initial_depth`` credits and rejects grants beyond ``recv_depth``. The argument above holds for the current
window at every moment: growth raises the window and the owed credits by the same amount, and the default
threshold is half the current window. ``tests/unit/test_protocol.py`` simulates growth at random moments.

Hot path
--------
:meth:`Session.take_data_frame`, :meth:`Session.on_frame`, :meth:`Session.on_recv_reposted`,
:meth:`Session.can_send_data` and :meth:`Session.credit_frame_due` run once per frame. They work on plain
ints (kinds are decoded with ``imm >> 28`` and compared with module-level constants; :meth:`Session.on_frame`
returns a pre-bound :class:`FrameKind` member, no enum is constructed), validate a frame with one combined
test and only fall back to the slower, message-building checks (``_frame_error``) when that test fails, and
derive rarely-read statistics instead of counting them per frame. Every check of the straightforward version
is still made, in the same order for the purpose of error messages; ``tools/bench_protocol.py`` measures it.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NoReturn, TypeAlias

from rdmaio.errors import (
    ConnectionAbortedError,
    ConnectionResetError,
    EndpointClosedError,
    FrameError,
    HandshakeError,
    MessageTooLargeError,
    ProtocolError,
)

__all__ = [
    "BATCH_RECORD_HEADER",
    "EOF",
    "FEATURE_BATCH",
    "FEATURE_GROW",
    "FEATURE_RNDV",
    "HANDSHAKE_MAGIC",
    "KNOWN_FEATURES",
    "MAX_CREDITS",
    "MAX_MESSAGE_SIZE",
    "MAX_PRIVATE_DATA",
    "MAX_RECV_DEPTH",
    "MAX_SLOT_SIZE",
    "MIN_MESSAGE_SIZE",
    "MIN_RECV_DEPTH",
    "MIN_SLOT_SIZE",
    "PROTOCOL_VERSION",
    "BytesLike",
    "EOFType",
    "FrameKind",
    "Handshake",
    "ReceivedMessageTooLargeError",
    "Session",
    "State",
    "batch_record_size",
    "decode_imm",
    "encode_imm",
    "pack_batch_into",
    "unpack_batch",
]

PROTOCOL_VERSION: Final = 1
HANDSHAKE_MAGIC: Final = b"RDIO"
MAX_PRIVATE_DATA: Final = 56  # rdma_cm limit for RDMA_PS_TCP connect private data

# recv_depth >= 4 so that the credit reserve (1) and a threshold in 2..recv_depth-1 both fit.
MIN_RECV_DEPTH: Final = 4
MAX_RECV_DEPTH: Final = 0xFFFF
MIN_SLOT_SIZE: Final = 64
MAX_SLOT_SIZE: Final = 16 * 1024 * 1024
MIN_MESSAGE_SIZE: Final = 1
MAX_MESSAGE_SIZE: Final = 2**40
MAX_CREDITS: Final = 0xFFFF  # width of the credit field of the immediate value

FEATURE_BATCH: Final = 0x01
"""Handshake feature bit: this side accepts DATA_BATCH frames (several small messages in one frame)."""
FEATURE_GROW: Final = 0x02
"""Handshake feature bit: this side posts ``initial_depth`` receives at first (an extra body field) and may
grow to ``recv_depth`` later, granting the new slots as credits; it also accepts such a peer."""
FEATURE_RNDV: Final = 0x04
"""Handshake feature bit: this side accepts RNDV frames (rendezvous: a large message's descriptor, the data
is pulled with RDMA READ; :mod:`rdmaio.rendezvous`). Used only if both sides announce it."""
KNOWN_FEATURES: Final = FEATURE_BATCH | FEATURE_GROW | FEATURE_RNDV
"""Every feature bit this version knows; other bits of the handshake's flags byte are ignored on receipt."""

BATCH_RECORD_HEADER: Final = 4
"""Bytes of the length prefix (u32, little-endian) in front of every message of a DATA_BATCH payload."""

BytesLike: TypeAlias = bytes | bytearray | memoryview
"""A buffer of single bytes (a memoryview must have an item size of 1)."""

# Header: magic, version, flags (feature bits, see KNOWN_FEATURES; unknown bits are ignored on receipt so
# that a later version can add features compatibly), body length.
_HEADER: Final = struct.Struct("!4sBBH")
# Version 1 body: recv_depth, slot_size, max_message_size. Wider than the ranges so that decode can see
# and reject out-of-range values instead of silently truncating them.
_BODY_V1: Final = struct.Struct("!IIQ")
# FEATURE_GROW extension, appended to the version 1 body: the receives posted at first.
_BODY_GROW: Final = struct.Struct("!I")
_BATCH_LEN: Final = struct.Struct("<I")

_KIND_SHIFT: Final = 28
_RESERVED_MASK: Final = 0x0FFF_0000
_CREDIT_MASK: Final = 0xFFFF
_U32_MAX: Final = 0xFFFF_FFFF
# Every bit outside the kind and credit fields, including the (infinite) sign bits of a negative int: one
# ``imm & _BAD_IMM_BITS`` rejects a negative, too wide or reserved-bit-carrying immediate value at once.
_BAD_IMM_BITS: Final = ~(0xF000_0000 | _CREDIT_MASK)


def _check_fields(recv_depth: int, slot_size: int, max_message_size: int) -> None:
    """Raise HandshakeError if a handshake field is outside the range this version allows."""
    for name, value, low, high in (
        ("recv_depth", recv_depth, MIN_RECV_DEPTH, MAX_RECV_DEPTH),
        ("slot_size", slot_size, MIN_SLOT_SIZE, MAX_SLOT_SIZE),
        ("max_message_size", max_message_size, MIN_MESSAGE_SIZE, MAX_MESSAGE_SIZE),
    ):
        if not low <= value <= high:
            raise HandshakeError(f"{name} {value} is out of range {low}..{high}")


@dataclass(frozen=True, slots=True)
class Handshake:
    """Connection parameters one side announces in the rdma_cm private data.

    ``recv_depth`` receive buffers of ``slot_size`` bytes each are posted for the peer; ``max_message_size``
    is the largest message this side accepts. ``features`` is a set of feature bits (:data:`FEATURE_BATCH`,
    :data:`FEATURE_GROW`) this side supports; a feature is used only if both sides announce it, except that a
    side announcing :data:`FEATURE_GROW` posts only ``initial_depth`` receives at first (0 means
    ``recv_depth``): its peer starts with that many credits and may be granted up to ``recv_depth``.
    """

    recv_depth: int
    slot_size: int
    max_message_size: int
    version: int = PROTOCOL_VERSION
    features: int = 0
    initial_depth: int = 0

    def __post_init__(self) -> None:
        for name in ("recv_depth", "slot_size", "max_message_size", "version", "features", "initial_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Handshake.{name} must be an int, not {type(value).__name__}")
        if self.initial_depth == 0 or not self.features & FEATURE_GROW:
            object.__setattr__(self, "initial_depth", self.recv_depth)
        elif not MIN_RECV_DEPTH <= self.initial_depth <= self.recv_depth:
            raise HandshakeError(
                f"initial_depth {self.initial_depth} is out of range {MIN_RECV_DEPTH}..{self.recv_depth}"
            )
        if self.version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"unsupported protocol version {self.version} (this side supports {PROTOCOL_VERSION})"
            )
        _check_fields(self.recv_depth, self.slot_size, self.max_message_size)
        if self.features & ~KNOWN_FEATURES:
            raise HandshakeError(
                f"unknown feature bits {self.features:#x} (this side knows {KNOWN_FEATURES:#x})"
            )

    def encode(self) -> bytes:
        """Return the private-data bytes (at most :data:`MAX_PRIVATE_DATA`) announcing this handshake."""
        body = _BODY_V1.pack(self.recv_depth, self.slot_size, self.max_message_size)
        if self.features & FEATURE_GROW:
            body += _BODY_GROW.pack(self.initial_depth)
        return _HEADER.pack(HANDSHAKE_MAGIC, self.version, self.features, len(body)) + body

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Handshake:
        """Parse a handshake received from an untrusted peer.

        Bytes beyond the declared length are ignored: rdma_cm pads private data with zeros, and later
        compatible extensions may append fields. Feature bits this version does not know are ignored too (a
        peer that announces a feature we lack simply does not get to use it). Raises
        :class:`HandshakeError` for anything malformed.
        """
        raw = bytes(data)
        if len(raw) < _HEADER.size:
            raise HandshakeError(
                f"handshake too short: {len(raw)} bytes, the header alone needs {_HEADER.size}"
            )
        magic, version, flags, body_len = _HEADER.unpack_from(raw)
        if magic != HANDSHAKE_MAGIC:
            raise HandshakeError(
                f"bad handshake magic {magic!r} (expected {HANDSHAKE_MAGIC!r}): the peer is not rdmaio"
            )
        if version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"unsupported protocol version {version} from the peer "
                f"(this side supports {PROTOCOL_VERSION})"
            )
        if body_len < _BODY_V1.size:
            raise HandshakeError(
                f"handshake declared length {body_len} is too small for version {version} "
                f"(needs at least {_BODY_V1.size})"
            )
        if len(raw) < _HEADER.size + body_len:
            raise HandshakeError(
                f"handshake too short: {len(raw)} bytes, the declared length needs {_HEADER.size + body_len}"
            )
        recv_depth, slot_size, max_message_size = _BODY_V1.unpack_from(raw, _HEADER.size)
        features = flags & KNOWN_FEATURES
        initial_depth = 0
        if features & FEATURE_GROW:
            if body_len >= _BODY_V1.size + _BODY_GROW.size:
                (initial_depth,) = _BODY_GROW.unpack_from(raw, _HEADER.size + _BODY_V1.size)
            else:
                features &= ~FEATURE_GROW  # the bit without its field: a peer that posted recv_depth
        try:
            _check_fields(recv_depth, slot_size, max_message_size)
            return cls(recv_depth, slot_size, max_message_size, version, features, initial_depth)
        except HandshakeError as exc:
            raise HandshakeError(f"invalid handshake from the peer: {exc.message}") from None


class FrameKind(enum.IntEnum):
    """Kind of a frame, bits 31..28 of the immediate value."""

    DATA_MORE = 1  # a fragment of a message; more fragments follow
    DATA_END = 2  # the last (or only) fragment of a message; may be empty
    CREDIT = 3  # no payload, only grants credits
    EOF = 4  # no payload; the sender sends no more data (half-close)
    DATA_BATCH = 5  # one or more complete messages as [u32 LE length][bytes] records (FEATURE_BATCH)
    RNDV = (
        6  # a rendezvous descriptor (FEATURE_RNDV): a message whose data the receiver pulls (rendezvous.py)
    )


# Plain-int kinds for the hot path (comparing ints, no enum lookup), the members on_frame returns (bound
# once here, so returning one costs a global load), and the kind bits of the immediate values we send.
_K_MORE: Final = 1
_K_END: Final = 2
_K_CREDIT: Final = 3
_K_EOF: Final = 4
_K_BATCH: Final = 5
_K_RNDV: Final = 6
_DATA_MORE: Final = FrameKind.DATA_MORE
_DATA_END: Final = FrameKind.DATA_END
_CREDIT: Final = FrameKind.CREDIT
_EOF_KIND: Final = FrameKind.EOF
_DATA_BATCH: Final = FrameKind.DATA_BATCH
_RNDV: Final = FrameKind.RNDV
_IMM_MORE: Final = _K_MORE << _KIND_SHIFT
_IMM_END: Final = _K_END << _KIND_SHIFT
_IMM_CREDIT: Final = _K_CREDIT << _KIND_SHIFT
_IMM_EOF: Final = _K_EOF << _KIND_SHIFT
_IMM_BATCH: Final = _K_BATCH << _KIND_SHIFT
_IMM_RNDV: Final = _K_RNDV << _KIND_SHIFT
# FrameKind member by raw kind value (None: unknown kind), for decode_imm and the error path.
_KIND_BY_VALUE: Final[tuple[FrameKind | None, ...]] = tuple(
    {int(k): k for k in FrameKind}.get(v) for v in range(1 << (32 - _KIND_SHIFT))
)


def encode_imm(kind: FrameKind, credits: int) -> int:
    """Return the immediate value of a frame of ``kind`` that grants ``credits`` (0..65535)."""
    kind = FrameKind(kind)
    if not 0 <= credits <= MAX_CREDITS:
        raise ValueError(f"credits {credits} out of range 0..{MAX_CREDITS}")
    return (int(kind) << _KIND_SHIFT) | credits


def decode_imm(imm: int) -> tuple[FrameKind, int]:
    """Split a received immediate value into ``(kind, credits)``; :class:`FrameError` if malformed."""
    if not 0 <= imm <= _U32_MAX:
        raise FrameError(f"immediate value {imm:#x} is not an unsigned 32-bit value")
    if imm & _RESERVED_MASK:
        raise FrameError(f"immediate value {imm:#010x} has reserved bits set")
    raw_kind = imm >> _KIND_SHIFT
    kind = _KIND_BY_VALUE[raw_kind]
    if kind is None:
        raise FrameError(f"unknown frame kind {raw_kind} in immediate value {imm:#010x}")
    return kind, imm & _CREDIT_MASK


class ReceivedMessageTooLargeError(MessageTooLargeError, FrameError):
    """The peer sent a message larger than our ``max_message_size``.

    On the receive side this is a protocol violation (the sender must check the size first), so it is both
    a :class:`MessageTooLargeError` and a :class:`~rdmaio.errors.ProtocolError`.
    """


# -- DATA_BATCH payloads ------------------------------------------------------------------------------------


def batch_record_size(n: int) -> int:
    """Bytes a message of ``n`` bytes takes in a DATA_BATCH payload: the 4-byte length prefix plus ``n``."""
    return BATCH_RECORD_HEADER + n


def pack_batch_into(buffer: memoryview | bytearray, offset: int, messages: Sequence[BytesLike]) -> int:
    """Write ``messages`` as DATA_BATCH records into ``buffer`` at ``offset``; return the bytes written.

    Every record is the message's length (u32, little-endian) followed by its bytes; empty messages are
    allowed, an empty ``messages`` is not (a DATA_BATCH frame carries at least one message). Meant for
    writing straight into a registered send slot.

    Raises ValueError, before writing anything, if the batch does not fit between ``offset`` and the end
    of ``buffer``. Pass a view that ends where the slot ends (``send_view[off : off + slot_size]``) so an
    overflow cannot spill into the next slot; the frame size must also be at most
    :attr:`Session.max_fragment` (checked again by :meth:`Session.take_batch_frame`).
    """
    # The records are joined first and copied into the buffer in one slice assignment: for small messages
    # that is about twice as fast as a struct.pack_into plus a slice assignment per message, and the extra
    # copy of at most one slot is cheap next to the per-message interpreter overhead it saves.
    if not messages:
        raise ValueError("a DATA_BATCH frame carries at least one message")
    parts: list[BytesLike] = []
    for message in messages:
        parts += (len(message).to_bytes(BATCH_RECORD_HEADER, "little"), message)
    data = b"".join(parts)
    total = len(data)
    end = offset + total
    if offset < 0 or end > len(buffer):
        raise ValueError(
            f"a batch of {len(messages)} messages needs {total} bytes, "
            f"{len(buffer) - offset} are available at offset {offset}"
        )
    buffer[offset:end] = data
    return total


def unpack_batch(view: BytesLike, max_message_size: int | None = None) -> list[bytes]:
    """Split a received DATA_BATCH payload into its messages (copies, so the slot can be reused at once).

    Raises :class:`FrameError` if the payload is empty, a record header is cut short or a record declares
    more bytes than follow, and :class:`ReceivedMessageTooLargeError` if a message exceeds
    ``max_message_size`` (when given).
    """
    data = bytes(view)  # one copy; slicing bytes is cheaper than slicing a memoryview and copying each slice
    end = len(data)
    if end < BATCH_RECORD_HEADER:
        raise FrameError(f"DATA_BATCH payload of {end} bytes is too short for one record")
    limit = _U32_MAX if max_message_size is None else max_message_size
    unpack_len = _BATCH_LEN.unpack_from
    messages: list[bytes] = []
    append = messages.append
    pos = 0
    while pos < end:
        start = pos + BATCH_RECORD_HEADER
        if start > end:
            raise FrameError(
                f"DATA_BATCH payload truncated: {end - pos} bytes left at offset {pos}, "
                f"a record header needs {BATCH_RECORD_HEADER}"
            )
        (n,) = unpack_len(data, pos)
        pos = start + n
        if pos > end:
            raise FrameError(
                f"DATA_BATCH record at offset {start - BATCH_RECORD_HEADER} declares {n} bytes, "
                f"only {end - start} follow"
            )
        if n > limit:
            raise ReceivedMessageTooLargeError(
                f"peer sent a batched message of {n} bytes, more than our maximum message size "
                f"of {limit} bytes"
            )
        append(data[start:pos])
    return messages


class EOFType(enum.Enum):
    """Type of the :data:`EOF` sentinel returned by :meth:`Session.recv_outcome`."""

    EOF = "EOF"

    def __repr__(self) -> str:
        return "EOF"


EOF: Final = EOFType.EOF
"""Clean end of stream: the peer sent an EOF frame."""


class State(enum.Enum):
    """Life cycle of a connection as seen by this side."""

    OPEN = "open"  # transport up, not closed locally (half-close is tracked separately)
    CLOSING = "closing"  # close() called; the I/O layer flushes and tears down
    DISCONNECTED = "disconnected"  # transport gone (peer disconnect or transport error), not closed locally
    ABORTED = "aborted"  # abort() called or the peer violated the protocol
    CLOSED = "closed"  # the I/O layer finished teardown (mark_closed())


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _chained(err: BaseException, cause: BaseException) -> BaseException:
    err.__cause__ = cause
    err.__suppress_context__ = True
    return err


class Session:
    """Flow control, fragmentation accounting and close state of one established connection.

    ``local`` is the handshake this side sent, ``peer`` the one it received. See the module docstring for
    the credit rules and why ``credit_threshold`` must be in ``2..local.recv_depth-1``.

    Contract with the I/O layer:

    * send a frame only with an imm obtained from ``take_*_frame()`` right before posting it;
    * for every receive completion call :meth:`on_frame` first and :meth:`on_recv_reposted` only after the
      buffer was posted again (slots of CREDIT/EOF frames carry no payload: repost them right away);
    * when :meth:`on_frame` returns DATA_BATCH, pass the frame's payload to :meth:`on_batch` before the next
      :meth:`on_frame`; it returns the messages;
    * send a CREDIT frame whenever :meth:`credit_frame_due` is true, and the EOF frame once
      :meth:`eof_pending` and :meth:`can_send_eof` are true and all data written before ``write_eof()`` is
      sent.
    """

    __slots__ = (
        "_abort_exc",
        "_aborted",
        "_batch_frames_received",
        "_batch_frames_sent",
        "_batch_pending",
        "_batched_messages_received",
        "_batched_messages_sent",
        "_batching",
        "_bytes_received",
        "_bytes_sent",
        "_credit_frames_received",
        "_credit_frames_sent",
        "_default_threshold",
        "_eof_requested",
        "_eof_sent",
        "_frames_received",
        "_frames_sent",
        "_grown",
        "_local",
        "_local_closed",
        "_local_max",
        "_max_fragment",
        "_messages_received",
        "_messages_sent",
        "_min_send_credits",
        "_onesided_received",
        "_onesided_sent",
        "_peer",
        "_peer_depth",
        "_peer_eof",
        "_peer_max",
        "_posted",
        "_recv_depth",
        "_recv_in_message",
        "_recv_max",
        "_recv_message_bytes",
        "_rndv",
        "_send_credits",
        "_send_in_message",
        "_send_message_bytes",
        "_slot_size",
        "_threshold",
        "_torn_down",
        "_transport_error",
        "_transport_lost",
        "_ungranted",
        "_wire_down",
    )

    def __init__(self, local: Handshake, peer: Handshake, *, credit_threshold: int | None = None) -> None:
        # Receives posted at first: fewer than recv_depth only if we announced FEATURE_GROW.
        depth = local.initial_depth
        self._default_threshold = credit_threshold is None
        if credit_threshold is None:
            credit_threshold = depth // 2
        if not 2 <= credit_threshold <= depth - 1:
            raise ValueError(
                f"credit_threshold {credit_threshold} out of range 2..{depth - 1} "
                "(1 lets idle peers exchange CREDIT frames forever, recv_depth can deadlock)"
            )
        self._local = local
        self._peer = peer
        # Handshake fields the hot path reads, copied to avoid a second attribute lookup per frame.
        # _recv_depth is the receives we have added so far (posted or consumed by frames in flight);
        # grow_receives() raises it up to _recv_max.
        self._recv_depth = depth
        self._recv_max = local.recv_depth
        self._grown = 0
        self._slot_size = local.slot_size
        self._local_max = local.max_message_size
        self._peer_depth = peer.recv_depth
        self._max_fragment = peer.slot_size
        self._peer_max = peer.max_message_size
        self._batching = bool(local.features & peer.features & FEATURE_BATCH)
        self._rndv = bool(local.features & peer.features & FEATURE_RNDV)
        self._threshold = credit_threshold
        # The peer posted initial_depth receives; its recv_depth bounds what it may grant us later.
        self._send_credits = peer.initial_depth
        self._ungranted = 0
        self._posted = depth
        self._recv_in_message = False
        self._recv_message_bytes = 0
        self._send_in_message = False
        self._send_message_bytes = 0
        self._batch_pending = -1  # payload size of the DATA_BATCH frame awaiting on_batch(), -1 if none
        self._eof_requested = False
        self._eof_sent = False
        self._peer_eof = False
        self._local_closed = False
        self._aborted = False
        self._abort_exc: BaseException | None = None
        self._transport_lost = False
        self._transport_error: BaseException | None = None
        self._torn_down = False
        self._wire_down = False  # aborted or transport lost or torn down: no frame may be sent
        # Counters. Those the statistics can derive (data frames, credits granted/received) are not kept.
        self._frames_sent = 0
        self._frames_received = 0
        self._bytes_sent = 0
        self._bytes_received = 0
        self._messages_sent = 0
        self._messages_received = 0
        self._credit_frames_sent = 0
        self._credit_frames_received = 0
        self._batch_frames_sent = 0
        self._batch_frames_received = 0
        self._batched_messages_sent = 0
        self._batched_messages_received = 0
        self._onesided_sent = 0  # peer receives consumed by our one-sided requests (issue 11)
        self._onesided_received = 0
        self._min_send_credits = self._send_credits

    def __repr__(self) -> str:
        return (
            f"<Session {self.state.name} send_credits={self._send_credits} ungranted={self._ungranted} "
            f"posted={self._posted} eof_sent={self._eof_sent} peer_eof={self._peer_eof}>"
        )

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def local(self) -> Handshake:
        """The handshake this side sent."""
        return self._local

    @property
    def peer(self) -> Handshake:
        """The handshake the peer sent."""
        return self._peer

    @property
    def send_credits(self) -> int:
        """Peer slots known to be posted for us: frames we may still send."""
        return self._send_credits

    @property
    def ungranted(self) -> int:
        """Slots reposted locally that the peer has not been told about yet."""
        return self._ungranted

    @property
    def posted(self) -> int:
        """Receive slots currently posted locally."""
        return self._posted

    @property
    def credit_threshold(self) -> int:
        """Number of ungranted credits that makes a standalone CREDIT frame due."""
        return self._threshold

    @property
    def max_fragment(self) -> int:
        """The most payload bytes one frame may carry (the peer's slot size)."""
        return self._max_fragment

    @property
    def batching(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_BATCH`: DATA_BATCH frames may be sent."""
        return self._batching

    @property
    def rendezvous(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_RNDV`: RNDV frames may be sent."""
        return self._rndv

    @property
    def peer_eof(self) -> bool:
        """True once the peer's EOF frame was received."""
        return self._peer_eof

    @property
    def eof_sent(self) -> bool:
        """True once our EOF frame was taken (:meth:`take_eof_frame`)."""
        return self._eof_sent

    @property
    def state(self) -> State:
        """The connection's :class:`State`, derived from the events seen so far."""
        if self._torn_down:
            return State.CLOSED
        if self._aborted:
            return State.ABORTED
        if self._local_closed:
            return State.CLOSING
        if self._transport_lost:
            return State.DISCONNECTED
        return State.OPEN

    # -- sending ------------------------------------------------------------------------------------------

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
        """True if a standalone CREDIT frame should be sent now."""
        return self._ungranted >= self._threshold and self._send_credits >= 1 and not self._wire_down

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

    def _take(self, kind_bits: int) -> int:
        # Shared by the less frequent frames (EOF, DATA_BATCH); take_data_frame/take_credit_frame inline it.
        grant = min(self._ungranted, MAX_CREDITS)
        self._ungranted -= grant
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

    # -- receiving ----------------------------------------------------------------------------------------

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

    # -- close state machine ------------------------------------------------------------------------------

    def close(self) -> None:
        """Graceful local close: implies :meth:`write_eof`; the state becomes CLOSING. Idempotent."""
        self._local_closed = True
        self._eof_requested = True

    def abort(self, exc: BaseException | None = None) -> None:
        """Abort the connection now (state ABORTED); ``exc``, if any, is reported to pending operations.

        Idempotent: the first cause is kept. A no-op once :meth:`mark_closed` was called.
        """
        if self._aborted or self._torn_down:
            return
        self._aborted = True
        self._abort_exc = exc
        self._wire_down = True

    def on_disconnected(self) -> None:
        """The transport reported DISCONNECTED (the peer left or our disconnect completed)."""
        self._transport_lost = True
        self._wire_down = True

    def on_transport_error(self, exc: BaseException) -> None:
        """A completion or rdma_cm error made the transport unusable.

        Only the first cause is kept: errors after a disconnect (e.g. flushed work requests) are
        consequences, not news.
        """
        if not self._transport_lost:
            self._transport_lost = True
            self._transport_error = exc
            self._wire_down = True

    def mark_closed(self) -> None:
        """The I/O layer finished tearing the connection down; the state becomes CLOSED."""
        self._torn_down = True
        self._wire_down = True

    def send_error(self) -> BaseException | None:
        """The exception a send/write/drain must raise now, or None if the state allows new data.

        Credits are a separate matter (:meth:`can_send_data`). A new instance is returned on each call.
        """
        if self._aborted:
            return self._abort_error()
        if self._local_closed:
            return EndpointClosedError("endpoint is closed")
        if self._eof_requested:
            return EndpointClosedError("cannot send after write_eof() was called")
        if self._transport_lost:
            return self._reset_error("peer closed the connection")
        if self._torn_down:
            return EndpointClosedError("endpoint is closed")
        return None

    def flush_error(self) -> BaseException | None:
        """The exception a wait for data already accepted (``drain()``) must raise now, or None.

        Unlike :meth:`send_error`, a requested EOF is no error here: the data written before
        ``write_eof()`` is still sent, and waiting for it is legitimate. A new instance on each call.
        """
        if self._aborted:
            return self._abort_error()
        if self._local_closed:
            return EndpointClosedError("endpoint is closed")
        if self._transport_lost:
            return self._reset_error("peer closed the connection")
        if self._torn_down:
            return EndpointClosedError("endpoint is closed")
        return None

    def recv_outcome(self) -> BaseException | EOFType | None:
        """What a read that finds no buffered data gets.

        None means wait for more, :data:`EOF` is the clean end of stream (the peer's EOF wins over a later
        disconnect or transport error), an exception instance is to be raised.
        """
        if self._aborted:
            return self._abort_error()
        if self._local_closed:
            return EndpointClosedError("endpoint is closed")
        if self._peer_eof:
            return EOF
        if self._transport_lost:
            return self._reset_error("connection reset: the peer disconnected without sending EOF")
        if self._torn_down:
            return EndpointClosedError("endpoint is closed")
        return None

    def _abort_error(self) -> BaseException:
        exc = self._abort_exc
        if exc is None:
            return EndpointClosedError("endpoint was aborted")
        return _chained(ConnectionAbortedError(f"connection aborted: {_describe(exc)}"), exc)

    def _reset_error(self, message: str) -> BaseException:
        exc = self._transport_error
        if exc is None:
            return ConnectionResetError(message)
        return _chained(ConnectionResetError(f"connection lost: transport error: {_describe(exc)}"), exc)

    def _wire_ok(self) -> bool:
        # A local close() still lets the I/O layer flush data, EOF and credits until teardown.
        return not self._wire_down

    def _raise_wire_error(self) -> None:
        if self._aborted:
            raise self._abort_error()
        if self._transport_lost:
            raise self._reset_error("peer closed the connection")
        if self._torn_down:
            raise EndpointClosedError("endpoint is closed")

    # -- statistics ---------------------------------------------------------------------------------------

    def statistics(self) -> dict[str, int]:
        """Counters and current credit state, for monitoring and tuning.

        ``data_frames_*`` count DATA_MORE/DATA_END frames, ``batch_frames_*`` DATA_BATCH frames and
        ``batched_messages_*`` the messages those carried; ``messages_*`` and ``bytes_*`` count every
        message and its bytes however it travelled (batch record headers are not counted).
        """
        eof_sent = int(self._eof_sent)
        eof_received = int(self._peer_eof)
        frames_sent = self._frames_sent
        frames_received = self._frames_received
        return {
            "frames_sent": frames_sent,
            "frames_received": frames_received,
            "data_frames_sent": frames_sent - self._credit_frames_sent - self._batch_frames_sent - eof_sent,
            "data_frames_received": (
                frames_received - self._credit_frames_received - self._batch_frames_received - eof_received
            ),
            "bytes_sent": self._bytes_sent,
            "bytes_received": self._bytes_received,
            "messages_sent": self._messages_sent,
            "messages_received": self._messages_received,
            "credit_frames_sent": self._credit_frames_sent,
            "credit_frames_received": self._credit_frames_received,
            "batch_frames_sent": self._batch_frames_sent,
            "batch_frames_received": self._batch_frames_received,
            "batched_messages_sent": self._batched_messages_sent,
            "batched_messages_received": self._batched_messages_received,
            "eof_sent": eof_sent,
            "eof_received": eof_received,
            # Every repost became an ungranted credit and every grant came out of those; reposts are the
            # posted slots minus the initial ones plus those consumed by received frames.
            # Growth adds slots to both posted and recv_depth, and grants them like reposts.
            "credits_granted": (
                self._posted
                - self._recv_depth
                + self._grown
                + frames_received
                + self._onesided_received
                - self._ungranted
            ),
            # send_credits = peer.initial_depth - frames and one-sided requests sent + credits received.
            "credits_received": (
                self._send_credits - self._peer.initial_depth + frames_sent + self._onesided_sent
            ),
            "onesided_slots_sent": self._onesided_sent,
            "onesided_slots_received": self._onesided_received,
            "send_credits": self._send_credits,
            "min_send_credits": self._min_send_credits,
            "ungranted": self._ungranted,
            "posted": self._posted,
            "credit_threshold": self._threshold,
            "recv_depth": self._recv_depth,
            "batching": int(self._batching),
        }

    # -- one-sided operations (issue 11) ------------------------------------------------------------------
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
