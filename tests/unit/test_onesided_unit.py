"""OneSidedEngine, RemoteKey and the one-sided credit rules, with a fake queue pair (no RDMA device)."""

from __future__ import annotations

import ast
import asyncio
import struct
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import rdmaio
from rdmaio._ffi import ffi, lib
from rdmaio.core.backend import AsyncioBackend
from rdmaio.core.onesided import (
    ACCESS_ATOMIC,
    ACCESS_READ,
    ACCESS_WRITE,
    OneSidedEngine,
    RemoteKey,
    parse_access,
)
from rdmaio.core.onesided import operations as onesided_operations
from rdmaio.protocol import Handshake, Session
from rdmaio.protocol.closestate import CloseState
from rdmaio.testing.fakes import FakeQP, FakeRegion, FakeRegistration, FakeSerialPort, FakeWindow

Run = Callable[[Coroutine[Any, Any, Any]], Any]
WR_ONESIDED = 2 << 56
STATUS_REM_ACCESS = int(rdmaio.verbs.WcStatus.REM_ACCESS_ERR)
RECV_RDMA_WITH_IMM = int(rdmaio.verbs.WcOpcode.RECV_RDMA_WITH_IMM)
RECV = int(rdmaio.verbs.WcOpcode.RECV)


# --- fakes ---------------------------------------------------------------------------------------------


class FakeCredits:
    def __init__(self, credits: int = 8) -> None:
        self.credits = credits
        self.used = 0
        self.error: BaseException | None = None
        self.close_state = CloseState()  # what a Session's flush_error answers from

    def can_take_slot(self) -> bool:
        return self.credits >= 2 and self.error is None

    def take_slot(self) -> None:
        assert self.credits >= 2
        self.credits -= 1

    def on_slot_used(self) -> None:
        self.used += 1

    def flush_error(self) -> BaseException | None:
        return self.error or self.close_state.flush_error()


class Rig:
    """An engine on the running loop with fakes around it."""

    def __init__(
        self,
        *,
        max_ops: int = 4,
        credits: int = 8,
        atomics: bool = True,
        peer_onesided: bool = True,
        notice_limit: int = 64,
        poll: Callable[[], None] | None = None,
        windows: bool = True,
        max_revoked_ranges: int = 4096,
        private_pd: bool = False,
        split_reads: bool = False,
    ) -> None:
        self.qp = FakeQP()
        self.reposted: list[int] = []
        self.credits = FakeCredits(credits)
        self.local: list[FakeRegion] = []
        self.grants: list[FakeRegion] = []
        self.cached: list[FakeRegistration] = []
        self.failures: list[BaseException] = []
        self.windows: list[FakeWindow] = []
        self.reaps = 0  # polls asked for by export() to free bind entries
        self.poll = poll
        self.polled_for: list[int] = []
        self.port = FakeSerialPort(self.qp)
        self.port.at_post = self._at_post
        self.port.after = self._after_poll
        self.engine = OneSidedEngine(
            AsyncioBackend(asyncio.get_running_loop()),
            self.qp,
            self.credits,
            register_local=self._local,
            register_grant=self._grant,
            cache_get=self._cache,
            fail=self._fail,
            max_ops=max_ops,
            max_inline=0,
            revoke_timeout=5.0,
            atomics=atomics,
            peer_onesided=peer_onesided,
            notice_limit=notice_limit,
            repost=self.reposted.append,
            port=None if poll is None else self.port,
            register_bindable=self._bindable,
            bind_window=self._bind if windows else None,
            poll=self._reap,
            max_revoked_ranges=max_revoked_ranges,
            close_state=self.credits.close_state,
            private_pd=private_pd,
            register_read_grant=self._read_grant,
            split_page_crossing_reads=split_reads,
        )

    def _bindable(self, view: memoryview, readonly: bool) -> FakeRegion:
        region = FakeRegion(view, access=-1, readonly=readonly)  # -1: MW_BIND only, no remote flags
        self.grants.append(region)
        return region

    def _bind(self, region: FakeRegion, wr_id: int, access: int) -> FakeWindow:
        self.windows.append(FakeWindow(region, wr_id, access))
        return self.windows[-1]

    def _reap(self) -> None:
        self.reaps += 1

    def complete_binds(self, status: int = 0) -> None:
        """Complete every window bind posted so far (as their completions would, through the CQ)."""
        for window in self.windows:
            self.engine.on_completion(window.wr_id, status)

    def _at_post(self, wr: dict[str, int]) -> int:
        # Posted (recorded by the fake port); the poll "found something" that is not known to be the
        # request's own success: the engine hands it on (_after_poll), where the tests' poll completes
        # what it finds through on_completion, as the dispatcher would.
        self.polled_for.append(wr["wr_id"])
        return rdmaio.verbs.POSTED_OTHER

    def _after_poll(self, result: int) -> bool:
        assert self.poll is not None and result == rdmaio.verbs.POSTED_OTHER
        self.poll()
        return True

    def _local(self, buffer: Any) -> FakeRegion:
        self.local.append(FakeRegion(buffer))
        return self.local[-1]

    def _grant(self, view: memoryview, bits: int) -> FakeRegion:
        self.grants.append(FakeRegion(view, bits))
        return self.grants[-1]

    def _read_grant(self, view: memoryview, readonly: bool) -> FakeRegion:
        self.grants.append(FakeRegion(view, ACCESS_READ, readonly=readonly))
        return self.grants[-1]

    def _cache(self, view: memoryview) -> FakeRegistration:
        self.cached.append(FakeRegistration(view))
        return self.cached[-1]

    def _fail(self, exc: BaseException) -> None:
        self.failures.append(exc)
        self.engine.close(exc)

    def complete(self, index: int = -1, *, status: int = 0, data: bytes = b"") -> dict[str, int]:
        """Complete a posted request, first writing ``data`` where the NIC would (its local buffer)."""
        wr = self.qp.posted[index]
        if data:
            ffi.memmove(ffi.cast("void *", wr["local_addr"]), data, len(data))
        self.engine.on_completion(wr["wr_id"], status)
        return wr


def key(
    length: int = 4096, access: int = ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC, addr: int = 0x10000
) -> RemoteKey:
    return RemoteKey(addr, 0x77, length, access, 42)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# --- RemoteKey -----------------------------------------------------------------------------------------


def test_key_wire_form_round_trip() -> None:
    k = RemoteKey(0x7F00_1234_5678, 0xDEADBEEF, 1 << 26, ACCESS_READ | ACCESS_ATOMIC, 2**64 - 1)
    wire = bytes(k)
    assert len(wire) == 32 <= 64
    assert wire[0] == 1  # version byte first
    assert RemoteKey.from_bytes(wire) == k
    assert RemoteKey.from_bytes(bytearray(wire)) == k
    assert RemoteKey.from_bytes(memoryview(wire)) == k
    assert (k.length, k.access) == (1 << 26, "ra")
    assert "length=67108864" in repr(k)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w[:-1],  # short
        lambda w: w + b"\0",  # long
        lambda w: b"\x02" + w[1:],  # unknown version
        lambda w: w[:1] + b"\x00" + w[2:],  # no access
        lambda w: w[:1] + b"\x08" + w[2:],  # unknown access bit
        lambda w: w[:2] + b"\x00\x01" + w[4:],  # reserved bits
        lambda w: w[:24] + struct.pack("!Q", 0),  # zero length
        lambda w: w[:16] + struct.pack("!QQ", 2**64 - 16, 32),  # range wraps past 2**64
        lambda w: b"",
    ],
)
def test_key_parsing_rejects_bad_input(mutate: Callable[[bytes], bytes]) -> None:
    wire = bytes(key())
    with pytest.raises(rdmaio.InvalidRemoteKeyError) as info:
        RemoteKey.from_bytes(mutate(wire))
    assert isinstance(info.value, ValueError) and isinstance(info.value, rdmaio.RdmaError)


def test_key_from_none_is_a_typed_error() -> None:
    with pytest.raises(rdmaio.InvalidRemoteKeyError):
        RemoteKey.from_bytes(None)


def test_parse_access() -> None:
    assert parse_access("r") == ACCESS_READ
    assert parse_access("wr") == ACCESS_READ | ACCESS_WRITE
    assert parse_access("rwa") == 7
    for bad in ("", "x", "rr", "rwx", 3):
        with pytest.raises(ValueError):
            parse_access(bad)  # type: ignore[arg-type]


def test_error_classes() -> None:
    assert issubclass(rdmaio.RemoteAccessError, PermissionError)
    assert issubclass(rdmaio.RemoteAccessError, rdmaio.RdmaError)
    assert issubclass(rdmaio.RemoteKeyRevokedError, rdmaio.RemoteAccessError)
    exc = rdmaio.RemoteKeyRevokedError("gone")
    assert str(exc) == "gone"


# --- export --------------------------------------------------------------------------------------------


def test_export_registers_exactly_the_range_with_its_access(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        buf = bytearray(10000)
        k = rig.engine.export(buf, 100, 900, access="ra", scope="domain")
        region = rig.grants[-1]
        assert region.length == 900 and region.access == ACCESS_READ | ACCESS_ATOMIC
        assert k.addr == region.addr == int(ffi.cast("uintptr_t", ffi.from_buffer(buf))) + 100
        assert (k.length, k.access, k.rkey) == (900, "ra", region.rkey)
        k2 = rig.engine.export(buf, scope="domain")  # whole buffer, "rw"
        assert k2.length == 10000 and k2.access == "rw" and k2.key_id != k.key_id
        for bad in ((0, 0), (0, 10001), (10000, 1), (-1, 5)):
            with pytest.raises(ValueError):
                rig.engine.export(buf, *bad)
        with pytest.raises(TypeError):
            rig.engine.export(b"immutable")
        assert len(rig.grants) == 2

    arun(main())


def test_export_with_atomics_needs_device_support(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(atomics=False)
        # A device without atomics: the typed error of a missing capability (it was a RemoteAccessError).
        with pytest.raises(rdmaio.FeatureNotSupportedError):
            rig.engine.export(bytearray(64), access="a")
        rig.engine.export(bytearray(64), access="rw")

    arun(main())


# --- local checks --------------------------------------------------------------------------------------


def test_bounds_access_and_alignment_are_checked_before_posting(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        e = rig.engine
        rw, ro, wo = key(1024, 3), key(1024, ACCESS_READ), key(1024, ACCESS_WRITE)
        at = key(1024, ACCESS_ATOMIC, addr=0x10004)  # the grant itself starts 4 bytes past alignment
        calls = [
            e.read(rw, 1000, 25),
            e.read(rw, -1, 1),
            e.read_into(rw, 1, bytearray(1024)),
            e.write(rw, 1024, b"x"),
            e.write(ro, 0, b"x"),
            e.read(wo, 0, 1),
            e.fetch_add(rw, 0, 1),
            e.fetch_add(at, 0, 1),  # offset 0 but remote address not 8-aligned
            e.compare_swap(at, 2, 0, 1),  # 0x10006
            e.compare_swap(key(16, ACCESS_ATOMIC), 16, 0, 1),
        ]
        for call in calls:
            with pytest.raises(rdmaio.RemoteAccessError):
                await call
        assert rig.qp.posted == []
        assert e.statistics()["rdma_ops_pending"] == 0
        atom = key(64, ACCESS_ATOMIC)
        for bad in (
            e.write(rw, 0, b"x", imm=-1),
            e.fetch_add(atom, 0, 2**64),
            e.compare_swap(atom, 0, -1, 0),
        ):
            with pytest.raises(ValueError):
                await bad
        assert await e.read(rw, 1024, 0) == b""  # empty read at the end: nothing to post
        assert rig.qp.posted == []

    arun(main())


# --- bookkeeping ---------------------------------------------------------------------------------------


def test_read_posts_signalled_kind_2_and_returns_what_the_nic_wrote(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        task = asyncio.ensure_future(rig.engine.read(key(), 100, 5))
        await settle()
        wr = rig.qp.posted[-1]
        assert wr["wr_id"] >> 56 == 2
        assert wr["opcode"] == lib.IBV_WR_RDMA_READ and wr["length"] == 5
        assert wr["remote_addr"] == 0x10000 + 100 and wr["rkey"] == 0x77
        assert wr["send_flags"] & lib.IBV_SEND_SIGNALED
        assert wr["lkey"] == rig.local[0].lkey  # rdmaio-owned staging memory, local access only
        rig.complete(data=b"hello")
        assert await task == b"hello"
        assert rig.engine.ops == {}

    arun(main())


def test_at_most_max_ops_in_flight_and_fifo_after(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=3)
        tasks = [asyncio.ensure_future(rig.engine.read(key(), i, 1)) for i in range(7)]
        await settle()
        assert len(rig.qp.posted) == 3
        for n in range(7):
            wr = rig.qp.posted[n]
            rig.engine.on_completion(wr["wr_id"], 0)
            await settle()
            assert len(rig.qp.posted) == min(7, n + 4)
        await asyncio.gather(*tasks)
        assert [wr["remote_addr"] - 0x10000 for wr in rig.qp.posted] == list(range(7))
        assert len(rig.engine.operations._free_staging) == 3

    arun(main())


def test_atomics_post_their_operands_and_decode_the_old_value(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        t = asyncio.ensure_future(rig.engine.fetch_add(key(), 8, -1))
        await settle()
        wr = rig.complete(data=(5).to_bytes(8, sys.byteorder))
        assert wr["opcode"] == lib.IBV_WR_ATOMIC_FETCH_AND_ADD and wr["length"] == 8
        assert wr["compare_add"] == 2**64 - 1
        assert await t == 5
        t = asyncio.ensure_future(rig.engine.compare_swap(key(), 16, 3, 4))
        await settle()
        wr = rig.complete(data=(3).to_bytes(8, sys.byteorder))
        assert wr["opcode"] == lib.IBV_WR_ATOMIC_CMP_AND_SWP
        assert (wr["compare_add"], wr["swap"]) == (3, 4)
        assert await t == 3

    arun(main())


def test_write_copies_data_and_large_ops_get_pooled_registrations(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        data = bytearray(b"abc")
        t = asyncio.ensure_future(rig.engine.write(key(), 0, data))
        await settle()
        data[:] = b"xyz"  # the caller's buffer is free once posted: the copy went to staging
        wr = rig.qp.posted[-1]
        assert bytes(ffi.buffer(ffi.cast("char *", wr["local_addr"]), 3)) == b"abc"
        rig.complete()
        await t
        big = key(1 << 20)
        t2 = asyncio.ensure_future(rig.engine.read(big, 0, 200_000))
        await settle()
        private = rig.local[-1]
        assert rig.qp.posted[-1]["lkey"] == private.lkey and not private.closed
        rig.complete(data=b"\x01" * 200_000)
        assert await t2 == b"\x01" * 200_000
        # Kept for reuse once the NIC is done with it: the next op of that size class (256 KiB) takes it.
        assert not private.closed and len(private.cbuf) == 256 * 1024
        t3 = asyncio.ensure_future(rig.engine.write(big, 0, b"\x02" * 150_000))
        await settle()
        assert rig.qp.posted[-1]["lkey"] == private.lkey and rig.local[-1] is private
        rig.complete()
        await t3
        rig.engine.close(None)
        assert private.closed  # deregistered with the connection

    arun(main())


def test_the_large_buffer_pool_is_bounded(arun: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onesided_operations, "_LARGE_POOL_BYTES", 2 << 20)

    async def main() -> None:
        rig = Rig(max_ops=4)
        k = key(1 << 22)
        reads = [asyncio.ensure_future(rig.engine.read(k, 0, 1 << 20)) for _ in range(4)]
        await settle()
        assert len(rig.local) == 4  # four 1 MiB buffers registered, one per request in flight
        for i in range(4):
            rig.complete(i)
        await asyncio.gather(*reads)
        # Two fit in the 2 MiB pool and stay registered; the other two were deregistered.
        assert sorted(r.closed for r in rig.local) == [False, False, True, True]
        again = asyncio.ensure_future(rig.engine.read(k, 0, 1 << 20))
        await settle()
        rig.complete()
        await again
        assert len(rig.local) == 4  # served from the pool: nothing new registered

    arun(main())


def test_requests_of_one_loop_iteration_share_a_doorbell(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=8)
        k = key()
        # Alone in flight: posted at once, nothing waits for the end of the iteration.
        first = asyncio.ensure_future(rig.engine.read(k, 0, 8))
        await settle()
        assert rig.qp.calls == [1]
        # Five more started in one iteration while the first is in flight: one post of five.
        more = [asyncio.ensure_future(rig.engine.fetch_add(k, 8 * i, 1)) for i in range(1, 6)]
        await settle()
        assert rig.qp.calls == [1, 5]
        assert [wr["remote_addr"] for wr in rig.qp.posted[1:]] == [0x10000 + 8 * i for i in range(1, 6)]
        for i in range(6):
            rig.complete(i, data=i.to_bytes(8, "little"))
        assert await first == (0).to_bytes(8, "little")
        assert await asyncio.gather(*more) == [1, 2, 3, 4, 5]
        assert rig.engine.statistics()["rdma_ops_pending"] == 0

    arun(main())


def test_a_failing_doorbell_fails_every_request_in_it(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=8)
        k = key()
        first = asyncio.ensure_future(rig.engine.read(k, 0, 8))
        await settle()
        rig.qp.fail_next = True
        more = [asyncio.ensure_future(rig.engine.read(k, 0, 8)) for _ in range(3)]
        results = await asyncio.gather(first, *more, return_exceptions=True)
        assert all(isinstance(r, rdmaio.RdmaError) for r in results), results
        assert len(rig.failures) == 1  # the connection failed once

    arun(main())


def test_remote_access_error_completion_raises_remote_access_error(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        t = asyncio.ensure_future(rig.engine.write(key(), 0, b"x"))
        await settle()
        rig.complete(status=STATUS_REM_ACCESS)
        with pytest.raises(rdmaio.RemoteAccessRefusedError) as refused:
            await t
        # the connection is lost with it: a dead peer's refusal is caught by "except ConnectionError" too
        assert isinstance(refused.value, rdmaio.RemoteAccessError)
        assert isinstance(refused.value, ConnectionResetError) and refused.value.errno == 104

    arun(main())


def test_close_fails_every_pending_op_and_releases_everything(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=2)
        e = rig.engine
        grant_key = e.export(bytearray(100))
        tasks = [asyncio.ensure_future(e.read(key(), 0, 10)) for _ in range(4)]
        notice = asyncio.ensure_future(e.wait_write_notice())
        await settle()
        err = rdmaio.ConnectionResetError("peer died")
        e.close(err)
        results = await asyncio.gather(*tasks, notice, return_exceptions=True)
        assert all(isinstance(r, rdmaio.ConnectionResetError) for r in results), results
        assert all(r is not err for r in results)  # fresh instances
        assert e.ops == {} and e.grants == {}
        assert all(g.closed for g in rig.grants) and all(r.closed for r in rig.local)
        with pytest.raises(rdmaio.ConnectionResetError):
            await e.read(key(), 0, 1)
        with pytest.raises(ValueError):
            await e.revoke(grant_key)

    arun(main())


def test_a_call_waits_for_a_staging_slot_held_by_a_completed_op_not_yet_released(arun: Run) -> None:
    """A completion gives its op slot back at once, but the staging slot only when its caller resumes: a
    call in between (every staging slot held) waits for one instead of failing (it raised IndexError)."""

    async def main() -> None:
        rig = Rig(max_ops=2)
        first = [asyncio.ensure_future(rig.engine.read(key(), 8 * i, 8)) for i in range(2)]
        go = asyncio.Event()

        async def third() -> bytes:
            await go.wait()
            return await rig.engine.read(key(), 16, 8)

        late = asyncio.ensure_future(third())
        await settle()
        go.set()  # the third caller runs before the first two resume (they are woken after it)
        for i in range(2):
            rig.complete(i, data=b"12345678")
        assert rig.engine.operations.in_flight == 0 and rig.engine.operations._free_staging == []
        assert await asyncio.gather(*first) == [b"12345678"] * 2
        await settle()
        assert len(rig.qp.posted) == 3
        rig.complete(data=b"abcdefgh")
        assert await asyncio.wait_for(late, 5) == b"abcdefgh"
        assert sorted(rig.engine.operations._free_staging) == [0, 1] and rig.engine.ops == {}

    arun(main())


def test_cancelled_read_keeps_its_staging_until_the_completion(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=2)
        t = asyncio.ensure_future(rig.engine.read(key(), 0, 10))
        await settle()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert len(rig.engine.operations._free_staging) == 1  # the NIC may still write into it
        rig.complete(data=b"late data!")
        assert len(rig.engine.operations._free_staging) == 2 and rig.engine.ops == {}
        assert rig.failures == []

    arun(main())


def test_cancelled_read_into_fails_the_connection(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        buf = bytearray(64)
        t = asyncio.ensure_future(rig.engine.read_into(key(), 0, buf))
        await settle()
        assert rig.qp.posted[-1]["lkey"] == rig.cached[-1].lkey  # zero-copy into the caller's buffer
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert len(rig.failures) == 1 and isinstance(rig.failures[0], rdmaio.EndpointClosedError)
        assert rig.cached[-1].released

    arun(main())


def test_read_registered_reads_into_the_callers_memory_and_leaves_a_cancelled_op_to_its_completion(
    arun: Run,
) -> None:
    """The rendezvous pull: a READ into memory the caller registered (no staging), its error raised, and a
    cancelled call's op kept (slot and all) until its completion, since the NIC may still write."""

    async def main() -> None:
        rig = Rig(max_ops=2)
        buf = bytearray(16)
        region = FakeRegion(buf)
        local = (region.addr, region.lkey)
        call = asyncio.ensure_future(rig.engine.read_registered(key(), 0x10000 + 8, 16, local))
        await settle()
        wr = rig.qp.posted[-1]
        assert (wr["opcode"], wr["length"], wr["remote_addr"]) == (lib.IBV_WR_RDMA_READ, 16, 0x10000 + 8)
        assert (wr["local_addr"], wr["lkey"]) == local
        rig.complete(data=b"r" * 16)
        await call
        assert bytes(buf) == b"r" * 16 and rig.engine.ops == {} and rig.local == []  # no staging
        failing = asyncio.ensure_future(rig.engine.read_registered(key(), 0x10000, 16, local))
        await settle()
        rig.complete(status=STATUS_REM_ACCESS)
        with pytest.raises(rdmaio.RemoteAccessRefusedError):
            await failing
        cancelled = asyncio.ensure_future(rig.engine.read_registered(key(), 0x10000, 16, local))
        await settle()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert rig.engine.operations.in_flight == 1 and len(rig.engine.ops) == 1
        rig.complete()
        assert rig.engine.operations.in_flight == 0 and rig.engine.ops == {} and rig.failures == []

    arun(main())


def test_failed_post_fails_the_op_and_the_connection(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        rig.qp.fail_next = True
        with pytest.raises(rdmaio.VerbsError):
            await rig.engine.read(key(), 0, 4)
        assert len(rig.failures) == 1

    arun(main())


# --- credits, notices, revocation ----------------------------------------------------------------------


def test_write_with_imm_waits_for_a_credit(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(credits=1)
        t = asyncio.ensure_future(rig.engine.write(key(), 0, b"x", imm=0xFFFFFFFF))
        await settle()
        assert rig.qp.posted == []  # one credit left: the reserve is not ours
        rig.credits.credits = 3
        rig.engine.pump()
        wr = rig.qp.posted[-1]
        assert wr["opcode"] == lib.IBV_WR_RDMA_WRITE_WITH_IMM and wr["imm_data"] == 0xFFFFFFFF
        assert rig.credits.credits == 2
        rig.complete()
        await t

    arun(main())


def test_write_notices_are_queued_in_order(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        waiter = asyncio.ensure_future(rig.engine.wait_write_notice())
        await settle()
        rig.engine.on_recv(RECV_RDMA_WITH_IMM, 7, 100, memoryview(b""))
        rig.engine.on_recv(RECV_RDMA_WITH_IMM, 8, 0, memoryview(b""))
        assert await waiter == rdmaio.WriteNotice(100, 7)
        assert await rig.engine.wait_write_notice() == rdmaio.WriteNotice(0, 8)
        assert rig.credits.used == 2

    arun(main())


def test_notices_beyond_the_limit_hold_their_receive_until_taken(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(notice_limit=2)
        repost_now = [
            rig.engine.on_recv(RECV_RDMA_WITH_IMM, i, 8, memoryview(b""), slot=10 + i) for i in range(5)
        ]
        # The first two are queued with their receive reposted (credit back); the next three hold theirs.
        assert repost_now == [True, True, False, False, False]
        assert rig.engine.statistics()["write_notices_queued"] == 5
        assert rig.engine.statistics()["write_notice_slots_held"] == 3
        assert rig.reposted == []
        for i in range(5):
            assert await rig.engine.wait_write_notice() == rdmaio.WriteNotice(8, i)
        # Each notice taken gave back the oldest held receive, in order; none is held any more.
        assert rig.reposted == [12, 13, 14]
        assert rig.engine.statistics()["write_notice_slots_held"] == 0
        # A control message never holds its receive.
        assert rig.engine.on_recv(RECV, 0, 16, memoryview(struct.pack("!BB6xQ", 1, 2, 99)), slot=3) is True

    arun(main())


def test_a_zero_limit_holds_every_notice_and_close_drops_the_held_slots(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(notice_limit=0)
        assert rig.engine.on_recv(RECV_RDMA_WITH_IMM, 1, 0, memoryview(b""), slot=0) is False
        rig.engine.close(None)
        # Queued notices are still delivered after the close; the QP is gone, so nothing is reposted.
        assert await rig.engine.wait_write_notice() == rdmaio.WriteNotice(0, 1)
        assert rig.reposted == []

    arun(main())


def test_a_peer_without_the_onesided_feature(arun: Run) -> None:
    """An older peer (no FEATURE_ONESIDED): notices and REVOKE are refused or skipped locally, nothing of
    the one-sided frames reaches it; plain READ/WRITE/atomics need nothing of its software and work."""

    async def main() -> None:
        rig = Rig(peer_onesided=False)
        k = key()
        with pytest.raises(rdmaio.FeatureNotSupportedError) as info:
            await rig.engine.write(k, 0, b"x", imm=1)
        assert isinstance(info.value, NotImplementedError) and isinstance(info.value, rdmaio.RdmaError)
        with pytest.raises(rdmaio.FeatureNotSupportedError):
            await rig.engine.wait_write_notice()
        assert rig.qp.posted == []
        writing = asyncio.ensure_future(rig.engine.write(k, 0, b"x"))
        await settle()
        rig.complete()
        await writing
        # revoke: no REVOKE message (the peer would fail on it); deregistering alone revokes at the NIC.
        own = rig.engine.export(bytearray(64))
        rig.complete_binds()
        await asyncio.wait_for(rig.engine.revoke(own), 1)
        assert rig.grants[-1].closed and len(rig.qp.posted) == 1

    arun(main())


def test_the_handshake_announces_and_reads_the_onesided_feature() -> None:
    from rdmaio.core.negotiation import local_handshake
    from rdmaio.protocol import FEATURE_ONESIDED, KNOWN_FEATURES

    ours = local_handshake(rdmaio.Options())
    assert ours.features & FEATURE_ONESIDED == FEATURE_ONESIDED == 0x04
    assert KNOWN_FEATURES & FEATURE_ONESIDED
    assert Handshake.decode(ours.encode()).features & FEATURE_ONESIDED
    older = Handshake(32, 65536, 1 << 20, features=0)
    assert not Handshake.decode(older.encode()).features & FEATURE_ONESIDED
    assert not Session(ours, older).peer.features & FEATURE_ONESIDED


def test_revoke_handshake_both_sides(arun: Run) -> None:
    async def main() -> None:
        exporter, importer = Rig(), Rig()
        k = exporter.engine.export(bytearray(64))
        exporter.complete_binds()
        revoking = asyncio.ensure_future(exporter.engine.revoke(k))
        await settle()
        wr = exporter.qp.posted[-1]
        assert wr["opcode"] == lib.IBV_WR_SEND and wr["length"] == 16
        message = bytes(ffi.buffer(ffi.cast("char *", wr["local_addr"]), 16))
        assert not exporter.grants[-1].closed and not revoking.done()
        exporter.complete()  # the control SEND completed; still waiting for the ACK
        await settle()
        assert not revoking.done()
        # The importer receives it: marks the key, answers with an ACK.
        importer.engine.on_recv(RECV, 0, 16, memoryview(message))
        assert k.key_id in importer.engine.revoked_ids
        ack = importer.qp.posted[-1]
        ack_message = bytes(ffi.buffer(ffi.cast("char *", ack["local_addr"]), 16))
        with pytest.raises(rdmaio.RemoteKeyRevokedError):
            await importer.engine.read(k, 0, 1)
        assert len(importer.qp.posted) == 1  # nothing posted for the revoked key
        exporter.engine.on_recv(RECV, 0, 16, memoryview(ack_message))
        await revoking
        assert exporter.grants[-1].closed and exporter.engine.grants == {}

    arun(main())


def test_revoke_deregisters_even_when_cancelled(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        k = rig.engine.export(bytearray(64))
        rig.complete_binds()
        t = asyncio.ensure_future(rig.engine.revoke(k))
        await settle()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert rig.grants[-1].closed and rig.engine.grants == {}

    arun(main())


def test_malformed_control_message_is_a_protocol_error(arun: Run) -> None:
    async def main() -> None:
        rig = Rig()
        with pytest.raises(rdmaio.ProtocolError):
            rig.engine.on_recv(RECV, 0, 5, memoryview(b"12345"))
        with pytest.raises(rdmaio.ProtocolError):
            rig.engine.on_recv(RECV, 0, 16, memoryview(struct.pack("!BB6xQ", 1, 9, 1)))

    arun(main())


# --- Session: one-sided requests pay credits like frames -----------------------------------------------


def _sessions() -> tuple[Session, Session]:
    a = Handshake(recv_depth=4, slot_size=1024, max_message_size=1 << 20)
    b = Handshake(recv_depth=4, slot_size=1024, max_message_size=1 << 20)
    return Session(a, b), Session(b, a)


def test_session_one_sided_slots_keep_the_reserve() -> None:
    sender, receiver = _sessions()
    taken = 0
    while sender.can_take_slot():
        sender.take_slot()
        receiver.on_slot_used()
        taken += 1
    assert taken == 3 and sender.send_credits == 1  # one credit kept for CREDIT/EOF frames
    with pytest.raises(RuntimeError):
        sender.take_slot()
    receiver.on_recv_reposted(3)
    assert receiver.credit_frame_due()
    imm = receiver.take_credit_frame()
    assert sender.on_frame(imm, 0) is not None
    assert sender.send_credits == 4 - 3 + 3 - 0  # the grant brought them back
    stats = sender.statistics()
    assert stats["onesided_slots_sent"] == 3 and stats["credits_received"] == 3


def test_session_rejects_a_one_sided_request_without_credit() -> None:
    _, receiver = _sessions()
    for _ in range(4):
        receiver.on_slot_used()
    with pytest.raises(rdmaio.FrameError):
        receiver.on_slot_used()


# --- a completion that is there when the post returns (rxe runs a loopback READ inside ibv_post_send) ----


async def first_call_completed_later(rig: Rig, call: Coroutine[Any, Any, Any], data: bytes = b"0" * 8) -> Any:
    """Make a first call from the running task (it does not poll: no previous request of this task) and
    complete it from elsewhere: later calls of this task are the serial ones."""

    async def complete_soon() -> None:
        await settle()
        rig.complete(-1, data=data)

    helper = asyncio.create_task(complete_soon())
    result = await call
    await helper
    return result


def test_a_lone_request_completed_at_post_returns_without_sleeping(arun: Run) -> None:
    async def main() -> None:
        polls: list[int] = []

        def poll() -> None:  # the device finished before ibv_post_send returned
            polls.append(len(rig.qp.posted))
            rig.complete(-1, data=b"v" * 64)

        rig = Rig(poll=poll)
        await first_call_completed_later(rig, rig.engine.read(key(), 0, 8))
        assert polls == []  # the task's first request: nothing says it calls serially yet
        loop_ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(loop_ran.set)
        assert await rig.engine.read(key(), 0, 64) == b"v" * 64
        assert await rig.engine.fetch_add(key(), 8, 1) == int.from_bytes(b"v" * 8, sys.byteorder)
        # Neither call slept: a callback scheduled before them has not run yet.
        assert not loop_ran.is_set()
        assert polls == [2, 3]
        assert rig.engine.statistics()["rdma_completed_at_post"] == 2
        assert rig.engine.statistics()["rdma_ops_pending"] == 0

    arun(main())


def test_a_completion_found_alone_at_post_is_completed_by_the_caller(arun: Run) -> None:
    """The C call returned POSTED_DONE: the request's own successful completion was what the poll took, so
    the dispatcher did not deliver it and the engine completes the call itself (no on_completion call)."""

    async def main() -> None:
        rig = Rig(poll=lambda: None)
        await first_call_completed_later(rig, rig.engine.read(key(), 0, 8))
        asked: list[int] = []

        def at_post(wr: dict[str, int]) -> int:
            asked.append(wr["wr_id"])
            ffi.memmove(ffi.cast("void *", wr["local_addr"]), b"w" * 64, 64)  # the NIC's READ
            return rdmaio.verbs.POSTED_DONE

        rig.port.at_post = at_post
        assert await rig.engine.read(key(), 0, 64) == b"w" * 64
        assert await rig.engine.fetch_add(key(), 8, 2) == int.from_bytes(b"w" * 8, sys.byteorder)
        assert asked == [rig.qp.posted[1]["wr_id"], rig.qp.posted[2]["wr_id"]]
        stats = rig.engine.statistics()
        assert stats["rdma_ops_pending"] == 0 and rig.engine.statistics()["rdma_completed_at_post"] == 2
        assert sorted(rig.engine.operations._free_staging) == list(
            range(rig.engine.max_ops)
        )  # memory given back

    arun(main())


def test_calls_completed_at_post_still_let_the_loop_run(arun: Run) -> None:
    """A task calling in a loop whose every request completes at its post yields to the loop at least
    once per _AT_POST_BUDGET calls: other tasks and callbacks are not starved."""

    async def main() -> None:
        rig = Rig(poll=lambda: rig.complete(-1, data=b"x" * 8))
        await first_call_completed_later(rig, rig.engine.read(key(), 0, 8))
        ticks: list[int] = []
        calls = 0

        def tick() -> None:
            ticks.append(calls)
            if len(ticks) < 5:
                asyncio.get_running_loop().call_soon(tick)

        asyncio.get_running_loop().call_soon(tick)
        for _ in range(100):
            await rig.engine.read(key(), 0, 8)
            calls += 1
        assert len(ticks) == 5
        gaps = [b - a for a, b in zip([0, *ticks], ticks, strict=False)]
        assert max(gaps) <= onesided_operations._AT_POST_BUDGET + 1, gaps
        assert rig.engine.statistics()["rdma_completed_at_post"] == 100

    arun(main())


def test_a_request_not_complete_at_post_waits_for_its_completion(arun: Run) -> None:
    async def main() -> None:
        polls: list[int] = []
        rig = Rig(poll=lambda: polls.append(1))  # nothing in the CQ yet

        async def caller() -> bytes:
            await first_call_completed_later(rig, rig.engine.read(key(), 0, 4))
            return await rig.engine.read(key(), 0, 4)

        task = asyncio.create_task(caller())
        for _ in range(3):
            await settle()
        assert not task.done() and polls == [1]
        rig.complete(-1, data=b"late")
        assert await task == b"late"
        assert rig.engine.statistics()["rdma_completed_at_post"] == 0

    arun(main())


def test_concurrent_callers_share_doorbells_and_do_not_poll_at_post(arun: Run) -> None:
    async def main() -> None:
        polls: list[int] = []
        rig = Rig(poll=lambda: polls.append(1))

        async def caller() -> list[int]:
            return [await rig.engine.fetch_add(key(), 0, 1) for _ in range(2)]

        tasks = [asyncio.create_task(caller()) for _ in range(3)]
        for round_ in range(2):
            await settle()
            # The first went alone, the other two were rung together at the end of the loop iteration;
            # in the second round too: another task posted the previous request, so nobody polls.
            assert rig.qp.calls == [1, 2] * (round_ + 1)
            for i in range(3):
                rig.complete(3 * round_ + i, data=(7).to_bytes(8, sys.byteorder))
        assert await asyncio.gather(*tasks) == [[7, 7]] * 3
        assert polls == []

    arun(main())


# --- batches: fetch_add_many, rdma_read_many ------------------------------------------------------------


def complete_wave(rig: Rig, datas: list[bytes], *, status: int = 0, first: int | None = None) -> None:
    """The NIC finished a wave of ``len(datas)`` requests (the last posted, or those from ``first``): each
    request's data lands at its local address, and only the last (signalled) one completes."""
    start = len(rig.qp.posted) - len(datas) if first is None else first
    wave = rig.qp.posted[start : start + len(datas)]
    assert [wr["send_flags"] for wr in wave] == [0] * (len(datas) - 1) + [int(lib.IBV_SEND_SIGNALED)]
    for wr, data in zip(wave, datas, strict=True):
        ffi.memmove(ffi.cast("void *", wr["local_addr"]), data, len(data))
    rig.engine.on_completion(wave[-1]["wr_id"], status)


def u64(value: int) -> bytes:
    return value.to_bytes(8, sys.byteorder)


def test_fetch_add_many_posts_waves_of_max_ops_and_returns_old_values_in_order(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=4)
        k = key()
        offsets = [8 * i for i in range(10)]
        call = asyncio.ensure_future(rig.engine.fetch_add_many(k, offsets, [i + 1 for i in range(10)]))
        for wave in (range(0, 4), range(4, 8), range(8, 10)):
            await settle()
            assert rig.qp.calls[-1] == len(wave)  # one chain per wave
            assert rig.engine.operations.in_flight == len(wave)
            complete_wave(rig, [u64(100 + i) for i in wave])
        assert await call == [100 + i for i in range(10)]
        posted = rig.qp.posted
        assert [wr["remote_addr"] for wr in posted] == [k.addr + o for o in offsets]
        assert [wr["compare_add"] for wr in posted] == [i + 1 for i in range(10)]
        assert {wr["opcode"] for wr in posted} == {int(lib.IBV_WR_ATOMIC_FETCH_AND_ADD)}
        assert rig.engine.operations.in_flight == 0 and not rig.engine.ops
        assert sorted(rig.engine.operations._free_staging) == [0, 1, 2, 3]
        # one add for every offset, negative adds wrap modulo 2**64
        call = asyncio.ensure_future(rig.engine.fetch_add_many(k, [0, 0], -1))
        await settle()
        assert [wr["compare_add"] for wr in rig.qp.posted[-2:]] == [2**64 - 1] * 2
        complete_wave(rig, [u64(5), u64(4)])
        assert await call == [5, 4]

    arun(main())


def test_a_batch_is_checked_whole_before_anything_is_posted(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=4)
        k = key(length=64)
        with pytest.raises(rdmaio.RemoteAccessError, match="not 8-byte aligned"):
            await rig.engine.fetch_add_many(k, [0, 8, 12])
        with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
            await rig.engine.fetch_add_many(k, [0, 64])
        with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
            await rig.engine.fetch_add_many(k, [-8, 0])
        with pytest.raises(rdmaio.RemoteAccessError, match="does not grant"):
            await rig.engine.fetch_add_many(key(access=ACCESS_READ), [0])
        with pytest.raises(TypeError):
            await rig.engine.fetch_add_many(k, [0, 8.0])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="2 values to add for 3 offsets"):
            await rig.engine.fetch_add_many(k, [0, 8, 16], [1, 2])
        with pytest.raises(ValueError):
            await rig.engine.fetch_add_many(k, [0], 2**64)
        with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
            await rig.engine.read_many(k, [(0, 8), (60, 8)])
        with pytest.raises(rdmaio.RemoteAccessError, match="does not grant"):
            await rig.engine.read_many(key(access=ACCESS_WRITE), [(0, 8)])
        with pytest.raises(rdmaio.MessageTooLargeError):
            await rig.engine.read_many(key(length=1 << 20), [(0, 8), (0, 65537)])
        assert rig.qp.posted == [] and rig.engine.operations.in_flight == 0
        assert await rig.engine.fetch_add_many(k, []) == [] and await rig.engine.read_many(k, []) == []
        rig.engine.revoked_ids.add(k.key_id)
        with pytest.raises(rdmaio.RemoteKeyRevokedError):
            await rig.engine.fetch_add_many(k, [0])
        assert rig.qp.posted == []

    arun(main())


def test_read_many_fills_waves_up_to_a_staging_slot_and_skips_empty_ranges(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=8)
        k = key(length=1 << 20)
        size = 30 * 1024  # two and a small one fit one 64 KiB staging slot, three do not
        ranges = [(0, size), (size, 0), (2 * size, size), (5, 3), (3 * size, size)]
        call = asyncio.ensure_future(rig.engine.read_many(k, ranges))
        await settle()
        assert rig.qp.calls == [3]  # 30 KiB + 30 KiB + 3 B; the empty range posted nothing
        wave = rig.qp.posted
        assert [wr["length"] for wr in wave] == [size, size, 3]
        assert wave[2]["local_addr"] - wave[0]["local_addr"] == 2 * size  # packed one after another
        complete_wave(rig, [b"a" * size, b"b" * size, b"xyz"])
        await settle()
        assert rig.qp.calls == [3, 1]
        complete_wave(rig, [b"c" * size])
        assert await call == [b"a" * size, b"", b"b" * size, b"xyz", b"c" * size]
        assert [wr["remote_addr"] - k.addr for wr in rig.qp.posted] == [0, 2 * size, 5, 3 * size]
        assert rig.engine.operations.in_flight == 0 and sorted(rig.engine.operations._free_staging) == list(
            range(8)
        )

    arun(main())


def test_read_many_splits_small_page_crossing_ranges_for_siw_and_joins_their_parts(arun: Run) -> None:
    """With split_page_crossing_reads (a peer whose device may be siw), a range of at most 32 bytes that
    crosses a 4 KiB page of the remote address goes as one READ per page, the parts packed one after the
    other (in the same wave or the next) and joined; other ranges go whole. Without it nothing is split."""

    async def main() -> None:
        rig = Rig(max_ops=4, split_reads=True)
        k = key(length=3 * 4096)  # at 0x10000: page-aligned remote addresses
        ranges = [(4090, 8), (0, 8), (4064, 32), (8191, 2), (8180, 33), (100, 0)]
        call = asyncio.ensure_future(rig.engine.read_many(k, ranges))
        await settle()
        posted = rig.qp.posted
        # (4090, 8) -> 6 + 2; (0, 8) whole; (4064, 32) ends at the page boundary: whole; then the wave is full
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in posted] == [
            (4090, 6),
            (4096, 2),
            (0, 8),
            (4064, 32),
        ]
        assert [wr["local_addr"] - posted[0]["local_addr"] for wr in posted] == [0, 6, 8, 16]
        complete_wave(rig, [b"AAAAAA", b"BB", b"c" * 8, b"d" * 32])
        await settle()
        # (8191, 2) -> 1 + 1; (8180, 33) is over 32 bytes (siw does not send it inline): whole
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in posted[4:]] == [
            (8191, 1),
            (8192, 1),
            (8180, 33),
        ]
        complete_wave(rig, [b"E", b"F", b"g" * 33])
        assert await call == [b"AAAAAA" + b"BB", b"c" * 8, b"d" * 32, b"EF", b"g" * 33, b""]
        assert rig.engine.operations.in_flight == 0 and sorted(rig.engine.operations._free_staging) == [
            0,
            1,
            2,
            3,
        ]

        # The two parts of one range in two waves (max_ops 2), and nothing split without the flag.
        rig = Rig(max_ops=2, split_reads=True)
        call = asyncio.ensure_future(rig.engine.read_many(k, [(0, 8), (4093, 8)]))
        await settle()
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in rig.qp.posted] == [(0, 8), (4093, 3)]
        complete_wave(rig, [b"h" * 8, b"ijk"])
        await settle()
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in rig.qp.posted[2:]] == [(4096, 5)]
        complete_wave(rig, [b"lmnop"])
        assert await call == [b"h" * 8, b"ijklmnop"]
        rig = Rig(max_ops=4)
        call = asyncio.ensure_future(rig.engine.read_many(k, [(4090, 8)]))
        await settle()
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in rig.qp.posted] == [(4090, 8)]
        complete_wave(rig, [b"q" * 8])
        assert await call == [b"q" * 8]

    arun(main())


def test_single_reads_split_small_page_crossing_ranges_for_siw(arun: Run) -> None:
    """rdma_read and rdma_read_into on such a connection: a READ of at most 32 bytes crossing a page goes
    as one READ per page; one that stays within a page, or is longer, goes whole."""

    async def main() -> None:
        rig = Rig(max_ops=4, split_reads=True)
        k = key(length=3 * 4096)
        call = asyncio.ensure_future(rig.engine.read(k, 4094, 8))
        await settle()
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in rig.qp.posted] == [(4094, 2)]
        rig.complete(-1, data=b"ab")
        await settle()
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in rig.qp.posted[1:]] == [(4096, 6)]
        rig.complete(-1, data=b"cdefgh")
        assert await call == b"abcdefgh"
        into = bytearray(5)
        call = asyncio.ensure_future(rig.engine.read_into(k, 8190, into))
        await settle()
        rig.complete(-1, data=b"12")
        await settle()
        rig.complete(-1, data=b"345")
        assert await call == 5 and into == b"12345"
        assert [(wr["remote_addr"] - k.addr, wr["length"]) for wr in rig.qp.posted[2:]] == [
            (8190, 2),
            (8192, 3),
        ]
        for offset, length in ((4088, 8), (4090, 33)):  # within a page; over 32 bytes
            call = asyncio.ensure_future(rig.engine.read(k, offset, length))
            await settle()
            assert (rig.qp.posted[-1]["remote_addr"] - k.addr, rig.qp.posted[-1]["length"]) == (
                offset,
                length,
            )
            rig.complete(-1, data=b"z" * length)
            assert await call == b"z" * length
        with pytest.raises(rdmaio.RemoteAccessError, match="outside"):
            await rig.engine.read(k, 3 * 4096 - 4, 8)
        assert len(rig.qp.posted) == 6

    arun(main())


def test_a_batch_takes_as_many_op_slots_as_requests(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=4)
        k = key()
        batch = asyncio.ensure_future(rig.engine.fetch_add_many(k, [0, 8, 16]))
        await settle()
        assert rig.engine.operations.in_flight == 3
        first = asyncio.ensure_future(rig.engine.read(k, 0, 8))  # one slot left: it goes
        await settle()
        second = asyncio.ensure_future(rig.engine.fetch_add_many(k, [0, 8]))  # needs two: waits
        await settle()
        assert rig.qp.calls == [3, 1] and rig.engine.operations.in_flight == 4
        rig.complete(-1, data=b"r" * 8)  # the READ
        assert await first == b"r" * 8
        await settle()
        assert rig.qp.calls == [3, 1]  # one slot free is not enough for two
        complete_wave(rig, [u64(1), u64(2), u64(3)], first=0)
        assert await batch == [1, 2, 3]
        await settle()
        assert rig.qp.calls == [3, 1, 2]
        complete_wave(rig, [u64(7), u64(8)])
        assert await second == [7, 8]
        assert rig.engine.operations.in_flight == 0

    arun(main())


def test_a_failed_wave_fails_the_call_and_frees_its_slots(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=4)
        k = key()
        call = asyncio.ensure_future(rig.engine.fetch_add_many(k, [0, 8, 16, 24, 32]))
        await settle()
        # the second request of the first wave failed: it completes (signalled or not) with its error
        rig.engine.on_completion(rig.qp.posted[1]["wr_id"], STATUS_REM_ACCESS)
        with pytest.raises(rdmaio.RemoteAccessError, match="refused"):
            await call
        assert rig.qp.calls == [4]  # the second wave was never posted
        assert rig.engine.operations.in_flight == 0 and sorted(rig.engine.operations._free_staging) == [
            0,
            1,
            2,
            3,
        ]

    arun(main())


def test_a_cancelled_batch_keeps_its_memory_until_the_wave_completes(arun: Run) -> None:
    async def main() -> None:
        rig = Rig(max_ops=4)
        call = asyncio.ensure_future(rig.engine.read_many(key(), [(0, 8), (8, 8)]))
        await settle()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (
            rig.engine.operations.in_flight == 2 and len(rig.engine.operations._free_staging) == 3
        )  # the NIC may still write
        complete_wave(rig, [b"1" * 8, b"2" * 8])
        assert rig.engine.operations.in_flight == 0 and len(rig.engine.operations._free_staging) == 4

    arun(main())


# --- the package's structure ----------------------------------------------------------------------------

PACKAGE = Path(onesided_operations.__file__).parent


def _package_imports() -> dict[str, set[str]]:
    """Module of rdmaio.core.onesided -> the modules of the package it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        name = "rdmaio.core.onesided" + ("" if path.stem == "__init__" else "." + path.stem)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("rdmaio.core.onesided")
            ):
                found.add(node.module)
                assert not any(a.name.startswith("_") for a in node.names), f"{name} imports a private name"
        graph[name] = found
    return graph


def test_the_package_has_no_import_cycle_and_no_module_imports_the_facade() -> None:
    graph = _package_imports()
    assert set(graph) >= {
        "rdmaio.core.onesided",
        "rdmaio.core.onesided.keys",
        "rdmaio.core.onesided.exporter",
        "rdmaio.core.onesided.operations",
    }
    for module, imported in graph.items():
        if module != "rdmaio.core.onesided":
            assert "rdmaio.core.onesided" not in imported, f"{module} imports the facade"
    done: set[str] = set()
    while len(done) < len(graph):  # peel off modules whose imports are all done: a cycle stops it
        ready = {m for m, imported in graph.items() if m not in done and imported <= done}
        assert ready, f"import cycle among {sorted(set(graph) - done)}"
        done |= ready


def test_no_module_of_the_package_touches_another_objects_private_names() -> None:
    """Each object owns its state: outside ``self``/``cls``, no ``x._name`` inside the package."""
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                raise AssertionError(f"{path.name}:{node.lineno} .{node.attr}")
