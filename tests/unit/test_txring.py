"""C-level tests of the send ring (rdmaio/_ffi/txring.c) through the cffi module: every bound refused with
its code and nothing changed, the fill of slot, inline and empty frames, release in RC order, and the
signalling rules (every interval, the chain's last request when short, the EOF frame)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from ctest import RUN_TIMEOUT, compile_c

from rdmaio import verbs
from rdmaio._ffi import ffi, lib

SLOTLESS = int(lib.RDMAIO_TX_SLOTLESS)
SEQ_MASK = int(lib.RDMAIO_TX_SEQ_MASK)
NO_SQ = int(lib.RDMAIO_TX_NO_SQ)
NO_SLOT = int(lib.RDMAIO_TX_NO_SLOT)
BAD_INDEX = int(lib.RDMAIO_TX_BAD_INDEX)
TOO_LONG = int(lib.RDMAIO_TX_TOO_LONG)
NO_SCRATCH = int(lib.RDMAIO_TX_NO_SCRATCH)
BAD_ARG = int(lib.RDMAIO_TX_BAD_ARG)
SIGNALED = int(lib.IBV_SEND_SIGNALED)
INLINE = int(lib.IBV_SEND_INLINE)
SLOT = 32
TAG = 0x42
WR_BASE = verbs.make_wr_id(verbs.WR_KIND_SEND, TAG, 0)


class Ring:
    """One C send ring with its memory: ``depth`` slots and send-queue entries, ``send_len`` send-array
    entries, a registered ring of ``depth`` slots (``slots`` of them added), inline areas of
    ``max_inline`` bytes."""

    def __init__(
        self,
        depth: int = 8,
        *,
        send_len: int | None = None,
        slots: int = 0,
        max_inline: int = 16,
        signal_interval: int = 4,
        scratch: bool = True,
    ) -> None:
        self.depth = depth
        self.sends: Any = ffi.new("struct rdmaio_send[]", send_len if send_len is not None else depth)
        self.free_stack: Any = ffi.new("uint32_t[]", depth)
        self.inflight: Any = ffi.new("uint32_t[]", depth)
        self.memory: Any = ffi.new("uint8_t[]", depth * SLOT)
        self.addr = int(ffi.cast("uintptr_t", self.memory))
        self.lkeys: Any = ffi.new("uint32_t[]", [100 + i for i in range(depth)])
        self.r: Any = ffi.new("struct rdmaio_txring *")
        rc = lib.rdmaio_txring_init(
            self.r,
            self.sends,
            len(self.sends),
            self.free_stack,
            depth,
            self.inflight,
            depth,
            SLOT,
            max_inline,
            signal_interval,
            WR_BASE,
        )
        assert rc == 0
        self.scratch: Any = None
        if scratch and max_inline:
            self.scratch = ffi.new("uint8_t[]", len(self.sends) * max_inline)
            assert lib.rdmaio_txring_set_scratch(self.r, self.scratch, len(self.sends)) == 0
        if slots:
            assert self.add(0, slots) == 0

    def add(self, first: int, count: int) -> int:
        return int(lib.rdmaio_txring_add_slots(self.r, self.addr, self.lkeys, first, count))

    def stage(self, i: int, data: bytes, imm: int = 0) -> int:
        return int(lib.rdmaio_txring_stage(self.r, i, ffi.from_buffer(data), len(data), imm))

    def empty(self, i: int, imm: int = 0, flags: int = 0) -> int:
        return int(lib.rdmaio_txring_stage_empty(self.r, i, imm, flags))

    def state(self) -> tuple[Any, ...]:
        """Everything a refusal must leave as it was."""
        r = self.r
        fields = "slots nfree inflight_head inflight_count unsignaled interval sq_interval seq"
        fields += " eof_staged eof_index"
        return (
            tuple(int(getattr(r, name)) for name in fields.split()),
            tuple(self.free_stack[0 : self.depth]),
            tuple(self.inflight[0 : self.depth]),
            bytes(ffi.buffer(self.sends)),
            bytes(ffi.buffer(self.memory)),
        )

    def in_flight(self) -> list[int]:
        out = ffi.new("uint32_t *")
        entries = []
        k = 0
        while lib.rdmaio_txring_inflight_at(self.r, k, out) == 0:
            entries.append(int(out[0]))
            k += 1
        return entries

    def free(self) -> list[int]:
        return list(self.free_stack[0 : self.r.nfree])


def test_init_and_add_slots_refuse_what_is_out_of_range() -> None:
    r = ffi.new("struct rdmaio_txring *")
    sends = ffi.new("struct rdmaio_send[]", 4)
    arrays = [ffi.new("uint32_t[]", 4) for _ in range(2)]
    good = (r, sends, 4, arrays[0], 4, arrays[1], 4, SLOT, 16, 2, WR_BASE)
    assert lib.rdmaio_txring_init(*good) == 0
    for position, bad in ((2, 0), (4, 0), (6, 0), (7, 0), (9, 0), (10, WR_BASE | 5), (4, SLOTLESS + 1)):
        args = list(good)
        args[position] = bad
        assert lib.rdmaio_txring_init(*args) == BAD_ARG, (position, bad)
    ring = Ring(4)
    before = ring.state()
    assert ring.add(1, 2) == BAD_ARG  # not after the last registered slot
    assert ring.add(0, 5) == BAD_ARG  # past the ring's size
    assert lib.rdmaio_txring_add_slots(ring.r, 0, ring.lkeys, 0, 2) == BAD_ARG  # no memory
    assert ring.state() == before
    assert ring.add(0, 2) == 0 and ring.free() == [1, 0]  # the lowest index on top
    other = ffi.new("uint32_t[]", 4)
    assert lib.rdmaio_txring_add_slots(ring.r, ring.addr, other, 2, 2) == BAD_ARG  # the keys moved
    assert lib.rdmaio_txring_add_slots(ring.r, ring.addr + 8, ring.lkeys, 2, 2) == BAD_ARG  # memory moved
    assert ring.add(2, 2) == 0 and ring.free() == [1, 0, 3, 2] and ring.r.slots == 4
    assert ring.add(4, 1) == BAD_ARG
    assert lib.rdmaio_txring_set_scratch(ring.r, ffi.NULL, 4) == BAD_ARG


def test_every_refusal_has_its_code_and_changes_nothing() -> None:
    ring = Ring(4, send_len=3, slots=1, max_inline=8, scratch=False)
    before = ring.state()
    assert ring.stage(3, b"x" * 20) == BAD_INDEX  # past the send array
    assert ring.empty(3) == BAD_INDEX
    assert ring.stage(0, b"x" * (SLOT + 1)) == TOO_LONG
    assert ring.stage(0, b"inline") == NO_SCRATCH  # no scratch area yet
    assert lib.rdmaio_txring_finish(ring.r, 0) == BAD_INDEX
    assert lib.rdmaio_txring_finish(ring.r, 4) == BAD_INDEX
    assert ring.state() == before
    assert ring.stage(0, b"x" * 20) == 1  # the only slot
    before = ring.state()
    assert ring.stage(1, b"y" * 20) == NO_SLOT
    assert ring.state() == before
    scratch = ffi.new("uint8_t[]", 2 * 8)
    assert lib.rdmaio_txring_set_scratch(ring.r, scratch, 2) == 0
    before = ring.state()
    assert ring.stage(2, b"inline") == NO_SCRATCH  # entry 2 has no scratch area
    assert ring.state() == before
    assert ring.stage(1, b"inline") == 0 and ring.empty(2) == 0
    # Three entries in flight of four: one more, then the send queue is full for every kind of frame.
    full = Ring(2, slots=2, max_inline=8)
    assert full.empty(0) == 0 and full.stage(1, b"z" * 20) == 1
    before = full.state()
    assert full.stage(0, b"z" * 20) == NO_SQ and full.stage(0, b"tiny") == NO_SQ and full.empty(0) == NO_SQ
    assert not lib.rdmaio_txring_room(full.r, 0) and full.state() == before


def test_slot_inline_and_empty_frames_are_copied_and_filled() -> None:
    ring = Ring(8, slots=4, max_inline=8, signal_interval=8)
    assert ring.stage(0, b"a slot frame of 20b", imm=7) == 1
    assert ring.stage(1, b"inline!", imm=8) == 0
    assert ring.empty(2, imm=9) == 0
    assert ring.stage(3, b"", imm=10) == 0  # an empty data frame: slotless, no SGE
    slot = 0  # the lowest free index is taken first
    wr = ring.sends[0]
    assert (wr.wr_id, wr.addr, wr.length, wr.lkey, wr.imm_data) == (WR_BASE | slot, ring.addr, 19, 100, 7)
    assert wr.opcode == lib.IBV_WR_SEND_WITH_IMM and wr.send_flags == 0
    assert bytes(ffi.buffer(ring.memory, 19)) == b"a slot frame of 20b"
    wr = ring.sends[1]
    assert wr.wr_id == WR_BASE | SLOTLESS | 0 and wr.send_flags == INLINE and wr.lkey == 0
    assert wr.addr == int(ffi.cast("uintptr_t", ring.scratch)) + 1 * 8 and wr.length == 7
    assert bytes(ffi.buffer(ffi.cast("char *", wr.addr), 7)) == b"inline!"
    # The 4th request is signalled: slotless, every sq_interval (4) requests.
    for i, seq, imm, flags in ((2, 1, 9, 0), (3, 2, 10, SIGNALED)):
        wr = ring.sends[i]
        assert (wr.wr_id, wr.addr, wr.length, wr.imm_data) == (WR_BASE | SLOTLESS | seq, 0, 0, imm)
        assert wr.send_flags == flags
    assert ring.in_flight() == [0, SLOTLESS | 0, SLOTLESS | 1, SLOTLESS | 2]
    assert ring.free() == [3, 2, 1]


def test_the_slotless_sequence_wraps_within_its_bits() -> None:
    ring = Ring(4, max_inline=8)
    ring.r.seq = SEQ_MASK
    assert ring.empty(0) == 0 and ring.empty(1) == 0
    assert [ring.sends[i].wr_id for i in (0, 1)] == [WR_BASE | SLOTLESS | SEQ_MASK, WR_BASE | SLOTLESS]
    assert ring.r.seq == 1


def test_a_completion_releases_everything_up_to_it_in_posting_order() -> None:
    ring = Ring(8, slots=4, max_inline=8, signal_interval=8)
    for i, data in enumerate((b"A" * 20, b"tiny", b"B" * 20, b"C" * 20)):
        ring.stage(i, data)
    order = ring.in_flight()
    assert order == [0, SLOTLESS, 1, 2] and ring.free() == [3]
    assert lib.rdmaio_txring_complete(ring.r, 1) == 0  # B's completion: A, the inline frame and B
    assert ring.in_flight() == [2] and ring.free() == [3, 0, 1]
    # One that is not in flight (never, on an RC queue) releases everything, and no more.
    assert lib.rdmaio_txring_complete(ring.r, 7) == 0
    assert ring.in_flight() == [] and ring.free() == [3, 0, 1, 2]
    assert lib.rdmaio_txring_complete(ring.r, 2) == 0 and ring.free() == [3, 0, 1, 2]


def test_the_in_flight_ring_wraps_and_a_corrupt_entry_is_never_written_out_of_bounds() -> None:
    ring = Ring(4, slots=4, max_inline=0, signal_interval=1)
    for round_ in range(10):  # 30 entries through a 4-entry ring
        staged = [ring.stage(i, bytes([round_]) * 9) for i in range(3)]
        assert staged == [1, 1, 1] and len(ring.in_flight()) == 3
        last = ring.in_flight()[-1]
        assert lib.rdmaio_txring_complete(ring.r, last) == 0
        assert ring.r.nfree == 4 and sorted(ring.free()) == [0, 1, 2, 3]
    # A slot index past the registered ring (a corrupt entry) is dropped, not pushed.
    ring.stage(0, b"x" * 9)
    ring.inflight[(ring.r.inflight_head + ring.r.inflight_count - 1) % 4] = 1000
    assert lib.rdmaio_txring_complete(ring.r, 1000) == 0
    assert ring.r.nfree == 3 and 1000 not in ring.free()


def test_the_eof_frame_is_signalled_and_its_completion_reported() -> None:
    ring = Ring(8, slots=4, max_inline=8, signal_interval=8)
    ring.stage(0, b"D" * 20)
    assert ring.empty(1, imm=5, flags=lib.RDMAIO_TX_EOF) == 0
    eof = SLOTLESS | 0
    assert ring.sends[1].send_flags == SIGNALED and ring.r.unsignaled == 0
    assert ring.r.eof_staged == 1 and ring.r.eof_index == eof
    assert lib.rdmaio_txring_complete(ring.r, 0) == 0  # the data frame's completion is not the EOF's
    assert lib.rdmaio_txring_complete(ring.r, eof) == 1


@pytest.mark.parametrize(
    ("slots", "signal_interval", "expected"), [(4, 8, 2), (16, 8, 8), (1, 8, 1), (16, 3, 3)]
)
def test_slot_frames_are_signalled_every_interval_at_most_half_the_ring(
    slots: int, signal_interval: int, expected: int
) -> None:
    ring = Ring(16, slots=slots, max_inline=0, signal_interval=signal_interval)
    assert ring.r.interval == expected
    signalled = []
    for _ in range(3 * expected):
        assert ring.stage(0, b"s" * 9) == 1
        signalled.append(bool(ring.sends[0].send_flags & SIGNALED))
        lib.rdmaio_txring_complete(ring.r, ring.sends[0].wr_id & verbs.WR_INDEX_MASK)  # slot back
        assert ring.r.nfree == slots
    assert signalled == ([False] * (expected - 1) + [True]) * 3


def test_slotless_frames_are_signalled_every_send_queue_interval() -> None:
    ring = Ring(8, max_inline=8, signal_interval=8)
    assert ring.r.sq_interval == 4  # at most half the send queue
    flags = []
    for _ in range(8):
        ring.empty(0)
        flags.append(ring.sends[0].send_flags)
        lib.rdmaio_txring_complete(ring.r, ring.sends[0].wr_id & verbs.WR_INDEX_MASK)
    assert flags == [0, 0, 0, SIGNALED] * 2


def test_finish_signals_the_chains_last_request_when_short_of_slots_or_entries() -> None:
    ring = Ring(16, slots=8, max_inline=8, signal_interval=8)  # interval 4, sq_interval 8
    for i in range(4):  # 4 free slots left: not below the interval
        ring.stage(i, b"x" * 20)
    assert ring.sends[3].send_flags & SIGNALED  # the 4th by the interval
    ring.sends[3].send_flags = 0
    assert lib.rdmaio_txring_finish(ring.r, 4) == 0 and ring.sends[3].send_flags == 0
    ring.stage(4, b"x" * 20)  # 3 free < interval 4, and slots are in flight
    assert lib.rdmaio_txring_finish(ring.r, 5) == 1 and ring.sends[4].send_flags & SIGNALED
    assert ring.r.unsignaled == 0
    # No slot registered: slots do not count (a completion would release none), only entries do.
    sq = Ring(8, max_inline=8, signal_interval=8)  # sq_interval 4
    for i in range(4):
        sq.empty(i)
    sq.sends[3].send_flags = 0
    assert lib.rdmaio_txring_finish(sq.r, 4) == 0  # 4 entries left, not below 4
    sq.empty(4)
    assert lib.rdmaio_txring_finish(sq.r, 5) == 1 and sq.sends[4].send_flags & SIGNALED


def test_room_is_a_free_entry_and_for_a_long_frame_a_free_slot() -> None:
    ring = Ring(2, max_inline=8)
    assert lib.rdmaio_txring_room(ring.r, 8) and not lib.rdmaio_txring_room(ring.r, 9)
    ring.add(0, 1)
    assert lib.rdmaio_txring_room(ring.r, 9) and lib.rdmaio_txring_room(ring.r, 1 << 40)
    ring.stage(0, b"x" * 9)
    assert not lib.rdmaio_txring_room(ring.r, 9) and lib.rdmaio_txring_room(ring.r, 0)
    ring.empty(1)
    assert not lib.rdmaio_txring_room(ring.r, 0)


HARNESS = Path(__file__).with_name("txring_harness.c")


def test_random_operations_keep_every_invariant_under_the_sanitizers(tmp_path: Path) -> None:
    """200,000 random stages (every length from empty to past a slot, some at an index past the send
    array), posts, in-order completions and ring growth, compiled with AddressSanitizer and UBSan: no
    out-of-bounds access or undefined behaviour, every slot free or in flight, refusals change nothing, and
    a sender out of slots or entries always has a signalled request posted (it cannot stall)."""
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g"]
    binary = compile_c(tmp_path, "harness", HARNESS, ["txring.c", "session.c"], sanitize)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    fields = dict(item.split("=") for item in run.stdout.split()[1:])
    assert run.stdout.startswith("ok ") and all(
        int(fields[k]) > 1000 for k in ("staged", "refused", "completed")
    )
    assert int(fields["stalls_checked"]) > 0


# ---- rdmaio_txring_stage_frame: the session's take and the ring's stage in one call ---------------------

SESSION = int(lib.RDMAIO_TX_SESSION)


def _sessions(peer_max: int = 1 << 20, depth: int = 8) -> tuple[Any, Any]:
    """Two sessions from the same handshakes: one on the Python SessionState (the reference), one on a C
    state (what stage_frame takes from)."""
    from rdmaio.core.shared_receive import new_session_state
    from rdmaio.protocol import FEATURE_BATCH, Handshake, Session

    local = Handshake(depth, 64, 1 << 20, features=FEATURE_BATCH)
    peer = Handshake(depth, 64, peer_max, features=FEATURE_BATCH)
    return Session(local, peer), Session(local, peer, state=new_session_state())


def _fields(session: Any) -> dict[str, int]:
    from rdmaio.protocol.sessionstate import STATE_FIELDS

    return {name: int(getattr(session.rules_state, name)) for name in STATE_FIELDS}


def _stage_frame(ring: Ring, session: Any, i: int, data: bytes, kind: int) -> int:
    return int(
        lib.rdmaio_txring_stage_frame(ring.r, session.rules_state, i, ffi.from_buffer(data), len(data), kind)
    )


def _python_take_and_stage(ring: Ring, session: Any, i: int, data: bytes, kind: int) -> tuple[str, Any]:
    """What the sender did per frame before stage_frame: the Python take, then the ring's stage (the ring's
    own checks first, as the sender makes them before taking)."""
    state = ring.state()
    probe = lib.rdmaio_txring_room(ring.r, len(data))
    if probe <= 0 or i >= len(ring.sends):
        return ("ring", state)
    try:
        imm = (
            session.take_data_frame(bool(kind), len(data))
            if kind >= 0
            else session.take_batch_frame(len(data), -kind)
        )
    except Exception as exc:
        return ("session", type(exc))
    return ("staged", ring.stage(i, data, imm))


def _comparable(ring: Ring) -> tuple[Any, ...]:
    """A ring's state without its own addresses: the work requests' buffers as offsets into its memory or
    scratch area, and the bytes there."""
    fields, free, inflight, _, memory = ring.state()
    base = ring.addr
    scratch = int(ffi.cast("uintptr_t", ring.scratch)) if ring.scratch is not None else 0
    sends = []
    for wr in ring.sends:
        addr = int(wr.addr)
        where = ("slot", addr - base) if base <= addr < base + len(memory) else ("scratch", addr - scratch)
        sends.append((int(wr.wr_id), where if addr else None, wr.length, wr.lkey, wr.imm_data, wr.send_flags))
    return fields, free, inflight, tuple(sends), memory, bytes(ffi.buffer(ring.scratch)) if scratch else b""


@pytest.mark.parametrize("seed", range(40))
def test_stage_frame_gives_the_imm_and_state_of_the_python_take_and_stage(seed: int) -> None:
    """The same frames through the Python take + rdmaio_txring_stage and through stage_frame on a C state:
    the same return, the same work requests, ring and session state; where the Python take raises, C
    refuses with RDMAIO_TX_SESSION and nothing changed (the ring and every session field)."""
    import random

    rnd = random.Random(seed)
    py_session, c_session = _sessions(peer_max=rnd.choice([64, 1 << 20]))
    py_ring, c_ring = Ring(16, slots=rnd.choice([0, 2, 16])), Ring(16, slots=0)
    c_ring.add(0, int(py_ring.r.slots)) if py_ring.r.slots else None
    count = 0
    refused_by_session = staged = 0
    for _ in range(60):
        length = rnd.choice([0, 1, 5, 16, 17, 32])
        kind = rnd.choice([1, 1, 0, -1, -2, -(max(1, length // 4)), -(length // 4 + 1)])
        data = bytes(rnd.randrange(256) for _ in range(length))
        i = count if rnd.random() < 0.95 else 99
        before = (c_ring.state(), _fields(c_session))
        expected = _python_take_and_stage(py_ring, py_session, i, data, kind)
        rc = _stage_frame(c_ring, c_session, i, data, kind)
        if expected[0] == "staged":
            assert rc == expected[1] >= 0
            count += 1
            staged += 1
        else:
            assert rc < 0 and (rc == SESSION) == (expected[0] == "session")
            assert (c_ring.state(), _fields(c_session)) == before  # a refusal changes nothing
            refused_by_session += rc == SESSION
        assert _comparable(c_ring) == _comparable(py_ring)
        assert _fields(c_session) == _fields(py_session)
        if rnd.random() < 0.3 and py_ring.r.inflight_count:  # completions come back (in order)
            last = rnd.randrange(int(py_ring.r.inflight_count))
            for r in (py_ring, c_ring):
                index = ffi.new("uint32_t *")
                assert lib.rdmaio_txring_inflight_at(r.r, last, index) == 0
                lib.rdmaio_txring_complete(r.r, index[0])
        if rnd.random() < 0.3:  # the peer grants credits back (a CREDIT frame): same rules on both sides
            for s in (py_session, c_session):
                s.rules_state.send_credits = min(int(s.rules_state.send_credits) + 3, 8)
        if count >= 16:
            count = 0  # the chain was posted: the send array is reused
            for r in (py_ring, c_ring):
                lib.rdmaio_txring_finish(r.r, 16)
    assert staged and refused_by_session  # both outcomes were compared


def test_stage_frame_refusals_change_nothing() -> None:
    """Each refusal: the ring's (no send-queue entry, no slot, bad index, bad kind) before the session is
    asked, the session's (no credits, message too large, not fast) after the ring's checks; nothing moves."""
    _, s = _sessions(peer_max=64)
    ring = Ring(2, slots=0)

    def refused(code: int, i: int, data: bytes, kind: int) -> None:
        before = (ring.state(), _fields(s))
        assert _stage_frame(ring, s, i, data, kind) == code
        assert (ring.state(), _fields(s)) == before

    refused(NO_SLOT, 0, b"x" * 20, 1)  # a slot frame, no slot: the session keeps its credit
    refused(BAD_INDEX, 5, b"x", 1)
    refused(BAD_INDEX, -1, b"x", 1)
    refused(BAD_ARG, 0, b"x", 2)  # RNDV (and any other kind) is the Python take's
    refused(SESSION, 0, b"x" * 4, -2)  # two messages need 8 bytes of records
    assert _stage_frame(ring, s, 0, b"a" * 16, 0) >= 0  # MORE: 16 of the peer's 64 bytes
    assert _stage_frame(ring, s, 1, b"b" * 16, 0) >= 0
    refused(NO_SQ, 0, b"c", 1)  # both entries in flight
    lib.rdmaio_txring_finish(ring.r, 2)
    index = ffi.new("uint32_t *")
    assert lib.rdmaio_txring_inflight_at(ring.r, 1, index) == 0
    lib.rdmaio_txring_complete(ring.r, index[0])
    s.rules_state.send_credits = 8
    ring.add(0, 2)
    assert _stage_frame(ring, s, 0, b"d" * 32, 0) == 1  # MORE in a slot: 64 of the peer's 64 bytes
    refused(SESSION, 1, b"e", 1)  # one byte more: over the peer's maximum (MessageTooLargeError in Python)
    assert _stage_frame(ring, s, 1, b"", 1) == 0  # the empty END completes the 64-byte message
    lib.rdmaio_txring_finish(ring.r, 2)
    assert lib.rdmaio_txring_inflight_at(ring.r, 1, index) == 0
    lib.rdmaio_txring_complete(ring.r, index[0])
    s.rules_state.send_credits = 1
    refused(SESSION, 0, b"e", 1)  # one credit: a data frame needs two
    s.rules_state.send_credits = 8
    s.rules_state.fast = 0
    refused(SESSION, 0, b"e", 1)  # not fast: every rule is the Python Session's
    s.rules_state.fast = 1
    assert _stage_frame(ring, s, 0, b"e", 1) == 0  # inline: a one-byte message
    assert int(s.rules_state.messages_sent) == 2
