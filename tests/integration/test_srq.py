"""Shared receive queues in the verbs layer, run inside the test host on rxe.

Two clients connect to one server whose two QPs take their receives from one SRQ; the SRQ's low-watermark
event (``IBV_EVENT_SRQ_LIMIT_REACHED``) arrives on the device's async fd once the queue drains below the
limit; a SEND that finds the SRQ empty fails with RNR (rnr_retry_count 1, as rdmaio configures QPs).
Synchronous, like test_verbs.py: fds are waited on with select().
"""

from __future__ import annotations

import re
import select
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from rdma_state import rdma_resources
from test_verbs import Events

from rdmaio import verbs
from rdmaio.verbs import CMEventType, CMId, EventChannel, WcOpcode, WcStatus

SLOT = 4096
SRQ_DEPTH = 16
LIMIT = 8


def srq_count() -> int:
    """SRQs over all devices (``rdma resource show``; 0 when the tool does not list them)."""
    out = subprocess.run(["rdma", "resource", "show"], check=True, capture_output=True, text=True).stdout
    return sum(int(n) for n in re.findall(r"\bsrq (\d+)", out))


@dataclass
class Client:
    """A connected client with its own PD, CQ, send buffer and a small receive queue of its own."""

    cm_id: CMId
    pd: verbs.ProtectionDomain = field(init=False)
    buf: bytearray = field(init=False)
    mr: verbs.MemoryRegion = field(init=False)
    comp: verbs.CompletionChannel = field(init=False)
    cq: verbs.CompletionQueue = field(init=False)
    qp: verbs.QueuePair = field(init=False)

    def __post_init__(self) -> None:
        ctx = self.cm_id.device()
        assert ctx is not None
        self.pd = verbs.ProtectionDomain(ctx)
        self.buf = bytearray(SLOT * 32)
        self.mr = verbs.MemoryRegion(self.pd, self.buf)
        self.comp = verbs.CompletionChannel(ctx)
        self.cq = verbs.CompletionQueue(ctx, self.comp, 64)
        self.qp = self.cm_id.create_qp(self.pd, self.cq, self.cq, max_send_wr=32, max_recv_wr=4)

    def send(self, index: int, data: bytes, imm: int) -> None:
        off = index * SLOT
        self.buf[off : off + len(data)] = data
        s = self.qp.send_array[0]
        s.wr_id = index
        s.addr = self.mr.addr + off
        s.length = len(data)
        s.lkey = self.mr.lkey
        s.imm_data = imm
        s.opcode = verbs.lib.IBV_WR_SEND_WITH_IMM
        s.send_flags = verbs.lib.IBV_SEND_SIGNALED
        self.qp.post_sends(1)

    def close(self) -> None:
        self.cm_id.close()
        for obj in (self.mr, self.cq, self.comp, self.pd):
            obj.close()


@dataclass
class Server:
    """One PD, one CQ and one SRQ of ``SRQ_DEPTH`` slots shared by every accepted QP."""

    ctx: verbs.DeviceContext
    pd: verbs.ProtectionDomain = field(init=False)
    buf: bytearray = field(init=False)
    mr: verbs.MemoryRegion = field(init=False)
    lkeys: object = field(init=False)
    comp: verbs.CompletionChannel = field(init=False)
    cq: verbs.CompletionQueue = field(init=False)
    srq: verbs.SharedReceiveQueue = field(init=False)
    ids: list[CMId] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pd = verbs.ProtectionDomain(self.ctx)
        self.buf = bytearray(SLOT * SRQ_DEPTH)
        self.mr = verbs.MemoryRegion(self.pd, self.buf)
        self.lkeys = verbs.ffi.new("uint32_t[]", [self.mr.lkey] * SRQ_DEPTH)
        self.comp = verbs.CompletionChannel(self.ctx)
        self.cq = verbs.CompletionQueue(self.ctx, self.comp, 4 * SRQ_DEPTH)
        self.srq = verbs.SharedReceiveQueue(self.pd, SRQ_DEPTH)
        self.repost(list(range(SRQ_DEPTH)))

    def repost(self, slots: list[int]) -> None:
        self.srq.post_ring_slots(self.lkeys, self.mr.addr, SLOT, slots)

    def accept(self, cm_id: CMId) -> None:
        cm_id.create_qp(self.pd, self.cq, self.cq, max_send_wr=8, max_recv_wr=0, srq=self.srq)
        cm_id.accept(b"srq")
        self.ids.append(cm_id)

    def receives(self, want: int, timeout: float = 30.0) -> list[tuple[int, int, int, bytes]]:
        """``(qp_num, slot, imm, payload)`` of ``want`` successful receive completions."""
        got: list[tuple[int, int, int, bytes]] = []
        deadline = time.monotonic() + timeout
        while len(got) < want:
            for wc in self.cq.iter_drain():
                assert wc.status == WcStatus.SUCCESS, verbs.wc_status_str(wc.status)
                if wc.opcode & WcOpcode.RECV:
                    slot = int(wc.wr_id)
                    data = bytes(self.buf[slot * SLOT : slot * SLOT + wc.byte_len])
                    got.append((int(wc.qp_num), slot, int(wc.imm_data), data))
            if len(got) < want:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"{len(got)} of {want} receives within {timeout} s"
                select.select([self.comp.fd], [], [], remaining)
        return got


@pytest.fixture
def pair_of_clients(rdma_addr: str) -> Iterator[tuple[Server, list[Client], EventChannel]]:
    channel = EventChannel()
    events = Events(channel)
    listener = CMId(channel)
    listener.bind_addr(rdma_addr, 0)
    listener.listen(8)
    port = listener.local_address[1] if listener.local_address else 0
    server: Server | None = None
    clients: list[Client] = []
    try:
        for _ in range(2):
            cm_id = CMId(channel)
            cm_id.resolve_addr(rdma_addr, port)
            events.wait(cm_id.handle, CMEventType.ADDR_RESOLVED)
            cm_id.resolve_route()
            events.wait(cm_id.handle, CMEventType.ROUTE_RESOLVED)
            client = Client(cm_id)
            clients.append(client)
            cm_id.connect(b"hello", rnr_retry_count=1)
            req = events.wait(listener.handle, CMEventType.CONNECT_REQUEST)
            server_id = CMId.from_event(channel, req)
            if server is None:
                ctx = server_id.device()
                assert ctx is not None
                server = Server(ctx)
            server.accept(server_id)
            events.wait(cm_id.handle, CMEventType.ESTABLISHED)
            events.wait(server_id.handle, CMEventType.ESTABLISHED)
        assert server is not None
        yield server, clients, channel
    finally:
        for client in clients:
            client.close()
        if server is not None:
            server.srq.close()
            for obj in (server.mr, server.cq, server.comp, server.pd):
                obj.close()
        listener.close()
        channel.close()


def async_events(ctx: verbs.DeviceContext, timeout: float) -> list[verbs.AsyncEvent]:
    """Every async event of the device within ``timeout`` seconds (stops early after an SRQ event)."""
    ctx.set_async_nonblocking()
    seen: list[verbs.AsyncEvent] = []
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        select.select([ctx.async_fd], [], [], remaining)
        while (event := ctx.get_async_event()) is not None:
            seen.append(event)
        if any(e.event_type == verbs.EVENT_SRQ_LIMIT_REACHED for e in seen):
            break
    return seen


@pytest.mark.requires_immediate  # the clients number their messages in immediate data
def test_two_qps_receive_from_one_srq_and_the_limit_event_arrives(
    pair_of_clients: tuple[Server, list[Client], EventChannel],
) -> None:
    server, clients, _channel = pair_of_clients
    info = next(d for d in verbs.list_devices() if d.name == server.ctx.name)
    print(f"{info.name}: max_srq {info.max_srq}, max_srq_wr {info.max_srq_wr}")
    assert info.max_srq > 0 and info.max_srq_wr >= SRQ_DEPTH
    max_wr, _max_sge, limit = server.srq.query()
    assert max_wr >= SRQ_DEPTH and limit == 0  # created without a limit: not armed
    server.srq.arm_limit(LIMIT)
    assert server.srq.query()[2] == LIMIT
    # Nothing consumed yet: the SRQ holds 16 >= 8, no event.
    assert not [e for e in async_events(server.ctx, 0.5) if e.event_type == verbs.EVENT_SRQ_LIMIT_REACHED]

    # 5 messages from each client: 10 receives taken, 6 left < 8.
    for i in range(5):
        for n, client in enumerate(clients):
            client.send(i, f"client{n} message {i}".encode(), imm=n << 8 | i)
    got = server.receives(10)
    qp_nums = {server_id.qp.qp_num for server_id in server.ids if server_id.qp is not None}
    assert {qp for qp, _, _, _ in got} == qp_nums and len(qp_nums) == 2
    by_client: dict[int, list[int]] = {0: [], 1: []}
    for _qp, _slot, imm, data in got:
        by_client[imm >> 8].append(imm & 0xFF)
        assert data == f"client{imm >> 8} message {imm & 0xFF}".encode()
    assert by_client == {0: list(range(5)), 1: list(range(5))}  # RC order per QP
    assert len({slot for _, slot, _, _ in got}) == 10  # every receive its own SRQ buffer

    events = async_events(server.ctx, 10.0)
    limit_events = [e for e in events if e.event_type == verbs.EVENT_SRQ_LIMIT_REACHED]
    print("async events:", [(e.description, e.obj == server.srq.handle) for e in events])
    assert len(limit_events) == 1 and limit_events[0].obj == server.srq.handle
    assert server.srq.query()[2] == 0  # the event disarmed the limit (rxe clears it when it fires)

    # Refill, re-arm, drain again: the event comes again only because it was re-armed.
    server.repost([slot for _, slot, _, _ in got])
    server.srq.arm_limit(LIMIT)
    for i in range(9):
        clients[i % 2].send(5 + i, b"again", imm=9)
    server.receives(9)
    assert [e for e in async_events(server.ctx, 10.0) if e.event_type == verbs.EVENT_SRQ_LIMIT_REACHED]


@pytest.mark.requires_immediate  # and RNR, which iWARP does not have (a SEND to an empty queue ends the QP)
def test_send_to_an_empty_srq_fails_with_rnr_when_rnr_retry_is_finite(
    pair_of_clients: tuple[Server, list[Client], EventChannel],
) -> None:
    """rdmaio's QPs use rnr_retry_count 1 (Options.rnr_retry_count): a SEND that meets an empty SRQ fails the
    connection instead of stalling, so the integration tests of the credit scheme would see any overrun."""
    server, clients, _channel = pair_of_clients
    for i in range(SRQ_DEPTH):
        clients[i % 2].send(i, b"fill", imm=i)
    server.receives(SRQ_DEPTH)
    clients[0].send(20, b"one too many", imm=99)
    deadline = time.monotonic() + 60
    statuses: list[int] = []
    while not statuses and time.monotonic() < deadline:
        select.select([clients[0].comp.fd], [], [], 1.0)
        statuses = [int(wc.status) for wc in clients[0].cq.iter_drain() if int(wc.wr_id) == 20]
    assert statuses == [WcStatus.RNR_RETRY_EXC_ERR], [verbs.wc_status_str(s) for s in statuses]


def test_closing_the_srq_closes_its_qps_first_and_leaks_nothing(rdma_addr: str) -> None:
    before, srqs_before = rdma_resources(), srq_count()
    with EventChannel() as channel:
        cm_id = CMId(channel)
        cm_id.resolve_addr(rdma_addr, 4791)
        Events(channel).wait(cm_id.handle, CMEventType.ADDR_RESOLVED)
        ctx = cm_id.device()
        assert ctx is not None
        pd = verbs.ProtectionDomain(ctx)
        comp = verbs.CompletionChannel(ctx)
        cq = verbs.CompletionQueue(ctx, comp, 16)
        srq = verbs.SharedReceiveQueue(pd, 8, limit=2)
        assert srq.query()[2] == 2
        with pytest.raises(ValueError, match="limit"):
            srq.arm_limit(srq.max_wr + 1)
        cm_id.resolve_route()
        Events(channel).wait(cm_id.handle, CMEventType.ROUTE_RESOLVED)
        qp = cm_id.create_qp(pd, cq, cq, max_send_wr=4, max_recv_wr=0, srq=srq)
        assert qp.srq is srq
        if srqs_before or srq_count():
            assert srq_count() == srqs_before + 1
        srq.close()  # the QP goes first: it may not outlive its SRQ
        assert qp.closed and srq.closed
        srq.close()  # idempotent
        for obj in (cq, comp, pd):
            obj.close()
    after = rdma_resources()
    for kind in ("qp", "cq", "mr", "cm_id", "pd"):
        assert after.get(kind, 0) == before.get(kind, 0), (kind, before, after)
    assert srq_count() == srqs_before


def test_srq_query_answers_where_the_device_does_not(rdma_addr: str, provider: str) -> None:
    """``SharedReceiveQueue.query`` on every device: Soft-iWARP does not implement ``ibv_query_srq``
    (EOPNOTSUPP), and the queue then answers what it was created and armed with. Before: VerbsError
    ``ibv_query_srq() [ENOTSUP]`` on siw."""
    with EventChannel() as channel:
        cm_id = CMId(channel)
        cm_id.resolve_addr(rdma_addr, 4791)
        Events(channel).wait(cm_id.handle, CMEventType.ADDR_RESOLVED)
        ctx = cm_id.device()
        assert ctx is not None
        pd = verbs.ProtectionDomain(ctx)
        srq = verbs.SharedReceiveQueue(pd, 8, limit=2)
        try:
            max_wr, max_sge, limit = srq.query()
            assert max_wr >= 8 and max_sge >= 1 and limit == 2
            srq.arm_limit(3)
            assert srq.query()[2] == 3
            # rxe answers from the device, siw (ibv_query_srq: EOPNOTSUPP) from what was asked
            assert srq.query_supported is (provider != "siw"), provider
            if not srq.query_supported:
                assert (max_wr, max_sge) == (srq.max_wr, 1)
        finally:
            srq.close()
            pd.close()
            cm_id.close()
