"""The header framing and the capabilities in the handshake (rdmaio.protocol.framing and .handshake), its
C ports (rdmaio_rx_unframe, the send ring's header), and whole connections over a fake device without
immediate data (it refuses SEND/WRITE with immediate data with EINVAL, as libsiw does)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rdmaio
from rdmaio import verbs
from rdmaio.core.capabilities import connect_blocks, device_capabilities
from rdmaio.core.negotiation import local_handshake
from rdmaio.errors import HandshakeError, VerbsError
from rdmaio.protocol import FEATURE_BATCH, FEATURE_GROW, FEATURE_ONESIDED, MAX_PRIVATE_DATA, Handshake
from rdmaio.protocol.framing import (
    CONTROL_WORD,
    FRAME_HEADER,
    IMMEDIATE_FRAMING,
    encode_frame_header,
    negotiate_framing,
    unframe_receive,
)
from rdmaio.protocol.handshake import _HEADER, FLAG_CAPS, MAX_SOFTWARE, Capabilities
from rdmaio.protocol.session import Session
from rdmaio.testing.fakes import FakeTransport, PostedSend
from rdmaio.testing.nullpair import null_pair
from rdmaio.verbs.native import ffi, lib

Run = Callable[[Coroutine[Any, Any, Any]], Any]
_RECV = int(verbs.WcOpcode.RECV)
_RECV_RDMA_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)
IWARP = Capabilities(immediate=False, atomics=False, memory_windows=False, max_inline=64, max_read_sge=1)

# -- capabilities in the handshake ---------------------------------------------------------------------------


def test_the_largest_handshake_with_capabilities_fits_rdma_cm_private_data() -> None:
    hs = Handshake(
        32,
        65536,
        1 << 30,
        features=FEATURE_BATCH | FEATURE_GROW | FEATURE_ONESIDED,
        initial_depth=4,
        software="9" * 40,
        caps=Capabilities(max_inline=0xFFFF, max_read_sge=0xFF, header_framing=True),
    )
    data = hs.encode()
    assert len(data) == 8 + 16 + 4 + 1 + MAX_SOFTWARE + 4 == 53 <= MAX_PRIVATE_DATA
    back = Handshake.decode(data + bytes(MAX_PRIVATE_DATA - len(data)))  # rdma_cm pads with zeros
    assert back == Handshake(
        32,
        65536,
        1 << 30,
        features=FEATURE_BATCH | FEATURE_GROW | FEATURE_ONESIDED,
        initial_depth=4,
        software="9" * MAX_SOFTWARE,
        caps=hs.caps,
    )


@pytest.mark.parametrize("software", ["", "1.2.3"])
def test_capabilities_round_trip_with_and_without_the_software_version(software: str) -> None:
    caps = Capabilities(immediate=False, atomics=False, memory_windows=True, max_inline=80, max_read_sge=1)
    hs = Handshake(8, 4096, 1 << 20, software=software, caps=caps)
    data = hs.encode()
    assert data[5] & FLAG_CAPS
    assert Handshake.decode(data).caps == caps


def test_an_older_decoder_reads_a_handshake_with_capabilities_as_before() -> None:
    """An older peer reads the fields it knows and ignores the flag bit and the trailing bytes: what it
    decodes is what a handshake without capabilities says."""
    with_caps = Handshake(8, 4096, 1 << 20, features=FEATURE_BATCH, software="0.9", caps=IWARP).encode()
    without = Handshake(8, 4096, 1 << 20, features=FEATURE_BATCH, software="0.9").encode()
    assert with_caps[: len(without)][:5] == without[:5]  # magic, version
    assert with_caps[8 : len(without)] == without[8:]  # the same body, the capabilities after it
    # The flags byte differs only in FLAG_CAPS, which an older version masks out (KNOWN_FEATURES) ...
    assert with_caps[5] & ~FLAG_CAPS == without[5]
    # ... and a handshake without the flag (an older peer's) has no capabilities: immediate data only.
    assert Handshake.decode(without).caps is None


def test_a_capabilities_flag_without_its_bytes_is_ignored() -> None:
    data = bytearray(Handshake(8, 4096, 1 << 20).encode())
    data[5] |= FLAG_CAPS
    assert Handshake.decode(bytes(data)).caps is None
    _magic, _v, _flags, body_len = _HEADER.unpack_from(data)
    assert len(data) == _HEADER.size + body_len


# -- negotiation ---------------------------------------------------------------------------------------------


def _hs(caps: Capabilities | None) -> Handshake:
    return Handshake(8, 4096, 1 << 20, caps=caps)


@pytest.mark.parametrize(
    ("mine", "theirs", "immediate"),
    [
        (None, None, True),
        (Capabilities(), None, True),
        (None, Capabilities(), True),
        (Capabilities(), Capabilities(), True),
        (Capabilities(header_framing=True), Capabilities(), False),
        (Capabilities(), Capabilities(header_framing=True), False),
        (IWARP, Capabilities(), False),
        (Capabilities(), IWARP, False),
        (IWARP, IWARP, False),
    ],
)
def test_the_header_framing_is_used_when_either_side_lacks_immediates_or_asks_for_it(
    mine: Capabilities | None, theirs: Capabilities | None, immediate: bool
) -> None:
    framing = negotiate_framing(_hs(mine), _hs(theirs))
    other = negotiate_framing(_hs(theirs), _hs(mine))
    assert framing.immediate is other.immediate is immediate
    assert framing.header == other.header == (0 if immediate else FRAME_HEADER)
    assert framing.name == ("immediate" if immediate else "header")
    session = Session(_hs(mine), _hs(theirs))
    assert session.framing.immediate is immediate
    assert session.max_fragment == 4096 - framing.header  # the header takes slot room
    assert framing.peer is theirs and framing.local is mine


@pytest.mark.parametrize("mine", [IWARP, Capabilities(header_framing=True)])
def test_the_header_framing_with_an_older_peer_is_refused(mine: Capabilities) -> None:
    with pytest.raises(HandshakeError, match="does not support it"):
        negotiate_framing(_hs(mine), _hs(None))
    with pytest.raises(HandshakeError, match="did not announce"):
        negotiate_framing(_hs(None), _hs(mine))
    with pytest.raises(HandshakeError):
        Session(_hs(mine), _hs(None))


def test_options_framing_is_validated_and_announced() -> None:
    assert rdmaio.Options().framing == "auto"
    with pytest.raises(ValueError, match="framing must be 'auto' or 'header'"):
        rdmaio.Options(framing="none")
    opts = rdmaio.Options(framing="header")
    fake = FakeTransport(1, 1)
    caps = device_capabilities(fake.device, 64, opts)
    assert caps.header_framing and caps.immediate and caps.max_inline == 64
    assert local_handshake(opts, caps=caps).caps is caps
    iwarp = FakeTransport(1, 1, immediate=False)
    caps = device_capabilities(iwarp.device, 64, rdmaio.Options())
    assert not caps.immediate and not caps.header_framing and iwarp.device.transport == "iWARP"
    assert IMMEDIATE_FRAMING.immediate


def test_whether_the_connect_blocks_is_the_devices_and_asked_once() -> None:
    """Dialing probes the peer with a TCP connect first only where rdma_connect would block the loop
    (Soft-iWARP): the device says so, once per device."""

    class Device:
        def __init__(self, handle: int, blocks: bool) -> None:
            self.handle, self.connect_blocks, self.asked = handle, blocks, 0

        def __getattribute__(self, name: str) -> Any:
            if name == "connect_blocks":
                object.__setattr__(self, "asked", object.__getattribute__(self, "asked") + 1)
            return object.__getattribute__(self, name)

    siw, rxe = Device(0x5157_0001, True), Device(0x5157_0002, False)
    assert connect_blocks(siw) and connect_blocks(siw) and siw.asked == 1
    assert not connect_blocks(rxe) and not connect_blocks(rxe) and rxe.asked == 1


# -- the receive side: unframing, C against its Python reference -------------------------------------------


def _unframe_both(
    rows: list[tuple[int, int, int, int, bytes]], slot_size: int
) -> tuple[list[tuple[int, ...]], bytes, list[tuple[int, ...]], bytes, int]:
    """rows: (status, opcode, flags, byte_len, slot bytes). C and Python results: records and ring."""
    ring_c = bytearray(slot_size * len(rows))
    for i, (*_rest, data) in enumerate(rows):
        ring_c[i * slot_size : i * slot_size + len(data)] = data
    ring_py = bytearray(ring_c)
    table = [
        (verbs.make_wr_id(verbs.WR_KIND_RECV, 3, i), status, opcode, n, 0, flags)
        for i, (status, opcode, flags, n, _d) in enumerate(rows)
    ]
    records = ffi.new("struct rdmaio_wc[]", table)
    changed = lib.rdmaio_rx_unframe(records, 0, len(rows), ffi.from_buffer(ring_c), len(ring_c), slot_size)
    c_out = [(r.status, r.opcode, r.byte_len, r.imm_data, r.flags) for r in records]
    py_out = []
    for i, (status, opcode, flags, n, _d) in enumerate(rows):
        if status or opcode != _RECV:
            py_out.append((status, opcode, n, 0, flags))
            continue
        view = memoryview(ring_py)[i * slot_size : (i + 1) * slot_size]
        f, imm, length = unframe_receive(flags, n, view)
        py_out.append((status, opcode, length, imm, f))
    return c_out, bytes(ring_c), py_out, bytes(ring_py), changed


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0, 0, 0, 5]),
            st.sampled_from([_RECV, _RECV, _RECV_RDMA_IMM]),
            st.sampled_from([0, 0, verbs.WC_WITH_IMM]),
            st.integers(0, 72),
            st.sampled_from([None, CONTROL_WORD, CONTROL_WORD | 1, 0x2000_0003, 0x8005_0000]),
            st.binary(max_size=68),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_c_unframing_matches_the_python_reference(
    rows: list[tuple[int, int, int, int, int | None, bytes]],
) -> None:
    slot_size = 72
    prepared = []
    for status, opcode, flags, n, word, payload in rows:
        data = (encode_frame_header(word) if word is not None else b"") + payload
        prepared.append((status, opcode, flags, n, data[:slot_size]))
    c_out, c_ring, py_out, py_ring, changed = _unframe_both(prepared, slot_size)
    assert c_out == py_out and c_ring == py_ring
    assert changed == sum(1 for status, opcode, *_ in rows if not status and opcode == _RECV)


def test_unframing_a_frame_a_control_message_and_malformed_receives() -> None:
    slot = 32
    frame = encode_frame_header(0x2000_0005) + b"hello"
    control = encode_frame_header(CONTROL_WORD) + b"ctl-message-----"
    rows = [
        (0, _RECV, 0, len(frame), frame),  # a DATA_END frame granting 5 credits
        (0, _RECV, 0, len(control), control),  # a one-sided control message
        (0, _RECV, 0, 3, b"abc"),  # shorter than the header
        (0, _RECV, verbs.WC_WITH_IMM, len(frame), frame),  # a SEND with immediate data: never sent here
        (0, _RECV, 0, 40, b""),  # longer than a slot
        (0, _RECV_RDMA_IMM, verbs.WC_WITH_IMM, 9, b""),  # a write notice: left as it is
    ]
    c_out, c_ring, py_out, _py_ring, changed = _unframe_both(rows, slot)
    assert c_out == py_out and changed == 5
    assert c_out[0] == (0, _RECV, 5, 0x2000_0005, verbs.WC_WITH_IMM) and c_ring[:5] == b"hello"
    assert c_out[1] == (0, _RECV, 16, 0, 0) and c_ring[slot : slot + 16] == b"ctl-message-----"
    for row in c_out[2:5]:
        assert row[2:] == (0, 0, verbs.WC_WITH_IMM)  # kind 0: the frame rules reject it
    assert c_out[5] == (0, _RECV_RDMA_IMM, 9, 0, verbs.WC_WITH_IMM)
    # A receive whose slot lies outside the ring is rejected, not read; bad arguments change nothing.
    records = ffi.new("struct rdmaio_wc[]", [(verbs.make_wr_id(verbs.WR_KIND_RECV, 3, 9), 0, _RECV, 8, 0, 0)])
    ring = ffi.new("uint8_t[]", 64)
    assert lib.rdmaio_rx_unframe(records, 0, 1, ring, 64, 32) == 1
    assert (records[0].imm_data, records[0].byte_len, records[0].flags) == (0, 0, verbs.WC_WITH_IMM)
    assert lib.rdmaio_rx_unframe(records, -1, 1, ring, 64, 32) == -1
    assert lib.rdmaio_rx_unframe(records, 0, 1, ring, 64, 0) == -1


# -- the send side: the ring writes the header and posts plain SENDs -----------------------------------------


def _ring(header: int, max_inline: int = 16, slot_size: int = 64) -> tuple[Any, ...]:
    sends = ffi.new("struct rdmaio_send[]", 4)
    tx = ffi.new("struct rdmaio_txring *")
    free_stack, inflight = ffi.new("uint32_t[]", 4), ffi.new("uint32_t[]", 4)
    base = verbs.make_wr_id(verbs.WR_KIND_SEND, 1, 0)
    assert (
        lib.rdmaio_txring_init(tx, sends, 4, free_stack, 4, inflight, 4, slot_size, max_inline, 8, base) == 0
    )
    scratch = ffi.new("uint8_t[]", 4 * max_inline)
    assert lib.rdmaio_txring_set_scratch(tx, scratch, 4) == 0
    memory = ffi.new("uint8_t[]", 4 * slot_size)
    lkeys = ffi.new("uint32_t[]", [7, 7, 7, 7])
    assert lib.rdmaio_txring_add_slots(tx, int(ffi.cast("uintptr_t", memory)), lkeys, 0, 4) == 0
    assert lib.rdmaio_txring_set_header(tx, header) == 0
    return tx, sends, (scratch, memory, lkeys, free_stack, inflight)


def _bytes(wr: Any) -> bytes:
    return bytes(ffi.buffer(ffi.cast("char *", wr.addr), wr.length)) if wr.length else b""


def test_the_send_ring_writes_the_header_before_every_frame_and_posts_plain_sends() -> None:
    tx, sends, _keep = _ring(FRAME_HEADER)
    assert lib.rdmaio_txring_stage(tx, 0, b"tiny", 4, 0x2000_0001) == 0  # 8 bytes: inline
    assert lib.rdmaio_txring_stage(tx, 1, b"x" * 13, 13, 0x1000_0000) == 1  # 17 > 16 inline: a slot
    assert lib.rdmaio_txring_stage_empty(tx, 2, 0x3000_0004, 0) == 0  # a CREDIT frame: its header only
    assert lib.rdmaio_txring_stage_empty(tx, 3, 0x4000_0000, lib.RDMAIO_TX_EOF) == 0
    expected = [
        (encode_frame_header(0x2000_0001) + b"tiny", verbs.SEND_INLINE),
        (encode_frame_header(0x1000_0000) + b"x" * 13, 0),
        (encode_frame_header(0x3000_0004), verbs.SEND_INLINE),
        (encode_frame_header(0x4000_0000), verbs.SEND_INLINE | verbs.SEND_SIGNALED),
    ]
    for wr, (data, flags) in zip(sends, expected, strict=True):
        assert wr.opcode == lib.IBV_WR_SEND and wr.imm_data == 0
        assert _bytes(wr) == data
        assert wr.send_flags & verbs.SEND_INLINE == flags & verbs.SEND_INLINE
        assert wr.send_flags & flags == flags  # the EOF frame is signalled
    assert tx.eof_staged == 1 and lib.rdmaio_txring_complete(tx, tx.eof_index) == 1
    # A frame that fits a slot only without the header is refused (the session never takes one).
    tx, _sends, _keep = _ring(FRAME_HEADER)
    assert lib.rdmaio_txring_stage(tx, 0, b"y" * 61, 61, 0) == lib.RDMAIO_TX_TOO_LONG
    assert lib.rdmaio_txring_stage(tx, 0, b"y" * 60, 60, 0) == 1
    # The framing is fixed once a frame was staged; only 0 and 4 exist.
    assert lib.rdmaio_txring_set_header(tx, 0) == lib.RDMAIO_TX_BAD_ARG
    tx, _sends, _keep = _ring(0)
    assert lib.rdmaio_txring_set_header(tx, 2) == lib.RDMAIO_TX_BAD_ARG


def test_the_immediate_framing_ring_is_unchanged() -> None:
    tx, sends, _keep = _ring(0)
    assert lib.rdmaio_txring_stage(tx, 0, b"tiny", 4, 0x2000_0001) == 0
    assert lib.rdmaio_txring_stage_empty(tx, 1, 0x3000_0004, 0) == 0
    assert (sends[0].opcode, sends[0].imm_data, _bytes(sends[0])) == (
        lib.IBV_WR_SEND_WITH_IMM,
        0x2000_0001,
        b"tiny",
    )
    assert (sends[1].opcode, sends[1].imm_data, sends[1].length) == (lib.IBV_WR_SEND_WITH_IMM, 0x3000_0004, 0)


# -- whole connections over a fake device without immediate data --------------------------------------------

SLOT = 256
OPTIONS = rdmaio.Options(
    slot_size=SLOT,
    recv_depth=8,
    send_depth=8,
    initial_depth=4,
    batch_limit=64,
    keepalive_interval=None,
    rndv_threshold=0,
)


def _iwarp_pair(caps: tuple[Capabilities, Capabilities] = (IWARP, IWARP)) -> tuple[Any, Any, list[Any]]:
    """Two endpoints over the null device whose queue pairs refuse immediate data (libsiw's EINVAL);
    each side announces ``caps``. Returns them and their transports."""
    hs = local_handshake(OPTIONS, grow=False, caps=caps[0])
    a, b, _device = null_pair(OPTIONS, hs)
    transports = [a._conn.transport, b._conn.transport]
    for transport in transports:
        transport.qp.immediate = False
    return a, b, transports


def test_the_fake_device_without_immediates_refuses_them_as_libsiw_does() -> None:
    transport = FakeTransport(1, 1, immediate=False)
    wr = transport.qp.send_array[0]
    wr.opcode = lib.IBV_WR_SEND_WITH_IMM
    with pytest.raises(VerbsError) as info:
        transport.qp.post_sends(1)
    assert info.value.errno == 22 and transport.qp.posts == []
    transport.qp.rdma_array[0].opcode = lib.IBV_WR_RDMA_WRITE_WITH_IMM
    with pytest.raises(VerbsError):
        transport.qp.post_rdma(1)


def test_an_immediate_connection_on_the_fake_device_without_immediates_fails_at_its_first_send(
    arun: Run,
) -> None:
    """What issue's first send on siw saw: the immediate framing there fails at the post (EINVAL)."""

    async def main() -> None:
        a, b, _t = _iwarp_pair((Capabilities(), Capabilities()))  # announces immediate data: wrong here
        assert a._conn.framing.immediate
        await a.send(b"x" * 200)  # posted at the end of the iteration: the post fails with EINVAL
        for _ in range(3):
            await asyncio.sleep(0)
        with pytest.raises(rdmaio.RdmaError) as info:
            await a.send(b"y")
        chain = [info.value, info.value.__cause__, info.value.__context__]
        assert any(isinstance(e, VerbsError) and e.errno == 22 for e in chain), chain
        a.abort()
        b.abort()

    arun(main())


def _sizes() -> list[int]:
    payload = SLOT - FRAME_HEADER
    return [0, 1, 3, 4, 5, 59, 60, 61, *range(payload - 4, payload + 5), SLOT + 4, 3 * SLOT + 17, 5000]


def test_a_connection_on_a_device_without_immediates_echoes_every_size_in_the_header_framing(
    arun: Run,
) -> None:
    """Messages around the slot boundary (the usable payload is slot_size - 4), small batched ones, stream
    bytes and EOF travel as plain SENDs with the header: no request with immediate data is posted (the
    fake would refuse it), every frame found a posted receive (iWARP has no RNR), all arrive intact."""

    async def main() -> None:
        a, b, transports = _iwarp_pair()
        assert a._conn.framing.name == b._conn.framing.name == "header"
        assert a._conn.extra["framing"] == "header"
        messages = [bytes((n + k) & 0xFF for k in range(n)) for n in _sizes()]
        for message in messages:
            await a.send(message)
        for _ in range(20):
            await a.send(b"small")  # batched (DATA_BATCH) while the first ones are in flight
        for message in messages:
            assert await asyncio.wait_for(b.recv(), 5) == message
        for _ in range(20):
            assert await asyncio.wait_for(b.recv(), 5) == b"small"
        b.write(b"stream " * 300)
        b.write_eof()
        await b.drain()
        assert await asyncio.wait_for(a.read(), 5) == b"stream " * 300
        posted = [request for transport in transports for chain in transport.qp.posts for request in chain]
        assert posted and all(isinstance(r, PostedSend) and r.opcode == lib.IBV_WR_SEND for r in posted)
        # Every SEND carries at least its header and at most a slot; its first 4 bytes are a frame word.
        assert all(FRAME_HEADER <= len(r[1]) <= SLOT and r[1][0] >> 4 in range(1, 10) for r in posted)
        assert max(len(r[1]) for r in posted) == SLOT  # full slots were used, header included
        assert [t.rnr_violations for t in transports] == [0, 0]
        stats = a.statistics()
        assert stats["messages_sent"] == len(messages) + 20
        await a.aclose()
        await b.aclose()

    arun(main())


def test_receives_are_posted_before_the_peer_may_send_under_the_header_framing(arun: Run) -> None:
    """Credits promise a posted receive for every SEND (iWARP ends the connection otherwise): both sides
    send at once, in both directions, far more than a window, while the reader side holds slots (reads
    late); the wire records any SEND that found no posted receive."""

    async def main() -> None:
        a, b, transports = _iwarp_pair()
        data = [bytes([i]) * (37 * i % 700) for i in range(120)]

        async def pump(ep: Any) -> None:
            for message in data:
                await ep.send(message)

        senders = [asyncio.create_task(pump(a)), asyncio.create_task(pump(b))]
        await asyncio.sleep(0.01)  # both sides run out of credits before anyone reads
        got_a = [await asyncio.wait_for(a.recv(), 5) for _ in data]
        got_b = [await asyncio.wait_for(b.recv(), 5) for _ in data]
        await asyncio.gather(*senders)
        assert got_a == data and got_b == data
        assert [t.rnr_violations for t in transports] == [0, 0]
        for t in transports:
            assert len(t.posted) <= OPTIONS.recv_depth
        a.abort()
        b.abort()

    arun(main())
