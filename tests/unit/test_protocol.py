"""Unit tests of rdmaio.protocol: handshake, imm values, credits, batches, close states and a simulation."""

from __future__ import annotations

import contextlib
import random
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_session_native import NativeSession

from rdmaio.errors import (
    ConnectionAbortedError,
    ConnectionResetError,
    EndpointClosedError,
    FrameError,
    HandshakeError,
    MessageTooLargeError,
    ProtocolError,
)
from rdmaio.protocol import (
    BATCH_RECORD_HEADER,
    EOF,
    FEATURE_BATCH,
    FEATURE_GROW,
    FEATURE_RNDV,
    HANDSHAKE_MAGIC,
    KNOWN_FEATURES,
    MAX_MESSAGE_SIZE,
    MAX_PRIVATE_DATA,
    MAX_SLOT_SIZE,
    PROTOCOL_VERSION,
    EOFType,
    FrameKind,
    Handshake,
    ReceivedMessageTooLargeError,
    Session,
    State,
    batch_record_size,
    decode_imm,
    encode_imm,
    pack_batch_into,
    unpack_batch,
)
from rdmaio.protocol.framing import encode_frame_header, unframe_receive
from rdmaio.protocol.handshake import Capabilities
from rdmaio.protocol.rendezvous import DESCRIPTOR_SIZE, Descriptor
from rdmaio.protocol.rxbuffer import Placeholder, ReceiveBuffer
from rdmaio.verbs import WC_WITH_IMM

HEADER = struct.Struct("!4sBBH")
BODY = struct.Struct("!IIQ")


def raw_handshake(
    recv_depth: int = 8,
    slot_size: int = 64,
    max_message_size: int = 1024,
    *,
    magic: bytes = HANDSHAKE_MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    body_len: int | None = None,
) -> bytes:
    """Build handshake bytes by hand, bypassing Handshake's validation."""
    body = BODY.pack(recv_depth, slot_size, max_message_size)
    return HEADER.pack(magic, version, flags, len(body) if body_len is None else body_len) + body


def make_session(
    local_depth: int = 8,
    peer_depth: int = 8,
    *,
    local_slot: int = 64,
    peer_slot: int = 64,
    local_max: int = 1024,
    peer_max: int = 1024,
    credit_threshold: int | None = None,
    local_features: int = 0,
    peer_features: int = 0,
) -> Session:
    return Session(
        Handshake(local_depth, local_slot, local_max, features=local_features),
        Handshake(peer_depth, peer_slot, peer_max, features=peer_features),
        credit_threshold=credit_threshold,
    )


def batch_session(**kwargs: int) -> Session:
    """A session on which both sides announced FEATURE_BATCH."""
    return make_session(local_features=FEATURE_BATCH, peer_features=FEATURE_BATCH, **kwargs)


def batch_payload(messages: list[bytes]) -> bytes:
    """Encode a DATA_BATCH payload by hand (the reference for pack_batch_into)."""
    return b"".join(struct.pack("<I", len(m)) + m for m in messages)


def imm(kind: FrameKind, credits: int = 0) -> int:
    return encode_imm(kind, credits)


# -- Handshake ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recv_depth", "slot_size", "max_message_size"),
    [(4, 64, 1), (128, 4096, 1 << 20), (65535, MAX_SLOT_SIZE, MAX_MESSAGE_SIZE)],
)
def test_handshake_roundtrip(recv_depth: int, slot_size: int, max_message_size: int) -> None:
    hs = Handshake(recv_depth, slot_size, max_message_size)
    data = hs.encode()
    assert len(data) <= MAX_PRIVATE_DATA
    assert data.startswith(HANDSHAKE_MAGIC)
    assert Handshake.decode(data) == hs
    assert Handshake.decode(bytearray(data)) == hs
    assert Handshake.decode(memoryview(data)) == hs
    assert hs.version == PROTOCOL_VERSION


@pytest.mark.parametrize("total", [MAX_PRIVATE_DATA, 196, 256])
def test_handshake_decode_accepts_zero_padding(total: int) -> None:
    hs = Handshake(16, 256, 4096)
    data = hs.encode()
    assert Handshake.decode(data + b"\0" * (total - len(data))) == hs


def test_handshake_decode_accepts_garbage_after_declared_length() -> None:
    hs = Handshake(16, 256, 4096)
    assert Handshake.decode(hs.encode() + b"\xff" * 40) == hs


def test_handshake_decode_accepts_longer_declared_body_and_ignores_flags() -> None:
    # A compatible extension may append fields and set flags; version 1 reads what it knows.
    data = raw_handshake(16, 256, 4096, flags=0x80, body_len=BODY.size + 4) + b"\1\2\3\4"
    assert Handshake.decode(data) == Handshake(16, 256, 4096)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"R",
        HANDSHAKE_MAGIC,
        raw_handshake()[: HEADER.size - 1],
        raw_handshake()[: HEADER.size],
        raw_handshake()[: HEADER.size + 4],
        raw_handshake()[:-1],
        raw_handshake(body_len=BODY.size + 1),
    ],
    ids=[
        "empty",
        "1-byte",
        "magic-only",
        "partial-header",
        "header-only",
        "truncated",
        "minus-1",
        "declared+1",
    ],
)
def test_handshake_decode_too_short(data: bytes) -> None:
    with pytest.raises(HandshakeError, match="too short"):
        Handshake.decode(data)


@pytest.mark.parametrize("magic", [b"XDIO", b"rdio", b"\0\0\0\0"])
def test_handshake_decode_bad_magic(magic: bytes) -> None:
    with pytest.raises(HandshakeError, match="bad handshake magic"):
        Handshake.decode(raw_handshake(magic=magic))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_handshake_decode_unsupported_version(version: int) -> None:
    with pytest.raises(HandshakeError, match=rf"unsupported protocol version {version} .*supports 1\)"):
        Handshake.decode(raw_handshake(version=version))


@pytest.mark.parametrize("body_len", [0, 1, BODY.size - 1])
def test_handshake_decode_declared_length_too_small(body_len: int) -> None:
    with pytest.raises(HandshakeError, match=f"declared length {body_len} is too small"):
        Handshake.decode(raw_handshake(body_len=body_len))


OUT_OF_RANGE = [
    ({"recv_depth": 0}, "recv_depth 0 is out of range 4..65535"),
    ({"recv_depth": 3}, "recv_depth 3 is out of range"),
    ({"recv_depth": 65536}, "recv_depth 65536 is out of range"),
    ({"slot_size": 0}, "slot_size 0 is out of range 64..16777216"),
    ({"slot_size": 63}, "slot_size 63 is out of range"),
    ({"slot_size": MAX_SLOT_SIZE + 1}, f"slot_size {MAX_SLOT_SIZE + 1} is out of range"),
    ({"max_message_size": 0}, "max_message_size 0 is out of range 1..1099511627776"),
    ({"max_message_size": MAX_MESSAGE_SIZE + 1}, "max_message_size 1099511627777 is out of range"),
]


@pytest.mark.parametrize(("fields", "fragment"), OUT_OF_RANGE)
def test_handshake_decode_field_out_of_range(fields: dict[str, int], fragment: str) -> None:
    with pytest.raises(HandshakeError, match="invalid handshake from the peer") as info:
        Handshake.decode(
            raw_handshake(
                fields.get("recv_depth", 8), fields.get("slot_size", 64), fields.get("max_message_size", 1024)
            )
        )
    assert fragment in str(info.value)


@pytest.mark.parametrize(("fields", "fragment"), OUT_OF_RANGE)
def test_handshake_construct_field_out_of_range(fields: dict[str, int], fragment: str) -> None:
    args = {"recv_depth": 8, "slot_size": 64, "max_message_size": 1024, **fields}
    with pytest.raises(ValueError, match=fragment):
        Handshake(**args)


def test_handshake_construct_rejects_other_versions_and_non_ints() -> None:
    with pytest.raises(HandshakeError, match="unsupported protocol version 2"):
        Handshake(8, 64, 1024, version=2)
    with pytest.raises(TypeError, match="recv_depth must be an int"):
        Handshake(True, 64, 1024)
    with pytest.raises(TypeError, match="slot_size must be an int"):
        Handshake(8, "64", 1024)  # type: ignore[arg-type]


def test_handshake_is_frozen() -> None:
    hs = Handshake(8, 64, 1024)
    with pytest.raises(AttributeError):
        hs.recv_depth = 9  # type: ignore[misc]


HANDSHAKE_BYTES = st.one_of(
    st.binary(max_size=80),
    st.builds(
        lambda version, body_len, body: HEADER.pack(HANDSHAKE_MAGIC, version, 0, body_len) + body,
        st.sampled_from([0, 1, 2, 255]),
        st.integers(0, 40),
        st.binary(max_size=72),
    ),
    st.builds(
        lambda depth, slot, size, pad: raw_handshake(depth, slot, size) + pad,
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
        st.binary(max_size=56),
    ),
)


@settings(max_examples=300, deadline=None)
@given(HANDSHAKE_BYTES)
def test_handshake_decode_fuzz(data: bytes) -> None:
    try:
        hs = Handshake.decode(data)
    except HandshakeError:
        return
    assert 4 <= hs.recv_depth <= 65535
    assert 64 <= hs.slot_size <= MAX_SLOT_SIZE
    assert 1 <= hs.max_message_size <= MAX_MESSAGE_SIZE
    assert Handshake.decode(hs.encode()) == hs


# -- Handshake features -------------------------------------------------------------------------------------


def test_handshake_features_roundtrip_in_the_flags_byte() -> None:
    hs = Handshake(16, 256, 4096, features=FEATURE_BATCH)
    data = hs.encode()
    assert len(data) == HEADER.size + BODY.size == 24  # no new bytes: the feature bits use the flags byte
    assert HEADER.unpack_from(data) == (HANDSHAKE_MAGIC, PROTOCOL_VERSION, FEATURE_BATCH, BODY.size)
    assert Handshake.decode(data) == hs
    assert Handshake.decode(data).features == FEATURE_BATCH
    assert Handshake(16, 256, 4096).encode()[5] == 0  # no features: byte-identical to the original encoding


@pytest.mark.parametrize(
    ("flags", "features"),
    # FEATURE_GROW without its body field is dropped: such a peer posted recv_depth receives.
    [(0, 0), (FEATURE_BATCH, FEATURE_BATCH), (0x80, 0), (0xFF, KNOWN_FEATURES & ~FEATURE_GROW)],
)
def test_handshake_decode_keeps_known_feature_bits_only(flags: int, features: int) -> None:
    # Unknown bits (a later version's features) are ignored, as the flags byte always was.
    assert Handshake.decode(raw_handshake(16, 256, 4096, flags=flags)) == Handshake(
        16, 256, 4096, features=features
    )


def test_handshake_construct_rejects_unknown_features() -> None:
    with pytest.raises(HandshakeError, match="unknown feature bits 0x80"):
        Handshake(8, 64, 1024, features=0x80)  # 0x04 is FEATURE_ONESIDED, 0x08 FEATURE_RNDV
    with pytest.raises(HandshakeError, match="unknown feature bits"):
        Handshake(8, 64, 1024, features=-1)
    with pytest.raises(TypeError, match="features must be an int"):
        Handshake(8, 64, 1024, features=True)


@pytest.mark.parametrize(
    ("local", "peer", "expected"),
    [
        (0, 0, False),
        (FEATURE_BATCH, 0, False),
        (0, FEATURE_BATCH, False),
        (FEATURE_BATCH, FEATURE_BATCH, True),
    ],
)
def test_session_batching_needs_both_sides(local: int, peer: int, expected: bool) -> None:
    s = make_session(local_features=local, peer_features=peer)
    assert s.batching is expected
    assert s.statistics()["batching"] == int(expected)


# -- immediate values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FrameKind))
@pytest.mark.parametrize("credits", [0, 1, 255, 256, 65535])
def test_imm_roundtrip(kind: FrameKind, credits: int) -> None:
    value = encode_imm(kind, credits)
    assert 0 <= value < 2**32
    assert value >> 28 == kind
    assert value & 0x0FFF0000 == 0
    assert decode_imm(value) == (kind, credits)


def test_encode_imm_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="credits 65536 out of range"):
        encode_imm(FrameKind.CREDIT, 65536)
    with pytest.raises(ValueError, match="credits -1 out of range"):
        encode_imm(FrameKind.CREDIT, -1)
    with pytest.raises(ValueError):
        encode_imm(9, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw_kind", [0, *range(9, 16)])  # 7, 8: RECLAIM, RETURN (FEATURE_RECLAIM)
def test_decode_imm_unknown_kind(raw_kind: int) -> None:
    with pytest.raises(FrameError, match=f"unknown frame kind {raw_kind}"):
        decode_imm(raw_kind << 28 | 7)


@pytest.mark.parametrize("bit", range(16, 28))
def test_decode_imm_reserved_bits(bit: int) -> None:
    with pytest.raises(FrameError, match="reserved bits set"):
        decode_imm(int(FrameKind.DATA_END) << 28 | 1 << bit)


@pytest.mark.parametrize("value", [-1, -(2**31), 2**32, 2**40])
def test_decode_imm_out_of_range(value: int) -> None:
    with pytest.raises(FrameError, match="not an unsigned 32-bit value"):
        decode_imm(value)


# -- DATA_BATCH payloads ------------------------------------------------------------------------------------


def test_batch_record_size() -> None:
    assert BATCH_RECORD_HEADER == 4
    assert batch_record_size(0) == 4
    assert batch_record_size(60) == 64


def test_pack_batch_into_layout() -> None:
    buf = bytearray(b"\xee" * 32)
    n = pack_batch_into(memoryview(buf), 3, [b"ab", b"", memoryview(b"xyz"), bytearray(b"q")])
    assert n == 4 + 2 + 4 + 0 + 4 + 3 + 4 + 1
    assert bytes(buf[3 : 3 + n]) == (b"\x02\0\0\0ab" + b"\0\0\0\0" + b"\x03\0\0\0xyz" + b"\x01\0\0\0q")
    assert buf[:3] == b"\xee" * 3 and buf[3 + n :] == b"\xee" * (32 - 3 - n)  # nothing else touched
    assert unpack_batch(memoryview(buf)[3 : 3 + n]) == [b"ab", b"", b"xyz", b"q"]


def test_pack_batch_into_fits_exactly_or_writes_nothing() -> None:
    buf = bytearray(16)
    assert pack_batch_into(buf, 4, [b"12345678"]) == 12  # exactly to the end
    before = bytes(buf)
    with pytest.raises(ValueError, match="needs 13 bytes, 12 are available at offset 4"):
        pack_batch_into(buf, 4, [b"123456789"])
    with pytest.raises(ValueError, match="available at offset -1"):
        pack_batch_into(buf, -1, [b""])
    with pytest.raises(ValueError, match="at least one message"):
        pack_batch_into(buf, 0, [])
    assert bytes(buf) == before


def test_pack_batch_into_a_slot_view_cannot_spill() -> None:
    # The endpoint passes the view of one slot; the next slot stays untouched even at offset 0.
    slots = memoryview(bytearray(128))
    with pytest.raises(ValueError, match="needs 69 bytes, 64 are available"):
        pack_batch_into(slots[0:64], 0, [b"x" * 65])
    assert bytes(slots) == bytes(128)


BATCH_MESSAGES = st.lists(
    st.one_of(st.binary(max_size=40), st.binary(min_size=200, max_size=300)), min_size=1
)


@settings(max_examples=300, deadline=None)
@given(messages=BATCH_MESSAGES, offset=st.integers(0, 9), slack=st.integers(0, 9), as_view=st.booleans())
def test_batch_roundtrip(messages: list[bytes], offset: int, slack: int, as_view: bool) -> None:
    size = sum(batch_record_size(len(m)) for m in messages)
    buf = bytearray(offset + size + slack)
    sources: list[bytes | memoryview] = [memoryview(m) if as_view else m for m in messages]
    assert pack_batch_into(memoryview(buf), offset, sources) == size
    payload = bytes(buf[offset : offset + size])
    assert payload == batch_payload(messages)
    assert unpack_batch(payload) == messages
    assert unpack_batch(memoryview(buf)[offset : offset + size]) == messages
    assert all(type(m) is bytes for m in unpack_batch(bytearray(payload)))


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"", "0 bytes is too short for one record"),
        (b"\0\0\0", "3 bytes is too short for one record"),
        (b"\x01\0\0\0", "record at offset 0 declares 1 bytes, only 0 follow"),
        (b"\x05\0\0\0abc", "declares 5 bytes, only 3 follow"),
        (b"\xff\xff\xff\xffabc", "declares 4294967295 bytes"),
        (b"\0\0\0\0\0", "1 bytes left at offset 4, a record header needs 4"),
        (b"\x01\0\0\0a\x02\0\0", "3 bytes left at offset 5"),
        (b"\x01\0\0\0a\x02\0\0\0b", "record at offset 5 declares 2 bytes, only 1 follow"),
    ],
)
def test_unpack_batch_rejects_malformed_payloads(payload: bytes, fragment: str) -> None:
    with pytest.raises(FrameError, match=fragment):
        unpack_batch(payload)
    with pytest.raises(FrameError, match=fragment):
        unpack_batch(memoryview(payload))


def test_unpack_batch_checks_message_size() -> None:
    payload = batch_payload([b"abc", b"defgh"])
    assert unpack_batch(payload, 5) == [b"abc", b"defgh"]
    with pytest.raises(ReceivedMessageTooLargeError, match=r"batched message of 5 bytes, more than .* of 4"):
        unpack_batch(payload, 4)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=40),
        st.builds(lambda ms, cut: batch_payload(ms)[:cut], BATCH_MESSAGES, st.integers(0, 400)),
        st.builds(
            lambda ms, junk: batch_payload(ms) + junk, BATCH_MESSAGES, st.binary(min_size=1, max_size=7)
        ),
    )
)
def test_unpack_batch_fuzz(payload: bytes) -> None:
    # Either a FrameError, or a canonical decoding: packing the messages again gives the same bytes.
    try:
        messages = unpack_batch(payload)
    except FrameError:
        return
    assert messages and batch_payload(messages) == payload


# -- Session: credits and framing ---------------------------------------------------------------------------


def test_session_initial_state() -> None:
    s = make_session(8, 6, local_slot=128, peer_slot=256)
    assert (s.send_credits, s.ungranted, s.posted) == (6, 0, 8)
    assert s.max_fragment == 256
    assert s.credit_threshold == 4
    assert s.state is State.OPEN
    assert s.local == Handshake(8, 128, 1024)
    assert s.peer == Handshake(6, 256, 1024)
    assert s.send_error() is None
    assert s.recv_outcome() is None
    assert not s.peer_eof and not s.eof_sent and not s.eof_pending()
    assert s.statistics()["send_credits"] == 6


@pytest.mark.parametrize(("depth", "expected"), [(4, 2), (5, 2), (9, 4), (65535, 32767)])
def test_default_credit_threshold(depth: int, expected: int) -> None:
    assert make_session(depth).credit_threshold == expected


@pytest.mark.parametrize(("depth", "threshold"), [(8, 0), (8, 1), (8, 8), (8, 9), (4, 4)])
def test_credit_threshold_out_of_range(depth: int, threshold: int) -> None:
    with pytest.raises(ValueError, match=r"credit_threshold .* out of range 2\.\."):
        make_session(depth, credit_threshold=threshold)


def test_credit_threshold_edges_accepted() -> None:
    assert make_session(8, credit_threshold=2).credit_threshold == 2
    assert make_session(8, credit_threshold=7).credit_threshold == 7


def test_data_keeps_one_credit_in_reserve() -> None:
    s = make_session(peer_depth=4)
    for _ in range(3):
        assert s.can_send_data()
        assert decode_imm(s.take_data_frame(last=True)) == (FrameKind.DATA_END, 0)
    assert s.send_credits == 1
    assert not s.can_send_data()
    with pytest.raises(RuntimeError, match="no credit for a DATA frame"):
        s.take_data_frame(last=False)
    # Nothing owed yet: neither CREDIT nor EOF may take the last credit without granting.
    with pytest.raises(RuntimeError, match="must grant at least one credit"):
        s.take_credit_frame()
    s.write_eof()
    assert s.eof_pending() and not s.can_send_eof()
    with pytest.raises(RuntimeError, match="no credit for the EOF frame"):
        s.take_eof_frame()
    # Once something is owed, the last credit may carry it.
    s.on_frame(imm(FrameKind.DATA_END), 10)
    s.on_recv_reposted(1)
    assert s.can_send_eof()
    assert decode_imm(s.take_eof_frame()) == (FrameKind.EOF, 1)
    assert s.send_credits == 0 and s.ungranted == 0
    assert not s.eof_pending() and not s.can_send_eof()


def test_credit_frame_may_use_last_credit() -> None:
    s = make_session(local_depth=4, peer_depth=4)
    for _ in range(3):
        s.take_data_frame(last=True)
    for _ in range(2):
        s.on_frame(imm(FrameKind.DATA_END), 1)
    assert not s.credit_frame_due()
    s.on_recv_reposted(1)
    assert not s.credit_frame_due()  # 1 < threshold 2
    s.on_recv_reposted(1)
    assert s.credit_frame_due()
    assert decode_imm(s.take_credit_frame()) == (FrameKind.CREDIT, 2)
    assert s.send_credits == 0
    assert not s.credit_frame_due()
    s.on_frame(imm(FrameKind.CREDIT), 0)
    s.on_recv_reposted(1)
    with pytest.raises(RuntimeError, match="no credit left for a CREDIT frame"):
        s.take_credit_frame()
    assert s.statistics()["credit_frames_sent"] == 1


def test_piggyback_drains_ungranted() -> None:
    s = make_session(local_depth=8, credit_threshold=6)
    for _ in range(5):
        s.on_frame(imm(FrameKind.DATA_MORE), 64)
    s.on_recv_reposted(3)
    assert (s.ungranted, s.posted) == (3, 6)
    assert not s.credit_frame_due()
    assert decode_imm(s.take_data_frame(last=False, nbytes=64)) == (FrameKind.DATA_MORE, 3)
    assert s.ungranted == 0
    s.on_recv_reposted(2)
    assert decode_imm(s.take_data_frame(last=True, nbytes=1)) == (FrameKind.DATA_END, 2)
    assert decode_imm(s.take_data_frame(last=True)) == (FrameKind.DATA_END, 0)
    stats = s.statistics()
    assert stats["credits_granted"] == 5
    assert stats["bytes_sent"] == 65
    assert stats["messages_sent"] == 2
    assert stats["data_frames_sent"] == 3
    assert stats["min_send_credits"] == 5


def test_received_credits_add_to_send_credits() -> None:
    s = make_session(peer_depth=8)
    for _ in range(5):
        s.take_data_frame(last=True)
    assert s.send_credits == 3
    assert s.on_frame(imm(FrameKind.CREDIT, 4), 0) is FrameKind.CREDIT
    assert s.send_credits == 7
    assert s.on_frame(imm(FrameKind.DATA_END, 1), 3) is FrameKind.DATA_END
    assert s.send_credits == 8
    stats = s.statistics()
    assert stats["credits_received"] == 5
    assert stats["credit_frames_received"] == 1
    assert stats["bytes_received"] == 3


def test_on_recv_reposted_validation() -> None:
    s = make_session(local_depth=4)
    with pytest.raises(RuntimeError, match="more than recv_depth 4"):
        s.on_recv_reposted(1)
    with pytest.raises(ValueError, match="negative"):
        s.on_recv_reposted(-1)
    s.on_recv_reposted(0)
    assert (s.posted, s.ungranted) == (4, 0)


def test_take_data_frame_checks_fragment_and_message_size() -> None:
    s = make_session(peer_slot=64, peer_max=100)
    with pytest.raises(ValueError, match="fragment of 65 bytes"):
        s.take_data_frame(last=True, nbytes=65)
    with pytest.raises(ValueError, match="fragment of -1 bytes"):
        s.take_data_frame(last=True, nbytes=-1)
    s.take_data_frame(last=False, nbytes=64)
    with pytest.raises(MessageTooLargeError, match="maximum message size of 100"):
        s.take_data_frame(last=True, nbytes=37)
    s.take_data_frame(last=True, nbytes=36)
    s.take_data_frame(last=True, nbytes=64)  # a new message starts from zero
    assert s.send_credits == 5


def test_check_message_size() -> None:
    s = make_session(peer_max=1000)
    s.check_message_size(0)
    s.check_message_size(1000)
    with pytest.raises(
        MessageTooLargeError, match="1001 bytes exceeds the peer's maximum message size of 1000"
    ):
        s.check_message_size(1001)
    with pytest.raises(ValueError, match="negative"):
        s.check_message_size(-1)


@pytest.mark.parametrize(
    ("n", "expected"), [(0, 1), (1, 1), (63, 1), (64, 1), (65, 2), (128, 2), (129, 3), (10**9, 15625000)]
)
def test_fragment_count(n: int, expected: int) -> None:
    s = make_session(peer_slot=64)
    assert s.fragment_count(n) == expected
    with pytest.raises(ValueError, match="negative"):
        s.fragment_count(-1)


def test_on_frame_accepts_empty_message() -> None:
    s = make_session()
    assert s.on_frame(imm(FrameKind.DATA_END), 0) is FrameKind.DATA_END
    assert s.statistics()["messages_received"] == 1
    assert s.posted == 7


def test_on_frame_reassembly_limit_is_exact() -> None:
    s = make_session(local_slot=64, local_max=100)
    s.on_frame(imm(FrameKind.DATA_MORE), 64)
    s.on_frame(imm(FrameKind.DATA_END), 36)  # exactly 100
    s.on_frame(imm(FrameKind.DATA_MORE), 64)
    with pytest.raises(ReceivedMessageTooLargeError, match="at least 101 bytes") as info:
        s.on_frame(imm(FrameKind.DATA_END), 37)
    assert isinstance(info.value, MessageTooLargeError)
    assert isinstance(info.value, ProtocolError)


def _exhaust_slots(s: Session) -> None:
    for _ in range(s.posted):
        s.on_frame(imm(FrameKind.DATA_END), 1)


def _after_peer_eof(s: Session) -> None:
    s.on_frame(imm(FrameKind.EOF), 0)


def _mid_message(s: Session) -> None:
    s.on_frame(imm(FrameKind.DATA_MORE), 64)


def _reposted_but_not_granted(s: Session) -> None:
    _exhaust_slots(s)
    s.on_recv_reposted(s.local.recv_depth)


def _spent_credits(s: Session) -> None:
    s.take_data_frame(last=True)


def _nothing(s: Session) -> None:
    pass


ON_FRAME_ERRORS: list[tuple[str, Callable[[Session], None], int, int, type[Exception], str]] = [
    ("no-slot-posted", _exhaust_slots, imm(FrameKind.DATA_END), 1, FrameError, "no receive posted"),
    ("no-slot-credit", _exhaust_slots, imm(FrameKind.CREDIT), 0, FrameError, "no receive posted"),
    ("ungranted-slot", _reposted_but_not_granted, imm(FrameKind.DATA_END), 1, FrameError, "held no credit"),
    ("oversize", _nothing, imm(FrameKind.DATA_MORE), 65, FrameError, "65 bytes exceeds the slot size of 64"),
    ("oversize-end", _nothing, imm(FrameKind.DATA_END), 2**32 - 1, FrameError, "exceeds the slot size"),
    ("negative-len", _nothing, imm(FrameKind.DATA_END), -1, FrameError, "exceeds the slot size"),
    ("payload-credit", _nothing, imm(FrameKind.CREDIT), 1, FrameError, "CREDIT frame carries 1 payload"),
    ("payload-eof", _nothing, imm(FrameKind.EOF), 8, FrameError, "EOF frame carries 8 payload"),
    ("data-after-eof", _after_peer_eof, imm(FrameKind.DATA_END), 0, FrameError, "after the peer's EOF"),
    ("more-after-eof", _after_peer_eof, imm(FrameKind.DATA_MORE), 5, FrameError, "after the peer's EOF"),
    ("second-eof", _after_peer_eof, imm(FrameKind.EOF), 0, FrameError, "second EOF"),
    ("eof-mid-message", _mid_message, imm(FrameKind.EOF), 0, FrameError, "middle of a message"),
    ("too-many-credits", _nothing, imm(FrameKind.CREDIT, 1), 0, FrameError, "more than its recv_depth 8"),
    ("credit-overflow", _spent_credits, imm(FrameKind.CREDIT, 2), 0, FrameError, "granted 2 credits"),
    ("bad-kind", _nothing, 9 << 28, 0, FrameError, "unknown frame kind 9"),
    ("reclaim-not-negotiated", _nothing, 7 << 28, 0, FrameError, "FEATURE_RECLAIM was not negotiated"),
    ("reserved", _nothing, 1 << 20 | 2 << 28, 0, FrameError, "reserved bits"),
    ("kind-15", _nothing, 15 << 28, 0, FrameError, "unknown frame kind 15"),
    ("kind-0", _nothing, 0, 0, FrameError, "unknown frame kind 0"),
    ("negative-imm", _nothing, -1, 0, FrameError, "not an unsigned 32-bit value"),
    ("wide-imm", _nothing, 1 << 32 | 2 << 28, 0, FrameError, "not an unsigned 32-bit value"),
    ("batch-no-slot", _exhaust_slots, imm(FrameKind.DATA_BATCH), 4, FrameError, "no receive posted"),
    ("batch-oversize", _nothing, imm(FrameKind.DATA_BATCH), 65, FrameError, "exceeds the slot size of 64"),
    ("batch-empty", _nothing, imm(FrameKind.DATA_BATCH), 0, FrameError, "0 bytes is too short for one"),
    ("batch-short", _nothing, imm(FrameKind.DATA_BATCH), 3, FrameError, "3 bytes is too short for one"),
    ("batch-after-eof", _after_peer_eof, imm(FrameKind.DATA_BATCH), 4, FrameError, "after the peer's EOF"),
    ("batch-credits", _spent_credits, imm(FrameKind.DATA_BATCH, 2), 4, FrameError, "granted 2 credits"),
    (
        "batch-mid-message",
        _mid_message,
        imm(FrameKind.DATA_BATCH),
        4,
        FrameError,
        r"DATA_BATCH frame in the middle of a message \(DATA_END missing\)",
    ),
    (
        "too-large",
        _mid_message,
        imm(FrameKind.DATA_END),
        1,
        ReceivedMessageTooLargeError,
        "more than our maximum message size of 64",
    ),
]


@pytest.mark.parametrize(
    ("setup", "raw_imm", "byte_len", "exc_type", "fragment"),
    [case[1:] for case in ON_FRAME_ERRORS],
    ids=[case[0] for case in ON_FRAME_ERRORS],
)
def test_on_frame_errors(
    setup: Callable[[Session], None], raw_imm: int, byte_len: int, exc_type: type[Exception], fragment: str
) -> None:
    s = batch_session(local_slot=64, local_max=64)
    setup(s)
    before = s.statistics()
    with pytest.raises(exc_type, match=fragment) as info:
        s.on_frame(raw_imm, byte_len)
    assert isinstance(info.value, ProtocolError)
    # Rejected frames change no counters, and the session is aborted with the violation.
    assert s.statistics() == before
    assert s.state is State.ABORTED
    err = s.send_error()
    assert isinstance(err, ConnectionAbortedError)
    assert err.__cause__ is info.value
    assert isinstance(s.recv_outcome(), ConnectionAbortedError)
    assert not s.credit_frame_due() and not s.can_send_data()


def test_frames_sent_after_eof_and_flush_after_write_eof() -> None:
    s = make_session()
    s.take_data_frame(last=False)
    s.write_eof()
    assert isinstance(s.send_error(), EndpointClosedError)
    # Data accepted before write_eof() is still flushed...
    assert s.can_send_data()
    assert not s.can_send_eof()  # ...and EOF waits for the message to end.
    with pytest.raises(RuntimeError, match="middle of a message"):
        s.take_eof_frame()
    s.take_data_frame(last=True)
    assert s.can_send_eof()
    s.take_eof_frame()
    assert s.eof_sent
    assert not s.can_send_data()
    with pytest.raises(EndpointClosedError, match="EOF was already sent"):
        s.take_data_frame(last=True)
    with pytest.raises(RuntimeError, match="already sent"):
        s.take_eof_frame()
    # Half-closed: we still receive and grant credits.
    s.on_frame(imm(FrameKind.DATA_END), 1)
    s.on_frame(imm(FrameKind.DATA_END), 1)
    s.on_recv_reposted(2)
    assert decode_imm(s.take_credit_frame()) == (FrameKind.CREDIT, 2)


def test_take_eof_frame_without_write_eof_implies_it() -> None:
    s = make_session()
    s.take_eof_frame()
    assert s.eof_sent
    assert isinstance(s.send_error(), EndpointClosedError)


@pytest.mark.parametrize(
    ("event", "exc_type"),
    [
        ("disconnect", ConnectionResetError),
        ("abort", EndpointClosedError),
        ("mark_closed", EndpointClosedError),
    ],
)
def test_no_frames_once_transport_is_gone(event: str, exc_type: type[Exception]) -> None:
    s = make_session(local_depth=4)
    s.on_frame(imm(FrameKind.DATA_END), 1)
    s.on_frame(imm(FrameKind.DATA_END), 1)
    s.on_recv_reposted(2)
    s.close()
    assert s.credit_frame_due() and s.eof_pending() and s.can_send_data()
    {"disconnect": s.on_disconnected, "abort": s.abort, "mark_closed": s.mark_closed}[event]()
    assert not s.credit_frame_due() and not s.eof_pending() and not s.can_send_eof() and not s.can_send_data()
    takes: list[Callable[[], int]] = [
        lambda: s.take_data_frame(last=True),
        lambda: s.take_batch_frame(4, 1),
        s.take_credit_frame,
        s.take_eof_frame,
    ]
    for take in takes:
        with pytest.raises(exc_type):
            take()


# -- Session: DATA_BATCH frames -----------------------------------------------------------------------------


def test_take_batch_frame_accounting() -> None:
    s = batch_session(peer_slot=64)
    s.on_frame(imm(FrameKind.DATA_END), 1)
    s.on_recv_reposted(1)
    slot = bytearray(64)
    n = pack_batch_into(memoryview(slot), 0, [b"ab", b"", b"xyz"])
    assert n == 17
    assert decode_imm(s.take_batch_frame(n, 3)) == (FrameKind.DATA_BATCH, 1)  # piggybacks the grant
    assert (s.send_credits, s.ungranted) == (7, 0)
    s.take_data_frame(last=False, nbytes=64)
    s.take_data_frame(last=True, nbytes=2)
    assert decode_imm(s.take_batch_frame(64, 16)) == (FrameKind.DATA_BATCH, 0)  # 16 empty messages
    stats = s.statistics()
    assert stats["frames_sent"] == 4
    assert stats["data_frames_sent"] == 2
    assert stats["batch_frames_sent"] == 2
    assert stats["batched_messages_sent"] == 19
    assert stats["messages_sent"] == 20
    assert stats["bytes_sent"] == 5 + 66  # message bytes; the record headers are not counted
    assert stats["credits_granted"] == 1
    assert stats["min_send_credits"] == 4


def _mid_send(s: Session) -> None:
    s.take_data_frame(last=False, nbytes=1)


def _eof_sent(s: Session) -> None:
    s.take_eof_frame()


def _one_credit_left(s: Session) -> None:
    while s.send_credits > 1:
        s.take_data_frame(last=True)


TAKE_BATCH_ERRORS: list[tuple[str, Callable[[Session], None], int, int, type[Exception], str]] = [
    ("mid-message", _mid_send, 4, 1, RuntimeError, "DATA_BATCH frame in the middle of a message"),
    ("after-eof", _eof_sent, 4, 1, EndpointClosedError, "EOF was already sent"),
    ("one-credit", _one_credit_left, 4, 1, RuntimeError, "no credit for a DATA frame"),
    ("no-messages", _nothing, 4, 0, ValueError, "0 messages cannot make a DATA_BATCH payload of 4 bytes"),
    ("too-many-messages", _nothing, 7, 2, ValueError, "2 messages cannot make"),
    ("too-short", _nothing, 3, 1, ValueError, "1 messages cannot make a DATA_BATCH payload of 3 bytes"),
    ("too-large", _nothing, 65, 1, ValueError, "DATA_BATCH frame of 65 bytes out of range 0..64"),
]


@pytest.mark.parametrize(
    ("setup", "nbytes", "messages", "exc_type", "fragment"),
    [case[1:] for case in TAKE_BATCH_ERRORS],
    ids=[case[0] for case in TAKE_BATCH_ERRORS],
)
def test_take_batch_frame_errors(
    setup: Callable[[Session], None], nbytes: int, messages: int, exc_type: type[Exception], fragment: str
) -> None:
    s = batch_session(peer_slot=64)
    setup(s)
    before = s.statistics()
    with pytest.raises(exc_type, match=fragment):
        s.take_batch_frame(nbytes, messages)
    assert s.statistics() == before


@pytest.mark.parametrize(("local", "peer"), [(0, 0), (FEATURE_BATCH, 0), (0, FEATURE_BATCH)])
def test_batch_frames_need_negotiation(local: int, peer: int) -> None:
    s = make_session(local_features=local, peer_features=peer)
    with pytest.raises(RuntimeError, match="batching was not negotiated"):
        s.take_batch_frame(4, 1)
    assert s.statistics()["frames_sent"] == 0
    with pytest.raises(FrameError, match="DATA_BATCH frame although batching was not negotiated"):
        s.on_frame(imm(FrameKind.DATA_BATCH), 4)
    assert s.state is State.ABORTED
    assert s.statistics()["frames_received"] == 0


def test_on_frame_batch_then_on_batch() -> None:
    s = batch_session(local_slot=64, local_max=3)
    payload = batch_payload([b"a", b"", b"bcd"])
    s.on_frame(imm(FrameKind.DATA_MORE), 2)
    s.on_frame(imm(FrameKind.DATA_END), 1)
    assert s.on_frame(imm(FrameKind.DATA_BATCH), len(payload)) is FrameKind.DATA_BATCH
    slot = memoryview(bytearray(payload + b"junk after the frame"))
    assert s.on_batch(slot[: len(payload)]) == [b"a", b"", b"bcd"]
    assert s.on_frame(imm(FrameKind.DATA_BATCH), 4) == FrameKind.DATA_BATCH
    assert s.on_batch(b"\0\0\0\0") == [b""]
    stats = s.statistics()
    assert stats["frames_received"] == 4
    assert stats["data_frames_received"] == 2
    assert stats["batch_frames_received"] == 2
    assert stats["batched_messages_received"] == 4
    assert stats["messages_received"] == 5
    assert stats["bytes_received"] == 3 + 4
    assert s.posted == 4
    s.on_recv_reposted(4)
    assert decode_imm(s.take_credit_frame()) == (FrameKind.CREDIT, 4)


def test_on_batch_misuse_is_a_runtime_error() -> None:
    s = batch_session()
    with pytest.raises(RuntimeError, match="without a DATA_BATCH frame"):
        s.on_batch(b"\0\0\0\0")
    s.on_frame(imm(FrameKind.DATA_BATCH), 8)
    with pytest.raises(RuntimeError, match="got 4 bytes, the DATA_BATCH frame had 8"):
        s.on_batch(b"\0\0\0\0")
    assert s.on_batch(b"\0\0\0\0" * 2) == [b"", b""]
    with pytest.raises(RuntimeError, match="without a DATA_BATCH frame"):
        s.on_batch(b"\0\0\0\0")
    assert s.state is State.OPEN


@pytest.mark.parametrize(
    ("payload", "exc_type", "fragment"),
    [
        (b"\x05\0\0\0abcd", FrameError, "declares 5 bytes, only 4 follow"),
        (b"\x01\0\0\0ab", FrameError, "1 bytes left at offset 5"),
        (batch_payload([b"abc", b"defgh"]), ReceivedMessageTooLargeError, "batched message of 5 bytes"),
    ],
)
def test_on_batch_malformed_payload_aborts(payload: bytes, exc_type: type[Exception], fragment: str) -> None:
    s = batch_session(local_max=4)
    s.on_frame(imm(FrameKind.DATA_BATCH), len(payload))
    before = s.statistics()
    with pytest.raises(exc_type, match=fragment) as info:
        s.on_batch(payload)
    assert isinstance(info.value, ProtocolError)
    assert s.statistics() == before
    assert s.state is State.ABORTED
    err = s.recv_outcome()
    assert isinstance(err, ConnectionAbortedError) and err.__cause__ is info.value


def test_credit_frame_allowed_mid_message_but_not_eof_or_batch() -> None:
    # Rule check: CREDIT carries only grants and may arrive between fragments; EOF and DATA_BATCH may not.
    s = batch_session(local_slot=64)
    s.on_frame(imm(FrameKind.DATA_MORE), 64)
    assert s.on_frame(imm(FrameKind.CREDIT), 0) is FrameKind.CREDIT
    assert s.on_frame(imm(FrameKind.DATA_END), 1) is FrameKind.DATA_END
    assert s.on_frame(imm(FrameKind.DATA_BATCH), 4) is FrameKind.DATA_BATCH
    # Sender side: a CREDIT frame may be taken mid-message, EOF and DATA_BATCH may not.
    s.on_batch(b"\0\0\0\0")
    s.take_data_frame(last=False, nbytes=1)
    s.on_recv_reposted(3)
    assert decode_imm(s.take_credit_frame()) == (FrameKind.CREDIT, 3)
    with pytest.raises(RuntimeError, match="middle of a message"):
        s.take_batch_frame(4, 1)
    with pytest.raises(RuntimeError, match="middle of a message"):
        s.take_eof_frame()


# -- close state machine ------------------------------------------------------------------------------------


BOOM = OSError(5, "boom")


def _apply(s: Session, action: str) -> None:
    if action == "write_eof":
        s.write_eof()
    elif action == "close":
        s.close()
    elif action == "abort":
        s.abort()
    elif action == "abort_exc":
        s.abort(BOOM)
    elif action == "disconnect":
        s.on_disconnected()
    elif action == "transport_error":
        s.on_transport_error(BOOM)
    elif action == "peer_eof":
        s.on_frame(imm(FrameKind.EOF), 0)
    elif action == "mark_closed":
        s.mark_closed()
    else:  # pragma: no cover
        raise AssertionError(action)


Outcome = tuple[type[BaseException], str] | EOFType | None
RESET_PEER = (ConnectionResetError, "peer closed the connection")
RESET_NO_EOF = (ConnectionResetError, "peer disconnected without sending EOF")
RESET_TRANSPORT = (ConnectionResetError, "transport error: .*boom")
CLOSED = (EndpointClosedError, "endpoint is closed")
ABORTED_CLOSED = (EndpointClosedError, "endpoint was aborted")
ABORTED_EXC = (ConnectionAbortedError, "connection aborted: .*boom")
WROTE_EOF = (EndpointClosedError, r"write_eof\(\) was called")

CLOSE_TABLE: list[tuple[list[str], State, Outcome, Outcome]] = [
    ([], State.OPEN, None, None),
    (["write_eof"], State.OPEN, WROTE_EOF, None),
    (["peer_eof"], State.OPEN, None, EOF),
    (["peer_eof", "write_eof"], State.OPEN, WROTE_EOF, EOF),
    (["disconnect"], State.DISCONNECTED, RESET_PEER, RESET_NO_EOF),
    (["peer_eof", "disconnect"], State.DISCONNECTED, RESET_PEER, EOF),
    (["peer_eof", "transport_error"], State.DISCONNECTED, RESET_TRANSPORT, EOF),
    (["transport_error"], State.DISCONNECTED, RESET_TRANSPORT, RESET_TRANSPORT),
    (["disconnect", "transport_error"], State.DISCONNECTED, RESET_PEER, RESET_NO_EOF),
    (["transport_error", "disconnect"], State.DISCONNECTED, RESET_TRANSPORT, RESET_TRANSPORT),
    (["write_eof", "disconnect"], State.DISCONNECTED, WROTE_EOF, RESET_NO_EOF),
    (["disconnect", "mark_closed"], State.CLOSED, RESET_PEER, RESET_NO_EOF),
    (["peer_eof", "disconnect", "mark_closed"], State.CLOSED, RESET_PEER, EOF),
    (["close"], State.CLOSING, CLOSED, CLOSED),
    (["peer_eof", "close"], State.CLOSING, CLOSED, CLOSED),
    (["close", "disconnect"], State.CLOSING, CLOSED, CLOSED),
    (["disconnect", "close"], State.CLOSING, CLOSED, CLOSED),
    (["close", "disconnect", "mark_closed"], State.CLOSED, CLOSED, CLOSED),
    (["mark_closed"], State.CLOSED, CLOSED, CLOSED),
    (["abort"], State.ABORTED, ABORTED_CLOSED, ABORTED_CLOSED),
    (["abort_exc"], State.ABORTED, ABORTED_EXC, ABORTED_EXC),
    (["peer_eof", "abort_exc"], State.ABORTED, ABORTED_EXC, ABORTED_EXC),
    (["close", "abort_exc"], State.ABORTED, ABORTED_EXC, ABORTED_EXC),
    (["abort", "abort_exc"], State.ABORTED, ABORTED_CLOSED, ABORTED_CLOSED),
    (["abort_exc", "close", "disconnect"], State.ABORTED, ABORTED_EXC, ABORTED_EXC),
    (["abort_exc", "mark_closed"], State.CLOSED, ABORTED_EXC, ABORTED_EXC),
    (["mark_closed", "abort_exc"], State.CLOSED, CLOSED, CLOSED),
]


def _check_outcome(actual: BaseException | EOFType | None, expected: Outcome) -> None:
    if expected is None or expected is EOF:
        assert actual is expected
        return
    assert isinstance(expected, tuple)
    exc_type, pattern = expected
    assert isinstance(actual, exc_type), actual
    with pytest.raises(exc_type, match=pattern):
        raise actual
    if "boom" in pattern:
        assert actual.__cause__ is BOOM


@pytest.mark.parametrize(
    ("actions", "state", "send", "recv"), CLOSE_TABLE, ids=["+".join(c[0]) or "fresh" for c in CLOSE_TABLE]
)
def test_close_state_machine(actions: list[str], state: State, send: Outcome, recv: Outcome) -> None:
    s = make_session()
    for action in actions:
        _apply(s, action)
    assert s.state is state
    _check_outcome(s.send_error(), send)
    _check_outcome(s.recv_outcome(), recv)
    # Repeating every action except the one-shot peer EOF (a second EOF is a protocol error) changes nothing.
    for action in actions:
        if action != "peer_eof":
            _apply(s, action)
    assert s.state is state
    _check_outcome(s.send_error(), send)
    _check_outcome(s.recv_outcome(), recv)


def test_close_implies_write_eof_and_errors_are_fresh_instances() -> None:
    s = make_session()
    s.close()
    assert s.eof_pending()
    assert s.state is State.CLOSING
    assert s.send_error() is not s.send_error()
    s.take_eof_frame()
    assert not s.eof_pending()
    s.close()
    s.write_eof()
    assert not s.eof_pending()


def test_eof_type_repr() -> None:
    assert repr(EOF) == "EOF"
    assert "OPEN" in repr(make_session())


# -- frame parser fuzz --------------------------------------------------------------------------------------

IMMS = st.one_of(
    st.integers(0, 2**32 - 1),
    st.builds(lambda k, c: k << 28 | c, st.integers(0, 15), st.integers(0, 0xFFFF)),
    st.builds(lambda k, c: k << 28 | c, st.integers(1, 5), st.integers(0, 3)),
    st.sampled_from([-1, 2**32, 2**32 + 1]),
)
LENS = st.one_of(st.integers(0, 80), st.integers(0, 2**32 - 1), st.just(-1))


@dataclass
class RecvModel:
    """The receive rules written out plainly, as the reference for on_frame's optimised checks."""

    in_message: bool = False
    message_bytes: int = 0

    def expect(self, s: Session, raw: int, byte_len: int) -> FrameKind | None:
        """The kind on_frame must return for this frame, or None if it must reject it."""
        if not 0 <= raw <= 0xFFFF_FFFF or raw & 0x0FFF_0000 or not 1 <= raw >> 28 <= 5:
            return None
        kind, credits = FrameKind(raw >> 28), raw & 0xFFFF
        data = kind in (FrameKind.DATA_MORE, FrameKind.DATA_END, FrameKind.DATA_BATCH)
        if s.posted - s.ungranted <= 0 or not 0 <= byte_len <= s.local.slot_size:
            return None
        if (not data and byte_len) or s.send_credits + credits > s.peer.recv_depth:
            return None
        if (data or kind is FrameKind.EOF) and s.peer_eof:
            return None
        if kind in (FrameKind.DATA_BATCH, FrameKind.EOF) and self.in_message:
            return None
        if kind is FrameKind.DATA_BATCH and (not s.batching or byte_len < 4):
            return None
        if kind in (FrameKind.DATA_MORE, FrameKind.DATA_END):
            if self.message_bytes + byte_len > s.local.max_message_size:
                return None
            self.in_message = kind is FrameKind.DATA_MORE
            self.message_bytes = self.message_bytes + byte_len if self.in_message else 0
        return kind


# Mostly plausible frames, so that the accepting paths get exercised as much as the rejecting ones.
GOOD_FRAMES = st.tuples(
    st.just("frame"),
    st.builds(lambda k, c: k << 28 | c, st.integers(1, 5), st.sampled_from([0, 0, 0, 1, 2])),
    st.sampled_from([0, 0, 0, 1, 3, 4, 5, 63, 64, 65]),
)
OPS = st.one_of(
    st.tuples(st.just("frame"), IMMS, LENS),
    GOOD_FRAMES,
    GOOD_FRAMES,
    st.tuples(st.just("repost"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("send"), st.booleans(), st.just(0)),
    st.tuples(st.just("batch"), st.integers(1, 3), st.integers(0, 60)),
)


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(OPS, max_size=30), batching=st.booleans())
def test_on_frame_fuzz(ops: list[tuple[str, object, object]], batching: bool) -> None:
    features = FEATURE_BATCH if batching else 0
    s = make_session(
        local_depth=6,
        peer_depth=6,
        local_slot=64,
        local_max=200,
        local_features=features,
        peer_features=features,
    )
    model = RecvModel()
    for op, a, b in ops:
        if op == "frame":
            assert isinstance(a, int) and isinstance(b, int)
            before = s.statistics()
            expected = model.expect(s, a, b)  # (an aborted session still validates; the I/O layer stops)
            try:
                kind = s.on_frame(a, b)
            except ProtocolError:
                assert expected is None, f"rejected a valid {expected!r} frame"
                assert s.state is State.ABORTED
                assert s.statistics() == before
            else:
                assert kind is expected
                assert isinstance(kind, FrameKind)
                if kind is FrameKind.DATA_BATCH:
                    assert s.on_batch(batch_payload([bytes(b - 4)])) == [bytes(b - 4)]
        elif op == "repost":
            assert isinstance(a, int)
            s.on_recv_reposted(min(a, s.local.recv_depth - s.posted))
        elif op == "send":
            if s.can_send_data():
                s.take_data_frame(last=bool(a))
        elif s.batching and s.can_send_data():
            assert isinstance(a, int) and isinstance(b, int)
            with contextlib.suppress(RuntimeError):  # refused in the middle of a message
                s.take_batch_frame(min(4 * a + b, s.max_fragment), a)
        assert 0 <= s.ungranted <= s.posted <= s.local.recv_depth
        assert 0 <= s.send_credits <= s.peer.recv_depth


# -- simulation ---------------------------------------------------------------------------------------------

POLICIES = ("eager", "lazy", "batched", "limit")


class _Announced(Placeholder):
    """A rendezvous message in the simulation: the placeholder and the data its pull will bring."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        super().__init__(len(data))
        self.data = data


@dataclass
class Side:
    """One end of the simulated connection: a Session plus a toy application and I/O layer."""

    session: Session
    # When received slots are reposted: on receipt ("eager"), when the app consumed them ("lazy"), in
    # batches ("batched"), or as Endpoint does it ("limit"): on receipt unless the unread data exceeds
    # ``limit`` bytes while a complete message is waiting to be read; then data slots are held until the app
    # reads. Frames without payload (CREDIT, EOF) are always reposted at once, whatever the policy.
    policy: str
    outbox: list[bytes]
    batch_max: int = 0  # most messages per DATA_BATCH frame (0: never), used only if batching was negotiated
    # The application: "random" reads whenever the schedule says so; "write_first" reads nothing until it
    # has handed every message of its outbox to the session (the two-way back-pressure case).
    app: str = "random"
    rxbuf: ReceiveBuffer = field(default_factory=lambda: ReceiveBuffer(1))  # "limit" policy
    # Rendezvous: a message of at least rndv_min bytes (0: never) goes as an RNDV frame (a descriptor) if
    # both sides announced FEATURE_RNDV; the receiver's placeholder is pulled ("pull", in any order, as the
    # engine's READs complete) or by the application's read. (The DONE answer is a one-sided control
    # message: it needs no slot of the receiver's, so it does not take part in the receiver's holding.)
    rndv_min: int = 0
    rndv_sent: int = 0
    rndv_bytes: int = 0
    peer_outbox: list[bytes] = field(default_factory=list)
    unpulled: list[_Announced] = field(default_factory=list)
    slots_seen: int = 0
    msg_index: int = 0
    offset: int = 0
    eof_written: bool = False
    wire_out: deque[tuple[int, bytes]] = field(default_factory=deque)
    rx: deque[tuple[FrameKind, list[bytes], bool]] = field(default_factory=deque)  # kind, payloads, held
    pending_reposts: int = 0
    assembling: bytearray = field(default_factory=bytearray)
    inbox: list[bytes] = field(default_factory=list)
    got_eof: bool = False

    def data_left(self) -> bool:
        return self.msg_index < len(self.outbox)

    def batchable(self) -> list[bytes]:
        """The next whole messages that fit in one DATA_BATCH frame (at most batch_max of them)."""
        if not (self.batch_max and self.session.batching) or self.offset:
            return []
        batch: list[bytes] = []
        room = self.session.max_fragment
        for msg in self.outbox[self.msg_index : self.msg_index + self.batch_max]:
            room -= batch_record_size(len(msg))
            if room < 0:
                break
            batch.append(msg)
        return batch

    def send_data(self) -> None:
        msg = self.outbox[self.msg_index]
        if self.rndv_min and not self.offset and len(msg) >= self.rndv_min and self.session.rendezvous:
            value = self.session.take_rndv_frame(DESCRIPTOR_SIZE)
            self.wire_out.append((value, Descriptor(self.msg_index + 1, 1, len(msg), 0).encode()))
            self.msg_index += 1
            self.rndv_sent += 1
            self.rndv_bytes += len(msg)
            return
        batch = self.batchable()
        if batch:
            slot = bytearray(self.session.max_fragment + 8)  # the slot plus the start of the next one
            n = pack_batch_into(memoryview(slot)[: self.session.max_fragment], 0, batch)
            self.wire_out.append((self.session.take_batch_frame(n, len(batch)), bytes(slot[:n])))
            assert not any(slot[n:])
            self.msg_index += len(batch)
            return
        msg = self.outbox[self.msg_index]
        chunk = msg[self.offset : self.offset + self.session.max_fragment]
        self.offset += len(chunk)
        last = self.offset >= len(msg)
        value = self.session.take_data_frame(last, nbytes=len(chunk))
        self.wire_out.append((value, chunk))
        if last:
            self.msg_index += 1
            self.offset = 0

    def repost(self, n: int) -> None:
        self.session.on_recv_reposted(n)

    def deliver(self, value: int, payload: bytes) -> None:
        # The no-RNR property: every frame finds a posted receive (on iWARP, which has no RNR retry, a SEND
        # without one ends the connection).
        assert self.session.posted > 0, "RNR: frame arrived with no receive posted"
        if self.session.framing.header:
            # The header framing: the frame travels as a plain SEND, its word in a 4-byte header before the
            # payload; the whole must fit the receive slot, and the receive side unframes it.
            wire = encode_frame_header(value) + payload
            slot_size = self.session.local.slot_size
            assert len(wire) <= slot_size, "a header-framed frame overflows the receive slot"
            slot = bytearray(slot_size)
            slot[: len(wire)] = wire
            flags, value, n = unframe_receive(0, len(wire), slot)
            assert flags == WC_WITH_IMM and bytes(slot[:n]) == payload
        kind = self.session.on_frame(value, len(payload))
        if kind is FrameKind.EOF:
            assert not self.got_eof
            self.got_eof = True
        data = kind in (FrameKind.DATA_MORE, FrameKind.DATA_END, FrameKind.DATA_BATCH, FrameKind.RNDV)
        if kind is FrameKind.RNDV:
            desc = Descriptor.decode(payload, 1 << 20)
            payload = self.peer_outbox[desc.msg_id - 1]
            assert desc.length == len(payload)
        if self.policy == "limit":
            self._deliver_limited(kind, payload, data)
            return
        if self.policy == "batched":
            self.pending_reposts += 1
            held = False
        elif self.policy == "eager" or not data:
            self.repost(1)  # payload copied out (eager), or nothing to keep (control frame)
            held = False
        else:
            held = True  # zero-copy: the slot is reposted when the app has read it
        if kind is FrameKind.DATA_BATCH:
            self.rx.append((kind, self.session.on_batch(memoryview(payload)), held))
        elif kind is FrameKind.RNDV:
            self.rx.append((FrameKind.DATA_END, [payload], held))  # a whole message, pulled when read
        elif data:
            self.rx.append((kind, [payload], held))

    def _deliver_limited(self, kind: FrameKind, payload: bytes, data: bool) -> None:
        # The receive buffer and hold rule of Endpoint itself (rdmaio.protocol.rxbuffer.ReceiveBuffer).
        if not data:
            self.repost(1)  # CREDIT/EOF: never held
            return
        rxbuf = self.rxbuf
        if kind is FrameKind.DATA_BATCH:
            rxbuf.add_messages(self.session.on_batch(memoryview(payload)))
        elif kind is FrameKind.RNDV:
            announced = _Announced(payload)
            rxbuf.add_pending(announced)
            self.unpulled.append(announced)
        elif kind is FrameKind.DATA_END:
            rxbuf.add_message(payload)
        else:
            rxbuf.add_fragment(payload)
        self.slots_seen += 1
        if rxbuf.admit(self.slots_seen):
            self.repost(1)

    def can_consume(self) -> bool:
        if self.app == "write_first" and self.data_left():
            return False
        return self.rxbuf.has_message() if self.policy == "limit" else bool(self.rx)

    def pull(self, index: int) -> None:
        announced = self.unpulled.pop(index)
        self.rxbuf.resolve(announced, announced.data)

    def consume(self) -> None:
        if self.policy == "limit":
            head = self.rxbuf.head()
            if isinstance(head, _Announced):  # the read pulls it
                self.pull(self.unpulled.index(head))
            self.inbox.append(self.rxbuf.pop_message())
            released = self.rxbuf.releasable()
            if released:
                self.repost(len(released))
            return
        kind, payloads, held = self.rx.popleft()
        if held:
            self.repost(1)
        if kind is FrameKind.DATA_BATCH:
            assert not self.assembling  # never between the fragments of a message
            self.inbox += payloads
            return
        self.assembling += payloads[0]
        if kind is FrameKind.DATA_END:
            self.inbox.append(bytes(self.assembling))
            self.assembling.clear()


ENGINES = ("python", "c")  # the Python Session, or the C rules on a C state (NativeSession)
ACTION_NAMES = ("data", "credit", "write_eof", "eof", "deliver", "consume", "repost", "grow")
RNDV_ACTIONS = ("pull",)  # only enabled when rendezvous is simulated (the other schedules stay as they were)


def _actions(me: Side) -> list[str]:
    s = me.session
    acts: list[str] = []
    if me.data_left() and s.can_send_data():
        acts.append("data")
    if s.credit_frame_due():
        acts.append("credit")
    if not me.eof_written:
        acts.append("write_eof")
    if not me.data_left() and s.can_send_eof():
        acts.append("eof")
    if me.wire_out:
        acts.append("deliver")
    if me.can_consume():
        acts.append("consume")
    if me.pending_reposts:
        acts.append("repost")
    if s.can_grow:
        acts.append("grow")
    if me.unpulled:
        acts.append("pull")
    return acts


def _step(rnd: random.Random, sides: tuple[Side, Side], weights: dict[str, float]) -> bool:
    """Run one random enabled action; False if nothing is enabled (quiescence)."""
    choices = [(i, name) for i in range(2) for name in _actions(sides[i])]
    if not choices:
        return False
    i, name = rnd.choices(choices, [weights[name] for _, name in choices])[0]
    me, peer = sides[i], sides[1 - i]
    if name == "data":
        me.send_data()
    elif name == "credit":
        me.wire_out.append((me.session.take_credit_frame(), b""))
    elif name == "write_eof":
        me.eof_written = True
        me.session.write_eof()
        assert isinstance(me.session.send_error(), EndpointClosedError)
    elif name == "eof":
        me.wire_out.append((me.session.take_eof_frame(), b""))
    elif name == "deliver":
        value, payload = me.wire_out.popleft()
        peer.deliver(value, payload)
    elif name == "consume":
        me.consume()
    elif name == "pull":
        me.pull(rnd.randrange(len(me.unpulled)))
    elif name == "grow":
        # The endpoint grows its receive ring at any moment (under load, as it sees fit): any amount up
        # to the announced recv_depth, at any point of the schedule, must keep the credit rules.
        me.session.grow_receives(rnd.randint(1, me.session.can_grow))
    else:
        me.repost(me.pending_reposts)
        me.pending_reposts = 0
    return True


def _credit_frames(sides: tuple[Side, Side]) -> int:
    return sum(side.session.statistics()["credit_frames_sent"] for side in sides)


def run_simulation(
    rnd: random.Random,
    depths: tuple[int, int],
    slots: tuple[int, int],
    thresholds: tuple[int | None, int | None],
    policies: tuple[str, str],
    sizes: tuple[list[int], list[int]],
    weights: dict[str, float] | None = None,
    max_steps: int = 200_000,
    batch_max: tuple[int, int] = (0, 0),
    limits: tuple[int, int] = (0, 0),
    apps: tuple[str, str] = ("random", "random"),
    initial: tuple[int, int] = (0, 0),
    rndv_min: tuple[int, int] = (0, 0),
    engine: str = "python",
    header: tuple[bool, bool] = (False, False),
) -> tuple[Side, Side]:
    """Run both sides to quiescence under a random schedule and check delivery, liveness and quiet.

    A side with ``batch_max > 0`` announces FEATURE_BATCH and, if the other side does too, sends runs of up
    to that many small whole messages as DATA_BATCH frames. A side with ``initial > 0`` announces
    FEATURE_GROW: it posts ``initial`` receives at first and grows to ``depths[i]`` at random moments.
    ``engine="c"`` runs both sessions on a C state with the C rules wherever they exist (NativeSession).
    A side with ``header`` true asks for the header framing (both then use it: every frame travels as a
    plain SEND with a 4-byte header, which must fit the peer's slot with the frame).
    """
    session_class = NativeSession if engine == "c" else Session
    weights = {name: 1.0 for name in (*ACTION_NAMES, *RNDV_ACTIONS)} | (weights or {})
    max_message = max([1, *sizes[0], *sizes[1]])
    hs = [
        Handshake(
            depths[i],
            slots[i],
            max_message,
            features=(FEATURE_BATCH if batch_max[i] else 0)
            | (FEATURE_GROW if initial[i] else 0)
            | (FEATURE_RNDV if any(rndv_min) else 0),
            initial_depth=initial[i],
            caps=Capabilities(header_framing=header[i]) if any(header) else None,
        )
        for i in range(2)
    ]
    sides = tuple(
        Side(
            session=session_class(hs[i], hs[1 - i], credit_threshold=thresholds[i]),
            policy=policies[i],
            outbox=[rnd.randbytes(n) for n in sizes[i]],
            batch_max=batch_max[i],
            rxbuf=ReceiveBuffer(max(limits[i], 1)),
            app=apps[i],
            rndv_min=rndv_min[i],
        )
        for i in range(2)
    )
    sides[0].peer_outbox = sides[1].outbox
    sides[1].peer_outbox = sides[0].outbox
    assert len(sides) == 2
    pair = (sides[0], sides[1])
    credits_when_done: int | None = None
    for _ in range(max_steps):
        if not _step(rnd, pair, weights):
            break
        if credits_when_done is None and all(
            side.inbox == other.outbox and not side.rx
            for side, other in ((pair[0], pair[1]), (pair[1], pair[0]))
        ):
            credits_when_done = _credit_frames(pair)
    else:
        raise AssertionError(f"no quiescence after {max_steps} steps: endless exchange? {pair[0].session}")

    # Quiescent: nothing can happen. That must mean everything was delivered (no deadlock).
    for side, other in ((pair[0], pair[1]), (pair[1], pair[0])):
        assert side.inbox == other.outbox
        assert side.got_eof and side.session.peer_eof and side.session.eof_sent
        assert side.session.recv_outcome() is EOF
        assert not side.rx and not side.wire_out and not side.assembling and not side.pending_reposts
        assert not side.rxbuf.held and not side.rxbuf.buffered and not side.rxbuf.pending
        assert not side.unpulled and not side.rxbuf.committed
        assert side.session.posted == side.session.recv_depth
        # Quiet and ready: nothing is due and the peer can start sending data at once.
        assert not side.session.credit_frame_due()
        # Credits owed for the peer's CREDIT frames may stay owed (granted on the next frame): the rest is
        # below the threshold, and all of it below what would leave the peer stuck.
        session = side.session
        assert session.ungranted - session.ungranted_for_credit_frames < session.credit_threshold
        assert session.ungranted < session.recv_depth - 1
        assert side.session.send_credits >= 2
        stats = side.session.statistics()
        # (an RNDV frame's message is counted by the rendezvous layer, not the session)
        assert stats["messages_sent"] == len(side.outbox) - side.rndv_sent
        assert stats["bytes_sent"] == sum(map(len, side.outbox)) - side.rndv_bytes
        other_stats = other.session.statistics()
        assert stats["frames_sent"] == other_stats["frames_received"]
        for key in ("data_frames", "batch_frames", "batched_messages", "messages", "bytes", "credit_frames"):
            assert stats[f"{key}_sent"] == other_stats[f"{key}_received"], key
        assert stats["credits_granted"] == other_stats["credits_received"]
        if not side.session.batching:
            assert stats["batch_frames_sent"] == stats["batch_frames_received"] == 0
    # No ping-pong: once all data is delivered, only a bounded number of CREDIT frames follows (growth
    # after that point adds owed credits, at most recv_depth - initial_depth per side).
    assert credits_when_done is not None
    assert _credit_frames(pair) - credits_when_done <= 2 * (depths[0] + depths[1])
    return pair


SIZES = st.lists(
    st.one_of(st.sampled_from([0, 1, 60, 61, 63, 64, 65, 128, 129]), st.integers(0, 400), st.integers(0, 30)),
    max_size=6,
)
WEIGHTS = st.fixed_dictionaries({name: st.sampled_from([0.05, 1.0, 20.0]) for name in ACTION_NAMES})


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rnd=st.randoms(use_true_random=False),
    depths=st.tuples(st.integers(4, 9), st.integers(4, 9)),
    slots=st.tuples(st.sampled_from([64, 65, 100]), st.sampled_from([64, 65, 100])),
    policies=st.tuples(st.sampled_from(POLICIES), st.sampled_from(POLICIES)),
    sizes=st.tuples(SIZES, SIZES),
    weights=WEIGHTS,
    batch_max=st.tuples(st.sampled_from([0, 1, 3, 16]), st.sampled_from([0, 1, 3, 16])),
    data=st.data(),
)
def test_simulation(
    rnd: random.Random,
    depths: tuple[int, int],
    slots: tuple[int, int],
    policies: tuple[str, str],
    sizes: tuple[list[int], list[int]],
    weights: dict[str, float],
    batch_max: tuple[int, int],
    data: st.DataObject,
    engine: str,
) -> None:
    thresholds = (
        data.draw(st.one_of(st.none(), st.integers(2, depths[0] - 1)), label="threshold_a"),
        data.draw(st.one_of(st.none(), st.integers(2, depths[1] - 1)), label="threshold_b"),
    )
    run_simulation(
        rnd, depths, slots, thresholds, policies, sizes, weights, batch_max=batch_max, engine=engine
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(6))
def test_simulation_larger(seed: int, engine: str) -> None:
    rnd = random.Random(seed)
    sizes = ([rnd.randrange(3000) for _ in range(40)], [rnd.randrange(3000) for _ in range(25)])
    policies = (POLICIES[seed % 3], POLICIES[(seed + 1 + seed // 3) % 3])
    weights = {name: rnd.choice([0.05, 1.0, 20.0]) for name in ACTION_NAMES}
    batch_max = ((0, 0), (8, 8), (8, 0))[seed % 3]
    a, b = run_simulation(
        rnd, (32, 16), (256, 128), (None, 2), policies, sizes, weights, batch_max=batch_max, engine=engine
    )
    assert a.session.statistics()["messages_received"] == 25
    assert b.session.statistics()["messages_received"] == 40


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(6))
def test_simulation_batching(seed: int, engine: str) -> None:
    # Mostly small messages with a few fragmented ones between them: batches and fragments interleave.
    rnd = random.Random(seed)
    sizes = tuple([rnd.choice([0, 1, 7, 20, 50, 124, 125, 300]) for _ in range(60)] for _ in range(2))
    policies = (POLICIES[seed % 3], POLICIES[(seed + 1) % 3])
    weights = {name: rnd.choice([0.05, 1.0, 20.0]) for name in ACTION_NAMES}
    a, b = run_simulation(
        rnd,
        (8, 6),
        (128, 256),
        (None, None),
        policies,
        (sizes[0], sizes[1]),
        weights,
        batch_max=(5, 12),
        engine=engine,
    )
    for side in (a, b):
        stats = side.session.statistics()
        assert side.session.batching
        assert stats["batch_frames_sent"] > 0 and stats["data_frames_sent"] > 0
        assert stats["batched_messages_sent"] > stats["batch_frames_sent"]
        assert stats["messages_sent"] == 60
        assert stats["frames_sent"] < 60


@pytest.mark.parametrize("engine", ENGINES)
def test_simulation_idle_credit_exchange_stops(engine: str) -> None:
    # Credit frames are taken late, so both sides end up owing nearly everything at once.
    for seed in range(20):
        rnd = random.Random(seed)
        a, b = run_simulation(
            rnd,
            (4, 4),
            (64, 64),
            (2, 2),
            ("eager", "eager"),
            ([64] * 3, [64] * 3),
            {"credit": 0.05},
            engine=engine,
        )
        assert a.session.statistics()["credit_frames_sent"] <= 8
        assert b.session.statistics()["credit_frames_sent"] <= 8


def _pair(depth: int = 4) -> tuple[Session, Session]:
    hs = Handshake(depth, 64, 1024)
    return Session(hs, hs, credit_threshold=2), Session(hs, hs, credit_threshold=2)


def test_eof_may_not_strand_both_sides_without_credits() -> None:
    # The schedule that would deadlock if EOF could take the last credit without granting one.
    a, b = _pair()
    for _ in range(3):  # A fills B; B's app holds the slots
        b.on_frame(a.take_data_frame(last=True), 1)
    for _ in range(3):  # B fills A; A's app consumes at once
        a.on_frame(b.take_data_frame(last=True), 1)
        a.on_recv_reposted(1)
    assert a.send_credits == 1 and a.credit_frame_due()
    b.on_frame(a.take_credit_frame(), 0)  # A spends its last credit granting 3; B reposts later
    assert a.send_credits == 0 and b.send_credits == 4
    frames = [b.take_data_frame(last=True) for _ in range(3)]
    b.write_eof()
    # B holds 1 credit and owes nothing yet: an EOF now would leave both sides at 0 credits while A still
    # has data to send and B could only grant after A sends again.
    assert b.send_credits == 1 and b.ungranted == 0
    assert not b.can_send_eof()
    for value in frames:
        a.on_frame(value, 1)
        a.on_recv_reposted(1)
    b.on_recv_reposted(4)  # B's app consumed everything
    assert b.can_send_eof()
    a.on_frame(b.take_eof_frame(), 0)
    assert a.send_credits == 4 and a.can_send_data()


def test_idle_quiescence_leaves_both_sides_ready_to_send() -> None:
    a, b = _pair(8)
    for _ in range(7):
        b.on_frame(a.take_data_frame(last=True), 0)
        b.on_recv_reposted(1)
    assert a.send_credits == 1 and b.ungranted == 7
    a.on_frame(b.take_credit_frame(), 0)
    a.on_recv_reposted(1)
    assert a.send_credits == 8 and a.ungranted == 1 and not a.credit_frame_due()
    assert not b.credit_frame_due()


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rnd=st.randoms(use_true_random=False),
    depths=st.tuples(st.integers(4, 9), st.integers(4, 9)),
    slots=st.tuples(st.sampled_from([64, 65, 100]), st.sampled_from([64, 65, 100])),
    policies=st.tuples(st.sampled_from(POLICIES), st.sampled_from(POLICIES)),
    limits=st.tuples(st.sampled_from([0, 1, 64, 150, 1000]), st.sampled_from([0, 1, 64, 150, 1000])),
    sizes=st.tuples(SIZES, SIZES),
    weights=WEIGHTS,
    batch_max=st.tuples(st.sampled_from([0, 3]), st.sampled_from([0, 3])),
    writer=st.sampled_from([0, 1]),
    header=st.sampled_from([(False, False), (True, True), (True, False), (False, True)]),
    data=st.data(),
)
def test_simulation_two_way_backpressure(
    rnd: random.Random,
    depths: tuple[int, int],
    slots: tuple[int, int],
    policies: tuple[str, str],
    limits: tuple[int, int],
    sizes: tuple[list[int], list[int]],
    weights: dict[str, float],
    batch_max: tuple[int, int],
    writer: int,
    header: tuple[bool, bool],
    data: st.DataObject,
    engine: str,
) -> None:
    """One side reads nothing until it has sent everything (holding slots as its buffer fills), while the
    other side sends too and reads: both directions must complete, as over TCP (the device-level program is
    test_two_way_backpressure_completes in tests/integration/test_correctness.py)."""
    thresholds = (
        data.draw(st.one_of(st.none(), st.integers(2, depths[0] - 1)), label="threshold_a"),
        data.draw(st.one_of(st.none(), st.integers(2, depths[1] - 1)), label="threshold_b"),
    )
    apps = ("write_first", "random") if writer == 0 else ("random", "write_first")
    run_simulation(
        rnd,
        depths,
        slots,
        thresholds,
        policies,
        sizes,
        weights,
        batch_max=batch_max,
        limits=limits,
        apps=apps,
        engine=engine,
        header=header,
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("header", [(False, False), (True, False)], ids=["immediate", "header"])
def test_simulation_two_way_backpressure_large(seed: int, engine: str, header: tuple[bool, bool]) -> None:
    """Two-way backpressure at small scale: the reader has much to send, the writer-first side holds slots."""
    rnd = random.Random(seed)
    sizes = ([rnd.randrange(1, 300) for _ in range(30)], [rnd.randrange(1, 300) for _ in range(200)])
    weights = {name: rnd.choice([0.05, 1.0, 20.0]) for name in ACTION_NAMES}
    run_simulation(
        rnd,
        (4, 4),
        (128, 128),
        (None, None),
        ("limit", "limit"),
        sizes,
        weights,
        limits=(200, 200),
        apps=("random", "write_first"),
        batch_max=((0, 0), (4, 4))[seed % 2],
        engine=engine,
        header=header,
    )


# -- growing receive windows (FEATURE_GROW) ------------------------------------------------------------------


def test_handshake_grow_roundtrip_carries_the_initial_depth() -> None:
    hs = Handshake(32, 65536, 1 << 20, features=FEATURE_BATCH | FEATURE_GROW, initial_depth=4)
    data = hs.encode()
    assert len(data) == HEADER.size + BODY.size + 4
    decoded = Handshake.decode(data)
    assert decoded == hs and decoded.initial_depth == 4 and decoded.recv_depth == 32


def test_handshake_initial_depth_defaults_to_recv_depth() -> None:
    assert Handshake(16, 64, 1024).initial_depth == 16
    assert Handshake(16, 64, 1024, features=FEATURE_GROW).initial_depth == 16
    # Without FEATURE_GROW an initial depth means nothing: the side posts recv_depth receives.
    assert Handshake(16, 64, 1024, initial_depth=4).initial_depth == 16


@pytest.mark.parametrize("initial", [1, 3, 17, 2**32 - 1])
def test_handshake_rejects_an_initial_depth_out_of_range(initial: int) -> None:
    with pytest.raises(HandshakeError, match="initial_depth"):
        Handshake(16, 64, 1024, features=FEATURE_GROW, initial_depth=initial)
    raw = raw_handshake(16, 64, 1024, flags=FEATURE_GROW, body_len=BODY.size + 4) + struct.pack("!I", initial)
    with pytest.raises(HandshakeError, match="invalid handshake from the peer: initial_depth"):
        Handshake.decode(raw)


def grow_pair(initial: int = 4, depth: int = 16) -> tuple[Session, Session]:
    hs = Handshake(depth, 64, 1024, features=FEATURE_GROW, initial_depth=initial)
    return Session(hs, hs), Session(hs, hs)


def test_session_starts_with_the_initial_window_and_grows_to_recv_depth() -> None:
    a, b = grow_pair()
    assert a.send_credits == 4 and a.posted == 4 and a.recv_depth == 4 and a.can_grow == 12
    assert a.credit_threshold == 2
    for _ in range(3):
        b.on_frame(a.take_data_frame(last=True), 1)
    assert not a.can_send_data()  # the reserve: one credit left
    b.on_recv_reposted(3)
    b.grow_receives(4)
    assert b.recv_depth == 8 and b.posted == 8 and b.ungranted == 7 and b.credit_threshold == 4
    a.on_frame(b.take_credit_frame(), 0)
    assert a.send_credits == 8  # 1 left + 3 reposted + 4 new
    a.on_recv_reposted(1)
    b.grow_receives(8)
    with pytest.raises(ValueError, match="cannot grow"):
        b.grow_receives(1)
    assert b.can_grow == 0
    stats = b.statistics()
    assert stats["recv_depth"] == 16
    assert stats["credits_granted"] == a.statistics()["credits_received"] == 7  # 8 grown, not granted yet


def test_a_grant_beyond_the_announced_recv_depth_is_a_protocol_error() -> None:
    a, b = grow_pair()
    b.grow_receives(12)
    a.on_frame(b.take_credit_frame(), 0)
    assert a.send_credits == 16
    bogus = encode_imm(FrameKind.CREDIT, 1)
    with pytest.raises(FrameError, match="more than its recv_depth"):
        a.on_frame(bogus, 0)


def test_no_growth_without_the_feature() -> None:
    s = make_session(8, 8)
    assert s.can_grow == 0
    with pytest.raises(ValueError, match="cannot grow"):
        s.grow_receives(1)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rnd=st.randoms(use_true_random=False),
    initial=st.tuples(st.sampled_from([0, 4, 5]), st.sampled_from([0, 4, 6])),
    extra=st.tuples(st.integers(0, 8), st.integers(0, 8)),
    policies=st.tuples(st.sampled_from(POLICIES), st.sampled_from(POLICIES)),
    limits=st.tuples(st.sampled_from([0, 1, 64, 1000]), st.sampled_from([0, 1, 64, 1000])),
    sizes=st.tuples(SIZES, SIZES),
    weights=WEIGHTS,
    writer=st.sampled_from([0, 1, 2]),
)
def test_simulation_growing_windows(
    rnd: random.Random,
    initial: tuple[int, int],
    extra: tuple[int, int],
    policies: tuple[str, str],
    limits: tuple[int, int],
    sizes: tuple[list[int], list[int]],
    weights: dict[str, float],
    writer: int,
    engine: str,
) -> None:
    """Windows that grow at random moments keep no-RNR, no-deadlock and no-ping-pong, with the hold rule
    and a side that reads nothing until it has written everything."""
    depths = (max(initial[0], 4) + extra[0], max(initial[1], 4) + extra[1])
    apps = (("write_first", "random"), ("random", "write_first"), ("random", "random"))[writer]
    run_simulation(
        rnd,
        depths,
        (64, 100),
        (None, None),
        policies,
        sizes,
        weights,
        limits=limits,
        apps=apps,
        initial=initial,
        engine=engine,
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(6))
def test_simulation_growing_windows_large(seed: int, engine: str) -> None:
    rnd = random.Random(seed)
    sizes = ([rnd.randrange(1, 600) for _ in range(60)], [rnd.randrange(1, 600) for _ in range(120)])
    weights = {name: rnd.choice([0.05, 1.0, 20.0]) for name in ACTION_NAMES}
    a, b = run_simulation(
        rnd,
        (32, 16),
        (128, 128),
        (None, None),
        ("limit", "eager"),
        sizes,
        weights,
        initial=(4, 4),
        engine=engine,
    )
    assert a.session.statistics()["messages_received"] == 120
    assert b.session.statistics()["messages_received"] == 60


# -- rendezvous announcements under the receive limit --------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rnd=st.randoms(use_true_random=False),
    depths=st.tuples(st.integers(4, 9), st.integers(4, 9)),
    policies=st.tuples(st.sampled_from(POLICIES), st.sampled_from(POLICIES)),
    limits=st.tuples(st.integers(1, 400), st.integers(1, 400)),
    sizes=st.tuples(SIZES, SIZES),
    weights=WEIGHTS,
    rndv_min=st.tuples(st.sampled_from([1, 30, 100]), st.sampled_from([0, 1, 30, 100])),
    writer=st.sampled_from([None, 0, 1]),
)
def test_simulation_rendezvous(
    rnd: random.Random,
    depths: tuple[int, int],
    policies: tuple[str, str],
    limits: tuple[int, int],
    sizes: tuple[list[int], list[int]],
    weights: dict[str, float],
    rndv_min: tuple[int, int],
    writer: int | None,
    engine: str,
) -> None:
    """Messages announced by RNDV frames mixed with data: the announced bytes count against the receiver's
    limit and hold the frames' slots past it ("limit" policy), pulls complete in any order; every message
    still arrives, in order, and the connection ends quiet, also when one side reads nothing until it has
    sent everything."""
    apps = (
        ("random", "random")
        if writer is None
        else tuple("write_first" if i == writer else "random" for i in range(2))
    )
    run_simulation(
        rnd,
        depths,
        (64, 100),
        (None, None),
        policies,
        sizes,
        weights,
        limits=limits,
        apps=(apps[0], apps[1]),
        rndv_min=rndv_min,
        engine=engine,
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(8))
def test_simulation_rendezvous_flood_large(seed: int, engine: str) -> None:
    """Many announcements (a third of all messages) both ways, small limits, one side writing first."""
    rnd = random.Random(seed)
    sizes = ([rnd.randrange(1, 300) for _ in range(60)], [rnd.randrange(1, 300) for _ in range(200)])
    weights = {name: rnd.choice([0.05, 1.0, 20.0]) for name in (*ACTION_NAMES, *RNDV_ACTIONS)}
    run_simulation(
        rnd,
        (4, 8),
        (128, 64),
        (None, None),
        ("limit", "limit"),
        sizes,
        weights,
        limits=(150, 40),
        apps=("random", "write_first") if seed % 2 else ("write_first", "random"),
        rndv_min=(200, 100),
        engine=engine,
    )
