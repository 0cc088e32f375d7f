"""Unit tests of rdmaio.core.receive.Receiver's per-batch seam: completion records in, frames in the receive
buffer, slots re-posted in one chained post (no device, no loop)."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import rdmaio
from rdmaio import verbs
from rdmaio.core.receive import Receiver
from rdmaio.protocol import FEATURE_BATCH, Handshake, Session, pack_batch_into

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


def make(limit: int = 1 << 20) -> tuple[Receiver, FakeSlots, Session, memoryview, list[int]]:
    hs = Handshake(DEPTH, SLOT, 1 << 20, features=FEATURE_BATCH)
    session, peer = Session(hs, hs), Session(hs, hs)
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


def test_the_one_sided_engines_repost_is_the_receivers() -> None:
    receiver, slots, peer, _ring, staged = make()
    receiver.session.on_frame(peer.take_data_frame(True, 1), 1)  # slot 5 took a frame the engine held
    receiver.repost(5)
    assert slots.posts == [[5]] and receiver.session.ungranted == 1 and staged == [1]
    receiver.stop()
    receiver.repost(6)  # torn down: nothing goes back to a destroyed queue pair
    assert slots.posts == [[5]]
