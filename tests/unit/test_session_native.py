"""The Session's hot rules in C (rdmaio/_ffi/session.c) against the Python Session, their reference model.

Two Sessions from the same handshakes get the same random operations: one works on a
:class:`~rdmaio.protocol.sessionstate.SessionState` with the Python rules, the other on a C
``struct rdmaio_session`` with the C rules wherever they exist (a C function that defers hands the operation
to the Python method, as the core does). Every step must give the same return value or the same exception,
and leave every state field, the close state and the statistics equal. Received completions also go through
``rdmaio_rx_run`` (the receive batch in C) against frame-by-frame ``on_frame``.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmaio import verbs
from rdmaio.core.shared_receive import new_session, new_session_state
from rdmaio.protocol import (
    FEATURE_BATCH,
    FEATURE_GROW,
    FEATURE_RECLAIM,
    FEATURE_RNDV,
    FrameKind,
    Handshake,
    Session,
)
from rdmaio.protocol.frames import pack_batch_into
from rdmaio.protocol.framing import CONTROL_WORD, unframe_receive
from rdmaio.protocol.handshake import Capabilities
from rdmaio.protocol.reclaim import ReclaimSession
from rdmaio.protocol.sessionstate import STATE_FIELDS, SessionState
from rdmaio.protocol.shared_session import SharedSession
from rdmaio.verbs.native import ffi, lib

_RECV = int(verbs.WcOpcode.RECV)
_RECV_RDMA_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)
_SEND = int(verbs.WcOpcode.SEND)
_WITH_IMM = verbs.WC_WITH_IMM
_WC_FIELDS = ("wr_id", "status", "opcode", "byte_len", "imm_data", "flags")


class NativeSession(Session):
    """A Session on a C state whose hot rules run in C: each method calls the C function and, when it
    defers, the Python method (what the core's callers of the C functions do)."""

    __slots__ = ()

    def __init__(self, local: Handshake, peer: Handshake, *, credit_threshold: int | None = None) -> None:
        super().__init__(local, peer, credit_threshold=credit_threshold, state=new_session_state())

    def on_frame(self, imm: int, byte_len: int) -> FrameKind:
        if 0 <= imm <= 0xFFFF_FFFF and 0 <= byte_len <= 0xFFFF_FFFF:
            kind = lib.rdmaio_session_on_frame(self._s, imm, byte_len)
            if kind:
                return FrameKind(kind)
        return super().on_frame(imm, byte_len)

    def take_data_frame(self, last: bool, nbytes: int = 0) -> int:
        imm: int = lib.rdmaio_session_take_data(self._s, last, nbytes)
        return imm if imm >= 0 else super().take_data_frame(last, nbytes)

    def take_batch_frame(self, nbytes: int, messages: int) -> int:
        imm: int = lib.rdmaio_session_take_batch(self._s, nbytes, messages)
        return imm if imm >= 0 else super().take_batch_frame(nbytes, messages)

    def take_credit_frame(self) -> int:
        imm: int = lib.rdmaio_session_take_credit(self._s)
        return imm if imm >= 0 else super().take_credit_frame()

    def credit_frame_due(self) -> bool:
        due = lib.rdmaio_session_credit_frame_due(self._s)
        return bool(due) if due >= 0 else super().credit_frame_due()

    def can_send_data(self) -> bool:
        can = lib.rdmaio_session_can_send_data(self._s)
        return bool(can) if can >= 0 else super().can_send_data()

    def eof_pending(self) -> bool:
        pending = lib.rdmaio_session_eof_pending(self._s)
        return bool(pending) if pending >= 0 else super().eof_pending()

    def control_frame_due(self) -> bool:
        due = lib.rdmaio_session_control_frame_due(self._s)
        return bool(due) if due >= 0 else super().control_frame_due()

    def on_recv_reposted(self, n: int) -> None:
        if lib.rdmaio_session_reposted(self._s, n):
            super().on_recv_reposted(n)

    def grow_receives(self, n: int) -> None:
        if lib.rdmaio_session_grow(self._s, n):
            super().grow_receives(n)

    def take_slot(self) -> None:
        if lib.rdmaio_session_take_slot(self._s):
            super().take_slot()


def fields(session: Session) -> dict[str, int]:
    state = session.rules_state
    return {name: int(getattr(state, name)) for name in STATE_FIELDS}


def test_the_c_struct_has_exactly_the_fields_of_session_state() -> None:
    c_fields = [name for name, _ in ffi.typeof("struct rdmaio_session").fields]
    assert c_fields == list(SessionState.__slots__) == list(STATE_FIELDS)
    assert all(ftype.type is ffi.typeof("int64_t") for _, ftype in ffi.typeof("struct rdmaio_session").fields)


def test_the_core_makes_its_sessions_on_a_c_state_and_a_shared_session_is_not_fast() -> None:
    hs = Handshake(8, 64, 1 << 20, features=FEATURE_RECLAIM)
    plain = new_session(Handshake(8, 64, 1 << 20), Handshake(8, 64, 1 << 20), _Transport(None))
    reclaim = new_session(hs, hs, _Transport(None))
    assert type(plain) is Session and isinstance(plain.rules_state, ffi.CData) and plain.rules_state.fast == 1
    assert type(reclaim) is ReclaimSession and reclaim.rules_state.fast == 1
    shared = SharedSession(
        hs,
        hs,
        reposted=lambda n: (n, 0),
        returned=lambda n: None,
        settled=lambda: None,
        state=new_session_state(),
    )
    assert shared.rules_state.fast == 0
    # Not fast: every C rule defers, whatever the state allows.
    s = shared.rules_state
    peer = Session(hs, hs)
    assert lib.rdmaio_session_on_frame(s, peer.take_data_frame(True, 1), 1) == 0
    assert lib.rdmaio_session_take_data(s, 1, 1) == -1
    assert lib.rdmaio_session_can_send_data(s) == -1 and lib.rdmaio_session_credit_frame_due(s) == -1
    assert lib.rdmaio_session_eof_pending(s) == -1
    assert lib.rdmaio_session_reposted(s, 0) == -1 and lib.rdmaio_session_take_slot(s) == -1
    before = fields(shared)
    records = _records([(0, peer.take_data_frame(True, 1), 1)])
    out, consumed, stop = _rx_run(s, records, 0, 1)
    assert out == [] and consumed == 0 and stop == lib.RDMAIO_RX_DEFER and fields(shared) == before


class _Transport:
    def __init__(self, shared: Any) -> None:
        self.shared = shared


# -- the receive batch --------------------------------------------------------------------------------------


def _records(frames: list[tuple[int, int, int]], opcode: int = _RECV, flags: int = _WITH_IMM) -> Any:
    """struct rdmaio_wc records of received frames (slot, imm, byte_len)."""
    return ffi.new(
        "struct rdmaio_wc[]",
        [
            (verbs.make_wr_id(verbs.WR_KIND_RECV, 1, slot), 0, opcode, n, imm, flags)
            for slot, imm, n in frames
        ],
    )


def _rx_reference(
    state: Any, records: Any, start: int, count: int, max_out: int = 64
) -> tuple[list[tuple[int, int, int]], int, int]:
    """What ``rdmaio_rx_run`` must do, record by record in Python with C's one-frame rule
    (``rdmaio_session_on_frame``): the receiver's rules for a run of completions, without the packing."""
    frames: list[tuple[int, int, int]] = []
    if start < 0 or count <= 0:
        return frames, 0, lib.RDMAIO_RX_DONE
    i, stop = 0, lib.RDMAIO_RX_DONE
    while i < count:
        wc = records[start + i]
        if wc.status or not wc.opcode & 0x80:
            i += 1  # the connection's (failed, or a send/one-sided completion)
            continue
        if wc.opcode == _RECV_RDMA_IMM or not wc.flags & _WITH_IMM:
            stop = lib.RDMAIO_RX_DEFER  # one-sided: a write notice or a control message
            break
        if len(frames) >= max_out:
            stop = lib.RDMAIO_RX_MORE
            break
        slot = wc.wr_id & 0xFFFF_FFFF
        if slot > lib.RDMAIO_RX_SLOT_MAX:
            stop = lib.RDMAIO_RX_DEFER  # does not fit the packed word
            break
        kind = lib.rdmaio_session_on_frame(state, wc.imm_data, wc.byte_len)
        if not kind:
            stop = lib.RDMAIO_RX_DEFER
            break
        frames.append((kind, slot, wc.byte_len))
        i += 1
        if kind == FrameKind.DATA_BATCH:
            if i < count:
                stop = lib.RDMAIO_RX_MORE  # the payload must be unpacked before the next frame
            break
    return frames, i, stop


def _rx_run(
    state: Any, records: Any, start: int, count: int, max_out: int = 64
) -> tuple[list[tuple[int, int, int]], int, int]:
    """``rdmaio_rx_run`` (the receiver's call): its packed words decoded to (kind, slot, length) triples, the
    records it consumed and why it stopped."""
    out = ffi.new("uint32_t[]", 2 * max(max_out, 1))
    run = lib.rdmaio_rx_run(state, records, start, count, out, max_out)
    assert run >= 0
    assert run < 1 << 30  # one digit of a Python int: the receiver's bit operations stay cheap
    n = run & ((1 << lib.RDMAIO_RX_CONSUMED_SHIFT) - 1)
    consumed = run >> lib.RDMAIO_RX_CONSUMED_SHIFT & lib.RDMAIO_RX_RUN_MAX
    frames = [
        (out[2 * j] >> lib.RDMAIO_RX_KIND_SHIFT, out[2 * j] & lib.RDMAIO_RX_SLOT_MAX, out[2 * j + 1])
        for j in range(n)
    ]
    return frames, consumed, run >> lib.RDMAIO_RX_STOP_SHIFT


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(
                ["end", "more", "batch", "eof", "credit", "garbage", "write", "ctl", "send", "failed"]
            ),
            st.integers(4, 64),
            st.sampled_from([0, 1, 5, lib.RDMAIO_RX_SLOT_MAX, lib.RDMAIO_RX_SLOT_MAX + 1, 0xFFFF_FFFF]),
        ),
        max_size=12,
    ),
    max_out=st.integers(0, 4),
    start=st.integers(0, 3),
)
def test_rx_run_applies_the_receivers_rules_record_by_record(
    rows: list[tuple[str, int, int]], max_out: int, start: int
) -> None:
    """The receiver's batch call against its rules applied one record at a time: from the same state and
    records, the same frames, records consumed, stop and state; a slot the packed word cannot hold is left to
    the Python rules (not consumed, nothing changed)."""
    hs = Handshake(8, 64, 1 << 20, features=FEATURE_BATCH)
    peer = Session(hs, hs)
    twins = NativeSession(hs, hs), NativeSession(hs, hs)
    table = []
    for what, n, slot in rows:
        wr_id = verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 0) | slot
        imm, flags, opcode, status = 0, _WITH_IMM, _RECV, 0
        if what in ("end", "more"):
            imm = peer.take_data_frame(what == "end", n) if peer.can_send_data() else 0
        elif what == "batch":
            ok = peer.can_send_data() and not peer.rules_state.send_in_message
            imm = peer.take_batch_frame(n, 1) if ok else 0
        elif what == "eof":
            imm = int(FrameKind.EOF) << 28
        elif what == "credit":
            imm = int(FrameKind.CREDIT) << 28 | 1
        elif what == "garbage":
            imm = 0x0FFF_0000
        elif what == "write":
            opcode = _RECV_RDMA_IMM
        elif what == "ctl":
            flags = 0
        elif what == "send":
            opcode = _SEND
        else:
            status = 5
        table.append((wr_id, status, opcode, n, imm, flags))
    records = ffi.new("struct rdmaio_wc[]", table or [(0, 0, 0, 0, 0, 0)])
    count = max(len(rows) - start, 0)
    assert _rx_run(twins[1].rules_state, records, start, count, max_out) == _rx_reference(
        twins[0].rules_state, records, start, count, max_out
    )
    assert fields(twins[1]) == fields(twins[0])


def test_rx_run_refuses_bad_arguments_and_changes_nothing() -> None:
    hs = Handshake(8, 64, 1 << 20)
    peer, me = Session(hs, hs), NativeSession(hs, hs)
    records = _records([(0, peer.take_data_frame(True, 3), 3)])
    out = ffi.new("uint32_t[]", 2 * (lib.RDMAIO_RX_RUN_MAX_OUT + 1))
    before = fields(me)
    assert lib.rdmaio_rx_run(ffi.NULL, records, 0, 1, out, 1) == -1
    assert lib.rdmaio_rx_run(me.rules_state, ffi.NULL, 0, 1, out, 1) == -1
    assert lib.rdmaio_rx_run(me.rules_state, records, 0, 1, ffi.NULL, 1) == -1
    assert lib.rdmaio_rx_run(me.rules_state, records, 0, 1, out, -1) == -1
    assert lib.rdmaio_rx_run(me.rules_state, records, 0, 1, out, lib.RDMAIO_RX_RUN_MAX_OUT + 1) == -1
    assert lib.rdmaio_rx_run(me.rules_state, records, -1, 1, out, 1) == 0  # nothing consumed
    assert fields(me) == before
    assert _rx_run(me.rules_state, records, 0, 1) == (
        [(int(FrameKind.DATA_END), 0, 3)],
        1,
        lib.RDMAIO_RX_DONE,
    )


def test_rx_run_applies_a_run_and_stops_at_what_it_leaves_to_python() -> None:
    hs = Handshake(8, 64, 1 << 20, features=FEATURE_BATCH)
    peer, me = Session(hs, hs), NativeSession(hs, hs)
    imms = [peer.take_data_frame(False, 10), peer.take_data_frame(True, 5), peer.take_batch_frame(8, 2)]
    rows = [(0, imms[0], 10), (1, imms[1], 5), (2, imms[2], 8), (3, peer.take_eof_frame(), 0)]
    records = _records(rows)
    out, consumed, stop = _rx_run(me.rules_state, records, 0, 4)
    # It stops right after DATA_BATCH: the payload must be unpacked before the next frame.
    assert out == [(1, 0, 10), (2, 1, 5), (5, 2, 8)] and consumed == 3 and stop == lib.RDMAIO_RX_MORE
    assert me.rules_state.batch_pending == 8 and me.posted == 5
    me.on_batch(b"\0\0\0\0" * 2)
    out, consumed, stop = _rx_run(me.rules_state, records, 3, 1)
    assert out == [] and consumed == 0 and stop == lib.RDMAIO_RX_DEFER  # EOF: the Python Session's
    assert me.on_frame(rows[3][1], 0) is FrameKind.EOF and me.peer_eof


def test_rx_run_skips_what_is_not_a_receive_and_defers_one_sided_receives() -> None:
    hs = Handshake(8, 64, 1 << 20)
    peer, me = Session(hs, hs), NativeSession(hs, hs)
    records = ffi.new(
        "struct rdmaio_wc[]",
        [
            (verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 0), 0, _SEND, 0, 0, 0),  # a send completion
            (verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 1), 5, _RECV, 0, 0, _WITH_IMM),  # failed
            (
                verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 2),
                0,
                _RECV,
                3,
                peer.take_data_frame(True, 3),
                _WITH_IMM,
            ),
            (verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 3), 0, _RECV_RDMA_IMM, 0, 7, _WITH_IMM),  # write notice
            (verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 4), 0, _RECV, 9, 0, 0),  # control message: no imm
        ],
    )
    out, consumed, stop = _rx_run(me.rules_state, records, 0, 5)
    assert out == [(2, 2, 3)] and consumed == 3 and stop == lib.RDMAIO_RX_DEFER
    out, consumed, stop = _rx_run(me.rules_state, records, 4, 1)
    assert out == [] and consumed == 0 and stop == lib.RDMAIO_RX_DEFER
    # A full out array: it stops with RX_MORE and what it consumed, and goes on when called again.
    records = _records([(i, peer.take_data_frame(True, 1), 1) for i in range(3)])
    out, consumed, stop = _rx_run(me.rules_state, records, 0, 3, max_out=2)
    assert len(out) == 2 and consumed == 2 and stop == lib.RDMAIO_RX_MORE
    out, consumed, stop = _rx_run(me.rules_state, records, 2, 1)
    assert len(out) == 1 and consumed == 1 and stop == lib.RDMAIO_RX_DONE
    assert _rx_run(me.rules_state, records, 0, 0) == ([], 0, lib.RDMAIO_RX_DONE)
    assert _rx_run(me.rules_state, records, -1, 3) == ([], 0, lib.RDMAIO_RX_DONE)


# -- the differential test --------------------------------------------------------------------------------

_KINDS = st.integers(0, 15)
_IMM = st.one_of(
    st.builds(lambda kind, credits: kind << 28 | credits, _KINDS, st.integers(0, 6)),
    st.builds(lambda kind, credits: kind << 28 | credits, st.integers(1, 5), st.integers(0, 0xFFFF)),
    st.integers(0, 0xFFFF_FFFF),
)
_LEN = st.one_of(st.integers(0, 300), st.sampled_from([0, 3, 4, 5, 63, 64, 65, 0xFFFF_FFFF]))
_N = st.integers(-2, 12)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("frame"), _IMM, _LEN),
        st.tuples(
            st.just("peer_frame"), st.sampled_from(["end", "more", "batch", "credit", "eof", "rndv"]), _LEN
        ),
        st.tuples(
            st.just("rx"),
            st.lists(
                st.tuples(_IMM, _LEN, st.sampled_from(["recv", "send", "failed", "write", "ctl"])), max_size=6
            ),
        ),
        st.tuples(
            st.just("rx_valid"),
            st.lists(
                st.tuples(st.sampled_from(["end", "more", "batch", "credit"]), st.integers(0, 80)), max_size=8
            ),
        ),
        st.tuples(
            st.just("take_data"), st.booleans(), st.one_of(st.integers(-1, 80), st.integers(-(2**40), 2**40))
        ),
        st.tuples(st.just("take_batch"), st.integers(-4, 90), st.integers(-1, 30)),
        st.tuples(st.just("send_now"), st.integers(0, 300)),
        st.tuples(st.just("take_credit")),
        st.tuples(st.just("credit_due")),
        st.tuples(st.just("control_due")),
        st.tuples(st.just("can_send")),
        st.tuples(st.just("eof_pending")),
        st.tuples(st.just("reposted"), _N),
        st.tuples(st.just("grow"), _N),
        st.tuples(st.just("take_slot")),
        st.tuples(st.just("slot_used")),
        st.tuples(st.just("take_eof")),
        st.tuples(st.just("take_rndv"), st.integers(-1, 80)),
        st.tuples(
            st.sampled_from(["write_eof", "close", "abort", "disconnected", "transport_error", "mark_closed"])
        ),
    ),
    max_size=60,
)


def _kind_imm(peer: Session, kind: str, n: int) -> tuple[int, int]:
    """A frame ``peer`` would send (if it may; else a raw one of that kind): its imm and byte_len."""
    try:
        if kind == "end":
            return peer.take_data_frame(True, min(n, peer.max_fragment)), min(n, peer.max_fragment)
        if kind == "more":
            return peer.take_data_frame(False, min(n, peer.max_fragment)), min(n, peer.max_fragment)
        if kind == "batch":
            size = max(4, min(n, peer.max_fragment)) // 4 * 4
            return peer.take_batch_frame(size, 1), size
        if kind == "credit":
            return peer.take_credit_frame(), 0
        if kind == "eof":
            return peer.take_eof_frame(), 0
        return peer.take_rndv_frame(max(1, min(n, peer.max_fragment))), max(1, min(n, peer.max_fragment))
    except Exception:  # the peer may not send it now: send it anyway, a peer breaking the rules
        raw = {"end": 2, "more": 1, "batch": 5, "credit": 3, "eof": 4, "rndv": 6}[kind]
        return raw << 28, n


def _outcome(call: Any) -> tuple[str, Any]:
    try:
        result = call()
    except Exception as exc:
        return "raised", (type(exc), str(exc))
    return "returned", int(result) if isinstance(result, int) else result


def _check_clear(session: Session) -> None:
    """The close state's ``clear`` (what a send and an empty read test instead of asking it) holds exactly
    while no close fact does, and then every answer is None."""
    close = session.close_state
    facts = (
        "aborted",
        "local_closed",
        "eof_requested",
        "peer_eof",
        "transport_lost",
        "torn_down",
        "wire_down",
    )
    assert close.clear == (not any(getattr(close, fact) for fact in facts))
    if close.clear:
        assert session.send_error() is session.flush_error() is session.recv_outcome() is None


_SEND_NOW_INLINE = 512  # the test ring sends every frame of send_now's lengths inline (no slot)


def _send_now(session: Session, length: int, native: bool) -> tuple[int, int]:
    """An idle sender's message of ``length`` bytes: ``rdmaio_txring_send_now`` (room, credit, the take, the
    copy, the work request, the chain's signalling) on the C state, against the Python rules it stands
    for: ``can_send_data()``, ``take_data_frame(True, length)`` and ``control_frame_due()``. Returns its
    code (0: no credit, 1: finished, 2: a control frame is due after it) and the frame's immediate value;
    a frame the C take refuses is handed to the Python take, which raises (as the sender does)."""
    if not native:
        if not session.can_send_data():
            return 0, -1
        imm = session.take_data_frame(True, length)
        return (2 if session.control_frame_due() else 1), imm
    sends = ffi.new("struct rdmaio_send[]", 1)
    tx = ffi.new("struct rdmaio_txring *")
    free_stack, inflight = ffi.new("uint32_t[]", 1), ffi.new("uint32_t[]", 1)
    wr_base = verbs.make_wr_id(verbs.WR_KIND_SEND, 1, 0)
    assert (
        lib.rdmaio_txring_init(tx, sends, 1, free_stack, 1, inflight, 1, 64, _SEND_NOW_INLINE, 4, wr_base)
        == 0
    )
    scratch = ffi.new("uint8_t[]", _SEND_NOW_INLINE)
    assert lib.rdmaio_txring_set_scratch(tx, scratch, 1) == 0
    header = session.framing.header
    assert lib.rdmaio_txring_set_header(tx, header) == 0
    data = bytes(range(256)) * 2
    rc: int = lib.rdmaio_txring_send_now(tx, session.rules_state, data, length)
    if rc == lib.RDMAIO_TX_SESSION:
        session.take_data_frame(True, length)  # raises the precise error
        raise AssertionError("the C take refused a frame the Python take accepts")
    assert rc >= 0, rc
    if not rc:
        assert tx.inflight_count == 0  # nothing changed
        return 0, -1
    # The frame is in entry 0: its bytes inline, its immediate value the take's; a finished chain of one
    # entry in a one-entry send queue is signalled (it leaves the sender short of entries).
    wr = sends[0]
    assert tx.inflight_count == 1 and wr.length == length + header
    sent = bytes(ffi.buffer(ffi.cast("char *", wr.addr), length + header))
    assert sent[header:] == data[:length]
    if rc == 1:
        assert wr.send_flags & verbs.SEND_SIGNALED
    if header:
        # The header framing: a plain SEND, the immediate value as the payload's first 4 bytes.
        assert wr.opcode == lib.IBV_WR_SEND and wr.imm_data == 0
        return rc, int.from_bytes(sent[:header], "big")
    assert wr.opcode == lib.IBV_WR_SEND_WITH_IMM
    return rc, int(wr.imm_data)


def _batch_payload(length: int) -> bytes:
    """A valid DATA_BATCH payload of ``length`` bytes (>= 4): one message of length - 4 bytes."""
    return struct.pack("<I", length - 4) + bytes(length - 4)


def _receive(session: Session, rows: list[tuple[int, int, str]], native: bool) -> list[Any]:
    """Apply received completions as Receiver.on_batch does: the Python rules frame by frame, or C's
    rdmaio_rx_run with the Python Session for what they defer. Returns what
    happened, in order."""
    opcodes = {"recv": _RECV, "send": _SEND, "failed": _RECV, "write": _RECV_RDMA_IMM, "ctl": _RECV}
    header = session.framing.header
    seen: list[Any] = []
    if header:
        # The header framing: each receive's word travels in its slot's first 4 bytes and the completion
        # has no immediate data (a write notice keeps its own); C's rdmaio_rx_unframe or the Python
        # reference (unframe_receive) turns them back first. Both must agree, record and slot bytes.
        # Slots of at most 4 KiB: a row's byte_len may be anything (up to 2**32 - 1); one longer than the
        # slot is rejected by the unframing either way, and only a slot's bytes are written.
        slot_size = min(max([n for _imm, n, _what in rows] + [0]), 4096) + header + 8
        ring = bytearray(slot_size * max(len(rows), 1))
        table = []
        for i, (imm, n, what) in enumerate(rows):
            word = CONTROL_WORD if what == "ctl" else imm
            fill = min(n, slot_size - header)
            ring[i * slot_size : i * slot_size + header + fill] = word.to_bytes(4, "big") + bytes(
                (i + k) & 0xFF for k in range(fill)
            )
            plain = what in ("recv", "ctl", "failed")
            table.append(
                (
                    verbs.make_wr_id(verbs.WR_KIND_RECV, 1, i),
                    5 if what == "failed" else 0,
                    opcodes[what],
                    min(n + header, 0xFFFF_FFFF) if plain else n,
                    0 if plain else imm,
                    0 if plain else _WITH_IMM,
                )
            )
        records = ffi.new("struct rdmaio_wc[]", table or [(0, 0, 0, 0, 0, 0)])
        if native:
            ring_c = ffi.from_buffer(ring)
            seen.append(
                ("unframed", lib.rdmaio_rx_unframe(records, 0, len(rows), ring_c, len(ring), slot_size))
            )
        else:
            changed = 0
            for i in range(len(rows)):
                wc = records[i]
                if wc.status or wc.opcode != _RECV:
                    continue
                changed += 1
                slot = memoryview(ring)[i * slot_size : (i + 1) * slot_size]
                wc.flags, wc.imm_data, wc.byte_len = unframe_receive(wc.flags, wc.byte_len, slot)
            seen.append(("unframed", changed))
        seen.append(("ring", bytes(ring)))
        seen.append(
            ("records", [tuple(int(getattr(records[i], f)) for f in _WC_FIELDS) for i in range(len(rows))])
        )
    else:
        records = ffi.new(
            "struct rdmaio_wc[]",
            [
                (
                    verbs.make_wr_id(verbs.WR_KIND_RECV, 1, i),
                    5 if what == "failed" else 0,
                    opcodes[what],
                    n,
                    imm,
                    0 if what == "ctl" else _WITH_IMM,
                )
                for i, (imm, n, what) in enumerate(rows)
            ]
            or [(0, 0, 0, 0, 0, 0)],
        )

    def apply(kind: int, length: int) -> None:
        seen.append(int(kind))
        if kind == FrameKind.DATA_BATCH:
            seen.append(_outcome(lambda: session.on_batch(_batch_payload(length))))

    def python(i: int) -> None:
        wc = records[i]
        if wc.status or not wc.opcode & 0x80:
            return
        if wc.opcode == _RECV_RDMA_IMM or not wc.flags & _WITH_IMM:
            seen.append("onesided")
            return
        apply(session.on_frame(wc.imm_data, wc.byte_len), wc.byte_len)

    try:
        i = 0
        while i < len(rows):
            if native:
                frames, consumed, stop = _rx_run(session.rules_state, records, i, len(rows) - i, max_out=3)
                for kind, _slot, length in frames:
                    apply(kind, length)
                i += consumed
                if stop != lib.RDMAIO_RX_DEFER:
                    continue
            python(i)
            i += 1
    except Exception as exc:
        seen.append(("raised", type(exc), str(exc)))
    return seen


def _apply(session: Session, peer: Session, op: tuple[Any, ...], native: bool) -> Any:
    name = op[0]
    if name == "frame":
        return _outcome(lambda: session.on_frame(op[1], op[2]))
    if name == "peer_frame":
        imm, n = _kind_imm(peer, op[1], op[2])
        return _outcome(lambda: session.on_frame(imm, n))
    if name == "rx":
        return _receive(session, op[1], native)
    if name == "rx_valid":
        rows = []
        for kind, n in op[1]:
            imm, length = _kind_imm(peer, kind, n)
            rows.append((imm, length, "recv"))
        return _receive(session, rows, native)
    if name == "take_data":
        return _outcome(lambda: session.take_data_frame(op[1], op[2]))
    if name == "take_batch":
        return _outcome(lambda: session.take_batch_frame(op[1], op[2]))
    if name == "send_now":
        return _outcome(lambda: _send_now(session, op[1], native))
    if name == "take_credit":
        return _outcome(session.take_credit_frame)
    if name == "credit_due":
        return _outcome(session.credit_frame_due)
    if name == "can_send":
        return _outcome(session.can_send_data)
    if name == "eof_pending":
        return _outcome(session.eof_pending)
    if name == "control_due":
        return _outcome(session.control_frame_due)
    if name == "reposted":
        return _outcome(lambda: session.on_recv_reposted(op[1]))
    if name == "grow":
        return _outcome(lambda: session.grow_receives(op[1]))
    if name == "take_slot":
        return _outcome(session.take_slot)
    if name == "slot_used":
        return _outcome(session.on_slot_used)
    if name == "take_eof":
        return _outcome(session.take_eof_frame)
    if name == "take_rndv":
        return _outcome(lambda: session.take_rndv_frame(op[1]))
    if name == "write_eof":
        return _outcome(session.write_eof)
    if name == "close":
        return _outcome(session.close)
    if name == "abort":
        return _outcome(lambda: session.abort(ConnectionError("aborted")))
    if name == "disconnected":
        return _outcome(session.on_disconnected)
    if name == "transport_error":
        return _outcome(lambda: session.on_transport_error(OSError("gone")))
    assert name == "mark_closed"
    return _outcome(session.mark_closed)


def _handshake(
    depth: int, initial: int, slot: int, max_message: int, features: int, caps: Capabilities | None = None
) -> Handshake:
    return Handshake(
        depth,
        slot,
        max_message,
        features=features | (FEATURE_GROW if initial < depth else 0),
        initial_depth=initial,
        caps=caps,
    )


#: The capabilities each side announces: none (an older rdmaio: the immediate framing), the immediate
#: framing, the header framing forced by one side or both, a device without immediate data (iWARP).
_FRAMINGS = {
    "none": (None, None),
    "immediate": (Capabilities(), Capabilities()),
    "header-both": (Capabilities(header_framing=True), Capabilities(header_framing=True)),
    "header-mixed": (Capabilities(header_framing=True), Capabilities()),
    "iwarp-peer": (Capabilities(), Capabilities(immediate=False, atomics=False, memory_windows=False)),
}


_FEATURES = st.sampled_from([0, FEATURE_BATCH, FEATURE_RNDV, FEATURE_BATCH | FEATURE_RNDV])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depths=st.tuples(st.integers(4, 12), st.integers(4, 12)),
    initial=st.tuples(st.integers(0, 8), st.integers(0, 8)),
    slots=st.tuples(st.sampled_from([64, 65, 100]), st.sampled_from([64, 65, 100])),
    max_message=st.tuples(st.sampled_from([1, 64, 150, 1 << 20]), st.sampled_from([1, 64, 150, 1 << 20])),
    features=st.tuples(_FEATURES, _FEATURES),
    threshold=st.one_of(st.none(), st.integers(2, 3)),
    ops=_OPS,
    framing=st.sampled_from(sorted(_FRAMINGS)),
)
def test_c_rules_match_the_python_session(
    depths: tuple[int, int],
    initial: tuple[int, int],
    slots: tuple[int, int],
    max_message: tuple[int, int],
    features: tuple[int, int],
    threshold: int | None,
    ops: list[tuple[Any, ...]],
    framing: str,
) -> None:
    caps = _FRAMINGS[framing]
    hs = [
        _handshake(depths[i], max(4, depths[i] - initial[i]), slots[i], max_message[i], features[i], caps[i])
        for i in range(2)
    ]
    reference, native = (
        Session(hs[0], hs[1], credit_threshold=threshold),
        NativeSession(hs[0], hs[1], credit_threshold=threshold),
    )
    # Each gets its own peer (the same one twice) so that valid frames follow the peer's own rules.
    peers = Session(hs[1], hs[0]), Session(hs[1], hs[0])
    assert reference.framing == native.framing
    assert reference.framing.header == peers[0].framing.header  # both sides agree
    assert reference.framing.immediate == (framing in ("none", "immediate"))
    assert fields(reference) == fields(native)
    for step, op in enumerate(ops):
        expected = _apply(reference, peers[0], op, native=False)
        got = _apply(native, peers[1], op, native=True)
        assert got == expected, (step, op)
        assert fields(native) == fields(reference), (step, op)
        assert native.state == reference.state and native.statistics() == reference.statistics(), (step, op)
        _check_clear(reference)


def test_a_rejected_frame_changes_nothing_in_c_and_python_raises_the_error() -> None:
    hs = Handshake(4, 64, 100)
    me = NativeSession(hs, hs)
    before = fields(me)
    for imm, n in ((2 << 28 | 0x10000, 1), (2 << 28, 65), (2 << 28 | 0xFFFF, 0), (9 << 28, 0), (4 << 28, 0)):
        assert lib.rdmaio_session_on_frame(me.rules_state, imm, n) == 0
        assert fields(me) == before
    with pytest.raises(Exception, match="exceeds the slot size"):
        me.on_frame(2 << 28, 65)


_RAW_KIND = {"end": 2, "more": 1, "credit": 3, "eof": 4, "batch": 5, "rndv": 6}


def _valid_frames(rnd: random.Random, s: Session, count: int) -> list[tuple[int, int]]:
    """Frames a well-behaved peer of ``s`` could send now (imm, byte_len), at most ``count``: each finds a
    credit of the peer's and grants what keeps its credits within our recv_depth (the kind may still be
    refused now, e.g. data after the peer's EOF, and then the Python Session raises)."""
    state = s.rules_state
    credits, avail = int(state.send_credits), int(state.posted - state.ungranted)
    frames = []
    for _ in range(count):
        if avail <= 0:
            break
        avail -= 1
        kind = rnd.choice(["end", "end", "end", "more", "batch", "batch", "credit", "credit", "rndv"])
        if rnd.random() < 0.01:
            kind = "eof"  # rarely: every data frame after it breaks the rules (and aborts the session)
        elif state.peer_eof and rnd.random() < 0.95:
            kind = "credit"
        elif (state.recv_in_message and kind in ("batch", "rndv")) or (
            kind == "batch" and not state.batching
        ):
            kind = "end"
        elif kind == "rndv" and not state.rndv:
            kind = "more"
        n = 0 if kind in ("credit", "eof") else rnd.choice([0, 1, 4, 8, 20, 40, 63, 64])
        if kind == "batch":
            n = max(4, n)
        grant = rnd.randint(0, max(0, min(3, int(state.peer_depth) - credits)))
        credits += grant
        frames.append((_RAW_KIND[kind] << 28 | grant, n))
    return frames


def _random_op(rnd: random.Random, s: Session) -> tuple[Any, ...]:
    """One operation, mostly what a well-behaved I/O layer and peer would do now, rarely a broken one."""
    r = rnd.random()
    if r < 0.30:
        frames = _valid_frames(rnd, s, 1)
        if frames:
            return ("frame", *frames[0])
        return ("reposted", 1)
    if r < 0.42:
        what = ["recv"] * 12 + ["send", "failed", "write", "ctl"]
        return ("rx", [(imm, n, rnd.choice(what)) for imm, n in _valid_frames(rnd, s, rnd.randint(1, 8))])
    if r < 0.43:
        imm = rnd.choice([rnd.randrange(1 << 32), rnd.randint(0, 15) << 28 | rnd.randint(0, 9)])
        return ("frame", imm, rnd.choice([0, 1, 4, 8, 64, 65, 100, 1 << 31]))
    if r < 0.56:
        return ("take_data", rnd.random() < 0.6, rnd.choice([0, 1, 10, 63, 64, 65, 100, -1]))
    if r < 0.59:
        return ("send_now", rnd.choice([0, 1, 10, 63, 64, 65, 100]))
    if r < 0.62:
        n = rnd.choice([4, 8, 12, 40, 64, 100, 3, 0])
        return ("take_batch", n, rnd.choice([1, 1, 2, max(1, n // 4), n // 4 + 1, 0]))
    if r < 0.68:
        return ("take_credit",)
    if r < 0.74:
        return (rnd.choice(["credit_due", "can_send", "eof_pending", "control_due"]),)
    if r < 0.88:
        unposted = int(s.rules_state.recv_depth - s.rules_state.posted)
        return ("reposted", rnd.choice([unposted, min(1, unposted), min(2, unposted), 0, -1, unposted + 1]))
    if r < 0.91:
        return ("grow", rnd.choice([1, 2, 4, 0, -1, 40]))
    if r < 0.95:
        if rnd.random() < 0.7 or s.posted <= s.ungranted:
            return ("take_slot",)
        return ("slot_used",)
    if r < 0.99:
        return ("take_eof",) if rnd.random() < 0.5 else ("take_rndv", rnd.choice([1, 20, 0, 200]))
    return (rnd.choice(["write_eof", "close", "abort", "disconnected", "transport_error", "mark_closed"]),)


@pytest.mark.parametrize("seed", range(300))
def test_c_rules_match_the_python_session_on_long_random_runs(seed: int) -> None:
    """The differential test on long runs of mostly valid operations (a hypothesis example is short and
    mostly invalid): every branch of the C accept paths is reached many times."""
    rnd = random.Random(seed)
    features = [rnd.choice([FEATURE_BATCH | FEATURE_RNDV, FEATURE_BATCH, 0]) for _ in range(2)]
    depths = [rnd.randint(4, 16) for _ in range(2)]
    hs = [
        _handshake(
            depths[i],
            rnd.randint(4, depths[i]),
            rnd.choice([64, 100]),
            rnd.choice([64, 150, 1 << 20]),
            features[i],
        )
        for i in range(2)
    ]
    threshold = rnd.choice([None, None, 2, 3])
    reference = Session(hs[0], hs[1], credit_threshold=threshold)
    native = NativeSession(hs[0], hs[1], credit_threshold=threshold)
    unused = Session(hs[1], hs[0])  # the ops above carry their frames: no peer session is asked
    for step in range(400):
        op = _random_op(rnd, reference)
        expected = _apply(reference, unused, op, native=False)
        got = _apply(native, unused, op, native=True)
        assert got == expected, (step, op)
        assert fields(native) == fields(reference), (step, op)
        assert native.state == reference.state and native.statistics() == reference.statistics(), (step, op)
        _check_clear(reference)


# -- the receiver on a C state ----------------------------------------------------------------------------


class _Slots:
    """The transport's receive side: records every chained re-post; grows by what is asked."""

    slot_size = 64

    def __init__(self) -> None:
        self.posts: list[list[int]] = []
        self.grown = 0

    def post_receives(self, slots: list[int]) -> None:
        self.posts.append(list(slots))

    def grow_receives(self, n: int) -> int:
        self.grown += n
        return n


def _receiver(session: Session) -> tuple[Any, _Slots, memoryview]:
    import collections
    from types import SimpleNamespace

    import rdmaio
    from rdmaio.core.receive import Receiver

    ring = memoryview(bytearray(64 * 32))
    slots = _Slots()
    receiver = Receiver(
        session,
        slots,
        ring,
        io=SimpleNamespace(),  # type: ignore[arg-type]  # on_batch never reaches the loop
        options=rdmaio.Options(),
        stats=collections.Counter(),
        stage=lambda: None,
    )
    return receiver, slots, ring


def test_the_receiver_applies_common_frames_in_c_and_the_rest_through_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hs = Handshake(16, 64, 1 << 20, features=FEATURE_BATCH | FEATURE_GROW, initial_depth=4)
    results = []
    for make in (lambda: Session(hs, hs), lambda: new_session(hs, hs, _Transport(None))):
        calls: list[tuple[Session, int]] = []
        original = Session.on_frame

        def counting(
            self: Session,
            imm: int,
            byte_len: int,
            original: Any = original,
            calls: list[tuple[Session, int]] = calls,
        ) -> FrameKind:
            calls.append((self, imm >> 28))
            return original(self, imm, byte_len)

        monkeypatch.setattr(Session, "on_frame", counting)
        session = make()
        receiver, slots, ring = _receiver(session)
        peer = Session(hs, hs)
        ring[0:5] = b"hello"
        ring[64:67] = b"abc"
        n = pack_batch_into(ring, 128, [b"x", b"yz"])
        rows = [
            (0, peer.take_data_frame(False, 5), 5),
            (1, peer.take_data_frame(True, 3), 3),
            (2, peer.take_batch_frame(n, 2), n),
        ]
        receiver.on_batch(_records(rows), 0, 3)  # half the window of data frames: it grows
        peer.on_frame(session.take_credit_frame(), 0)  # the reposted and new slots, granted
        rows = [(3, peer.take_eof_frame(), 0)]
        receiver.on_batch([SimpleRecord(verbs.make_wr_id(verbs.WR_KIND_RECV, 1, 3), rows[0][1])], 0, 1)
        monkeypatch.setattr(Session, "on_frame", original)
        messages = [receiver.rxbuf.pop_message() for _ in range(3)]
        mine = [kind for who, kind in calls if who is session]
        results.append((messages, slots.posts, slots.grown, fields(session), session.peer_eof, mine))
    python, native = results
    assert python[0] == native[0] == [b"helloabc", b"x", b"yz"]
    assert python[1:5] == native[1:5]  # same posts, growth, state fields and EOF
    assert python[2] == 4 and python[4]
    assert python[5] == [1, 2, 5, 4]  # the Python Session saw every frame
    assert native[5] == [4]  # on a C state only EOF reached it (a record list was copied into an array)


class SimpleRecord:
    """A completion record that is not a struct rdmaio_wc (as some callers build them)."""

    def __init__(self, wr_id: int, imm: int) -> None:
        self.wr_id, self.status, self.opcode, self.byte_len = wr_id, 0, _RECV, 0
        self.imm_data, self.flags, self.vendor_err = imm, _WITH_IMM, 0
