"""How one Dask message (a list of frames) travels over an rdmaio :class:`~rdmaio.Endpoint`.

This module knows nothing of Dask; it moves a list of buffers with the endpoint's message API, so it can
be tested against an in-memory endpoint.

Wire format of one message, as rdmaio messages:

1. A *header message*: ``version`` (u8), three zero bytes, ``count`` (u32), then ``count`` descriptors
   (u64 each: the frame size in the low 63 bits, bit 63 set when the frame is *inline*), then the bytes of
   the inline frames, in order. Small frames ride inline, so a typical control message is one rdmaio
   message (and one work request).
2. Each non-inline frame, in order, as one or more rdmaio messages of at most ``chunk_size`` bytes.

The receiver checks the declared sizes against its :class:`FrameLimits` before it allocates anything,
then allocates each non-inline frame at its final size when it gets to that frame (``distributed``'s
``host_array``: a writable NumPy-backed buffer when NumPy is there) and fills it with
``Endpoint.recv_into`` on the part still missing. ``recv_into`` fills at most the buffer it is given and
keeps the rest of a longer message for the next read call, so the frame boundary is exact whatever the
chunking; a peer that chunks differently still produces the right frames, and one that lies about
sizes is caught by the next header's validation. A frame's buffer is allocated before its data
arrives (a rendezvous message is pulled straight into it), so ``FrameLimits.max_frame_size`` is what a
peer can make the receiver allocate ahead of data; large allocations are mapped lazily by the
allocator, so resident memory grows as the data is written.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import rdmaio

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "INLINE_FRAME_LIMIT",
    "INLINE_TOTAL_LIMIT",
    "FrameLimitError",
    "FrameLimits",
    "FramingError",
    "MessageEndpoint",
    "OutgoingMessage",
    "check_limits",
    "decode_header",
    "encode_header",
    "encode_message",
    "read_frames",
    "send_message",
    "write_frames",
]

VERSION = 1
_PREFIX = struct.Struct("<B3xI")
_DESCRIPTOR = struct.Struct("<Q")
_INLINE_BIT = 1 << 63
_SIZE_MASK = _INLINE_BIT - 1

MAX_FRAMES = 1 << 20
"""More frames than this in one message is treated as a protocol violation (Dask sends a handful)."""
MAX_FRAME_SIZE = 1 << 46
"""A frame size above this (64 TiB) is a protocol violation, not an allocation to attempt."""
INLINE_FRAME_LIMIT = 64 * 1024
"""Frames up to this size may be sent inside the header message ..."""
INLINE_TOTAL_LIMIT = 256 * 1024
"""... while the inline frames of one message add up to no more than this. Larger frames get a buffer
of their own, so one long-lived array does not keep a whole message's bytes alive."""
DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
"""Largest rdmaio message a large frame is cut into: rdmaio's default ``max_message_size`` and
distributed's default ``distributed.comm.shard``, so a shard goes as one message. Between rdmaio peers a
message this large goes by rendezvous, straight into the receiver's frame buffer (no transient copy), and
every message costs a round trip before the next starts, so fewer, larger messages are faster: one 16 MiB
frame moved at 59 MiB/s as one message and at 49 MiB/s in 4 MiB messages (``bench.dask --framing``, test
host, asyncio; rxe's own ``ib_write_bw`` 60 MiB/s in the same run). Against a peer without rendezvous
the messages are reassembled by the receiving endpoint, which its own ``max_message_size`` bounds."""


class FramingError(rdmaio.FrameError):
    """The peer sent a header that does not follow the format above (a ``ValueError``)."""


class FrameLimitError(FramingError, rdmaio.MessageTooLargeError):
    """A header declares a frame or a message larger than the receiver's :class:`FrameLimits`."""


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """What one received Dask message may declare; checked before anything is allocated for it."""

    max_frame_size: int = MAX_FRAME_SIZE
    """Largest frame (each frame's buffer is allocated at its declared size before its data arrives)."""
    max_message_size: int = MAX_FRAME_SIZE
    """Largest message: all its frames together, inline ones included."""
    frame_size_name: str = "max_frame_size"
    """How the frame limit is called in error messages (the comm names its config key)."""
    message_size_name: str = "max_message_size"
    """How the message limit is called in error messages."""

    def __post_init__(self) -> None:
        if self.max_frame_size < 1 or self.max_message_size < 1:
            raise ValueError("frame and message limits must be positive")


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One encoded Dask message: its header message and the frames that follow it."""

    header: bytes
    frames: list[memoryview]
    nbytes: int
    """Bytes on the wire: the header and every separate frame."""

    def pieces(self, chunk_size: int) -> Iterator[memoryview]:
        """The rdmaio messages to send, in order: the header, then each frame cut at ``chunk_size``."""
        yield memoryview(self.header)
        for view in self.frames:
            for start in range(0, view.nbytes, chunk_size):
                yield view[start : start + chunk_size]


class MessageEndpoint(Protocol):
    """The part of :class:`rdmaio.Endpoint` this module uses."""

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send one message."""

    async def recv(self) -> bytes | None:
        """The next message, ``None`` at end of stream."""

    async def recv_into(self, buffer: bytearray | memoryview) -> int:
        """Copy the next message (or what fits of it) into ``buffer``; 0 at end of stream."""


def _as_bytes_view(frame: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(frame)
    if view.nbytes == 0:  # an empty N-d view (a zero in its shape) cannot be cast
        return memoryview(b"")
    if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


def encode_header(
    frames: Sequence[memoryview],
    inline_frame_limit: int = INLINE_FRAME_LIMIT,
    inline_total_limit: int = INLINE_TOTAL_LIMIT,
) -> tuple[bytes, list[memoryview]]:
    """Build the header message for ``frames``; return it and the frames to send after it."""
    descriptors = []
    inline: list[memoryview] = []
    separate: list[memoryview] = []
    inline_total = 0
    for view in frames:
        size = view.nbytes
        # Empty frames are always inline: the receiver never waits for a zero-length message.
        if size == 0 or (size <= inline_frame_limit and inline_total + size <= inline_total_limit):
            descriptors.append(size | _INLINE_BIT)
            inline.append(view)
            inline_total += size
        else:
            descriptors.append(size)
            separate.append(view)
    prefix = _PREFIX.pack(VERSION, len(frames)) + struct.pack(f"<{len(frames)}Q", *descriptors)
    return b"".join([prefix, *inline]), separate


def decode_header(message: bytes) -> tuple[list[memoryview | int], int]:
    """Parse a header message: for each frame, its inline bytes (a view) or the size still to receive.

    Returns that list and the number of frames to receive separately. Raises :class:`FramingError`.
    """
    if len(message) < _PREFIX.size:
        raise FramingError(f"header message of {len(message)} bytes is too short")
    version, count = _PREFIX.unpack_from(message)
    if version != VERSION:
        raise FramingError(f"unsupported frame format version {version} (this side speaks {VERSION})")
    if count > MAX_FRAMES:
        raise FramingError(f"{count} frames in one message is over the limit of {MAX_FRAMES}")
    offset = _PREFIX.size + count * _DESCRIPTOR.size
    if len(message) < offset:
        raise FramingError(f"header message of {len(message)} bytes is too short for {count} frames")
    view = memoryview(message)
    out: list[memoryview | int] = []
    separate = 0
    for (descriptor,) in _DESCRIPTOR.iter_unpack(view[_PREFIX.size : offset]):
        size = descriptor & _SIZE_MASK
        if size > MAX_FRAME_SIZE:
            raise FramingError(f"frame size {size} is over the limit of {MAX_FRAME_SIZE}")
        if descriptor & _INLINE_BIT:
            if offset + size > len(message):
                raise FramingError("inline frames run past the end of the header message")
            out.append(view[offset : offset + size])
            offset += size
        else:
            out.append(size)
            separate += 1
    if offset != len(message):
        raise FramingError(f"{len(message) - offset} stray bytes after the inline frames")
    return out, separate


def encode_message(frames: Sequence[bytes | bytearray | memoryview]) -> OutgoingMessage:
    """Encode ``frames`` as one Dask message. The frames are referenced, not copied (except a
    non-contiguous buffer, which has to be made contiguous): they must not change until it is sent."""
    views = [_as_bytes_view(frame) for frame in frames]
    header, separate = encode_header(views)
    return OutgoingMessage(header, separate, len(header) + sum(view.nbytes for view in separate))


async def send_message(
    endpoint: MessageEndpoint, message: OutgoingMessage, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> int:
    """Send an encoded message; return its bytes (header included).

    Not safe to interleave with another message on the same endpoint: the caller serialises.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    for piece in message.pieces(chunk_size):
        await endpoint.send(piece)
    return message.nbytes


async def write_frames(
    endpoint: MessageEndpoint,
    frames: Sequence[bytes | bytearray | memoryview],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> int:
    """Send ``frames`` as one Dask message; return the bytes sent (header included).

    Not safe to interleave with another ``write_frames`` on the same endpoint: the caller serialises.
    """
    return await send_message(endpoint, encode_message(frames), chunk_size)


def check_limits(layout: Sequence[memoryview | int], limits: FrameLimits) -> None:
    """Raise :class:`FrameLimitError` if a decoded header declares more than ``limits`` allow."""
    total = 0
    for item in layout:
        size = item.nbytes if isinstance(item, memoryview) else item
        if not isinstance(item, memoryview) and size > limits.max_frame_size:
            raise FrameLimitError(
                f"the peer declared a frame of {size} bytes, over {limits.frame_size_name} "
                f"({limits.max_frame_size} bytes)"
            )
        total += size
    if total > limits.max_message_size:
        raise FrameLimitError(
            f"the peer declared a message of {total} bytes in {len(layout)} frames, over "
            f"{limits.message_size_name} ({limits.max_message_size} bytes)"
        )


async def read_frames(
    endpoint: MessageEndpoint,
    allocate: Callable[[int], memoryview] | None = None,
    limits: FrameLimits | None = None,
) -> list[memoryview] | None:
    """Receive one Dask message; ``None`` if the stream ended cleanly before it began.

    ``allocate(n)`` makes the buffer of a non-inline frame (default: a ``bytearray``), one frame at a
    time, when the previous frames are complete. Raises :class:`FramingError` on a malformed header,
    :class:`FrameLimitError` (before allocating anything) when it declares more than ``limits`` allow
    (default: only the format's own bounds), and :class:`EOFError` if the stream ends inside a message.
    """
    message = await endpoint.recv()
    if message is None:
        return None
    layout, _ = decode_header(message)
    check_limits(layout, limits or FrameLimits())
    frames: list[memoryview] = []
    for item in layout:
        if isinstance(item, memoryview):
            frames.append(item)
            continue
        buffer = allocate(item) if allocate is not None else memoryview(bytearray(item))
        await _recv_exactly(endpoint, buffer, item)
        frames.append(buffer)
    return frames


async def _recv_exactly(endpoint: MessageEndpoint, buffer: memoryview, size: int) -> None:
    view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
    received = 0
    while received < size:
        n = await endpoint.recv_into(view[received:size])
        if n == 0:  # a frame is never sent as an empty message, so 0 is the end of the stream
            raise EOFError(f"stream ended after {received} of {size} bytes of a frame")
        received += n
