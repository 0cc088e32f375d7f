"""Unit tests of rdmaio.core.send.Sender's staging and posting against a fake queue pair and a peer Session
(no device)."""

from __future__ import annotations

import asyncio
import collections
import sys
from types import SimpleNamespace
from typing import Any

import pytest

import rdmaio
from rdmaio import verbs
from rdmaio._ffi import ffi
from rdmaio.core.rings import SlotRing
from rdmaio.core.send import Sender
from rdmaio.core.shared_receive import new_session_state
from rdmaio.protocol import FEATURE_BATCH, FrameKind, Handshake, Session
from rdmaio.protocol.frames import BATCH_RECORD_HEADER, append_batch_record
from rdmaio.protocol.sendqueue import SendQueue
from rdmaio.testing.fakes import FakeBackend, FakeQP, FakeRegistrar

SLOT = 64
SLOTLESS = 1 << 31  # wr index bit of a frame sent without a slot


def make(
    depth: int = 8,
    peer_depth: int = 8,
    peer_max: int = 1 << 20,
    batch_limit: int = 0,
    signal_interval: int = 4,
    initial: int = 64,
    tag: int = 0,
    max_inline: int = 0,
) -> tuple[Sender, FakeQP, Session]:
    features = FEATURE_BATCH if batch_limit else 0
    local = Handshake(8, SLOT, 1 << 20, features=features)
    peer = Handshake(peer_depth, SLOT, peer_max, features=features)
    ring = SlotRing(SLOT, depth, FakeRegistrar(SLOT))
    qp = FakeQP(depth, ring=ring)  # checks every posted slot against the ring
    engine = Sender(
        Session(local, peer),
        qp,
        ring,
        SLOT,
        io=SimpleNamespace(),  # type: ignore[arg-type]  # staging and posting never reach the loop
        options=rdmaio.Options(),
        initial=initial,
        max_inline=max_inline,
        signal_interval=signal_interval,
        batch_limit=batch_limit,
        stats=collections.Counter(),
        tag=tag,
    )
    return engine, qp, Session(peer, local)


def deliver(peer: Session, chain: list[tuple[int, bytes, int, int]]) -> list[bytes]:
    """What the peer's session makes of a posted chain: the messages completed (fragments joined)."""
    messages: list[bytes] = []
    parts: list[bytes] = []
    for _slot, data, imm, _flags in chain:
        kind = peer.on_frame(imm, len(data))
        if kind is FrameKind.DATA_MORE:
            parts.append(data)
        elif kind is FrameKind.DATA_END:
            messages.append(b"".join([*parts, data]))
            parts.clear()
        elif kind is FrameKind.DATA_BATCH:
            messages += peer.on_batch(data)
    return messages


def test_a_message_is_fragmented_copied_and_posted_in_one_chain() -> None:
    engine, qp, peer = make()
    message = bytes(range(150))
    assert engine.queue.queue_message(memoryview(message)) == 3
    assert engine._stage_queued() and engine.staged == 3
    engine._post()
    assert len(qp.posts) == 1 and deliver(peer, qp.posts[0]) == [message]
    assert engine.buffered == 0 and engine.posted_frames == 3


def test_credits_limit_staging_and_keep_one_in_reserve() -> None:
    engine, qp, peer = make(peer_depth=4)
    for i in range(5):
        engine.queue.queue_message(memoryview(bytes([i]) * 10))
    engine._stage_queued()
    engine._post()
    assert len(qp.posts[0]) == 3 and len(engine.queue.txq) == 2  # 4 credits, one kept for control frames
    got = deliver(peer, qp.posts[0])
    peer.on_recv_reposted(3)
    # The peer grants its 3 reposted slots back on its next frame (a CREDIT frame here).
    engine.session.on_frame(peer.take_credit_frame(), 0)
    engine._stage_queued()
    engine._post()
    assert deliver(peer, qp.posts[1]) == [bytes([3]) * 10, bytes([4]) * 10]
    assert got == [bytes([i]) * 10 for i in range(3)]


def test_send_slots_are_reused_only_after_their_completion() -> None:
    engine, qp, _peer = make(depth=2, signal_interval=1)
    for i in range(4):
        engine.queue.queue_message(memoryview(bytes([i])))
    engine._stage_queued()
    engine._post()
    assert len(qp.posts[0]) == 2 and not engine.free_slots
    assert engine._stage_queued() is False  # no free slot
    first_slot = qp.posts[0][0][0]
    engine.on_send_completion(first_slot)
    assert engine.free_slots == [first_slot]
    engine._stage_queued()
    engine._post()
    assert qp.posts[1][0][0] == first_slot


def test_selective_signalling_and_a_signal_when_short_of_slots() -> None:
    engine, qp, _peer = make(depth=8, signal_interval=4)
    for i in range(5):
        engine.queue.queue_message(memoryview(bytes([i])))
    engine._stage_queued()
    engine._post()
    signalled = [bool(flags & verbs.SEND_SIGNALED) for *_rest, flags in qp.posts[0]]
    assert signalled[3]  # every 4th request
    assert signalled[4]  # fewer free slots than the interval: the last one asks for a completion too


def test_a_small_ring_is_not_signalled_on_every_post() -> None:
    """An idle connection's send ring starts with 4 slots, below the default interval of 8: the "short of
    slots" rule signalled every post, so a request/reply connection woke its loop once more per message
    for the send completion (echo: 4 wake-ups per round trip instead of 2, the before/after bench of
    the growing rings, against commit 3443ee5). The interval is now at most half the ring; slots are still
    recycled before they run out."""
    engine, qp, _peer = make(depth=8, peer_depth=64, signal_interval=8, initial=4)
    signalled = []
    for i in range(12):  # one message per post, as a request/reply connection sends
        engine.queue.queue_message(memoryview(bytes([i])))
        assert engine._stage_queued()
        engine._post()
        ((wr_id, _data, _imm, flags),) = qp.posts[-1]
        signalled.append(bool(flags & verbs.SEND_SIGNALED))
        if signalled[-1]:
            engine.on_send_completion(wr_id & verbs.WR_INDEX_MASK)
    assert engine._slot_ring.slots == 4  # never ran out, never grew
    assert signalled == [False, True] * 6


def test_stream_frames_respect_the_peers_max_message_size() -> None:
    # The peer accepts at most 20-byte messages although its slots hold 64: stream frames are cut at 20.
    engine, qp, peer = make(peer_max=20)
    added, coalescing = engine.queue.queue_stream(bytes(range(50)))
    assert (added, coalescing) == (2, True)
    engine.queue.flush_buffers()
    engine._stage_queued()
    engine._post()
    frames = deliver(peer, qp.posts[0])
    assert [len(f) for f in frames] == [20, 20, 10] and b"".join(frames) == bytes(range(50))


def test_small_messages_share_one_batch_frame() -> None:
    engine, qp, peer = make(batch_limit=32)
    messages = [b"a", b"", b"bcd", b"e" * 20]
    for m in messages:
        engine.queue.queue_small(memoryview(m), len(m))
    engine.queue.flush_buffers()
    engine._stage_queued()
    engine._post()
    assert len(qp.posts[0]) == 1 and deliver(peer, qp.posts[0]) == messages


def test_eof_follows_the_data_and_completes() -> None:
    engine, qp, peer = make()
    engine.queue.queue_message(memoryview(b"last"))
    engine.session.write_eof()
    engine._stage_queued()
    engine._post()
    chain = qp.posts[0]
    assert len(chain) == 2 and chain[1][1] == b"" and chain[1][3] & verbs.SEND_SIGNALED
    deliver(peer, chain)
    assert peer.peer_eof and not engine.eof_done
    engine.on_send_completion(chain[1][0])
    assert engine.eof_done


def test_queued_frames_stop_referencing_the_callers_buffer() -> None:
    engine, _qp, _peer = make(depth=1, signal_interval=1)
    engine.queue.queue_message(memoryview(b"x"))
    engine._stage_queued()  # takes the only slot
    caller: Any = bytearray(b"hello")
    added = engine.queue.queue_message(memoryview(caller))
    engine.queue.own_queued(added)
    caller[:] = b"HELLO"
    assert bytes(engine.queue.txq[0][0]) == b"hello"


def test_clear_drops_everything_not_staged() -> None:
    engine, _qp, _peer = make(depth=1)
    engine.queue.queue_message(memoryview(b"x" * 10))
    engine.queue.queue_stream(b"y" * 5)
    engine._stage_queued()
    engine.queue.clear()
    assert engine.buffered == 0 and not engine.queue.txq


def test_the_send_ring_is_registered_by_the_first_frame_and_doubles_under_load() -> None:
    engine, qp, peer = make(depth=16, peer_depth=64, initial=4, signal_interval=1)
    registrar = engine._slot_ring._register
    assert engine._slot_ring.slots == 0 and engine.free_slots == []  # an idle connection pins nothing
    engine.queue.queue_message(memoryview(b"x" * 40))
    engine._stage_queued()
    engine._post()
    assert registrar.chunks == [4]
    # Keep every slot in flight: the ring doubles (4, 8, 16) and stops at its depth.
    for i in range(40):
        engine.queue.queue_message(memoryview(bytes([i]) * 40))
    engine._stage_queued()
    engine._post()
    assert registrar.chunks == [4, 4, 8] and engine._slot_ring.slots == 16
    assert len(qp.posts[1]) == 15 and len(engine.queue.txq) == 25
    assert engine._stats["send_ring_grown"] == 3
    messages = deliver(peer, qp.posts[0]) + deliver(peer, qp.posts[1])
    assert messages == [b"x" * 40] + [bytes([i]) * 40 for i in range(15)]


def test_the_send_ring_does_not_grow_when_credits_are_the_limit() -> None:
    engine, qp, _peer = make(depth=16, peer_depth=4, initial=4, signal_interval=1)
    registrar = engine._slot_ring._register
    for i in range(10):
        engine.queue.queue_message(memoryview(bytes([i]) * 40))
    engine._stage_queued()
    engine._post()
    assert len(qp.posts[0]) == 3  # 4 credits, one in reserve
    assert registrar.chunks == [4]  # a free slot is left: no reason to pin more


def test_a_credit_frame_takes_no_slot_and_registers_nothing() -> None:
    engine, qp, peer = make(depth=8, peer_depth=8, initial=4)
    engine.session.on_frame(peer.take_data_frame(True, 1), 1)
    for _ in range(4):
        engine.session.on_frame(
            peer.take_credit_frame() if peer.credit_frame_due() else peer.take_data_frame(True, 1), 1
        )
    engine.session.on_recv_reposted(5)
    assert engine.session.credit_frame_due()
    assert engine._stage_queued()
    engine._post()
    assert engine._slot_ring._register.chunks == []  # an empty frame needs no memory
    ((wr_id, data, imm, _flags),) = qp.posts[0]
    assert imm >> 28 == FrameKind.CREDIT and data == b"" and verbs.wr_index(wr_id) & SLOTLESS


def test_small_frames_go_inline_without_a_slot_and_are_signalled_every_interval() -> None:
    """A request/reply connection sends one small message per post. Those frames are inline: they take no
    send slot, so the ring is never registered, and the "short of slots" rule does not apply to them; only
    the send queue's interval does (signal_interval, at most half the queue). Before, each took one of the
    4 first slots and every second send was signalled: one more loop wake-up per two messages."""
    engine, qp, peer = make(depth=32, peer_depth=64, signal_interval=8, initial=4, max_inline=16)
    signalled = []
    sent = []
    for i in range(24):
        message = bytes([i]) * (1 + i % 16)
        sent.append(message)
        engine.queue.queue_message(memoryview(message))
        assert engine._stage_queued()
        engine._post()
        ((wr_id, _data, _imm, flags),) = qp.posts[-1]
        assert flags & verbs.SEND_INLINE
        signalled.append(bool(flags & verbs.SEND_SIGNALED))
        if signalled[-1]:
            engine.on_send_completion(verbs.wr_index(wr_id))
    assert engine._slot_ring._register.chunks == []
    assert signalled == ([False] * 7 + [True]) * 3
    assert [m for chain in qp.posts for m in deliver(peer, chain)] == sent


def test_the_send_queue_bounds_slotless_frames_and_a_completion_releases_them() -> None:
    engine, qp, peer = make(depth=4, peer_depth=64, signal_interval=4, max_inline=16)
    for i in range(10):
        engine.queue.queue_message(memoryview(bytes([i]) * 8))
    engine._stage_queued()
    engine._stage_queued()  # staged again before the post: the inline bytes of every entry survive until it
    engine._post()
    chain = qp.posts[0]
    assert len(chain) == 4 and len(engine.queue.txq) == 6  # the send queue's 4 entries, no slot used
    assert chain[-1][3] & verbs.SEND_SIGNALED
    assert not engine.room_for(1) and engine._stage_queued() is False
    engine.on_send_completion(verbs.wr_index(chain[-1][0]))
    assert engine.room_for(1)
    engine._stage_queued()
    engine._post()
    messages = deliver(peer, chain) + deliver(peer, qp.posts[1])
    assert messages == [bytes([i]) * 8 for i in range(8)]


def test_slot_frames_and_inline_frames_keep_their_order_and_release_only_slots() -> None:
    engine, qp, peer = make(depth=8, peer_depth=64, signal_interval=8, initial=4, max_inline=16)
    messages = [b"s" * 10, b"L" * 40, b"t" * 3, b"M" * 64, b""]
    for m in messages:
        engine.queue.queue_message(memoryview(m))
    engine._stage_queued()
    engine._post()
    chain = qp.posts[0]
    slotted = [verbs.wr_index(wr_id) for wr_id, *_ in chain if not verbs.wr_index(wr_id) & SLOTLESS]
    assert len(slotted) == 2 and engine._slot_ring.slots == 4
    assert sorted(engine.free_slots + slotted) == [0, 1, 2, 3]
    engine.on_send_completion(verbs.wr_index(chain[-1][0]))
    assert sorted(engine.free_slots) == [0, 1, 2, 3] and not engine._inflight
    assert deliver(peer, chain) == messages


def test_send_wr_ids_carry_kind_send_and_the_connection_tag() -> None:
    """wr_id = make_wr_id(WR_KIND_SEND, tag, slot); a completion is handed back by its index part."""
    tag = 0xABCDEF
    engine, qp, _peer = make(depth=2, signal_interval=1, initial=2, tag=tag)
    for i in range(3):
        engine.queue.queue_message(memoryview(bytes([i])))
    engine._stage_queued()
    engine._post()
    wr_ids = [wr_id for wr_id, *_ in qp.posts[0]]
    assert len(wr_ids) == 2 and not engine.free_slots
    for wr_id in wr_ids:
        assert verbs.wr_kind(wr_id) == verbs.WR_KIND_SEND and verbs.wr_tag(wr_id) == tag
        assert wr_id == verbs.make_wr_id(verbs.WR_KIND_SEND, tag, verbs.wr_index(wr_id))
    engine.on_send_completion(verbs.wr_index(wr_ids[0]))
    assert engine.free_slots == [verbs.wr_index(wr_ids[0])]


def test_wr_id_helpers_round_trip_and_check_their_ranges() -> None:
    wr_id = verbs.make_wr_id(verbs.WR_KIND_CONTROL, verbs.WR_TAG_MASK, 0xFFFFFFFF)
    assert wr_id == 0x03FF_FFFF_FFFF_FFFF
    assert (verbs.wr_kind(wr_id), verbs.wr_tag(wr_id), verbs.wr_index(wr_id)) == (3, 0xFFFFFF, 0xFFFFFFFF)
    assert verbs.make_wr_id(verbs.WR_KIND_RECV, 5, 9) == (1 << 56) | (5 << 32) | 9
    assert verbs.dispatch_key(0x12, 5) == (0x12 << 24) | 5
    for bad in ((256, 0, 0), (0, 1 << 24, 0), (0, 0, 1 << 32), (0, -1, 0)):
        with pytest.raises(ValueError):
            verbs.make_wr_id(*bad)


def test_staging_makes_no_python_call_per_frame_beyond_the_sessions_take() -> None:
    """Each frame is one C call (rdmaio_txring_stage) after the session's take: no Python fill per frame,
    no Python call for the chain's signalling. Before, each frame cost a ``_fill`` (and a ``_fill_slotless``
    for an inline one) and each staging a ``_stage_control``: 13 calls in send.py for these 8 frames."""
    engine, qp, peer = make(depth=16, peer_depth=64, initial=16, max_inline=16, signal_interval=4)
    assert engine._grow() and engine._slot_ring.slots == 16
    engine._alloc_scratch()  # once per connection, by its first inline frame
    sent = [bytes([i]) * (8 if i % 2 else 40) for i in range(8)]  # inline and slot frames in turn
    for message in sent:
        engine.queue.queue_message(memoryview(message))
    calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def hook(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            calls[(frame.f_code.co_filename.rsplit("/", 1)[-1], frame.f_code.co_name)] += 1

    sys.setprofile(hook)
    try:
        staged = engine._stage_queued()
        engine._post()
    finally:
        sys.setprofile(None)
    assert staged and len(qp.posts) == 1 and deliver(peer, qp.posts[0]) == sent
    in_sender = {name: n for (file, name), n in calls.items() if file == "send.py"}
    assert in_sender == {"_stage_queued": 1, "_post": 1}
    assert calls[("session.py", "take_data_frame")] == 8


def test_every_kind_of_payload_buffer_is_staged_by_the_c_ring() -> None:
    """The queue holds bytes, bytearrays and memoryviews (slices of read-only and writable buffers): each is
    copied into its slot or inline area as it is at staging time."""
    engine, qp, peer = make(depth=16, peer_depth=64, max_inline=16)
    source = bytearray(range(100))
    payloads: list[Any] = [
        memoryview(bytes(range(50)))[5:45],  # read-only slice, slot frame
        memoryview(source)[10:20],  # writable slice, inline
        memoryview(bytearray(b"z" * 30)),  # slot frame
        memoryview(b"ro"),  # read-only, inline
    ]
    expected = [bytes(p) for p in payloads]
    for payload in payloads:
        engine.queue.queue_message(payload)
    engine._stage_queued()
    source[10:20] = b"\xff" * 10  # staged: the inline bytes were copied already
    engine._post()
    assert deliver(peer, qp.posts[0]) == expected
    flags = [f for *_rest, f in qp.posts[0]]
    assert [bool(f & verbs.SEND_INLINE) for f in flags] == [False, True, False, True]


def test_the_inline_scratch_area_is_allocated_by_the_first_inline_frame_only() -> None:
    engine, qp, peer = make(depth=8, peer_depth=64, initial=4, max_inline=16)
    engine.queue.queue_message(memoryview(b"L" * 40))  # a slot frame
    engine._stage_queued()
    engine._post()
    assert engine._scratch_cdata is None
    engine.queue.queue_message(memoryview(b"short"))
    engine._stage_queued()
    engine._post()
    assert engine._scratch_cdata is not None
    assert [m for chain in qp.posts for m in deliver(peer, chain)] == [b"L" * 40, b"short"]


def test_a_ring_with_slots_at_creation_hands_them_to_the_c_ring_lowest_first() -> None:
    local = Handshake(8, SLOT, 1 << 20)
    ring = SlotRing(SLOT, 8, FakeRegistrar(SLOT), initial=4)
    qp = FakeQP(8, ring=ring)
    engine = Sender(
        Session(local, local),
        qp,
        ring,
        SLOT,
        io=SimpleNamespace(),  # type: ignore[arg-type]
        options=rdmaio.Options(),
        max_inline=0,
        signal_interval=4,
        batch_limit=0,
        stats=collections.Counter(),
    )
    assert engine.free_slots == [3, 2, 1, 0] and engine.room_for(SLOT)
    engine.queue.queue_message(memoryview(b"x" * 10))
    engine._stage_queued()
    engine._post()
    assert verbs.wr_index(qp.posts[0][0][0]) == 0 and engine._inflight == [0]
    assert engine._stats["send_ring_grown"] == 0


def test_a_send_array_shorter_than_the_ring_is_refused_not_overrun() -> None:
    """The C ring checks every send-array index: a queue pair with fewer entries than the sender may stage
    (a broken set-up) fails the staging with RuntimeError instead of writing past the array."""
    engine, _qp, _peer = make(depth=8, peer_depth=64)
    short = FakeQP(2, ring=engine._slot_ring)
    bad = Sender(
        engine.session,
        short,
        engine._slot_ring,
        SLOT,
        io=SimpleNamespace(),  # type: ignore[arg-type]
        options=rdmaio.Options(),
        max_inline=0,
        signal_interval=4,
        batch_limit=0,
        stats=collections.Counter(),
    )
    for i in range(3):
        bad.queue.queue_message(memoryview(bytes([i]) * 10))
    with pytest.raises(RuntimeError, match="index out of its bound"):
        bad._stage_queued()
    assert bad.staged == 0 and len(bad._inflight) == 2


def make_native(max_inline: int = 32, peer_depth: int = 8) -> tuple[Sender, FakeQP, Session, FakeBackend]:
    """A sender on a C session state (as a connection's), batching on, an io whose callbacks the test runs."""
    local = Handshake(8, SLOT, 1 << 20, features=FEATURE_BATCH)
    peer = Handshake(peer_depth, SLOT, 1 << 20, features=FEATURE_BATCH)
    ring = SlotRing(SLOT, 8, FakeRegistrar(SLOT))
    qp = FakeQP(8, ring=ring)
    io = FakeBackend()
    engine = Sender(
        Session(local, peer, state=new_session_state()),
        qp,
        ring,
        SLOT,
        io=io,  # type: ignore[arg-type]
        options=rdmaio.Options(),
        initial=4,
        max_inline=max_inline,
        signal_interval=4,
        batch_limit=48,
        stats=collections.Counter(),
    )
    assert engine.plain_state is not None  # the idle-send path applies
    return engine, qp, Session(peer, local), io


def _profiled(coro: Any) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[frame.f_code.co_name] += 1

    sys.setprofile(hook)
    try:
        asyncio.run(coro)
    finally:
        sys.setprofile(None)
    return counts


def test_an_idle_senders_message_is_staged_and_posted_at_once_by_one_c_call() -> None:
    engine, qp, peer, io = make_native()
    asyncio.run(engine.send(b"warm"))  # the first inline frame allocates the scratch area (general path)
    engine.coalesce_next = False  # as a completion batch does
    counts = _profiled(engine.send(b"hello"))
    # Posted at once, alone in its chain, with the session's take and the sender's counters as before.
    assert [deliver(peer, chain) for chain in qp.posts] == [[b"warm"], [b"hello"]]
    assert engine.posted_frames == 2 and engine.staged == 0 and not engine.queue.txq
    assert engine.messages_sent == 2 and engine.bytes_sent == 9
    assert engine.frames_posted == 2 and engine.post_calls == 2
    assert engine.coalesce_next and not io.pending  # the next ones batch; no callback for this one
    for helper in ("_queue_batched", "transmit", "_stage_queued", "_post", "queue_message", "can_send_data"):
        assert counts[helper] == 0, helper
    # A long message takes a send slot the same way (the ring registered its first slots).
    engine.coalesce_next = False
    engine._grow()
    asyncio.run(engine.send(b"L" * 40))
    assert deliver(peer, qp.posts[-1]) == [b"L" * 40] and len(engine.free_slots) == 3


def test_an_idle_send_without_a_credit_is_batched_as_before() -> None:
    engine, qp, peer, io = make_native(peer_depth=4)
    asyncio.run(engine.send(b"a"))
    for _ in range(2):
        engine.coalesce_next = False
        asyncio.run(engine.send(b"b"))
    assert len(qp.posts) == 3  # 4 credits, one kept for control frames
    engine.coalesce_next = False
    asyncio.run(engine.send(b"c"))  # no credit: the C call changes nothing, the message is batched
    asyncio.run(engine.send(b"d"))
    assert len(qp.posts) == 3 and engine.queue.mbuf_count == 2 and len(io.pending) == 1
    for chain in qp.posts:
        deliver(peer, chain)
    peer.on_recv_reposted(3)
    engine.session.on_frame(peer.take_credit_frame(), 0)
    io.advance(0)  # the end-of-iteration flush: one batch frame of both
    assert len(qp.posts) == 4 and len(qp.posts[3]) == 1 and deliver(peer, qp.posts[3]) == [b"c", b"d"]


def test_a_send_after_a_close_fact_raises_as_before() -> None:
    engine, qp, _peer, _io = make_native()
    assert engine.session.close_state.clear
    engine.session.write_eof()
    assert not engine.session.close_state.clear
    with pytest.raises(rdmaio.EndpointClosedError, match="write_eof"):
        asyncio.run(engine.send(b"x"))
    engine2, _qp, _peer2, _io2 = make_native()
    engine2.session.on_transport_error(OSError("gone"))
    with pytest.raises(ConnectionResetError):
        asyncio.run(engine2.send(b"x"))
    engine3, _qp3, _peer3, _io3 = make_native()
    engine3.abort()
    with pytest.raises(rdmaio.EndpointClosedError, match="closing"):
        asyncio.run(engine3.send(b"x"))
    assert not qp.posts and not _qp.posts and not _qp3.posts


def test_an_idle_send_stages_a_due_control_frame_in_the_same_chain() -> None:
    engine, qp, peer, _io = make_native()
    asyncio.run(engine.send(b"warm"))
    engine.coalesce_next = False
    state = engine.plain_state
    state.eof_due = 1  # a control frame due after the message (the C call's code 2)
    asyncio.run(engine.send(b"m"))
    assert len(qp.posts[-1]) == 2 and deliver(peer, qp.posts[-1]) == [b"m"]
    assert engine.staged == 0 and engine.frames_posted == 3


def test_a_batch_built_by_the_send_queue_is_the_protocols_record_encoding() -> None:
    # queue_small() writes each record inline: it must be append_batch_record()'s bytes, record by record.
    queue = SendQueue(4096, 4096, 1000)
    expected = bytearray()
    for size in (0, 1, 63, 64, 255, 256, 999):
        message = bytes(range(256)) * 4
        view = memoryview(message[:size])
        assert queue.queue_small(view, size) == len(expected) + BATCH_RECORD_HEADER + size  # buffered
        append_batch_record(expected, view)
        assert queue.mbuf == expected
    assert queue.mbuf_count == 7


def test_a_batched_send_writes_the_records_of_append_batch_record() -> None:
    # send()'s inline append (a message below len(RECORD_HEADERS) bytes that fits the batch being built)
    # and the send queue's queue_small() (the rest) must both write append_batch_record()'s bytes.
    slot = 4096
    local = Handshake(8, slot, 1 << 20, features=FEATURE_BATCH)
    peer_hs = Handshake(8, slot, 1 << 20, features=FEATURE_BATCH)
    ring = SlotRing(slot, 8, FakeRegistrar(slot))
    qp = FakeQP(8, ring=ring)
    io = FakeBackend()
    engine = Sender(
        Session(local, peer_hs, state=new_session_state()),
        qp,
        ring,
        slot,
        io=io,  # type: ignore[arg-type]
        options=rdmaio.Options(),
        initial=4,
        max_inline=32,
        signal_interval=4,
        batch_limit=2000,
        stats=collections.Counter(),
    )
    peer = Session(peer_hs, local)
    engine.coalesce_next = True  # not idle: every message is batched
    sizes = (0, 1, 63, 64, 1023, 1024, 1999, 5, 700, 700, 700, 700, 3, 0)
    messages: list[Any] = [bytes((i + k) & 0xFF for k in range(n)) for i, n in enumerate(sizes)]
    messages[2] = bytearray(messages[2])  # other buffers than bytes take the same path
    messages[3] = memoryview(messages[3])
    expected = bytearray()
    flushed = 0
    for message in messages:
        before = len(engine.queue.txq)
        asyncio.run(engine.send(message))
        if len(engine.queue.txq) > before:  # the batch was full: queued, a new one begun
            flushed += 1
            expected = bytearray()
        append_batch_record(expected, message)
        assert engine.queue.mbuf == expected
    assert flushed == 2  # 1023 + 1024 + 1999 and then 4 x 700 do not fit one 4 KiB frame
    io.advance(0)
    received = [m for chain in qp.posts for m in deliver(peer, chain)]
    assert received == [bytes(m) for m in messages]
