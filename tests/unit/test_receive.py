"""Unit tests of rdmaio.core.receive.Receiver's per-batch seam: completion records in, frames in the receive
buffer, slots re-posted in one chained post (no device, no loop)."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import pytest

import rdmaio
from rdmaio import verbs
from rdmaio.core.receive import Receiver
from rdmaio.core.shared_receive import new_session_state
from rdmaio.protocol import FEATURE_BATCH, Handshake, Session, pack_batch_into
from rdmaio.protocol.rxbuffer import ReceiveBuffer
from rdmaio.verbs.native import ffi

SLOT = 64
DEPTH = 8
_RECV = int(verbs.WcOpcode.RECV)
_SEND = int(verbs.WcOpcode.SEND)


class FakeSlots:
    """The transport's receive side: records every chained re-post."""

    slot_size = SLOT

    def __init__(self) -> None:
        self.posts: list[list[int]] = []

    def post_receives(self, slots: list[int]) -> None:
        self.posts.append(list(slots))

    def grow_receives(self, n: int) -> int:
        return 0


def make(
    limit: int = 1 << 20, native: bool = False
) -> tuple[Receiver, FakeSlots, Session, memoryview, list[int]]:
    hs = Handshake(DEPTH, SLOT, 1 << 20, features=FEATURE_BATCH)
    # native: the session's state is the C struct the core gives it, so the receiver runs the frame rules in
    # C (rdmaio_rx_run) and a batch of one message takes its short path.
    session = Session(hs, hs, state=new_session_state()) if native else Session(hs, hs)
    peer = Session(hs, hs)
    ring = memoryview(bytearray(SLOT * DEPTH))
    slots = FakeSlots()
    staged: list[int] = []
    receiver = Receiver(
        session,
        slots,
        ring,
        io=SimpleNamespace(),  # type: ignore[arg-type]  # on_batch never reaches the loop
        options=rdmaio.Options(recv_buffer_limit=limit),
        stats=collections.Counter(),
        stage=lambda: staged.append(1),
    )
    return receiver, slots, peer, ring, staged


def wc(slot: int, imm: int, length: int, opcode: int = _RECV, status: int = 0) -> Any:
    return SimpleNamespace(
        wr_id=verbs.make_wr_id(verbs.WR_KIND_RECV, 1, slot),
        status=status,
        opcode=opcode,
        byte_len=length,
        imm_data=imm,
        flags=verbs.WC_WITH_IMM,
        vendor_err=0,
    )


def test_a_batch_of_frames_lands_in_the_buffer_and_its_slots_go_back_in_one_post() -> None:
    receiver, slots, peer, ring, staged = make()
    ring[0:5] = b"hello"
    n = pack_batch_into(ring, SLOT, [b"a", b"bc"])
    records = [
        wc(0, peer.take_data_frame(True, 5), 5),
        wc(7, 0, 0, opcode=_SEND),  # not a receive: the connection's, skipped here
        wc(1, peer.take_batch_frame(n, 2), n),
    ]
    receiver.on_batch(records, 0, len(records))
    assert [receiver.rxbuf.pop_message() for _ in range(3)] == [b"hello", b"a", b"bc"]
    assert slots.posts == [[0, 1]]  # one chained post for the batch
    assert receiver.session.ungranted == 2 and not staged  # the connection transmits after the batch


def test_a_held_slot_goes_back_only_when_a_read_releases_it() -> None:
    receiver, slots, peer, ring, staged = make(limit=4)
    ring[0:4] = b"data"
    receiver.on_batch([wc(0, peer.take_data_frame(True, 4), 4)], 0, 1)
    ring[SLOT : SLOT + 4] = b"more"
    receiver.on_batch([wc(1, peer.take_data_frame(True, 4), 4)], 0, 1)
    assert slots.posts == [[0]] and receiver.rxbuf.held == 1  # over the limit: held, no credit
    assert receiver.recv_nowait() == b"data"  # the read releases it: re-posted, the sender stages
    assert slots.posts == [[0], [1]] and staged == [1]


_WC_FIELDS = ("wr_id", "status", "opcode", "byte_len", "imm_data", "flags", "vendor_err")


def test_a_batch_of_one_message_takes_the_short_path_with_the_loops_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-message path (C records, one DATA_END frame) against the general loop (the same records as a
    Python list, which that path never takes): the same buffer, slots held and re-posts, credits and wake-ups,
    under back-pressure and after a fragment (then the buffer call joins the parts)."""

    def run(short: bool) -> list[Any]:
        receiver, slots, peer, ring, _staged = make(limit=10, native=True)
        woken: list[int] = []
        seen: list[Any] = []
        for k, (payload, last) in enumerate(
            [(b"abcd", True), (b"efgh", True), (b"ijklmnop", True), (b"qr", False), (b"st", True)]
        ):
            slot = k % DEPTH
            ring[slot * SLOT : slot * SLOT + len(payload)] = payload
            record = wc(slot, peer.take_data_frame(last, len(payload)), len(payload))
            future = SimpleNamespace(done=lambda: False, set_result=lambda _r, k=k: woken.append(k))
            receiver._waiter = future  # type: ignore[assignment]  # a read waits: woken by the batch
            if short:
                array = ffi.new("struct rdmaio_wc[]", 1)
                array[0] = {name: getattr(record, name) for name in _WC_FIELDS}
                receiver.on_batch(array, 0, 1)
            else:
                receiver.on_batch([record], 0, 1)
            buf = receiver.rxbuf
            seen.append((list(buf.messages), buf.unread, buf.ready, buf.held, [list(p) for p in slots.posts]))
            state = receiver.session.rules_state
            seen.append((state.ungranted, state.posted, state.messages_received, state.bytes_received))
            seen.append((receiver.messages_received, receiver.bytes_received, list(woken)))
            slots.posts.clear()
        while receiver.recv_nowait() is not None:
            seen.append((receiver.rxbuf.held, [list(p) for p in slots.posts]))
        return seen

    calls: list[int] = []
    add_admitted = ReceiveBuffer.add_admitted

    def counted(self: ReceiveBuffer, data: bytes, slot: int) -> bool:
        calls.append(slot)
        return add_admitted(self, data, slot)

    monkeypatch.setattr(ReceiveBuffer, "add_admitted", counted)
    short = run(True)
    assert calls == [4]  # the short path calls the buffer only for the message with a fragment to join
    calls.clear()
    general = run(False)
    assert calls == [0, 1, 2, 4]  # the loop calls it for every message
    assert short == general
    assert short[3][3] == 0 and short[6][3] == 1  # the third message went over the limit: its slot held


def test_the_one_sided_engines_repost_is_the_receivers() -> None:
    receiver, slots, peer, _ring, staged = make()
    receiver.session.on_frame(peer.take_data_frame(True, 1), 1)  # slot 5 took a frame the engine held
    receiver.repost(5)
    assert slots.posts == [[5]] and receiver.session.ungranted == 1 and staged == [1]
    receiver.stop()
    receiver.repost(6)  # torn down: nothing goes back to a destroyed queue pair
    assert slots.posts == [[5]]


# --- the read calls -----------------------------------------------------------------------------------


def test_recv_pops_whole_messages_and_the_rest_of_one_a_stream_read_began() -> None:
    # recv() pops a complete message itself (the buffer's pop, inline): the counts it keeps must be the
    # ones pop_message() keeps, and the rest of a partly read message still comes from pop_message().
    import asyncio

    receiver, _slots, peer, ring, _staged = make()
    ring[0:5] = b"hello"
    ring[SLOT : SLOT + 5] = b"world"
    ring[2 * SLOT : 2 * SLOT + 3] = b"end"
    records = [wc(i, peer.take_data_frame(True, n), n) for i, n in ((0, 5), (1, 5), (2, 3))]
    receiver.on_batch(records, 0, len(records))
    rxbuf = receiver.rxbuf
    assert rxbuf.unread == rxbuf.ready == 13

    async def main() -> list[bytes | None]:
        first = await receiver.recv()
        assert (rxbuf.unread, rxbuf.ready, rxbuf.offset) == (8, 8, 0)
        assert await receiver.read(2) == b"wo"  # a stream read begins the next message
        assert rxbuf.offset == 2
        rest = await receiver.recv()
        assert (rxbuf.unread, rxbuf.ready, rxbuf.offset) == (3, 3, 0)
        return [first, rest, await receiver.recv()]

    assert asyncio.run(main()) == [b"hello", b"rld", b"end"]
    assert rxbuf.unread == rxbuf.ready == 0 and not rxbuf.messages and not rxbuf.has_message()


def test_recv_waits_once_and_a_second_reader_is_refused_until_the_first_is_done() -> None:
    import asyncio

    from rdmaio.core.backend import AsyncioBackend

    async def main() -> None:
        receiver, _slots, peer, ring, _staged = make()
        receiver.io = AsyncioBackend(asyncio.get_running_loop())
        first = asyncio.ensure_future(receiver.recv())
        await asyncio.sleep(0)
        assert receiver.rxbuf.reader_waiting
        try:
            await receiver.recv()
            raise AssertionError("a second reader was let in")
        except RuntimeError as exc:
            assert "another task" in str(exc)
        ring[0:2] = b"hi"
        receiver.on_batch([wc(0, peer.take_data_frame(True, 2), 2)], 0, 1)  # wakes the first reader
        assert await first == b"hi"
        assert not receiver.rxbuf.reader_waiting and receiver._waiter is None
        # A cancelled reader lets the next one in at once (its future is cancelled, so done).
        cancelled = asyncio.ensure_future(receiver.recv())
        await asyncio.sleep(0)
        cancelled.cancel()
        second = asyncio.ensure_future(receiver.recv())
        await asyncio.sleep(0)
        assert cancelled.cancelled() and not second.done()
        ring[SLOT : SLOT + 3] = b"two"
        receiver.on_batch([wc(1, peer.take_data_frame(True, 3), 3)], 0, 1)
        assert await second == b"two"

    asyncio.run(main())
