"""One-sided RDMA on devices without atomics or memory windows (iWARP: siw, E810, Chelsio), on the fakes of
test_onesided_unit and the null device (no RDMA device): typed errors before anything is posted, the key's
flag that says the exporter has no atomics, and the Options that take a capability away on rxe."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from test_onesided_unit import RECV, RECV_RDMA_WITH_IMM, Rig, key, settle

import rdmaio
from rdmaio._ffi import ffi, lib
from rdmaio.core.onesided import ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, RemoteKey
from rdmaio.core.onesided.exporter import CTL_WRITE_NOTICE
from rdmaio.core.onesided.keys import KEY_FLAG_NO_ATOMICS
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
