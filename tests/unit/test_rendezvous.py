"""The sans-IO rendezvous pieces (zero-copy): descriptor encoding, both sides' state machines, the receive
buffer's placeholders and the registration cache's hard bound."""

from __future__ import annotations

import pytest

from rdmaio.core.domain import RegistrationCache
from rdmaio.errors import FrameError, ProtocolError
from rdmaio.protocol import (
    FEATURE_RNDV,
    FrameKind,
    Handshake,
    ReceivedMessageTooLargeError,
    Session,
)
from rdmaio.protocol.rendezvous import (
    CTL_DONE,
    CTL_WITHDRAWN,
    DESCRIPTOR_SIZE,
    Descriptor,
    RecvState,
    RecvTable,
    SendState,
    SendTable,
)
from rdmaio.protocol.rxbuffer import PLACEHOLDER_CHARGE, Placeholder, ReceiveBuffer


def test_descriptor_round_trip_and_size() -> None:
    desc = Descriptor(7, 0x7F00_1234_5000, 3 << 20, 0xABCD)
    raw = desc.encode()
    assert len(raw) == DESCRIPTOR_SIZE == 32
    assert raw[:2] == b"\x01\x01"
    assert Descriptor.decode(raw, 64 << 20) == desc


def test_descriptor_withdrawn_in_place_hides_the_key() -> None:
    desc = Descriptor(9, 0x1000, 1 << 20, 0x55)
    encoded = bytearray(desc.encode())
    desc.withdraw_in_place(encoded)
    parsed = Descriptor.decode(encoded, 1 << 30)
    assert parsed.withdrawn and parsed.msg_id == 9 and (parsed.addr, parsed.length, parsed.rkey) == (0, 0, 0)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x01" * 31,
        b"\x02\x01" + bytes(30),  # version 2
        b"\x01\x03" + bytes(30),  # unknown type
        b"\x01\x01\x00\x01" + bytes(28),  # reserved bits
        Descriptor(1, 0x1000, 1, 2).encode()[:24] + bytes(8),  # zero length
        Descriptor(1, (1 << 64) - 10, 100, 2).encode(),  # wraps around
    ],
)
def test_descriptor_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(FrameError):
        Descriptor.decode(raw, 1 << 30)


def test_descriptor_above_max_message_size() -> None:
    with pytest.raises(ReceivedMessageTooLargeError):
        Descriptor.decode(Descriptor(1, 0x1000, 2048, 2).encode(), 2047)


def test_send_table_done_withdrawn_and_violations() -> None:
    table = SendTable()
    a, b = table.start(100), table.start(200)
    assert a.msg_id != b.msg_id and a.state is SendState.QUEUED
    # a DONE may come before the I/O layer marked the descriptor posted
    assert table.on_control(CTL_DONE, a.msg_id) is a and a.state is SendState.DONE and a.finished
    with pytest.raises(ProtocolError):
        table.on_control(CTL_DONE, a.msg_id)  # answered twice
    table.posted(b)
    with pytest.raises(ProtocolError):
        table.on_control(CTL_WITHDRAWN, b.msg_id)  # WITHDRAWN without CANCEL
    assert table.cancel(b) is True and b.state is SendState.CANCELLING
    assert table.on_control(CTL_WITHDRAWN, b.msg_id).state is SendState.WITHDRAWN
    c = table.start(1)
    assert table.cancel(c) is False and c.state is SendState.WITHDRAWN  # never posted: withdrawn locally
    d = table.start(1)
    assert table.fail_all() == [d] and d.state is SendState.FAILED and not table.active


def test_recv_table_cancel_before_and_during_pull() -> None:
    table = RecvTable(1 << 20)
    m1 = table.on_descriptor(Descriptor(1, 0x1000, 10, 3).encode())
    m2 = table.on_descriptor(Descriptor(2, 0x2000, 10, 3).encode())
    assert m1 is not None and m2 is not None
    with pytest.raises(FrameError):
        table.on_descriptor(Descriptor(1, 0x1000, 10, 3).encode())  # id announced twice
    assert table.on_descriptor(Descriptor(3, 0, 0, 0, withdrawn=True).encode()) is None
    assert table.on_cancel(1) is m1 and m1.state is RecvState.WITHDRAWN  # not pulled: withdraw
    table.start_pull(m2)
    assert table.on_cancel(2) is None and m2.cancel_requested  # being pulled: finish it, then DONE
    assert table.pulled(m2) == CTL_DONE and m2.state is RecvState.DONE
    assert table.on_cancel(2) is None  # already answered
    with pytest.raises(RuntimeError):
        table.start_pull(m2)


def test_receive_buffer_placeholders_keep_order() -> None:
    rxbuf = ReceiveBuffer(1 << 20)
    rxbuf.add_message(b"a")
    first, second = Placeholder(3), Placeholder(5)
    rxbuf.add_pending(first)
    rxbuf.add_message(b"b")
    rxbuf.add_pending(second)
    assert rxbuf.pending == 2 and rxbuf.unread == 2 and rxbuf.announced == 8
    assert rxbuf.ready == 1 and rxbuf.needed(1) == [] and rxbuf.needed(2) == [first]
    assert rxbuf.needed(5) == [first] and rxbuf.needed(6) == [first, second]  # a, 3 announced, b, 5
    assert rxbuf.pop_message() == b"a"
    assert rxbuf.head() is first
    rxbuf.resolve(first, b"big")
    assert rxbuf.ready == 4 and rxbuf.take(100) == b"bigb"  # never past the unsettled `second`
    rxbuf.withdraw(second)
    assert rxbuf.pending == 0 and rxbuf.announced == 0 and rxbuf.unread == 0 and not rxbuf.has_message()


def test_receive_buffer_placeholders_settled_out_of_order() -> None:
    rxbuf = ReceiveBuffer(1 << 20)
    marks = [Placeholder(2) for _ in range(4)]
    for i, mark in enumerate(marks):
        rxbuf.add_pending(mark)
        rxbuf.add_message(bytes([65 + i]))
    rxbuf.resolve(marks[2], b"cc")
    rxbuf.withdraw(marks[1])
    assert rxbuf.ready == 0 and rxbuf.needed(1) == rxbuf.needed(7) == [marks[0]]
    assert rxbuf.needed(8) == [marks[0], marks[3]]
    rxbuf.resolve(marks[0], b"aa")
    # a's data, A, (b withdrawn) B, cc, C: readable up to the unsettled fourth
    assert rxbuf.ready == 7 and rxbuf.find(b"C") == 6
    assert rxbuf.take_all() == b"aaABccC"
    assert isinstance(rxbuf.head(), Placeholder) and rxbuf.unread == 1
    rxbuf.resolve(marks[3], b"dd")
    assert rxbuf.pop_message() == b"dd" and rxbuf.pop_message() == b"D" and not rxbuf.has_message()


def test_announcements_count_against_the_limit_and_hold_their_slots() -> None:
    # A flood of announcements is held back as a flood of data is: past the limit, their slots are held
    # (the sender runs out of credits), and reading releases them.
    rxbuf = ReceiveBuffer(64 * 1024)
    marks = []
    slot = 0
    while True:
        mark = Placeholder(1)
        rxbuf.add_pending(mark)
        marks.append(mark)
        slot += 1
        if not rxbuf.admit(slot):
            break
    assert len(marks) == 64 * 1024 // (PLACEHOLDER_CHARGE + 1) + 1  # the bound the docstring states
    assert rxbuf.held == 1 and rxbuf.buffered == 0 and rxbuf.committed > rxbuf.limit
    assert rxbuf.releasable() == []
    rxbuf.resolve(marks[0], b"x")
    assert rxbuf.pop_message() == b"x"
    assert rxbuf.releasable() == [slot] and rxbuf.held == 0  # one read brought it under the limit
    # A reader waiting for more is never starved, even over the limit.
    rxbuf.add_pending(Placeholder(1 << 20))
    rxbuf.reader_waiting = True
    assert rxbuf.admit(slot + 1)


def test_recv_table_index_of_queued_messages() -> None:
    table = RecvTable(1 << 20)
    msgs = [table.on_descriptor(Descriptor(i, 0x1000, 10, 3).encode()) for i in range(1, 6)]
    assert all(m is not None for m in msgs)
    assert table.next_queued() is msgs[0]
    table.start_pull(msgs[0])
    table.start_pull(msgs[2])
    assert table.on_cancel(2) is msgs[1]
    assert table.next_queued() is msgs[3]
    table.start_pull(msgs[3])
    assert table.next_queued() is msgs[4]
    table.fail_all()
    assert table.next_queued() is None


def test_session_rndv_frames() -> None:
    both = Handshake(8, 256, 1 << 20, features=FEATURE_RNDV)
    s = Session(both, both)
    assert s.rendezvous
    imm = s.take_rndv_frame(DESCRIPTOR_SIZE)
    assert imm >> 28 == FrameKind.RNDV
    assert s.on_frame(int(FrameKind.RNDV) << 28, DESCRIPTOR_SIZE) is FrameKind.RNDV
    plain = Session(Handshake(8, 256, 1 << 20), both)
    assert not plain.rendezvous
    with pytest.raises(FrameError, match="rendezvous was not negotiated"):
        plain.on_frame(int(FrameKind.RNDV) << 28, DESCRIPTOR_SIZE)


class _Region:
    def __init__(self, length: int) -> None:
        self.length = length
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_cache_try_get_and_reserve_respect_the_bound() -> None:
    cache = RegistrationCache(lambda buf, access: _Region(len(buf)), lambda buf: (id(buf), len(buf)), 1000)
    a = bytearray(600)
    reg = cache.try_get(a)
    assert reg is not None and cache.pinned == 600
    assert cache.try_get(bytearray(500)) is None  # in use: nothing to evict
    assert not cache.try_reserve(300, limit=500)  # a send may use half
    assert cache.try_reserve(300) and cache.pinned == 900 and cache.reserved == 300
    reg.release()
    assert cache.try_reserve(500) and cache.evictions == 1 and cache.pinned == 800  # the unused one went
    cache.unreserve(800)
    assert cache.pinned == 0 and cache.reserved == 0
