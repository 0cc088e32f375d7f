"""Unit tests of the shared fakes in rdmaio.testing.fakes, used the way the unit tests of the core use them:
a queue pair recording chains (checked against its ring) and one-sided requests, two transports wired back
to back, scripted cm/completion/async events, memory objects and the backend's clock."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest

from rdmaio import verbs
from rdmaio._ffi import ffi, lib
from rdmaio.core.rings import SlotRing
from rdmaio.errors import VerbsError
from rdmaio.options import Options
from rdmaio.testing.fakes import (
    SLOTLESS,
    CompletionRecord,
    FakeBackend,
    FakeCMId,
    FakeCompletionBatch,
    FakeCompletionChannel,
    FakeCQ,
    FakeDevice,
    FakeDeviceHandles,
    FakeDomain,
    FakeEventChannel,
    FakeMemoryLib,
    FakeProtectionDomain,
    FakeQP,
    FakeReactor,
    FakeRegion,
    FakeRegistrar,
    FakeRegistration,
    FakeTransport,
    FakeWindow,
    fake_completion,
    wire,
)

Run = Callable[[Coroutine[Any, Any, Any]], Any]
SLOT = 64


def _fill(wr: Any, wr_id: int, addr: int, length: int, lkey: int, flags: int, imm: int = 0) -> None:
    wr.wr_id, wr.addr, wr.length, wr.lkey, wr.send_flags, wr.imm_data = wr_id, addr, length, lkey, flags, imm


def test_a_chain_is_recorded_with_its_bytes_read_at_post_time_and_checked_against_the_ring() -> None:
    registrar = FakeRegistrar(SLOT)
    ring = SlotRing(SLOT, 8, registrar)
    ring.grow(4)
    qp = FakeQP(8, ring=ring)
    ring.view[SLOT : SLOT + 5] = b"hello"
    scratch = ffi.new("char[]", b"inline")
    slot_id = verbs.make_wr_id(verbs.WR_KIND_SEND, 0, 1)
    inline_id = verbs.make_wr_id(verbs.WR_KIND_SEND, 0, SLOTLESS)
    _fill(qp.send_array[0], slot_id, ring.addr + SLOT, 5, ring.lkeys[1], verbs.SEND_SIGNALED, imm=7)
    _fill(qp.send_array[1], inline_id, int(ffi.cast("uintptr_t", scratch)), 6, 0, verbs.SEND_INLINE)
    qp.post_sends(2)
    ring.view[SLOT : SLOT + 5] = b"later"  # the NIC read the slot at post time
    assert qp.posts == [
        [(slot_id, b"hello", 7, verbs.SEND_SIGNALED), (inline_id, b"inline", 0, verbs.SEND_INLINE)]
    ]
    assert qp.chains == 1 and registrar.chunks == [4] and registrar.slots == 4
    _fill(qp.send_array[0], slot_id, ring.addr + SLOT, 5, 999, 0)  # the wrong key for the slot
    with pytest.raises(AssertionError):
        qp.post_sends(1)
    qp.send_error = VerbsError("no room", errno=errno.ENOMEM, call="ibv_post_send")
    with pytest.raises(VerbsError):
        qp.post_sends(1)
    with pytest.raises(AssertionError):
        qp.post_empty_write(1)  # keepalive probes are refused unless allowed
    qp.allow_empty_writes = True
    qp.post_empty_write(1)
    assert qp.empty_writes == [1]


def test_registrar_keys_chunks_in_order_and_forgets_closed_ones() -> None:
    registrar = FakeRegistrar(SLOT)
    first, second = registrar(memoryview(bytearray(4 * SLOT))), registrar(memoryview(bytearray(8 * SLOT)))
    assert (first.lkey, second.lkey) == (100, 101) and registrar.chunks == [4, 8] and registrar.slots == 12
    first.close()
    assert registrar.live == {101: 8} and registrar.calls == 2 and registrar.chunks == [4, 8]


def test_one_sided_requests_are_recorded_per_request_and_per_doorbell() -> None:
    qp = FakeQP()
    for i in range(2):
        wr = qp.rdma_array[i]
        wr.wr_id, wr.local_addr, wr.length, wr.lkey, wr.rkey, wr.remote_addr = 10 + i, 4096, 8, 1, 2, 64 * i
        wr.opcode = lib.IBV_WR_RDMA_READ
    qp.post_rdma(2)
    qp.post_batch(20, int(lib.IBV_WR_ATOMIC_FETCH_AND_ADD), 8192, 3, 4, [0, 8, 16], compare_add=[1, 2, 3])
    assert qp.calls == [2, 3] and [p["wr_id"] for p in qp.posted] == [10, 11, 20, 20, 20]
    assert qp.posted[1]["remote_addr"] == 64 and qp.posted[3]["local_addr"] == 8192 + 8
    assert [p["send_flags"] for p in qp.posted[2:]] == [0, 0, int(lib.IBV_SEND_SIGNALED)]
    assert qp.posted[4]["compare_add"] == 3
    qp.fail_next = True
    with pytest.raises(VerbsError, match="fake post failure"):
        qp.post_rdma(1)
    with pytest.raises(VerbsError):
        qp.post_batch(21, 0, 0, 0, 0, [0])
    assert qp.calls == [2, 3]


def test_two_wired_transports_deliver_into_posted_slots_and_complete_signalled_sends(arun: Run) -> None:
    async def main() -> None:
        a, b = FakeTransport(10, 1, slot_size=SLOT, depth=4), FakeTransport(11, 2, slot_size=SLOT, depth=4)
        a.qp.wire, b.qp.wire = wire(a, b), wire(b, a)
        got: dict[str, list[Any]] = {"a": [], "b": []}
        a.set_completion_handler(lambda wcs, start, n: got["a"].extend(wcs[start : start + n]))
        b.set_completion_handler(lambda wcs, start, n: got["b"].extend(wcs[start : start + n]))
        data = ffi.new("char[]", b"frame")
        _fill(a.qp.send_array[0], 5, int(ffi.cast("uintptr_t", data)), 5, 100, verbs.SEND_SIGNALED, imm=9)
        a.qp.post_sends(1)
        assert got == {"a": [], "b": []}  # on the wire until the next loop iteration
        await asyncio.sleep(0)
        (recv,) = got["b"]
        assert verbs.wr_index(recv.wr_id) == 0 and verbs.wr_tag(recv.wr_id) == 2
        assert (recv.byte_len, recv.imm_data, recv.flags) == (5, 9, verbs.WC_WITH_IMM)
        assert bytes(b.recv_ring.view[:5]) == b"frame" and list(b.posted) == [1, 2, 3]
        assert [wc.wr_id for wc in got["a"]] == [5] and got["a"][0].status == 0
        b.post_receives([0])
        assert list(b.posted) == [1, 2, 3, 0] and b.grow_receives(4) == 0
        b.close()
        a.qp.post_sends(1)
        await asyncio.sleep(0)
        assert len(got["b"]) == 1 and len(got["a"]) == 2  # a closed receiver sees nothing
        assert a.qp.chains == 2 and a.qp.qp_num == 10

    arun(main())


def test_cm_id_counts_disconnects_and_schedules_the_peers_event(arun: Run) -> None:
    async def main() -> None:
        device = FakeDevice(3)
        cm_id = FakeCMId(7, device, local_address=("198.18.0.2", 2))
        seen: list[str] = []
        cm_id.on_disconnect = lambda: seen.append("DISCONNECTED")
        cm_id.disconnect()
        assert cm_id.disconnects == 1 and seen == []
        await asyncio.sleep(0)
        assert seen == ["DISCONNECTED"] and cm_id.device() is device
        assert cm_id.local_address == ("198.18.0.2", 2) and cm_id.peer_address == ("198.18.0.2", 1)
        cm_id.close()
        assert cm_id.closed and FakeCMId(8).device() is None

    arun(main())


def test_reactor_records_handlers_watches_and_released_ids(arun: Run) -> None:
    async def main() -> None:
        reactor = FakeReactor()
        reactor.set_handler("id", print)
        reactor.watch_qp(1, 7, 100, print)
        assert reactor.watched == {(1, 7, 100)} and reactor.cm_handlers == {"id": print}
        reactor.unwatch_qp(1, 7, 100)
        reactor.release_id("id")
        assert reactor.watched == set() and reactor.released == ["id"]

    arun(main())


def test_scripted_events_come_out_in_order() -> None:
    event = verbs.CMEvent(verbs.CMEventType.DISCONNECTED, 0, 5, 0, b"", 0, 0, 0, 0, raw_id=None)
    channel = FakeEventChannel(event)
    assert channel.get_event() is event and channel.get_event() is None
    fatal = verbs.AsyncEvent(verbs.EVENT_DEVICE_FATAL, "fatal", "device", 0, 0)
    device = FakeDevice(2, fatal, async_fd=-1)
    assert (device.name, device.async_fd) == ("fake2", -1) and FakeDevice(1).async_fd == 101
    assert device.get_async_event() is fatal and device.get_async_event() is None
    handles = FakeDeviceHandles()
    handles.answers = [{1, 2}, {2}]
    assert (
        handles() == {1, 2} and handles() == {2} and handles() == {2} and handles.calls == [{1, 2}, {2}, {2}]
    )


def test_cq_groups_completions_by_connection_in_first_seen_order() -> None:
    log: list[str] = []
    channel = FakeCompletionChannel(log)
    cq, other = FakeCQ(16, log), FakeCQ(16)
    assert cq.handle != other.handle
    recv = verbs.WR_KIND_RECV
    cq.pending = [
        CompletionRecord(verbs.make_wr_id(recv, 1, 0), 7),
        CompletionRecord(verbs.make_wr_id(recv, 2, 0), 8),
        CompletionRecord(verbs.make_wr_id(recv, 1, 1), 7, status=5),
    ]
    batch = FakeCompletionBatch(2)
    assert cq.poll_grouped(batch) == 2 and batch.ngroups == 2
    assert [(g.key, g.start, g.count) for g in batch.groups] == [
        (verbs.dispatch_key(7, 1), 0, 1),
        (verbs.dispatch_key(8, 2), 1, 1),
    ]
    assert cq.poll_grouped(batch) == 1 and batch.copy_records(0, 1)[0].status == 5
    channel.fired += [cq.handle, other.handle, cq.handle]
    assert channel.drain_events() == ([cq.handle, other.handle], False, 3) and channel.drain_events()[2] == 0
    cq.close()
    channel.close()
    with pytest.raises(AssertionError):
        cq.close()
    assert log == [f"destroy cq {cq.cqe}", "destroy channel"]
    wc = fake_completion(1, int(verbs.WcOpcode.SEND), status=int(verbs.WcStatus.RETRY_EXC_ERR))
    assert wc.status == int(verbs.WcStatus.RETRY_EXC_ERR) and wc.byte_len == 0


def test_memory_objects_have_real_addresses_unique_keys_and_check_their_order() -> None:
    log: list[str] = []
    buffer = bytearray(100)
    region = FakeRegion(buffer, 3, log=log, strict=True)
    assert region.addr == int(ffi.cast("uintptr_t", ffi.from_buffer(buffer))) and region.length == 100
    assert region.lkey == region.rkey and region.access == 3 and region.buffer is buffer
    readonly = FakeRegion(b"constant")  # read-only buffers register read-only
    window = FakeWindow(readonly, 42, 1)
    assert len({region.lkey, readonly.lkey, window.rkey}) == 3 and window.wr_id == 42
    readonly.close()
    with pytest.raises(AssertionError, match="before its region"):
        window.close()
    readonly.close()  # not strict: counted
    assert readonly.closes == 2
    region.close()
    with pytest.raises(AssertionError):
        region.close()
    assert log == ["reg 100", "dereg 100"]
    cached = FakeRegistration(bytearray(8))
    assert (cached.addr, cached.lkey) == (cached.region.addr, cached.region.lkey)
    cached.release()
    assert cached.released
    c_lib = FakeMemoryLib(dereg_rc=errno.EBUSY)
    assert c_lib.ibv_dereg_mr(None) == errno.EBUSY and c_lib.rdmaio_alloc_mw(None, None) == 0
    assert c_lib.rdmaio_dealloc_mw(None) == 0 and c_lib.calls == ["ibv_dereg_mr", "ibv_dealloc_mw"]


def test_backend_records_readers_spawns_and_runs_due_timers_in_order() -> None:
    backend = FakeBackend()
    ran: list[str] = []
    backend.add_reader(5, lambda: None)
    backend.remove_reader(5)
    assert backend.removed_readers == [5] and backend.readers == {}

    async def never() -> None:
        raise AssertionError("spawned coroutines are not run")

    backend.spawn(never(), "task")
    assert backend.spawned == ["task"]
    backend.call_later(2.0, lambda: ran.append("late"))
    cancelled = backend.call_later(1.0, lambda: ran.append("cancelled"))
    backend.call_soon(lambda: ran.append("soon"))
    cancelled.cancel()
    backend.advance(1.5)
    assert ran == ["soon"] and backend.clock() == 1.5 and len(backend.pending) == 1
    backend.advance(1.0)
    assert ran == ["soon", "late"] and not backend.pending
    domain = FakeDomain()
    domain.close()
    domain.close()
    assert domain.closed and domain.closes == 2


def test_a_server_side_reactor_adopts_ids_answers_requests_and_makes_transports_without_a_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a server's acceptor asks of the fakes: ids adopted from requests (answered by accept or
    reject), timers on a FakeBackend, counted drains, transports made as the core makes them."""
    monkeypatch.setattr(FakeTransport, "made", [])
    reactor = FakeReactor(FakeBackend())
    request = SimpleNamespace(id_handle=3, source="198.18.0.9")
    cm_id = reactor.adopt_id(request, print)
    assert (cm_id.handle, cm_id.peer_address) == (3, ("198.18.0.9", 40003)) and reactor.handlers == {3: print}
    cm_id.accept(b"hello", responder_resources=4, initiator_depth=2)
    assert cm_id.accepted == {"responder_resources": 4, "initiator_depth": 2} and not cm_id.rejected
    cm_id.reject()
    assert cm_id.rejected
    fired: list[str] = []
    first = reactor.backend.call_later(5.0, lambda: fired.append("first"))
    reactor.backend.call_soon(lambda: fired.append("second"))
    first.cancel()
    reactor.backend.advance(10.0)
    assert fired == ["second"] and reactor.timers[0] is first and len(reactor.timers) == 2
    reactor.timers[0].callback()  # a test may fire one by hand
    reactor.drain_cm_events()
    assert fired == ["second", "first"] and reactor.drained == 1
    transport = FakeTransport.for_cm_id(reactor, cm_id, Options(slot_size=SLOT), 4)
    default = FakeTransport.for_cm_id(reactor, cm_id, Options(slot_size=SLOT, recv_depth=16))
    assert FakeTransport.made == [transport, default] and transport.cm_id is cm_id
    assert (transport.initial, transport.slot_size, default.initial) == (4, SLOT, 16)


def test_reads_of_the_event_channel_failed_cqs_and_the_protection_domain_are_recorded() -> None:
    event = verbs.CMEvent(verbs.CMEventType.ESTABLISHED, 0, 5, 0, b"", 0, 0, 0, 0, raw_id=None)
    channel = FakeEventChannel()
    assert channel.get_event() is None and channel.calls == 1  # the empty read counts too
    channel.events.append(event)
    assert channel.get_event() is event and channel.calls == 2
    domain = FakeDomain()
    domain.cq_failed(100)
    assert domain.failed_cqs == [100] and not domain.closed
    device = FakeDevice(1)
    pd = FakeProtectionDomain(device)
    pd.close()
    assert pd.closed and pd.device is device
