"""Integration tests of the FFI and verbs layers (run inside the test host, on rxe).

Everything here is synchronous: fds are waited on with select(), CM events come from the event channel,
completions come only through the C drain helper (CompletionQueue.drain).
"""

from __future__ import annotations

import os
import random
import select
import struct
import time
from dataclasses import dataclass, field

import pytest
from rdma_state import rdma_resources

from rdmaio import verbs
from rdmaio.errors import ForkError, VerbsError
from rdmaio.verbs import CMEvent, CMEventType, CMId, EventChannel, WcOpcode, WcStatus

SLOT = 64 * 1024
DEPTH = 32
CREDIT_MSG = struct.Struct("<I")
DEVICE = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")  # siw0 with the test host's --provider siw


class Events:
    """Collects CM events from one channel, waiting with select()."""

    def __init__(self, channel: EventChannel) -> None:
        self.channel = channel
        self.pending: list[CMEvent] = []

    def wait(self, handle: int, *types: CMEventType, timeout: float = 30.0) -> CMEvent:
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.pending:
                if ev.id_handle == handle or ev.listen_id_handle == handle:
                    self.pending.remove(ev)
                    assert ev.event in types, f"expected {types}, got {ev.event.name} status {ev.status}"
                    return ev
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {types}")
            select.select([self.channel.fd], [], [], remaining)
            while (ev := self.channel.get_event()) is not None:
                self.pending.append(ev)


@dataclass
class Side:
    """One connected end: PD, registered slots, channel, CQ and QP on a cm id."""

    cm_id: CMId
    pd: verbs.ProtectionDomain = field(init=False)
    recv_buf: bytearray = field(init=False)
    send_buf: bytearray = field(init=False)
    recv_mr: verbs.MemoryRegion = field(init=False)
    send_mr: verbs.MemoryRegion = field(init=False)
    comp: verbs.CompletionChannel = field(init=False)
    cq: verbs.CompletionQueue = field(init=False)
    qp: verbs.QueuePair = field(init=False)
    batches: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        ctx = self.cm_id.device()
        assert ctx is not None
        self.pd = verbs.ProtectionDomain(ctx)
        self.recv_buf = bytearray(SLOT * DEPTH)
        self.send_buf = bytearray(SLOT * DEPTH)
        self.recv_mr = verbs.MemoryRegion(self.pd, self.recv_buf)
        self.send_mr = verbs.MemoryRegion(self.pd, self.send_buf)
        self.comp = verbs.CompletionChannel(ctx)
        self.cq = verbs.CompletionQueue(ctx, self.comp, 2 * DEPTH + 8)
        self.qp = self.cm_id.create_qp(self.pd, self.cq, self.cq, max_send_wr=DEPTH, max_recv_wr=DEPTH)
        self.qp.post_recv_slots(self.recv_mr, SLOT, list(range(DEPTH)))

    def send(self, slot: int, data: bytes | memoryview, imm: int = 0) -> None:
        off = slot * SLOT
        self.send_buf[off : off + len(data)] = data
        s = self.qp.send_array[0]
        s.wr_id = slot
        s.addr = self.send_mr.addr + off
        s.length = len(data)
        s.lkey = self.send_mr.lkey
        s.imm_data = imm
        s.opcode = verbs.lib.IBV_WR_SEND_WITH_IMM
        s.send_flags = verbs.lib.IBV_SEND_SIGNALED
        self.qp.post_sends(1)

    def completions(self) -> list[tuple[int, int, int, int, int]]:
        """(wr_id, status, opcode, byte_len, imm) of everything one drain pass returns."""
        got = [
            (int(wc.wr_id), int(wc.status), int(wc.opcode), int(wc.byte_len), int(wc.imm_data))
            for wc in self.cq.iter_drain()
        ]
        if got:
            self.batches.append(len(got))
        return got

    def close(self) -> None:
        self.cm_id.close()  # QP first
        for obj in (self.recv_mr, self.send_mr, self.cq, self.comp, self.pd):
            obj.close()


def connect_pair(addr: str) -> tuple[EventChannel, CMId, Side, Side]:
    channel = EventChannel()
    events = Events(channel)
    listener = CMId(channel)
    listener.bind_addr(addr, 0)
    listener.listen(8)
    port = listener.local_address[1] if listener.local_address else 0
    assert port > 0

    client_id = CMId(channel)
    client_id.resolve_addr(addr, port)
    events.wait(client_id.handle, CMEventType.ADDR_RESOLVED)
    client_id.resolve_route()
    events.wait(client_id.handle, CMEventType.ROUTE_RESOLVED)
    client = Side(client_id)
    client_id.connect(b"hello-private-data")

    req = events.wait(listener.handle, CMEventType.CONNECT_REQUEST)
    assert req.private_data[:18] == b"hello-private-data"
    server = Side(CMId.from_event(channel, req))
    server.cm_id.accept(b"welcome")
    est = events.wait(client_id.handle, CMEventType.ESTABLISHED)
    assert est.private_data[:7] == b"welcome"
    events.wait(server.cm_id.handle, CMEventType.ESTABLISHED)
    return channel, listener, client, server


def test_list_devices_and_ports() -> None:
    devices = verbs.list_devices()
    names = [d.name for d in devices]
    assert DEVICE in names
    rxe = devices[names.index(DEVICE)]
    assert rxe.max_qp_wr > 0 and rxe.max_cqe > 0 and rxe.max_mr_size > 0
    assert rxe.ports and rxe.ports[0].active
    assert rxe.ports[0].link_layer == "Ethernet"
    assert rxe.ports[0].active_mtu in (256, 512, 1024, 2048, 4096)


def test_event_channel_resolves_test_address(rdma_addr: str) -> None:
    with EventChannel() as channel:
        assert os.get_blocking(channel.fd) is False
        assert channel.get_event() is None  # non-blocking: nothing pending
        cm_id = CMId(channel)
        cm_id.resolve_addr(rdma_addr, 4791)
        ev = Events(channel).wait(cm_id.handle, CMEventType.ADDR_RESOLVED)
        assert ev.status == 0
        ctx = cm_id.device()
        assert ctx is not None and ctx.name == DEVICE
        assert cm_id.peer_address == (rdma_addr, 4791)
    assert cm_id.closed  # closing the channel closed its id first
    channel.close()  # idempotent


def test_errors_carry_errno_and_call(rdma_addr: str) -> None:
    with EventChannel() as channel:
        cm_id = CMId(channel)
        with pytest.raises(VerbsError) as info:
            cm_id.bind_addr("203.0.113.7", 0)  # TEST-NET-3: not an address of this host
        assert info.value.call == "rdma_bind_addr"
        assert info.value.errno is not None and info.value.errno > 0
        with pytest.raises(VerbsError, match="numeric"):
            cm_id.resolve_addr("not-an-ip", 1)


@pytest.mark.requires_immediate  # every message is a SEND with immediate data
def test_connect_and_exchange_10000_messages_through_drain(rdma_addr: str) -> None:
    before = rdma_resources()
    channel, listener, client, server = connect_pair(rdma_addr)
    rng = random.Random(1234)
    pattern = rng.randbytes(2 * SLOT)
    count = 10_000
    # Random sizes over 1 B..64 KiB, log-uniform so small and large sizes are both well represented.
    sizes = [max(1, min(SLOT, int(2 ** rng.uniform(0, 16)))) for _ in range(count)]
    sizes[0], sizes[1] = 1, SLOT

    def payload(i: int) -> memoryview:
        off = (i * 7919) % SLOT
        return memoryview(pattern)[off : off + sizes[i]]

    credits = DEPTH  # the server posted DEPTH receives for us
    free_slots = list(range(DEPTH))
    server_free_slots = list(range(DEPTH))
    sent = received = 0
    while received < count:
        # client: post as many messages as credits and send slots allow, without waiting in between
        while sent < count and credits > 0 and free_slots:
            client.send(free_slots.pop(), payload(sent), imm=sent)
            credits -= 1
            sent += 1
        ready, _, _ = select.select([client.comp.fd, server.comp.fd], [], [], 30)
        assert ready, "no completion within 30 s"
        # server: verify each message of this wake-up, re-post the slots, grant credits in one message
        reposted = []
        for wr_id, status, opcode, byte_len, imm in server.completions():
            assert status == WcStatus.SUCCESS, verbs.wc_status_str(status)
            if opcode & WcOpcode.RECV:
                assert imm == received and byte_len == sizes[received]
                got = memoryview(server.recv_buf)[wr_id * SLOT : wr_id * SLOT + byte_len]
                assert got == payload(received)
                received += 1
                reposted.append(wr_id)
            else:
                server_free_slots.append(wr_id)
        if reposted:
            server.qp.post_recv_slots(server.recv_mr, SLOT, reposted)
            server.send(server_free_slots.pop(), CREDIT_MSG.pack(len(reposted)))
        # client: send completions free slots, credit messages add credits
        for wr_id, status, opcode, _byte_len, _imm in client.completions():
            assert status == WcStatus.SUCCESS, verbs.wc_status_str(status)
            if opcode & WcOpcode.RECV:
                (n,) = CREDIT_MSG.unpack_from(client.recv_buf, wr_id * SLOT)
                credits += n
                client.qp.post_recv_slots(client.recv_mr, SLOT, [wr_id])
            else:
                free_slots.append(wr_id)

    assert received == count
    mean_batch = sum(server.batches) / len(server.batches)
    print(f"server wake-ups {len(server.batches)}, mean batch {mean_batch:.2f}, max {max(server.batches)}")
    assert mean_batch > 1, server.batches[:50]
    assert server.cq.completions_total >= count

    client.cm_id.disconnect()
    client.close()
    server.close()
    listener.close()
    channel.close()
    after = rdma_resources()
    for kind in ("qp", "cq", "mr", "cm_id", "pd"):
        assert after.get(kind, 0) == before.get(kind, 0), (kind, before, after)


def test_teardown_in_dependency_order_and_idempotent(rdma_addr: str) -> None:
    before = rdma_resources()
    channel, listener, client, server = connect_pair(rdma_addr)
    during = rdma_resources()
    assert during["qp"] >= before.get("qp", 0) + 2 and during["mr"] >= before.get("mr", 0) + 4
    # Closing the PD first must close the QP and MRs that depend on it, QP before MRs.
    client.pd.close()
    assert client.qp.closed and client.recv_mr.closed and client.send_mr.closed
    client.pd.close()
    # Closing the event channel closes every cm id on it (and their QPs) before itself.
    channel.close()
    assert server.qp.closed and listener.closed and client.cm_id.closed
    for side in (client, server):
        side.close()  # everything already or now closed: no error
    after = rdma_resources()
    for kind in ("qp", "cq", "mr", "cm_id", "pd"):
        assert after.get(kind, 0) == before.get(kind, 0), (kind, before, after)


def test_fork_child_gets_clear_error(rdma_addr: str) -> None:
    with EventChannel() as channel:
        cm_id = CMId(channel)
        pid = os.fork()
        if pid == 0:  # child: must not touch the parent's verbs objects
            code = 1
            try:
                cm_id.resolve_addr(rdma_addr, 1)
            except ForkError:
                code = 0
            except BaseException:
                code = 2
            cm_id.close()  # forgets, destroys nothing
            channel.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # the parent's objects are intact after the child closed its copies
        cm_id.resolve_addr(rdma_addr, 4791)
        Events(channel).wait(cm_id.handle, CMEventType.ADDR_RESOLVED)
