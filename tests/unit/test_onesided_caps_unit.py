"""One-sided RDMA on devices without atomics or memory windows (iWARP: siw, E810, Chelsio), on the fakes of
test_onesided_unit and the null device (no RDMA device): typed errors before anything is posted, the key's
flag that says the exporter has no atomics, and the Options that take a capability away on rxe."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from ctest import build_and_run
from test_onesided_unit import RECV, RECV_RDMA_WITH_IMM, Rig, key, settle

import rdmaio
from rdmaio._ffi import ffi, lib
from rdmaio.core.onesided import ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, RemoteKey
from rdmaio.core.onesided.exporter import CTL_WRITE_NOTICE
from rdmaio.core.onesided.keys import KEY_FLAG_NO_ATOMICS
from rdmaio.core.transport import private_pd_needed
from rdmaio.options import Options
from rdmaio.testing.fakes import IWARP_ONESIDED_CAPS, RXE_ONESIDED_CAPS, FakeCapsDevice, onesided_rig
from rdmaio.testing.nullpair import null_pair

Run = Callable[[Coroutine[Any, Any, Any]], Any]


# --- the key's wire form -------------------------------------------------------------------------------


def test_a_key_of_a_device_without_atomics_says_so_on_the_wire() -> None:
    plain = RemoteKey(0x10000, 0x77, 4096, ACCESS_READ | ACCESS_WRITE, 5)
    flagged = RemoteKey(0x10000, 0x77, 4096, ACCESS_READ | ACCESS_WRITE, 5, exporter_atomics=False)
    # A device with atomics: the wire form is what it always was (the u16 after the access bits is 0).
    assert bytes(plain)[2:4] == b"\0\0"
    assert struct.unpack_from("!H", bytes(flagged), 2)[0] == KEY_FLAG_NO_ATOMICS
    assert bytes(flagged)[4:] == bytes(plain)[4:]
    assert RemoteKey.from_bytes(bytes(flagged)) == flagged
    assert RemoteKey.from_bytes(bytes(flagged)).exporter_atomics is False
    assert RemoteKey.from_bytes(bytes(plain)).exporter_atomics is True
    # A key that grants atomics from a device that says it has none is not a key rdmaio makes.
    with pytest.raises(rdmaio.InvalidRemoteKeyError):
        RemoteKey(0x10000, 0x77, 4096, ACCESS_ATOMIC, 5, exporter_atomics=False)
    wire = bytearray(bytes(flagged))
    wire[1] |= ACCESS_ATOMIC
    with pytest.raises(rdmaio.InvalidRemoteKeyError):
        RemoteKey.from_bytes(bytes(wire))
    # Every other bit of that u16 is still reserved.
    for bit in range(15):
        wire = bytearray(bytes(plain))
        struct.pack_into("!H", wire, 2, 1 << bit)
        with pytest.raises(rdmaio.InvalidRemoteKeyError, match="reserved"):
            RemoteKey.from_bytes(bytes(wire))


# --- the exporter's device -----------------------------------------------------------------------------


def test_export_with_atomics_on_a_device_without_them_raises_naming_the_device(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(atomics=False)
        rig.engine.operations.device_name = "siw0"
        for access in ("a", "ra", "rwa"):
            with pytest.raises(rdmaio.FeatureNotSupportedError, match="siw0") as info:
                rig.engine.export(bytearray(64), access=access, scope="domain")
            assert isinstance(info.value, NotImplementedError) and isinstance(info.value, rdmaio.RdmaError)
            assert "atomic" in str(info.value)
        assert rig.grants == [] and rig.engine.grants == {}  # nothing registered
        k = rig.engine.export(bytearray(64), access="rw", scope="domain")
        assert k.exporter_atomics is False
        assert struct.unpack_from("!H", bytes(k), 2)[0] == KEY_FLAG_NO_ATOMICS
        # A device with atomics marks nothing.
        rig2 = Rig()
        k2 = rig2.engine.export(bytearray(64), access="rw", scope="domain")
        assert k2.exporter_atomics is True and bytes(k2)[2:4] == b"\0\0"

    arun(main())


def test_atomics_on_a_key_of_an_exporter_without_atomics_raise_before_posting(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        e = rig.engine
        flagged = RemoteKey(0x10000, 0x77, 4096, ACCESS_READ | ACCESS_WRITE, 42, exporter_atomics=False)
        for call in (
            e.fetch_add(flagged, 0, 1),
            e.compare_swap(flagged, 8, 0, 1),
            e.fetch_add_many(flagged, [0, 8], 1),
            e.fetch_add_many(flagged, [], 1),
        ):
            with pytest.raises(rdmaio.FeatureNotSupportedError, match="peer's device"):
                await call
        assert rig.qp.posted == [] and rig.failures == []
        # The connection stays usable: a read on the same key goes out.
        future = asyncio.ensure_future(e.read(flagged, 0, 4))
        await asyncio.sleep(0)
        rig.complete(data=b"abcd")
        assert await future == b"abcd"
        # A key that merely does not grant atomics (its device has them) is an access error, as before.
        with pytest.raises(rdmaio.RemoteAccessError):
            await e.fetch_add(key(64, ACCESS_READ), 0, 1)

    arun(main())


def test_atomics_on_this_sides_device_without_them_raise_before_posting(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(atomics=False)
        e = rig.engine
        e.operations.device_name = "siw0"
        full = key(4096)  # a peer with atomics granted them
        for call in (
            e.fetch_add(full, 0, 1),
            e.compare_swap(full, 8, 0, 1),
            e.fetch_add_many(full, [0, 8, 16], 2),
        ):
            with pytest.raises(rdmaio.FeatureNotSupportedError, match="siw0"):
                await call
        assert rig.qp.posted == [] and rig.failures == []
        assert e.statistics()["rdma_ops_pending"] == 0

    arun(main())


def test_the_serial_path_of_atomics_is_closed_on_a_device_without_them(arun: Run) -> None:
    """The serial path posts without the general checks: on a device without atomics it must not take an
    atomic (it would reach the NIC, which refuses it by failing the connection)."""

    async def main() -> None:
        for atomics in (True, False):
            rig = onesided_rig(atomics=atomics)
            e = rig.engine
            for _ in range(3):  # the first read opens the serial path, the next ones take it
                assert await e.read(rig.key, 0, 8) == bytes(8)
            posted = len(rig.qp.posted)
            at_post = e.operations.statistics()["rdma_completed_at_post"]
            if atomics:  # the control: the same calls take the serial path where the device has atomics
                await e.fetch_add(rig.key, 0, 1)
                await e.compare_swap(rig.key, 0, 0, 1)
                assert len(rig.qp.posted) == posted + 2
                assert e.operations.statistics()["rdma_completed_at_post"] == at_post + 2
                continue
            for _ in range(3):
                with pytest.raises(rdmaio.FeatureNotSupportedError):
                    await e.fetch_add(rig.key, 0, 1)
                with pytest.raises(rdmaio.FeatureNotSupportedError):
                    await e.compare_swap(rig.key, 0, 0, 1)
            assert len(rig.qp.posted) == posted
            assert await e.read(rig.key, 0, 8) == bytes(8)  # still usable

    arun(main())


# --- what a connection uses of its device --------------------------------------------------------------


@pytest.mark.parametrize(
    ("caps", "options", "atomics", "windows"),
    [
        (IWARP_ONESIDED_CAPS, Options(), False, False),
        (RXE_ONESIDED_CAPS, Options(), True, True),
        (RXE_ONESIDED_CAPS, Options(atomics="off"), False, True),
        (RXE_ONESIDED_CAPS, Options(memory_windows="off"), True, False),
    ],
)
def test_a_connection_uses_what_its_device_offers_less_what_options_take_away(
    arun: Run,
    monkeypatch: pytest.MonkeyPatch,
    caps: Any,
    options: Options,
    atomics: bool,
    windows: bool,
) -> None:
    """Real connections of the null device on a fake device of the given capabilities (an iWARP device
    has neither atomics nor windows): what their engines use, and what export() says where one lacks."""
    device = FakeCapsDevice(caps)
    monkeypatch.setattr(rdmaio.core.onesided, "cached_caps", lambda _device: device.query_onesided_caps())

    async def main() -> None:
        _a, b, _device = null_pair(options)
        engine = b._conn.onesided
        assert engine.operations.atomics is atomics
        assert (engine.exporter._bind_window is not None) is windows
        name = engine.operations.device_name  # the connection's device, named in the errors
        assert name == b._conn.transport.device.name
        memory = bytearray(64)
        if atomics:
            assert b.export(memory, access="rwa", scope="domain").exporter_atomics
        else:
            with pytest.raises(rdmaio.FeatureNotSupportedError, match=name):
                b.export(memory, access="rwa", scope="domain")
            assert not b.export(memory, access="rw", scope="domain").exporter_atomics
        if not windows:
            with pytest.raises(rdmaio.FeatureNotSupportedError, match=f"{name} has no memory windows"):
                b.export(memory, access="rw")

    arun(main())


@pytest.mark.parametrize("field", ["atomics", "memory_windows"])
def test_the_capability_options_are_validated(field: str) -> None:
    for bad in ("on", "", None, True, "OFF"):
        with pytest.raises(ValueError, match=field.split("_")[0]):
            Options(**{field: bad})
    assert getattr(Options(**{field: "off"}), field) == "off"
    assert getattr(Options(), field) == "auto"


def test_atomics_off_on_real_connections_of_the_null_device(arun: Run) -> None:
    """Options(atomics="off") on both sides of a real pair: export with "a" raises, keys carry the flag,
    the importer's atomics raise FeatureNotSupportedError before posting, and the connection goes on."""

    async def main() -> None:
        a, b, _device = null_pair(Options(atomics="off"))
        memory = bytearray(64)
        with pytest.raises(rdmaio.FeatureNotSupportedError):
            b.export(memory, access="rwa", scope="domain")
        k = b.export(memory, access="rw", scope="domain")
        assert k.exporter_atomics is False
        received = RemoteKey.from_bytes(bytes(k))
        for call in (
            a.fetch_add(received, 0, 1),
            a.compare_swap(received, 0, 0, 1),
            a.fetch_add_many(received, [0, 8], 1),
        ):
            with pytest.raises(rdmaio.FeatureNotSupportedError):
                await call
        assert a.statistics()["rdma_fetch_adds"] == 0 and a.statistics()["rdma_compare_swaps"] == 0
        await a.rdma_write(received, 0, b"still up")
        assert memory[:8] == b"still up"
        await a.send(b"ping")
        assert await b.recv() == b"ping"
        # The default on the same null device: atomics go.
        c, d, _ = null_pair()
        k2 = d.export(memory, access="rwa", scope="domain")
        assert await c.fetch_add(k2, 8, 3) == 0

    arun(main())


# --- write notices without immediate data --------------------------------------------------------------


def notice_message(length: int, imm: int) -> memoryview:
    """The control message of a write notice, as the writer's exporter packs it (version 1, kind 3)."""
    return memoryview(struct.pack("!BB6xQ", 1, CTL_WRITE_NOTICE, length << 32 | imm))


def test_a_write_notice_by_message_is_a_write_then_a_control_send_in_that_order(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(credits=1)
        rig.engine.write_notice_by_message = True
        assert rig.engine.operations.write_notice_by_message is True
        writing = asyncio.ensure_future(rig.engine.write(key(), 16, b"payload", imm=0xFFFF_FFFF))
        await settle()
        # The WRITE goes at once (no immediate: it consumes no receive of the peer, needs no credit)...
        assert [wr["opcode"] for wr in rig.qp.posted] == [lib.IBV_WR_RDMA_WRITE]
        write = rig.qp.posted[0]
        assert write["remote_addr"] == 0x10000 + 16 and write["length"] == 7 and write["imm_data"] == 0
        # ...the notice waits for a credit (one left: the reserve is not ours), after the WRITE.
        rig.credits.credits = 3
        rig.engine.pump()
        assert [wr["opcode"] for wr in rig.qp.posted] == [lib.IBV_WR_RDMA_WRITE, lib.IBV_WR_SEND]
        send = rig.qp.posted[1]
        sent = bytes(ffi.buffer(ffi.cast("char *", send["local_addr"]), send["length"]))
        assert sent == bytes(notice_message(7, 0xFFFF_FFFF))
        assert rig.credits.credits == 2
        rig.complete(0)
        await writing
        rig.complete(1)
        assert rig.engine.statistics()["rdma_ops_pending"] == 0

    arun(main())


def test_a_notice_follows_its_write_even_when_the_write_waits_for_a_doorbell(arun: Run) -> None:
    """With another request in flight a WRITE is collected for the end of the loop iteration's doorbell:
    its notice must not overtake it (the doorbell is rung first)."""

    async def main() -> None:
        rig = Rig()
        rig.engine.write_notice_by_message = True
        reading = asyncio.ensure_future(rig.engine.read(key(), 0, 8))
        await settle()
        assert len(rig.qp.posted) == 1
        writing = asyncio.ensure_future(rig.engine.write(key(), 0, b"abc", imm=5))
        await settle()
        opcodes = [wr["opcode"] for wr in rig.qp.posted]
        assert opcodes == [lib.IBV_WR_RDMA_READ, lib.IBV_WR_RDMA_WRITE, lib.IBV_WR_SEND]
        for i in range(3):
            rig.complete(i)
        await reading
        await writing

    arun(main())


def test_a_notice_of_nothing_written_is_the_message_alone_and_a_failed_write_sends_none(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        rig.engine.write_notice_by_message = True
        await rig.engine.write(key(), 0, b"", imm=9)
        assert [wr["opcode"] for wr in rig.qp.posted] == [lib.IBV_WR_SEND]
        rig.complete(0)
        rig.qp.fail_next = True
        with pytest.raises(rdmaio.VerbsError):
            await rig.engine.write(key(), 0, b"lost", imm=10)
        assert len(rig.qp.posted) == 1 and rig.failures  # no notice for a WRITE that never went

    arun(main())


def test_the_exporter_queues_a_notice_message_as_a_notice_with_immediate_data(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(notice_limit=2)
        e = rig.engine
        assert e.on_recv(RECV, 0, 16, notice_message(100, 7), slot=1) is True
        assert e.on_recv(RECV_RDMA_WITH_IMM, 8, 0, memoryview(b""), slot=2) is True  # the other form
        assert e.on_recv(RECV, 0, 16, notice_message(2**32 - 1, 2**32 - 1), slot=3) is False  # held
        assert rig.credits.used == 3
        assert await e.wait_write_notice() == rdmaio.WriteNotice(100, 7)
        assert rig.reposted == [3]  # one notice taken: the held receive goes back
        assert await e.wait_write_notice() == rdmaio.WriteNotice(0, 8)
        assert await e.wait_write_notice() == rdmaio.WriteNotice(2**32 - 1, 2**32 - 1)
        assert e.statistics()["write_notice_slots_held"] == 0

    arun(main())


def test_write_notices_by_message_between_two_real_engines(arun: Run) -> None:
    """The writer's control SEND, carried to the exporter's receive, is the notice of the bytes the WRITE
    placed before it (the null device carries WRITEs; the SEND is handed over as the NIC would)."""

    async def main() -> None:
        writer, exporter = Rig(), Rig()
        writer.engine.write_notice_by_message = True
        memory = bytearray(64)
        k = exporter.engine.export(memory, access="w", scope="domain")
        writing = asyncio.ensure_future(writer.engine.write(k, 8, b"data!", imm=0xABCD))
        await settle()
        write, send = writer.qp.posted
        # The NIC: the WRITE's data placed, then the SEND delivered to a receive of the exporter.
        ffi.memmove(ffi.cast("void *", write["remote_addr"]), ffi.cast("void *", write["local_addr"]), 5)
        payload = bytes(ffi.buffer(ffi.cast("char *", send["local_addr"]), send["length"]))
        exporter.engine.on_recv(RECV, 0, len(payload), memoryview(payload), slot=0)
        notice = await asyncio.wait_for(exporter.engine.wait_write_notice(), 5)
        assert notice == rdmaio.WriteNotice(5, 0xABCD)
        assert memory[8:13] == b"data!"
        writer.complete(0)
        await writing

    arun(main())


class _Nic:
    """Completes what the engine posts on a Rig, as the NIC would: every RDMA WRITE, and the SENDs of the
    notices too when ``sends`` is set (the exporter gives credits). Keeps each SEND's bytes, read when
    first seen (its staging slot is reused once it completed), with its place among the requests."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.completed: set[int] = set()
        self.sends: dict[int, bytes] = {}

    def run(self, *, sends: bool) -> None:
        for index, wr in enumerate(self.rig.qp.posted):
            if wr["opcode"] == lib.IBV_WR_SEND and index not in self.sends:
                self.sends[index] = bytes(ffi.buffer(ffi.cast("char *", wr["local_addr"]), wr["length"]))
            if index in self.completed or (wr["opcode"] == lib.IBV_WR_SEND and not sends):
                continue
            self.completed.add(index)
            self.rig.complete(index)


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-writer", "many-writers"])
def test_write_notices_by_message_hold_the_writer_back_while_the_peer_withholds_credits(
    arun: Run, concurrent: bool
) -> None:
    """A peer that grants no credit (it stops consuming notices) must not make us queue notices without
    bound: as with a WRITE with immediate data, the writer waits until its notice took a credit, and the
    notices waiting for one hold op slots (at most max_ops of them). Given credits, every notice goes out,
    each after its WRITE, in order, none lost."""

    async def main() -> None:
        max_ops, total = 4, 24
        rig = Rig(max_ops=max_ops, credits=1)  # one credit: the reserve, never ours to take
        rig.engine.write_notice_by_message = True
        ops = rig.engine.operations
        done: list[int] = []

        async def write(i: int) -> None:
            await rig.engine.write(key(), i * 8, i.to_bytes(8, "little"), imm=i)
            done.append(i)

        async def one_writer() -> None:
            for i in range(total):
                await write(i)

        tasks = (
            [asyncio.ensure_future(write(i)) for i in range(total)]
            if concurrent
            else [asyncio.ensure_future(one_writer())]
        )
        nic = _Nic(rig)
        for _ in range(20):  # the NIC completes every WRITE it is given; no credit comes
            await settle()
            nic.run(sends=False)
        waiting = ops.waiting_for_credit
        assert len(done) < total and not all(t.done() for t in tasks), (len(done), waiting)
        assert 0 < waiting <= max_ops and ops.in_flight <= max_ops
        assert len(ops._pending_sends) + len(ops._credit_queue) == waiting  # nothing queued outside
        assert nic.sends == {}
        # Credits come back (the exporter consumes its notices): every write goes through.
        rig.credits.credits = 10 * total
        rig.engine.pump()
        for _ in range(50):
            nic.run(sends=True)
            await settle()
            if all(t.done() for t in tasks):
                break
        for task in tasks:
            await task
        nic.run(sends=True)
        assert sorted(done) == list(range(total)) and ops.waiting_for_credit == 0
        values = [struct.unpack("!BB6xQ", sent)[2] for _, sent in sorted(nic.sends.items())]
        if not concurrent:
            assert values == [8 << 32 | i for i in range(total)]
        assert sorted(values) == [8 << 32 | i for i in range(total)]
        # Each notice is posted after the WRITE of its bytes.
        posted = rig.qp.posted
        writes = {
            wr["remote_addr"]: n for n, wr in enumerate(posted) if wr["opcode"] == lib.IBV_WR_RDMA_WRITE
        }
        for n, sent in nic.sends.items():
            i = struct.unpack("!BB6xQ", sent)[2] & 0xFFFF_FFFF
            assert writes[0x10000 + i * 8] < n
        assert rig.engine.statistics()["rdma_ops_pending"] == 0
        assert sorted(ops._free_staging) == list(range(max_ops))

    arun(main())


def test_a_writer_waiting_for_its_notices_credit_fails_with_the_connection(arun: Run) -> None:
    """The connection ends while writers wait for their notices' credits (and for op slots behind them):
    each raises the connection's typed error; nothing stays queued."""

    async def main() -> None:
        rig = Rig(max_ops=2, credits=1)
        rig.engine.write_notice_by_message = True
        ops = rig.engine.operations
        writers = [
            asyncio.ensure_future(rig.engine.write(key(), i * 8, b"12345678", imm=i)) for i in range(5)
        ]
        nic = _Nic(rig)
        for _ in range(10):
            await settle()
            nic.run(sends=False)
        assert not any(w.done() for w in writers) and ops.waiting_for_credit == 2
        rig.engine.close(rdmaio.ConnectionResetError("peer closed the connection"))
        for writer in writers:
            with pytest.raises(rdmaio.ConnectionResetError):
                await writer
        assert ops.waiting_for_credit == 0 and not ops._credit_queue and not ops._pending_sends

    arun(main())


def test_a_cancelled_write_with_a_notice_frees_its_staging_only_after_the_nic_is_done(arun: Run) -> None:
    """One op slot (max_ops 1): the WRITE is posted, then its notice waits for the slot the WRITE holds.
    Cancelled there, the writer leaves the WRITE's staging slot to its completion (the NIC may still read
    it: no other call may reuse it before); cancelled while its notice waits for a credit, the notice stays
    queued, holding its op slot, and goes out once a credit comes (as a cancelled WRITE with immediate
    data does)."""

    async def main() -> None:
        rig = Rig(max_ops=1, credits=1)
        rig.engine.write_notice_by_message = True
        ops = rig.engine.operations
        first = asyncio.ensure_future(rig.engine.write(key(), 0, b"first", imm=1))
        await settle()
        assert [wr["opcode"] for wr in rig.qp.posted] == [lib.IBV_WR_RDMA_WRITE]
        assert ops._free_staging == []  # the posted WRITE's slot
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert ops._free_staging == []  # still the NIC's
        second = asyncio.ensure_future(rig.engine.write(key(), 8, b"second", imm=2))
        await settle()
        assert len(rig.qp.posted) == 1  # nothing may take the slot yet
        rig.complete(0)  # the first WRITE completes: its slot comes back, the second goes on
        await settle()
        assert [wr["opcode"] for wr in rig.qp.posted] == [lib.IBV_WR_RDMA_WRITE] * 2
        rig.complete(1)
        await settle()
        # The second's notice holds the one op slot and waits for a credit.
        assert ops.waiting_for_credit == 1 and ops.in_flight == 1 and not second.done()
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert ops.waiting_for_credit == 1 and ops.in_flight == 1  # still queued, still bounded
        rig.credits.credits = 3
        rig.engine.pump()
        send = rig.qp.posted[-1]
        assert send["opcode"] == lib.IBV_WR_SEND
        assert bytes(ffi.buffer(ffi.cast("char *", send["local_addr"]), send["length"])) == notice_message(
            6, 2
        )
        assert ops._free_staging == []  # the SEND's slot, until its completion
        rig.complete(2)
        assert ops._free_staging == [0] and ops.in_flight == 0
        await rig.engine.write(key(), 0, b"", imm=3)  # the engine goes on
        send = rig.qp.posted[-1]
        assert bytes(ffi.buffer(ffi.cast("char *", send["local_addr"]), send["length"])) == notice_message(
            0, 3
        )

    arun(main())


# --- no memory windows: a protection domain per connection ---------------------------------------------


@pytest.mark.parametrize(
    ("caps", "options", "private"),
    [
        (IWARP_ONESIDED_CAPS, Options(), True),
        (RXE_ONESIDED_CAPS, Options(), False),
        (RXE_ONESIDED_CAPS, Options(memory_windows="off"), True),
        (IWARP_ONESIDED_CAPS, Options(shared_receive_queue=True), False),  # the SRQ is the shared PD's
        (RXE_ONESIDED_CAPS, Options(memory_windows="off", shared_receive_queue=True), False),
    ],
)
def test_a_connection_gets_a_pd_of_its_own_where_its_device_has_no_windows(
    caps: Any, options: Options, private: bool
) -> None:
    # A handle of its own: the process-wide capability cache keeps each fake device's apart.
    device = FakeCapsDevice(caps, handle=0x6000 + (caps is IWARP_ONESIDED_CAPS))
    assert private_pd_needed(device, options) is private  # type: ignore[arg-type]


def test_without_windows_an_export_is_its_own_region_and_revoke_deregisters_it(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(windows=False, private_pd=True)
        e = rig.engine
        memory = bytearray(4096)
        k = e.export(memory, 100, 1000, access="rw")  # the default scope: this connection
        region = rig.grants[-1]
        # A region with exactly the remote access asked for, no window: its own rkey is the key's.
        assert rig.windows == [] and region.access == ACCESS_READ | ACCESS_WRITE
        assert (k.rkey, k.addr, k.length) == (region.rkey, region.addr, 1000)
        assert e.grants[k.key_id].scoped is None
        with pytest.raises(rdmaio.FeatureNotSupportedError, match="scope='domain'"):
            e.export(memory, access="r", scope="domain")
        assert len(rig.grants) == 1
        revoking = asyncio.ensure_future(e.revoke(k))
        await settle()
        assert not region.closed  # not before the importer's ACK: its requests may still be in flight
        ctl = rig.qp.posted[-1]
        assert ctl["opcode"] == lib.IBV_WR_SEND
        e.on_recv(RECV, 0, 16, memoryview(struct.pack("!BB6xQ", 1, 2, k.key_id)))
        await asyncio.wait_for(revoking, 5)
        assert region.closed and e.grants == {}

    arun(main())


def test_without_windows_a_rendezvous_buffer_is_a_read_only_region_of_the_connection(arun: Run) -> None:
    async def main() -> None:
        private = Rig(windows=False, private_pd=True)
        grant = await private.engine.export_for_read(memoryview(b"immutable payload"))
        assert grant is not None and grant is private.grants[-1]
        assert grant.access == ACCESS_READ and private.windows == []
        # Without windows and without a PD of its own (a shared receive queue): by copy.
        shared = Rig(windows=False)
        assert await shared.engine.export_for_read(memoryview(b"immutable payload")) is None
        with pytest.raises(rdmaio.FeatureNotSupportedError, match="has no memory windows"):
            shared.engine.export(bytearray(64))

    arun(main())


# --- one READ scatter entry (siw) ----------------------------------------------------------------------

# Every path of the C helper that posts an RDMA READ (a doorbell of single requests, a batch of waves, a
# serial request, a serial wave), compiled against a fake provider that records each work request of each
# chain: siw takes one scatter entry per READ (and rdmaio creates its QPs with max_send_sge 1).
READ_SGE_HARNESS = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "helper.h"

int ibv_get_cq_event(struct ibv_comp_channel *c, struct ibv_cq **cq, void **ctx)
{
    (void)c; (void)cq; (void)ctx; errno = EAGAIN; return -1;
}
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n) { (void)cq; (void)n; }
int ibv_get_async_event(struct ibv_context *c, struct ibv_async_event *e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
void ibv_ack_async_event(struct ibv_async_event *e) { (void)e; }
int rdma_get_cm_event(struct rdma_event_channel *c, struct rdma_cm_event **e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
int rdma_ack_cm_event(struct rdma_cm_event *e) { (void)e; return 0; }
int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a) { (void)c; (void)a; return EINVAL; }
int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int m, struct ibv_qp_init_attr *i)
{
    (void)qp; (void)a; (void)m; (void)i; return EINVAL;
}

static int reads, max_sge, bad_length;

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)qp; (void)bad;
    for (; wr; wr = wr->next) {
        if (wr->opcode != IBV_WR_RDMA_READ)
            continue;
        reads++;
        if (wr->num_sge > max_sge)
            max_sge = wr->num_sge;
        if (wr->num_sge == 1 && wr->sg_list[0].length == 0)
            bad_length++;
    }
    return 0;
}
static int fake_poll(struct ibv_cq *cq, int n, struct ibv_wc *wc) { (void)cq; (void)n; (void)wc; return 0; }

int main(void)
{
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct ibv_cq cq;
    int bad = -1;
    memset(&ctx, 0, sizeof ctx);
    memset(&qp, 0, sizeof qp);
    memset(&cq, 0, sizeof cq);
    ctx.ops.post_send = fake_post_send;
    ctx.ops.poll_cq = fake_poll;
    qp.context = &ctx;
    cq.context = &ctx;

    struct rdmaio_rdma_op ops[16];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < 16; i++) {
        ops[i].opcode = IBV_WR_RDMA_READ;
        ops[i].length = 1u << (i + 10);
    }
    int a = rdmaio_post_rdma(&qp, ops, 16, &bad);

    uint64_t remote[100];
    uint32_t length[100];
    uint64_t offset[100];
    for (int i = 0; i < 100; i++) {
        remote[i] = 0x1000 * (uint64_t)i;
        length[i] = 1 + (uint32_t)i * 7;
        offset[i] = 1024 * (uint64_t)i;
    }
    struct rdmaio_batch b;
    memset(&b, 0, sizeof b);
    b.opcode = IBV_WR_RDMA_READ;
    b.count = 100;
    b.remote_addr = remote;
    b.length = length;
    b.local_offset = offset;
    int c = rdmaio_post_batch(&qp, &b, &bad);

    struct rdmaio_onesided_port port;
    memset(&port, 0, sizeof port);
    port.qp = &qp;
    port.cq = &cq;
    int d = rdmaio_onesided_post_poll(&port, 1, 0x5000, 7, 65536, IBV_WR_RDMA_READ, 0x9000, 9, 0, 0);
    b.count = 16;
    int e = rdmaio_onesided_post_batch_poll(&port, &b);
    printf("doorbell=%d batch=%d serial=%d wave=%d reads=%d max_sge=%d empty_sge=%d\n", a, c, d, e, reads,
           max_sge, bad_length);
    return 0;
}
"""


def test_no_read_is_posted_with_more_than_one_scatter_entry(tmp_path: Path) -> None:
    out = build_and_run(tmp_path, "reads", READ_SGE_HARNESS, ["helper.c", "onesided.c"])
    # 16 + 100 + 1 + 16 READs, each with exactly one scatter entry of its own length (never 0 entries
    # for a non-empty READ, never 2): siw's limit of one READ scatter entry holds on every path.
    assert out.strip() == "doorbell=16 batch=100 serial=0 wave=0 reads=133 max_sge=1 empty_sge=0", out
