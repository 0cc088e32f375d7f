"""A DATA_BATCH payload's rule and split in C (``rdmaio_session_on_batch``) against the Python rule, its
reference model (:meth:`rdmaio.protocol.Session.on_batch` with :func:`rdmaio.protocol.frames.unpack_batch`).

The same payload, valid or malformed, goes to a Session on the Python state and to one on the C state: C
must accept exactly what Python accepts, with the same messages (the struct format it writes, applied with
``struct.unpack_from``) and the same state afterwards; what Python refuses C refuses with the code of the
same violation and changes nothing, and the Python rule then raises the same error on the C state. The
receiver (:meth:`rdmaio.core.receive.Receiver.on_batch`) is held to the same on both states.
"""

from __future__ import annotations

import collections
import re
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_receive import FakeSlots

import rdmaio
from rdmaio import verbs
from rdmaio.core.receive import Receiver
from rdmaio.core.shared_receive import new_session
from rdmaio.errors import FrameError
from rdmaio.protocol import FEATURE_BATCH, Handshake, Session
from rdmaio.protocol.frames import ReceivedMessageTooLargeError, pack_batch_into
from rdmaio.protocol.sessionstate import STATE_FIELDS
from rdmaio.verbs.native import ffi, lib

_FMT_CAP = 1 << 16
#: The C code of each violation, and what the Python rule's error says.
_VIOLATIONS = {
    lib.RDMAIO_BATCH_SHORT: (FrameError, "too short for one record"),
    lib.RDMAIO_BATCH_TRUNCATED: (FrameError, "payload truncated"),
    lib.RDMAIO_BATCH_OVERRUN: (FrameError, "only .* follow"),
    lib.RDMAIO_BATCH_TOO_LARGE: (ReceivedMessageTooLargeError, "more than our maximum message size"),
}


class _Transport:
    shared = None


def _sessions(slot: int, max_message: int) -> tuple[Session, Session, Session]:
    """A Session on the Python state, one on the C state (the core's), and their peer."""
    mine = Handshake(8, slot, max_message, features=FEATURE_BATCH)
    theirs = Handshake(8, slot, 1 << 20, features=FEATURE_BATCH)
    python = Session(mine, theirs)
    native = new_session(mine, theirs, _Transport())
    assert type(native) is Session and native.rules_state.fast == 1
    return python, native, Session(theirs, mine)


def fields(session: Session) -> dict[str, int]:
    state = session.rules_state
    return {name: int(getattr(state, name)) for name in STATE_FIELDS}


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:
        return "raised", (type(exc), str(exc))


def _c_on_batch(session: Session, ring: bytes | bytearray, off: int, length: int, cap: int = _FMT_CAP) -> Any:
    """rdmaio_session_on_batch on ``ring``: (code, messages or None)."""
    fmt = ffi.new("char[]", cap)
    buffer = ffi.from_buffer(ring)
    code = lib.rdmaio_session_on_batch(session.rules_state, buffer, len(ring), off, length, fmt, cap)
    if code > 0:
        return code, list(struct.unpack_from(ffi.string(fmt), ring, off))
    return code, None


def _check(payload: bytes, max_message: int, lead: int = 0) -> None:
    slot = max(len(payload), 64)
    python, native, peer = _sessions(slot, max_message)
    imm = peer.take_batch_frame(len(payload), 1) if len(payload) >= 4 else (5 << 28)
    seen = [_outcome(lambda s=s: s.on_frame(imm, len(payload))) for s in (python, native)]
    assert seen[0] == seen[1]
    assert fields(python) == fields(native)
    if seen[0][0] != "ok":
        return  # the frame itself was refused (a payload shorter than a record header)
    expected = _outcome(lambda: python.on_batch(payload))
    ring = bytes(lead) + payload + bytes(3)
    before = fields(native)
    code, messages = _c_on_batch(native, ring, lead, len(payload))
    if expected[0] == "ok":
        assert code == len(expected[1]) and messages == expected[1]
        assert fields(native) == fields(python)
        assert native.statistics() == python.statistics()
    else:
        error_type, message = expected[1]
        assert code in _VIOLATIONS, (code, expected)
        assert fields(native) == before  # nothing changed
        kind, pattern = _VIOLATIONS[code]
        assert error_type is kind
        assert re.search(pattern, message), (code, message)
        # The Python rule on the C state (what the receiver calls then) raises the same error.
        assert _outcome(lambda: native.on_batch(payload)) == expected
        assert fields(native) == fields(python)


def _pack(messages: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(m)) + m for m in messages)


@settings(max_examples=400, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=40), min_size=1, max_size=12),
    max_message=st.sampled_from([1, 7, 20, 40, 1 << 20]),
    cut=st.integers(-8, 8),
    pokes=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=3),
    lead=st.integers(0, 9),
)
def test_c_accepts_and_splits_exactly_what_the_python_rule_does(
    messages: list[bytes], max_message: int, cut: int, pokes: list[tuple[int, int]], lead: int
) -> None:
    payload = bytearray(_pack(messages))
    if cut < 0:
        del payload[cut:]  # a record cut short
    else:
        payload += bytes(range(cut))  # trailing bytes: a record header cut short, or a record
    for pos, value in pokes:  # a length field (or a payload byte) changed
        if payload:
            payload[pos % len(payload)] = value
    _check(bytes(payload), max_message, lead)


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(min_size=4, max_size=80), max_message=st.sampled_from([1, 3, 1 << 20]))
def test_c_matches_the_python_rule_on_random_bytes(payload: bytes, max_message: int) -> None:
    _check(payload, max_message)


@pytest.mark.parametrize(
    "payload, max_message, code",
    [
        (b"\x00\x00\x00", 100, None),  # too short for a DATA_BATCH frame: on_frame refuses it
        (_pack([b"ab"]) + b"\x01\x00", 100, lib.RDMAIO_BATCH_TRUNCATED),
        (_pack([b"ab"]) + b"\x05\x00\x00\x00abc", 100, lib.RDMAIO_BATCH_OVERRUN),
        (_pack([b"ab", b"abcdef"]), 5, lib.RDMAIO_BATCH_TOO_LARGE),
        (b"\xff\xff\xff\xff", 1 << 20, lib.RDMAIO_BATCH_OVERRUN),  # overrun comes before too large
        (_pack([b"", b"", b"x"]), 100, 3),
    ],
)
def test_each_violation_has_its_code(payload: bytes, max_message: int, code: int | None) -> None:
    _check(payload, max_message)
    if code is None:
        return
    _python, native, peer = _sessions(max(len(payload), 64), max_message)
    native.on_frame(peer.take_batch_frame(len(payload), 1), len(payload))
    assert _c_on_batch(native, payload, 0, len(payload))[0] == code


def test_c_defers_what_it_does_not_take_and_changes_nothing() -> None:
    payload = _pack([b"abc", b"", b"de"])
    _python, native, peer = _sessions(64, 100)
    state = native.rules_state
    before = fields(native)
    assert _c_on_batch(native, payload, 0, len(payload))[0] == 0  # no DATA_BATCH frame pending
    assert fields(native) == before
    native.on_frame(peer.take_batch_frame(len(payload), 3), len(payload))
    before = fields(native)
    assert _c_on_batch(native, payload, 0, len(payload) - 1)[0] == 0  # another length than the frame's
    assert _c_on_batch(native, payload, 1, len(payload))[0] == 0  # past the ring's end
    assert _c_on_batch(native, payload, 0, len(payload), cap=12)[0] == 0  # the format does not fit
    assert fields(native) == before
    assert _c_on_batch(native, payload, 0, len(payload), cap=13)[0] == 3  # "4x3s4x0s4x2s" and its NUL
    assert fields(native) != before and native.rules_state.batch_pending == -1
    state.batch_pending = len(payload)
    state.fast = 0
    before = fields(native)
    assert _c_on_batch(native, payload, 0, len(payload))[0] == 0  # not fast: the Python rules'
    assert fields(native) == before


def test_a_batch_of_more_records_than_the_format_holds_is_split_by_the_python_rule() -> None:
    # The receiver's format buffer holds 8 KiB: 4,000 empty messages need 16,000 bytes of it.
    payload = bytes(4 * 4000)
    received = [_receive_batch(make, payload) for make in (Session, _native)]
    assert received[0][0] == received[1][0] == [b""] * 4000
    assert received[0][1] == received[1][1]


def _native(mine: Handshake, theirs: Handshake) -> Session:
    return new_session(mine, theirs, _Transport())


class _Slots(FakeSlots):
    """test_receive's transport fake with slots big enough for the batches made here."""

    slot_size = 1 << 16


def _receive_batch(make: Any, payload: bytes, max_message: int = 1 << 20) -> tuple[Any, ...]:
    """One DATA_BATCH frame through Receiver.on_batch on a session made by ``make``: (messages or the error,
    the session's fields, the receiver's counters, the posts)."""
    slots = _Slots()
    mine = Handshake(8, slots.slot_size, max_message, features=FEATURE_BATCH)
    theirs = Handshake(8, slots.slot_size, 1 << 20, features=FEATURE_BATCH)
    session = make(mine, theirs)
    ring = memoryview(bytearray(slots.slot_size * 2))
    receiver = Receiver(
        session,
        slots,
        ring,
        io=SimpleNamespace(),  # type: ignore[arg-type]  # on_batch never reaches the loop
        options=rdmaio.Options(),
        stats=collections.Counter(),
        stage=lambda: None,
    )
    peer = Session(theirs, mine)
    ring[slots.slot_size : slots.slot_size + len(payload)] = payload
    imm = peer.take_batch_frame(len(payload), 1)
    records = ffi.new(
        "struct rdmaio_wc[]",
        [
            (
                verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 1),
                0,
                int(verbs.WcOpcode.RECV),
                len(payload),
                imm,
                verbs.WC_WITH_IMM,
            )
        ],
    )
    outcome = _outcome(lambda: receiver.on_batch(records, 0, 1))
    if outcome[0] == "ok":
        messages: Any = [receiver.rxbuf.pop_message() for _ in range(len(receiver.rxbuf.messages))]
    else:
        messages = outcome
    return (
        messages,
        fields(session),
        (receiver.messages_received, receiver.bytes_received, receiver.rxbuf.unread),
        slots.posts,
        session.state,
    )


@pytest.mark.parametrize(
    "payload, max_message",
    [
        (_pack([b"hello", b"", b"x" * 300]), 1 << 20),
        (_pack([b"ab"]) + b"\x01\x00", 1 << 20),
        (_pack([b"ab"]) + b"\x05\x00\x00\x00abc", 1 << 20),
        (_pack([b"ab", b"abcdef"]), 5),
    ],
)
def test_the_receiver_gives_the_same_messages_and_errors_on_both_states(
    payload: bytes, max_message: int
) -> None:
    python = _receive_batch(Session, payload, max_message)
    native = _receive_batch(_native, payload, max_message)
    assert native == python
    if python[0][0] == "raised":
        assert isinstance(python[0], tuple) and issubclass(python[0][1][0], FrameError)


def test_pack_batch_into_and_the_c_split_agree() -> None:
    buffer = bytearray(256)
    messages = [b"a", b"", b"bc" * 20, bytes(range(9))]
    n = pack_batch_into(buffer, 7, messages)
    _python, native, peer = _sessions(256, 1 << 20)
    native.on_frame(peer.take_batch_frame(n, len(messages)), n)
    assert _c_on_batch(native, buffer, 7, n) == (4, messages)
