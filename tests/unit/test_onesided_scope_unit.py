"""Connection-scoped grants (memory windows), revocation at the doorbell, the bounded memory of revoked key
ids, and the verbs objects under them; with the fakes of test_onesided_unit (no RDMA device)."""

from __future__ import annotations

import asyncio
import errno
import struct
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest
from test_onesided_unit import RECV, Rig, key, settle

import rdmaio
from rdmaio._ffi import ffi, lib
from rdmaio.core.onesided import MAX_BINDS_IN_FLIGHT, RemoteKey
from rdmaio.core.onesided.revoked import RevokedKeys
from rdmaio.testing.fakes import FakeMemoryLib
from rdmaio.verbs import memory

Run = Callable[[Coroutine[Any, Any, Any]], Any]
STATUS_BIND_ERR = int(rdmaio.verbs.WcStatus.REM_ACCESS_ERR) + 100  # any failure status of a bind


def control(kind: int, key_id: int) -> memoryview:
    return memoryview(struct.pack("!BB6xQ", 1, kind, key_id))


# --- export binds a window on the connection's queue pair ----------------------------------------------


def test_export_binds_a_window_over_a_region_without_remote_flags(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        buf = bytearray(10000)
        k = rig.engine.export(buf, 100, 900, access="rw")
        region, window = rig.grants[-1], rig.windows[-1]
        assert region.access == -1 and region.length == 900  # MW_BIND only: its own rkey opens nothing
        assert window.region is region
        assert window.access == lib.IBV_ACCESS_REMOTE_READ | lib.IBV_ACCESS_REMOTE_WRITE
        assert k.rkey == window.rkey != region.rkey and k.addr == region.addr
        # The bind is a signalled kind 2 request without an op slot, routed back by its index.
        assert window.wr_id >> 56 == 2 and rig.engine.operations.in_flight == 0
        assert rig.engine.statistics()["mw_binds_in_flight"] == 1
        rig.complete_binds()
        assert rig.engine.statistics()["mw_binds_in_flight"] == 0 and rig.failures == []
        assert rig.engine.grants[k.key_id].scoped.bound
        # Keys are numbered densely per connection.
        assert [rig.engine.export(buf).key_id for _ in range(3)] == [2, 3, 4]

    arun(main())


def test_without_memory_windows_export_needs_the_domain_scope_by_name(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(windows=False)
        with pytest.raises(rdmaio.FeatureNotSupportedError) as info:
            rig.engine.export(bytearray(64))
        assert isinstance(info.value, NotImplementedError) and info.value.errno == errno.EOPNOTSUPP
        assert rig.grants == [] and rig.windows == []
        k = rig.engine.export(bytearray(64), scope="domain")
        assert k.rkey == rig.grants[-1].rkey and rig.grants[-1].access == 0x3
        with pytest.raises(ValueError):
            rig.engine.export(bytearray(64), scope="everyone")
        assert await rig.engine.export_for_read(memoryview(b"x" * 64)) is None  # rendezvous: by copy

    arun(main())


def test_a_failed_bind_fails_the_connection_loudly(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        rig.engine.export(bytearray(64))
        rig.complete_binds(status=STATUS_BIND_ERR)
        assert len(rig.failures) == 1
        error = rig.failures[0]
        assert isinstance(error, rdmaio.VerbsError) and error.call == "IBV_WR_BIND_MW"
        assert rig.engine.statistics()["mw_binds_in_flight"] == 0
        # the connection's close released the region and its window (window first)
        assert rig.windows[-1].closed and rig.grants[-1].closed

    arun(main())


def test_binds_in_flight_are_bounded_and_polled_for(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        buf = bytearray(64)
        for _ in range(MAX_BINDS_IN_FLIGHT):
            rig.engine.export(buf)
        assert rig.reaps == 0
        with pytest.raises(rdmaio.BindQueueFullError) as info:
            rig.engine.export(buf)
        assert isinstance(info.value, BlockingIOError)
        assert rig.reaps == 1 and len(rig.windows) == MAX_BINDS_IN_FLIGHT  # polled, nothing registered
        # A poll that finds the binds done frees their entries: export goes on.
        rig._reap = rig.complete_binds  # type: ignore[method-assign]
        rig.engine.exporter._poll = rig.complete_binds
        rig.engine.export(buf)
        assert len(rig.windows) == MAX_BINDS_IN_FLIGHT + 1
        # export_for_read (rendezvous) waits for a bind entry instead of raising.
        rig.engine.exporter._poll = None
        for _ in range(MAX_BINDS_IN_FLIGHT - 1):
            rig.engine.export(buf)
        waiting = asyncio.ensure_future(rig.engine.export_for_read(memoryview(bytes(64))))
        await settle()
        assert not waiting.done()
        rig.engine.on_completion(rig.windows[-1].wr_id, 0)
        scoped = await asyncio.wait_for(waiting, 5)
        assert scoped is not None and scoped.rkey == rig.windows[-1].rkey
        assert rig.windows[-1].access == lib.IBV_ACCESS_REMOTE_READ

    arun(main())


def test_revoke_frees_the_window_before_the_region_and_only_after_its_bind(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(peer_onesided=False)  # no REVOKE round trip: the bind is all revoke waits for
        k = rig.engine.export(bytearray(64))
        revoking = asyncio.ensure_future(rig.engine.revoke(k))
        await settle()
        assert not revoking.done() and not rig.windows[-1].closed  # the bind is still queued
        rig.complete_binds()
        await asyncio.wait_for(revoking, 5)
        assert rig.windows[-1].closed and rig.grants[-1].closed  # FakeWindow checks the order

    arun(main())


def test_a_rendezvous_grant_closed_before_its_bind_completes_waits_for_it(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        scoped = await rig.engine.export_for_read(memoryview(b"payload" * 10))
        assert scoped is not None and rig.grants[-1].access == -1
        scoped.close()  # the send was cancelled at once
        assert not rig.windows[-1].closed  # freeing it now would fail the queued bind
        rig.complete_binds()
        assert rig.windows[-1].closed and rig.grants[-1].closed

    arun(main())


# --- revocation is checked when the doorbell rings -----------------------------------------------------


def test_requests_waiting_for_the_doorbell_fail_when_their_key_was_revoked_meanwhile(arun: Run) -> None:
    """The REVOKE arrives between the calls' checks and the doorbell (a busy loop): its ACK goes out at
    once, so the requests must not follow it to the NIC (the window is gone: a remote access error)."""

    async def main() -> None:
        rig = Rig(max_ops=8)
        k = key()
        other = RemoteKey(0x20000, 0x78, 4096, 0x3, 43)
        real_ring = rig.engine.operations._ring
        rang: list[int] = []
        rig.engine.operations._ring = lambda: rang.append(1)  # type: ignore[method-assign]  # the loop is busy
        reads = [asyncio.ensure_future(rig.engine.read(k, 0, 8)) for _ in range(3)]
        kept = asyncio.ensure_future(rig.engine.read(other, 0, 8))
        await settle()  # every call ran its checks; the doorbell has not rung yet
        assert len(rig.qp.posted) == 1 and len(rig.engine.operations._doorbell) == 3 and rang == [1]
        rig.engine.on_recv(RECV, 0, 16, control(1, k.key_id))  # REVOKE
        ack = rig.qp.posted[-1]
        assert ack["opcode"] == lib.IBV_WR_SEND  # the REVOKE_ACK, posted at once
        real_ring()  # the doorbell rings
        await settle()
        after_ack = rig.qp.posted[rig.qp.posted.index(ack) + 1 :]
        assert [wr["rkey"] for wr in after_ack] == [other.rkey]  # nothing on the revoked key
        rig.complete(0)  # the first read, posted before the REVOKE arrived
        rig.engine.on_completion(ack["wr_id"], 0)
        rig.complete(-1)
        results = await asyncio.gather(*reads, kept, return_exceptions=True)
        assert isinstance(results[0], bytes) and isinstance(results[3], bytes)
        assert all(isinstance(r, rdmaio.RemoteKeyRevokedError) for r in results[1:3]), results
        assert rig.failures == [] and rig.engine.ops == {}

    arun(main())


# --- the peer's revoked key ids: bounded -----------------------------------------------------------------


def test_revoked_keys_in_order_move_a_floor() -> None:
    revoked = RevokedKeys(limit=4)
    for key_id in range(1, 1001):
        assert revoked.add(key_id)
    assert len(revoked) == 0 and revoked.floor == 1001
    assert 1 in revoked and 1000 in revoked and 1001 not in revoked
    assert not revoked.add(500)  # a repeated REVOKE changes nothing


def test_revoked_keys_around_a_long_lived_key_cost_one_range() -> None:
    revoked = RevokedKeys(limit=4)
    for key_id in range(2, 1000):  # key 1 stays alive
        revoked.add(key_id)
    assert len(revoked) == 1 and 1 not in revoked and 2 in revoked and 999 in revoked
    revoked.add(1)
    assert len(revoked) == 0 and revoked.floor == 1000
    # out of order: ranges merge from both sides, then into the floor
    for key_id in (1004, 1002, 1003, 1001):
        revoked.add(key_id)
    assert len(revoked) == 1 and 1000 not in revoked
    revoked.add(1000)
    assert len(revoked) == 0 and revoked.floor == 1005


def test_revoked_keys_beyond_the_bound_are_a_protocol_error() -> None:
    revoked = RevokedKeys(limit=3)
    for key_id in (10, 20, 30):
        revoked.add(key_id)
    with pytest.raises(rdmaio.ProtocolError):
        revoked.add(40)
    assert len(revoked) == 3 and 40 not in revoked
    revoked.add(11)  # joins a range: no new one
    assert len(revoked) == 3


def test_a_peer_revoking_ids_it_never_issued_is_stopped_at_the_bound(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_revoked_ranges=16)
        for i in range(16):
            rig.engine.on_recv(RECV, 0, 16, control(1, (i + 1) * 1_000_003))
        assert rig.engine.statistics()["keys_revoked_by_peer"] == 16
        with pytest.raises(rdmaio.ProtocolError):  # fails the connection (processing turns it into fail())
            rig.engine.on_recv(RECV, 0, 16, control(1, 99 << 40))
        assert rig.engine.statistics()["keys_revoked_by_peer"] == 16
        # 1000 REVOKEs of keys exported and revoked in turn leave nothing behind.
        rig2 = Rig(max_revoked_ranges=16)
        for key_id in range(1, 1001):
            rig2.engine.on_recv(RECV, 0, 16, control(1, key_id))
        stats = rig2.engine.statistics()
        assert stats["keys_revoked_by_peer"] == 0 and stats["revoked_key_floor"] == 1001

    arun(main())


# --- verbs: a failing deregistration or window allocation is reported ----------------------------------


def _fake_region(buffer: bytearray) -> memory.MemoryRegion:
    region = memory.MemoryRegion.__new__(memory.MemoryRegion)
    memory._Resource.__init__(region)
    region.buffer = buffer
    region._cbuf = ffi.from_buffer(buffer)
    region.length = len(buffer)
    region._ptr = ffi.NULL
    return region


def test_a_failed_deregistration_raises_and_keeps_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMemoryLib(dereg_rc=errno.EBUSY)
    monkeypatch.setattr(memory, "lib", fake)
    buffer = bytearray(4096)
    region = _fake_region(buffer)
    with pytest.raises(rdmaio.VerbsError) as info:
        region.close()
    assert info.value.errno == errno.EBUSY and info.value.call == "ibv_dereg_mr"
    assert region._cbuf is not None  # still registered: the buffer stays referenced
    fake.dereg_rc = 0
    ok = _fake_region(bytearray(64))
    ok.close()
    assert ok._cbuf is None and fake.calls == ["ibv_dereg_mr", "ibv_dereg_mr"]


def test_memory_windows_report_a_device_without_them_and_a_failed_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeMemoryLib(alloc_rc=-errno.EOPNOTSUPP)
    monkeypatch.setattr(memory, "lib", fake)
    pd = SimpleNamespace(_ptr=ffi.NULL, _check_usable=lambda: None, _dependents={})
    region = _fake_region(bytearray(64))
    with pytest.raises(rdmaio.FeatureNotSupportedError) as info:
        memory.MemoryWindow(pd, region)  # type: ignore[arg-type]
    assert info.value.call == "ibv_alloc_mw"
    fake.alloc_rc = -errno.ENOMEM
    with pytest.raises(rdmaio.VerbsError) as other:
        memory.MemoryWindow(pd, region)  # type: ignore[arg-type]
    assert other.value.errno == errno.ENOMEM and not isinstance(other.value, rdmaio.FeatureNotSupportedError)
    fake.alloc_rc = 0
    window = memory.MemoryWindow(pd, region)  # type: ignore[arg-type]
    fake.dealloc_rc = -errno.EBUSY
    with pytest.raises(rdmaio.VerbsError) as busy:
        region.close()  # closes its window first: the failure is reported, not swallowed
    assert busy.value.call == "ibv_dealloc_mw" and busy.value.errno == errno.EBUSY
    assert window.closed and fake.calls == ["ibv_dealloc_mw"]


def test_closing_a_queue_pair_deallocates_its_windows_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound type 2 window holds its QP: rxe's QP destroy waits (seconds) for every such hold, so the
    windows bound on a QP go before it (a dead peer was detected 50 s late otherwise)."""
    fake = FakeMemoryLib()
    monkeypatch.setattr(memory, "lib", fake)

    class FakeQueuePair(memory._Resource):
        _close_rank = 0

        def _destroy(self) -> None:
            fake.calls.append("rdma_destroy_qp")

    pd = SimpleNamespace(_ptr=ffi.NULL, _check_usable=lambda: None, _dependents={})
    region = _fake_region(bytearray(64))
    qp = FakeQueuePair()
    window = memory.MemoryWindow(pd, region, qp)  # type: ignore[arg-type]
    qp.close()
    assert fake.calls == ["ibv_dealloc_mw", "rdma_destroy_qp"] and window.closed
    region.close()  # the region's own close does not free the window twice
    assert fake.calls == ["ibv_dealloc_mw", "rdma_destroy_qp", "ibv_dereg_mr"]
