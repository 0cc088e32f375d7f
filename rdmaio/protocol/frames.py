"""Frame encoding: the frame kind and credits in the 32-bit immediate value, and the DATA_BATCH payload
(several small messages in one frame)."""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import Final, TypeAlias

from rdmaio.errors import (
    FrameError,
    MessageTooLargeError,
)
from rdmaio.protocol.handshake import MAX_CREDITS

BATCH_RECORD_HEADER: Final = 4
"""Bytes of the length prefix (u32, little-endian) in front of every message of a DATA_BATCH payload."""

BytesLike: TypeAlias = bytes | bytearray | memoryview
"""A buffer of single bytes (a memoryview must have an item size of 1)."""

_BATCH_LEN: Final = struct.Struct("<I")

_KIND_SHIFT: Final = 28
_RESERVED_MASK: Final = 0x0FFF_0000
_CREDIT_MASK: Final = 0xFFFF
_U32_MAX: Final = 0xFFFF_FFFF
# Every bit outside the kind and credit fields, including the (infinite) sign bits of a negative int: one
# ``imm & _BAD_IMM_BITS`` rejects a negative, too wide or reserved-bit-carrying immediate value at once.
_BAD_IMM_BITS: Final = ~(0xF000_0000 | _CREDIT_MASK)


class FrameKind(enum.IntEnum):
    """Kind of a frame, bits 31..28 of the immediate value."""

    DATA_MORE = 1  # a fragment of a message; more fragments follow
    DATA_END = 2  # the last (or only) fragment of a message; may be empty
    CREDIT = 3  # no payload, only grants credits
    EOF = 4  # no payload; the sender sends no more data (half-close)
    DATA_BATCH = 5  # one or more complete messages as [u32 LE length][bytes] records (FEATURE_BATCH)
    RNDV = 6  # a rendezvous descriptor (FEATURE_RNDV): a message whose data the receiver pulls
    RECLAIM = 7  # no payload (FEATURE_RECLAIM): the receiver asks for unused credits back
    RETURN = 8  # no payload (FEATURE_RECLAIM): gives back the credits in bits 27..16 (the answer to RECLAIM)


# Plain-int kinds for the hot path (comparing ints, no enum lookup), the members on_frame returns (bound
# once here, so returning one costs a global load), and the kind bits of the immediate values we send.
_K_MORE: Final = 1
_K_END: Final = 2
_K_CREDIT: Final = 3
_K_EOF: Final = 4
_K_BATCH: Final = 5
_K_RNDV: Final = 6
_K_RECLAIM: Final = 7
_K_RETURN: Final = 8
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
_IMM_RECLAIM: Final = _K_RECLAIM << _KIND_SHIFT
_IMM_RETURN: Final = _K_RETURN << _KIND_SHIFT
# A RETURN frame carries the count of credits it gives back in the otherwise reserved bits 27..16.
_RETURN_SHIFT: Final = 16
MAX_RETURN: Final = 0x0FFF
"""The most credits one RETURN frame gives back (the width of bits 27..16); more take several frames."""
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


def encode_return_imm(returned: int, credits: int) -> int:
    """Return the immediate value of a RETURN frame giving back ``returned`` credits (0..:data:`MAX_RETURN`)
    and granting ``credits`` (0..65535), like every frame."""
    if not 0 <= returned <= MAX_RETURN:
        raise ValueError(f"returned credits {returned} out of range 0..{MAX_RETURN}")
    if not 0 <= credits <= MAX_CREDITS:
        raise ValueError(f"credits {credits} out of range 0..{MAX_CREDITS}")
    return _IMM_RETURN | returned << _RETURN_SHIFT | credits


def returned_credits(imm: int) -> int:
    """The credits a RETURN frame's immediate value gives back (bits 27..16; 0 for any other kind)."""
    return (imm & _RESERVED_MASK) >> _RETURN_SHIFT if imm >> _KIND_SHIFT == _K_RETURN else 0


def decode_imm(imm: int) -> tuple[FrameKind, int]:
    """Split a received immediate value into ``(kind, credits)``; :class:`FrameError` if malformed.

    Bits 27..16 must be 0 except in a RETURN frame, where they are the credits given back
    (:func:`returned_credits`)."""
    if not 0 <= imm <= _U32_MAX:
        raise FrameError(f"immediate value {imm:#x} is not an unsigned 32-bit value")
    if imm & _RESERVED_MASK and imm >> _KIND_SHIFT != _K_RETURN:
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


def append_batch_record(batch: bytearray, message: BytesLike) -> int:
    """Append ``message`` as one DATA_BATCH record (its length as u32 little-endian, then its bytes) to
    ``batch``; return the bytes the record took. The encoder of DATA_BATCH payloads: the send queue
    (:mod:`rdmaio.protocol.sendqueue`) writes the same records inline, record by record (a unit test holds
    it to this function's bytes), and :func:`pack_batch_into` writes a whole batch with it."""
    n = len(message)
    batch += _BATCH_LEN.pack(n)
    batch += message
    return BATCH_RECORD_HEADER + n


def pack_batch_into(buffer: memoryview | bytearray, offset: int, messages: Sequence[BytesLike]) -> int:
    """Write ``messages`` as DATA_BATCH records into ``buffer`` at ``offset``; return the bytes written.

    Every record is the message's length (u32, little-endian) followed by its bytes
    (:func:`append_batch_record`); empty messages are allowed, an empty ``messages`` is not (a DATA_BATCH
    frame carries at least one message). Meant for writing straight into a registered send slot.

    Raises ValueError, before writing anything, if the batch does not fit between ``offset`` and the end
    of ``buffer``. Pass a view that ends where the slot ends (``send_view[off : off + slot_size]``) so an
    overflow cannot spill into the next slot; the frame size must also be at most
    :attr:`Session.max_fragment` (checked again by :meth:`Session.take_batch_frame`).
    """
    # The records are built first and copied into the buffer in one slice assignment, so nothing is
    # written when the batch does not fit.
    if not messages:
        raise ValueError("a DATA_BATCH frame carries at least one message")
    data = bytearray()
    for message in messages:
        append_batch_record(data, message)
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
