"""Unit tests of rdmaio.protocol.rxbuffer.ReceiveBuffer: buffering, reads, the back-pressure (hold) rule."""

from __future__ import annotations

import random

import pytest

from rdmaio.protocol.rxbuffer import Placeholder, ReceiveBuffer


def test_messages_and_stream_reads_share_one_buffer() -> None:
    buf = ReceiveBuffer(1000)
    buf.add_message(b"hello")
    buf.add_messages([b"", b"world"])
    assert buf.unread == 10 and buf.has_message()
    assert buf.take(3) == b"hel"
    assert buf.pop_message() == b"lo"  # the rest of a partly read message
    assert buf.pop_message() == b""  # an empty message is a message
    assert buf.take(100) == b"world"
    assert buf.unread == 0 and not buf.has_message()


def test_fragments_count_while_they_are_reassembled() -> None:
    buf = ReceiveBuffer(1000)
    buf.add_fragment(b"a" * 300)
    buf.add_fragment(b"b" * 300)
    assert buf.buffered == 600 and buf.unread == 0 and not buf.has_message()
    assert buf.add_message(b"c" * 10) == b"a" * 300 + b"b" * 300 + b"c" * 10
    assert buf.buffered == buf.unread == 610 and buf.assembling == 0


def test_data_slots_are_held_only_over_the_limit_with_something_to_read() -> None:
    buf = ReceiveBuffer(100)
    buf.add_message(b"x" * 60)
    assert buf.admit(0)  # 60 <= 100
    buf.add_message(b"y" * 60)
    assert not buf.admit(1)  # 120 > 100 and 120 unread: held
    assert buf.held == 1 and buf.releasable() == []
    assert buf.pop_message() == b"x" * 60
    assert buf.releasable() == [1] and buf.held == 0


def test_a_message_larger_than_the_limit_is_never_starved() -> None:
    # Nothing complete to read: holding would leave the reader waiting for fragments that cannot come.
    buf = ReceiveBuffer(100)
    for slot in range(5):
        buf.add_fragment(b"z" * 64)
        assert buf.admit(slot)
    buf.add_message(b"z")
    assert buf.unread == 321
    buf.add_fragment(b"next")  # the next message, with a complete one unread over the limit: held
    assert not buf.admit(9)


def test_a_waiting_reader_releases_held_slots() -> None:
    # As asyncio's StreamReader resumes reading for readexactly(n) above its limit.
    buf = ReceiveBuffer(10)
    buf.add_message(b"a" * 20)
    assert not buf.admit(3)
    buf.reader_waiting = True
    assert buf.releasable() == [3]
    buf.add_message(b"b" * 20)
    assert buf.admit(4)  # not held while a reader waits for more
    buf.reader_waiting = False
    buf.add_message(b"c")
    assert not buf.admit(5)


def test_find_merges_across_messages_and_clear() -> None:
    buf = ReceiveBuffer(1000)
    for part in (b"ab", b"c\nd", b"ef"):
        buf.add_message(part)
    buf.take(1)
    assert buf.find(b"\nd") == 2
    assert buf.startswith(b"\n", 2) and not buf.startswith(b"\n", 1)
    assert buf.take(4) == b"bc\nd"
    assert buf.clear() == 2 and buf.unread == 0 and buf.find(b"x") == -1


def test_read_message_into_keeps_the_rest() -> None:
    buf = ReceiveBuffer(1000)
    buf.add_message(b"0123456789")
    target = bytearray(4)
    assert buf.read_message_into(memoryview(target)) == 4 and target == b"0123"
    assert buf.unread == 6
    assert buf.pop_message() == b"456789"


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReceiveBuffer(0)


def test_plain_attributes_agree_with_the_calls_they_stand_for() -> None:
    # held is len() of the held slots; a head of `messages` that is not a Placeholder is exactly what
    # pop_message() returns (from `offset` on), through messages and placeholders settled in any order.
    import random

    from rdmaio.protocol.rxbuffer import Placeholder

    rng = random.Random(3)
    buf = ReceiveBuffer(300)
    placeholders: list[Placeholder] = []
    held: list[int] = []
    for step in range(3000):
        action = rng.random()
        if action < 0.3:
            buf.add_message(bytes([step % 256]) * rng.randrange(0, 50))
            if not buf.admit(step):
                held.append(step)
        elif action < 0.4:
            p = Placeholder(rng.randrange(1, 40))
            buf.add_pending(p)
            placeholders.append(p)
        elif action < 0.5 and placeholders:
            p = placeholders.pop(rng.randrange(len(placeholders)))
            if rng.random() < 0.5:
                buf.resolve(p, b"r" * p.length)
            else:
                buf.withdraw(p)
        elif action < 0.6 and buf.ready:
            buf.take(rng.randrange(1, 20))
        elif action < 0.65:
            buf.reader_waiting = not buf.reader_waiting
        head = buf.messages[0] if buf.messages else None
        if head is not None and not isinstance(head, Placeholder):
            assert buf.has_message()
            expected = head[buf.offset :]
            before = (buf.unread, buf.ready)
            if rng.random() < 0.5:
                assert buf.pop_message() == expected
                assert (buf.unread, buf.ready) == (before[0] - len(expected), before[1] - len(expected))
        released = buf.releasable()
        held = [slot for slot in held if slot not in released]
        assert buf.held == len(held)
    assert buf.held == len(held)


def test_add_admitted_is_add_message_then_admit() -> None:
    # The receiver's one call per message must leave the buffer as the two calls it replaces, across
    # fragments, placeholders, the limit, held slots and a waiting reader.
    rnd = random.Random(3)
    for _trial in range(200):
        limit = rnd.choice([1, 50, 200, 1000])
        one, two = ReceiveBuffer(limit), ReceiveBuffer(limit)
        for slot in range(60):
            op = rnd.random()
            if op < 0.15:
                data = bytes(rnd.randint(0, 40))
                one.add_fragment(data)
                two.add_fragment(data)
            elif op < 0.2:
                length = rnd.randint(1, 100)
                one.add_pending(Placeholder(length))
                two.add_pending(Placeholder(length))
            elif op < 0.3:
                flag = rnd.random() < 0.5
                one.reader_waiting = two.reader_waiting = flag
            elif op < 0.4 and one.messages and not isinstance(one.messages[0], Placeholder):
                assert one.pop_message() == two.pop_message()
                assert one.releasable() == two.releasable()
            else:
                data = bytes([slot]) * rnd.randint(0, 80)
                message = one.add_message(data)
                admitted = one.admit(slot)
                assert two.add_admitted(data, slot) is admitted
                assert list(two.messages)[-1] == message
            for name in ("unread", "ready", "assembling", "held", "pending", "announced", "offset"):
                assert getattr(one, name) == getattr(two, name), name
            assert [m if isinstance(m, bytes) else m.length for m in one.messages] == [
                m if isinstance(m, bytes) else m.length for m in two.messages
            ]
