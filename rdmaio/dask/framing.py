"""How one Dask message (a list of frames) travels over an rdmaio :class:`~rdmaio.Endpoint`.

This module knows nothing of Dask; it moves a list of buffers with the endpoint's message API, so it can
be tested against an in-memory endpoint.

Wire format of one message, as rdmaio messages:

1. A *header message*: ``version`` (u8), three zero bytes, ``count`` (u32), then ``count`` descriptors
   (u64 each: the frame size in the low 63 bits, bit 63 set when the frame is *inline*), then the bytes of
   the inline frames, in order. Small frames ride inline, so a typical control message is one rdmaio
   message (and one work request).
2. Each non-inline frame, in order, as one or more rdmaio messages of at most ``chunk_size`` bytes.

The receiver allocates each non-inline frame at its final size (``distributed``'s ``host_array``: a
writable NumPy-backed buffer when NumPy is there) and fills it with ``Endpoint.recv_into`` on the part
still missing. ``recv_into`` fills at most the buffer it is given and keeps the rest of a longer message
for the next read call, so the frame boundary is exact whatever the chunking; a peer that chunks
differently still produces the right frames, and one that lies about sizes is caught by the next
header's validation.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "INLINE_FRAME_LIMIT",
    "INLINE_TOTAL_LIMIT",
    "FramingError",
    "MessageEndpoint",
    "decode_header",
    "encode_header",
    "read_frames",
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


class FramingError(ValueError):
    """The peer sent a header that does not follow the format above."""


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


async def write_frames(
    endpoint: MessageEndpoint,
    frames: Sequence[bytes | bytearray | memoryview],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> int:
    """Send ``frames`` as one Dask message; return the bytes sent (header included).

    Not safe to interleave with another ``write_frames`` on the same endpoint: the caller serialises.
    """
    views = [_as_bytes_view(frame) for frame in frames]
    header, separate = encode_header(views)
    await endpoint.send(header)
    total = len(header)
    for view in separate:
        size = view.nbytes
        for start in range(0, size, chunk_size):
            await endpoint.send(view[start : start + chunk_size])
        total += size
    return total


async def read_frames(
    endpoint: MessageEndpoint, allocate: Callable[[int], memoryview] | None = None
) -> list[memoryview] | None:
    """Receive one Dask message; ``None`` if the stream ended cleanly before it began.

    ``allocate(n)`` makes the buffer of a non-inline frame (default: a ``bytearray``). Raises
    :class:`FramingError` on a malformed header and :class:`EOFError` if the stream ends inside a message.
    """
    message = await endpoint.recv()
    if message is None:
        return None
    layout, _ = decode_header(message)
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
