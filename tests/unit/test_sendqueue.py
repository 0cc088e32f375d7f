"""Unit tests of rdmaio.protocol.sendqueue.SendQueue: fragmentation, coalescing and DATA_BATCH encoding
(sans-IO, no verbs objects)."""

from __future__ import annotations

import pytest

from rdmaio.protocol import pack_batch_into, unpack_batch
from rdmaio.protocol.frames import append_batch_record
from rdmaio.protocol.sendqueue import RNDV_FRAME, SendQueue


def frames(queue: SendQueue) -> list[tuple[bytes, int]]:
    return [(bytes(data), kind) for data, kind in queue.txq]


def test_a_message_is_cut_into_frames_of_one_slot() -> None:
    queue = SendQueue(max_fragment=64, stream_fragment=64, batch_limit=32)
    message = bytes(range(150))
    assert queue.queue_message(memoryview(message)) == 3
    assert frames(queue) == [(message[:64], False), (message[64:128], False), (message[128:], True)]
    assert queue.buffered == queue.txq_bytes == 150 and queue.queued_frames == 3


def test_stream_bytes_are_coalesced_into_whole_frames_and_flushed_in_order() -> None:
    queue = SendQueue(max_fragment=64, stream_fragment=20, batch_limit=32)
    assert queue.queue_stream(b"a" * 5) == (0, True)  # coalescing
    assert queue.queue_stream(b"b" * 30) == (0, False)  # 35 bytes: flushed as frames of 20
    assert frames(queue) == [(b"a" * 5 + b"b" * 15, True), (b"b" * 15, True)]
    queue.clear()
    added, coalescing = queue.queue_stream(
        bytes(range(50))
    )  # nothing coalescing: 2 whole frames by reference
    assert (added, coalescing) == (2, True) and queue.buffered == 50
    queue.flush_buffers()
    assert b"".join(bytes(d) for d, _k in queue.txq) == bytes(range(50))


def test_small_messages_are_batched_with_the_protocols_record_encoder() -> None:
    queue = SendQueue(max_fragment=64, stream_fragment=64, batch_limit=32)
    messages = [b"a", b"", b"bcd"]
    for m in messages:
        queue.queue_small(memoryview(m), len(m))
    queue.flush_buffers()
    ((payload, kind),) = frames(queue)
    assert kind == -3 and unpack_batch(payload) == messages
    slot = bytearray(64)
    assert pack_batch_into(slot, 0, messages) == len(payload) and bytes(slot[: len(payload)]) == payload


def test_a_lone_batched_message_goes_as_a_plain_frame_and_a_full_batch_is_flushed() -> None:
    queue = SendQueue(max_fragment=16, stream_fragment=16, batch_limit=12)
    queue.queue_small(memoryview(b"x" * 8), 8)
    queue.flush_buffers()
    assert frames(queue) == [(b"x" * 8, True)]
    queue.clear()
    queue.queue_small(memoryview(b"y" * 8), 8)
    queue.queue_small(memoryview(b"z" * 8), 8)  # 12 + 12 > 16: the first goes alone
    queue.flush_buffers()
    assert frames(queue) == [(b"y" * 8, True), (b"z" * 8, True)]


def test_an_rndv_frame_keeps_its_place_after_coalesced_writes() -> None:
    queue = SendQueue(max_fragment=64, stream_fragment=64, batch_limit=32)
    queue.queue_stream(b"early")
    descriptor = bytearray(b"D" * 24)
    assert queue.queue_rndv(descriptor) == 2
    assert frames(queue) == [(b"early", True), (b"D" * 24, RNDV_FRAME)]
    assert queue.txq[1][0] is descriptor  # mutable: a cancellation withdraws it in place


def test_queued_frames_stop_referencing_the_callers_buffer() -> None:
    queue = SendQueue(max_fragment=64, stream_fragment=64, batch_limit=32)
    caller = bytearray(b"hello")
    queue.own_queued(queue.queue_message(memoryview(caller)))
    caller[:] = b"HELLO"
    assert frames(queue) == [(b"hello", True)]


def test_queued_views_of_bytes_are_kept_and_views_of_mutable_buffers_are_copied() -> None:
    queue = SendQueue(max_fragment=64, stream_fragment=64, batch_limit=32)
    immutable = b"i" * 40
    mutable = bytearray(b"m" * 40)
    read_only_view_of_mutable = memoryview(bytearray(b"r" * 40)).toreadonly()
    for source in (immutable, mutable, read_only_view_of_mutable):
        queue.own_queued(queue.queue_message(memoryview(source).cast("B")[4:]))
    kept, copied, copied_too = (data for data, _ in queue.txq)
    # The bytes object's view is the frame (no copy): it cannot change, and the view keeps it alive.
    assert type(kept) is memoryview and kept.obj is immutable
    # Anything the caller may still change is copied before the call returns.
    assert type(copied) is bytes and type(copied_too) is bytes
    mutable[:] = b"M" * 40
    assert frames(queue) == [(b"i" * 36, True), (b"m" * 36, True), (b"r" * 36, True)]


def test_the_record_encoder_and_pack_batch_into_refuse_what_does_not_fit() -> None:
    batch = bytearray()
    assert append_batch_record(batch, b"abc") == 7 and bytes(batch) == b"\x03\x00\x00\x00abc"
    with pytest.raises(ValueError):
        pack_batch_into(bytearray(6), 0, [b"abc"])
    with pytest.raises(ValueError):
        pack_batch_into(bytearray(64), 0, [])
