"""What a server holds for connections that are not (yet) served, and what one peer can take of a shared
receive queue: half-open requests (a raw rdma_cm client that never completes the exchange), the bound per
source address, the window of a peer without FEATURE_GROW, the shared-receive lease of a peer that cannot
answer RECLAIM, and a peer that leaves a RECLAIM unanswered.

Every bound is asserted from counters (the server's statistics(), the transports' registered bytes, the
shared receive pool's ledger), never from timing; each wait that would hang on a server without the bound
is itself bounded (a failure, not a duration assertion).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import trio
from loops import Runner, arun

import rdmaio
import rdmaio.core.dial
from rdmaio import verbs
from rdmaio.core.reactor import Reactor
from rdmaio.core.shared_receive import SharedReceivePool
from rdmaio.protocol import FEATURE_GROW, FEATURE_RECLAIM, Capabilities, FrameKind, Handshake, encode_imm
from rdmaio.protocol.framing import encode_frame_header
from rdmaio.protocol.reclaim import MIN_WINDOW, ReclaimSession
from rdmaio.verbs import CMEvent, CMEventType, CMId, EventChannel

__all__ = ["arun"]

SLOT = 64 * 1024
# What a peer without FEATURE_GROW announces: the whole window posted at once (rdmaio before growing
# windows, or another implementation). Before the fix the server posted its whole recv_depth for it.
NO_GROW = Handshake(recv_depth=32, slot_size=SLOT, max_message_size=1 << 20)


def other_address(addr: str) -> str:
    """The test host's second address on the same device (198.18.0.1 and .2 on dum0/rxe0): hostile
    requests come from it, so that the legitimate clients have a source address of their own."""
    return os.environ.get("RDMAIO_TEST_ADDR2", "198.18.0.2" if addr != "198.18.0.2" else "198.18.0.1")


async def until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait (bounded) for ``condition``; a hang on a server without the fix becomes this failure. (anyio's
    sleep: the same helper serves the asyncio, uvloop and trio tests.)"""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit} s: {what}")
        await anyio.sleep(0.05)


class HalfOpenClient:
    """Raw rdma_cm connection requests that never complete: no QP (so the kernel does not answer the
    server's REP with an RTU: a CONNECT_RESPONSE is reported and left unanswered), a valid handshake in
    the private data and a distinct QP number in each request (the IB CM drops a request repeating a QP
    number it knows as stale)."""

    def __init__(self, src: str | None = None) -> None:
        self.channel = EventChannel()
        self.src = src
        self.ids: list[CMId] = []
        self.events: list[CMEvent] = []
        self._next_qp = 0x1000

    def _drain(self) -> None:
        while (event := self.channel.get_event()) is not None:
            self.events.append(event)

    async def wait(self, cm_id: CMId, *types: CMEventType) -> CMEvent:
        """The next event of ``cm_id`` (which must be one of ``types``)."""
        found: list[CMEvent] = []

        def arrived() -> bool:
            self._drain()
            for event in self.events:
                if event.id_handle == cm_id.handle:
                    self.events.remove(event)
                    found.append(event)
                    return True
            return False

        await until(arrived, f"an event {types} on a hostile cm id")
        assert found[0].event in types, (found[0].event.name, found[0].status)
        return found[0]

    def seen(self, cm_id: CMId, event_type: CMEventType) -> bool:
        """Whether ``cm_id`` reported ``event_type`` (drains the channel; keeps the event)."""
        self._drain()
        return any(e.id_handle == cm_id.handle and e.event == event_type for e in self.events)

    async def request(self, host: str, port: int, handshake: Handshake) -> CMId:
        """Send one connection request announcing ``handshake``; return its cm id once it is sent."""
        cm_id = CMId(self.channel)
        self.ids.append(cm_id)
        cm_id.resolve_addr(host, port, src=(self.src, 0) if self.src else None)
        await self.wait(cm_id, CMEventType.ADDR_RESOLVED)
        cm_id.resolve_route()
        await self.wait(cm_id, CMEventType.ROUTE_RESOLVED)
        param, _keep = cm_id._conn_param(
            handshake.encode(), retry_count=6, rnr_retry_count=1, responder_resources=1, initiator_depth=1
        )
        param.qp_num = self._next_qp
        self._next_qp += 1
        assert verbs.lib.rdma_connect(cm_id._ptr, param) == 0, "rdma_connect failed"
        return cm_id

    def close(self) -> None:
        for cm_id in self.ids:
            cm_id.close()
        self.channel.close()


# --- half-open requests on iWARP ------------------------------------------------------------------------
# rdma_cm on iWARP connects over TCP, then the initiator sends an MPA request frame (RFC 5044; version 2,
# RFC 6581) with the private data and the listener answers with an MPA reply. siw reports ESTABLISHED on the
# listener's side as soon as it sent its reply (drivers/infiniband/sw/siw/siw_cm.c, siw_accept()), unless the
# request asked for peer-to-peer mode (MPA v2 "enhanced" with a ready-to-receive frame, RTR): then the
# listener waits for the initiator's RTR before it reports ESTABLISHED (wait_for_peer_rts: the socket's data
# callback becomes siw_rtr_data_ready). That wait is iWARP's half-open state, where the server has accepted
# (queue pair, receives) as an InfiniBand or RoCE server has when it waits for the RTU. siw's own initiator
# never asks for an RTR (its peer_to_peer is a constant false, siw_main.c), so a raw rdma_cm id cannot make
# a siw server wait: a connection request without a queue pair is refused by siw_connect() itself (EINVAL,
# "QP does not exist"). Hardware iWARP initiators do ask for it. MpaHalfOpenClient speaks MPA itself.

MPA_KEY_REQ = b"MPA ID Req Frame"
MPA_KEY_REP = b"MPA ID Rep Frame"
MPA_HEADER = struct.Struct("!16sHH")  # key, flags and revision bits, private data length
MPA_FLAG_REJECT = 0x2000
MPA_FLAG_ENHANCED = 0x1000  # MPA v2: IRD/ORD and the peer-to-peer mode lead the private data
MPA_REVISION = 2
MPA_V2 = struct.Struct("!HH")  # IRD (and the peer-to-peer flag), ORD (and the RTR kinds offered)
MPA_V2_PEER_TO_PEER = 0x8000
MPA_V2_RTR_WRITE_OR_READ = 0x8000 | 0x4000


@dataclasses.dataclass
class MpaOutcome:
    """What the listener's MPA reply said, as the rdma_cm event a raw cm id would have reported: its reply
    accepted the request (CONNECT_RESPONSE), or it rejected it (REJECTED)."""

    event: CMEventType
    status: int = 0


class MpaHalfOpenClient:
    """Half-open connection requests on iWARP (see above): a TCP connection from ``src``, an MPA v2 request
    asking for peer-to-peer mode with the handshake in its private data, the listener's reply read, and
    never the RTR. The same calls as :class:`HalfOpenClient`: :meth:`wait` for ``CONNECT_RESPONSE`` is the
    reply accepting the request (``REJECTED``: rejecting it); :meth:`seen` ``REJECTED`` is the listener
    closing the TCP connection (it dropped the request)."""

    def __init__(self, src: str | None = None) -> None:
        self.src = src
        self.socks: list[socket.socket] = []
        self._received: dict[int, bytearray] = {}
        self._closed: set[int] = set()

    def _read(self, sock: socket.socket) -> None:
        """Take what the listener sent (non-blocking); note the connection's end."""
        while sock.fileno() not in self._closed:
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:  # reset by the listener
                data = b""
            if not data:
                self._closed.add(sock.fileno())
                return
            self._received[sock.fileno()] += data

    async def request(self, host: str, port: int, handshake: Handshake) -> socket.socket:
        """Connect and send one MPA request announcing ``handshake``; return the socket."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socks.append(sock)
        self._received[sock.fileno()] = bytearray()
        if self.src:
            sock.bind((self.src, 0))
        sock.settimeout(30)
        sock.connect((host, port))  # the listener's kernel accepts at once (a local address)
        private = MPA_V2.pack(MPA_V2_PEER_TO_PEER | 1, MPA_V2_RTR_WRITE_OR_READ | 1) + handshake.encode()
        sock.sendall(MPA_HEADER.pack(MPA_KEY_REQ, MPA_FLAG_ENHANCED | MPA_REVISION, len(private)) + private)
        sock.setblocking(False)
        return sock

    async def wait(self, sock: socket.socket, *types: CMEventType) -> MpaOutcome:
        """The listener's MPA reply to the request on ``sock`` (which must be one of ``types``)."""
        received = self._received[sock.fileno()]

        def replied() -> bool:
            self._read(sock)
            if len(received) < MPA_HEADER.size:
                assert sock.fileno() not in self._closed, f"closed before an MPA reply: {bytes(received)!r}"
                return False
            key, _bits, length = MPA_HEADER.unpack_from(received)
            assert key == MPA_KEY_REP, bytes(received)
            return len(received) >= MPA_HEADER.size + length or sock.fileno() in self._closed

        await until(replied, "an MPA reply on a hostile TCP connection")
        _key, bits, _length = MPA_HEADER.unpack_from(received)
        outcome = MpaOutcome(CMEventType.REJECTED if bits & MPA_FLAG_REJECT else CMEventType.CONNECT_RESPONSE)
        assert outcome.event in types, (outcome.event.name, hex(bits))
        return outcome

    def seen(self, sock: socket.socket, event_type: CMEventType) -> bool:
        """Whether the listener closed the connection (``REJECTED``: it dropped the request)."""
        assert event_type == CMEventType.REJECTED, event_type
        self._read(sock)
        return sock.fileno() in self._closed

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def half_open_client(provider: str, src: str | None = None) -> Any:
    """The half-open client of ``provider``'s transport: raw rdma_cm ids on InfiniBand and RoCE, MPA over
    TCP on iWARP."""
    return HalfOpenClient(src) if provider == "rxe" else MpaHalfOpenClient(src)


def shared_pool() -> SharedReceivePool:
    """The shared receive pool of the running loop's (only) device."""
    pools = [d.shared_receive for d in Reactor.current()._domains.values() if d.shared_receive is not None]
    assert len(pools) == 1, pools
    pool = pools[0]
    assert isinstance(pool, SharedReceivePool)
    return pool


def pending_receives(server: rdmaio.StreamServer) -> list[int]:
    """Receives each pending connection of ``server`` holds: slots registered for it, or its lease."""
    held = []
    for pending in server._acceptor._pending.values():
        transport = pending.transport
        if transport.shared is not None:
            held.append(transport.shared.pool.ledger.window(transport.shared.key))
        else:
            held.append(transport.recv_ring.registered_bytes // transport.slot_size)
    return held


async def echo(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (message := await ep.recv()) is not None:
            await ep.send(message)


async def echo_once(host: str, port: int, options: rdmaio.Options | None = None) -> None:
    async with await rdmaio.connect(host, port, options=options, timeout=60) as ep:
        await ep.send(b"legitimate")
        assert await asyncio.wait_for(ep.recv(), 60) == b"legitimate"


@pytest.mark.requires_dropping_unestablished
@pytest.mark.parametrize("srq", [False, True], ids=["own-receives", "srq"])
def test_half_open_requests_time_out_and_free_the_backlog(
    arun: Runner[Any], rdma_addr: str, srq: bool, provider: str
) -> None:
    """Four connection requests without FEATURE_GROW that never complete fill a backlog=4 server: each
    holds only ``initial_depth`` receives (registered slots, or SRQ receives lent), not ``recv_depth``; a
    legitimate client is refused while they wait; after ``establish_timeout`` they are dropped (resources
    released, ids destroyed: the hostile side sees REJECTED) and the legitimate client is served.

    Before the fix: each pending request held 32 receives (8 MiB for the four), and they were never
    dropped (the wait for the backlog to free timed out).

    On iWARP the requests are MPA requests that ask for a ready-to-receive frame and never send it
    (:class:`MpaHalfOpenClient`); dropping one closes its TCP connection."""
    options = rdmaio.Options(
        establish_timeout=3.0, shared_receive_queue=srq, srq_max_buffers=64, max_pending_per_source=8
    )

    async def main() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0, backlog=4, options=options)
        hostile = half_open_client(provider, src=other_address(rdma_addr))
        try:
            port = server.addresses[0][1]
            ids = [await hostile.request(rdma_addr, port, NO_GROW) for _ in range(4)]
            for cm_id in ids:  # the server accepted: its REP arrived, no RTU goes back
                await hostile.wait(cm_id, CMEventType.CONNECT_RESPONSE)
            stats = server.statistics()
            assert stats["pending"] == 4, stats
            assert pending_receives(server) == [options.initial_depth] * 4
            if srq:
                assert stats["pending_shared_receives"] == 4 * options.initial_depth
                assert shared_pool().ledger.connections == 4
            else:
                assert stats["pending_registered_bytes"] == 4 * options.initial_depth * SLOT
            with pytest.raises(rdmaio.ConnectionRefusedError):  # the backlog is full of them
                await rdmaio.connect(rdma_addr, port, timeout=60)
            await until(lambda: server.statistics()["pending"] == 0, "the half-open requests dropped")
            stats = server.statistics()
            assert stats["pending_timed_out"] == 4 and stats["pending_registered_bytes"] == 0, stats
            assert stats["pending_shared_receives"] == 0
            for cm_id in ids:  # destroying the server's id rejected the request
                await until(lambda c=cm_id: hostile.seen(c, CMEventType.REJECTED), "REJECTED at the client")
            if srq:
                pool = shared_pool()
                assert pool.ledger.connections == 0 and pool.ledger.free == pool.ledger.buffers
                pool.ledger.check()
            await echo_once(rdma_addr, port, options)
            assert server.statistics()["accepted"] == 1
        finally:
            server.close()
            hostile.close()
            await server.wait_closed()

    arun(main())


@pytest.mark.requires_dropping_unestablished
def test_half_open_requests_time_out_on_trio(rdma_addr: str, provider: str) -> None:
    """The establishment deadline on trio (its timers are system tasks, not loop callbacks): two half-open
    requests fill a backlog=2 server, are dropped after ``establish_timeout``, and a client is served."""
    options = rdmaio.Options(establish_timeout=2.0)

    async def main() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0, backlog=2, options=options)
        hostile = half_open_client(provider, src=other_address(rdma_addr))
        try:
            port = server.addresses[0][1]
            ids = [await hostile.request(rdma_addr, port, NO_GROW) for _ in range(2)]
            for cm_id in ids:
                await hostile.wait(cm_id, CMEventType.CONNECT_RESPONSE)
            assert server.statistics()["pending"] == 2
            assert pending_receives(server) == [options.initial_depth] * 2
            await until(lambda: server.statistics()["pending"] == 0, "the half-open requests dropped")
            assert server.statistics()["pending_timed_out"] == 2
            with trio.fail_after(60):
                async with await rdmaio.connect(rdma_addr, port, timeout=60) as ep:
                    await ep.send(b"legitimate")
                    assert await ep.recv() == b"legitimate"
        finally:
            server.close()
            hostile.close()
            await server.wait_closed()

    trio.run(main)


@pytest.mark.requires_dropping_unestablished  # the server's close drops the two that stay pending
def test_one_source_address_cannot_hold_the_whole_backlog(
    arun: Runner[Any], rdma_addr: str, provider: str
) -> None:
    """With ``max_pending_per_source=2``, six half-open requests from one address: two are pending, the
    other four are rejected at once (the hostile client sees REJECTED); a client from another address is
    served at once, long before the two time out.

    Before the fix: all six were pending (the backlog of 8 allowed it) and nothing was refused."""
    options = rdmaio.Options(establish_timeout=600.0, max_pending_per_source=2)

    async def main() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0, backlog=8, options=options)
        hostile = half_open_client(provider, src=other_address(rdma_addr))
        try:
            port = server.addresses[0][1]
            ids = [await hostile.request(rdma_addr, port, NO_GROW) for _ in range(6)]
            outcomes = [
                (await hostile.wait(c, CMEventType.CONNECT_RESPONSE, CMEventType.REJECTED)).event for c in ids
            ]
            assert outcomes.count(CMEventType.CONNECT_RESPONSE) == 2, outcomes
            assert outcomes.count(CMEventType.REJECTED) == 4, outcomes
            stats = server.statistics()
            assert stats["pending"] == 2 and stats["rejected_source_limit"] == 4, stats
            assert stats["pending_registered_bytes"] == 2 * options.initial_depth * SLOT
            await echo_once(rdma_addr, port, options)  # another source: its own allowance
            assert server.statistics()["pending"] == 2
        finally:
            server.close()
            hostile.close()
            await server.wait_closed()

    arun(main())


@pytest.mark.provider("siw")
def test_tcp_connections_without_an_mpa_request_hold_nothing_of_the_server(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """What a half-open peer can leave on a siw server before rdma_cm sees it: TCP connections to the
    listener's port that never send their MPA request. siw's listener accepts them in the kernel and waits
    at most 5 s for the request (MPAREP_TIMEOUT in drivers/infiniband/sw/siw/siw_cm.h: "Responder waits
    for 5 seconds for MPA request to arrive if new TCP connection was set up"), then closes them; rdma_cm
    reports nothing, so the server holds nothing for them. (An rdma_cm initiator sends its request inside
    rdma_connect, with the TCP connect: it cannot stop before it.) Eight of them to a backlog=4 server: no
    pending connection, nothing registered, the backlog never used, a client served at once; the kernel
    closes all eight."""
    options = rdmaio.Options(establish_timeout=600.0, max_pending_per_source=2)

    async def main() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0, backlog=4, options=options)
        socks: list[socket.socket] = []
        try:
            port = server.addresses[0][1]
            for _ in range(8):
                sock = socket.create_connection(
                    (rdma_addr, port), timeout=30, source_address=(other_address(rdma_addr), 0)
                )
                sock.setblocking(False)
                socks.append(sock)
            stats = server.statistics()
            assert stats["pending"] == 0 and stats["pending_registered_bytes"] == 0, stats
            await echo_once(rdma_addr, port, options)
            stats = server.statistics()
            assert stats["accepted"] == 1 and stats["rejected"] == 0, stats
            assert stats["peak_waiting"] == 1, stats  # only the client's own connection ever waited
            closed: set[int] = set()

            def all_closed() -> bool:
                for i, sock in enumerate(socks):
                    if i in closed:
                        continue
                    try:
                        if sock.recv(64) == b"":
                            closed.add(i)
                    except BlockingIOError:
                        pass
                    except OSError:  # reset
                        closed.add(i)
                return len(closed) == len(socks)

            await until(all_closed, "siw closing the TCP connections that sent no MPA request")
            stats = server.statistics()
            assert stats["pending"] == 0 and stats["rejected"] == 0 and stats["accepted"] == 1, stats
        finally:
            for sock in socks:
                sock.close()
            server.close()
            await server.wait_closed()

    arun(main())


def test_peers_that_cannot_be_reclaimed_get_the_reserve_of_the_srq(
    arun: Runner[Any], rdma_addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a server with a shared receive queue of 64 buffers (documented capacity 64 / 4 = 16 connections):
    8 clients without FEATURE_GROW asking for 32 receives and 8 default clients (neither answers RECLAIM)
    are lent the reserve, 4 receives each, so all 16 connect; the 17th is refused (the pool is at its
    bound), and its refusal leaves every lease as it was.

    Before the fix: a peer without FEATURE_GROW was lent its whole 32 receives for life, so two of them
    took the whole pool and the third connection was refused."""
    server_options = rdmaio.Options(shared_receive_queue=True, srq_max_buffers=64)
    original = rdmaio.core.dial.local_handshake

    def handshake_for(options: rdmaio.Options, *, grow: bool = True, caps: Any = None) -> Handshake:
        if options.initial_depth == options.recv_depth:  # the "fixed ring" clients: no FEATURE_GROW
            handshake = original(options, grow=False, caps=caps)
            assert not handshake.features & FEATURE_GROW
            return handshake
        return original(options, grow=grow, caps=caps)

    monkeypatch.setattr(rdmaio.core.dial, "local_handshake", handshake_for)
    fixed = rdmaio.Options(initial_depth=32, recv_depth=32)

    async def main() -> None:
        server = await rdmaio.listen(rdma_addr, 0, options=server_options, backlog=32)
        clients: list[rdmaio.Endpoint] = []
        try:
            port = server.addresses[0][1]
            for i in range(16):
                ep = await rdmaio.connect(rdma_addr, port, options=fixed if i < 8 else None, timeout=60)
                clients.append(ep)
            peers = [await asyncio.wait_for(server.accept(), 60) for _ in clients]
            pool = shared_pool()
            leases = [pool.ledger.window(p._conn.transport.shared.key) for p in peers]  # type: ignore[union-attr]
            assert leases == [MIN_WINDOW] * 16, leases
            assert [p._conn.session.local.recv_depth for p in peers] == [MIN_WINDOW] * 16
            assert pool.ledger.buffers == 64 and pool.ledger.free == 0
            with pytest.raises(rdmaio.ConnectionRefusedError):
                await rdmaio.connect(rdma_addr, port, timeout=60)
            assert pool.statistics()["refused"] >= 1
            # Every connection works on its reserve, both ways.
            for i, (ep, peer) in enumerate(zip(clients, peers, strict=True)):
                await ep.send(b"%d" % i)
                assert await asyncio.wait_for(peer.recv(), 60) == b"%d" % i
                await peer.send(b"back %d" % i)
                assert await asyncio.wait_for(ep.recv(), 60) == b"back %d" % i
            pool.ledger.check()
        finally:
            for ep in clients:
                ep.abort()
            server.close()
            server.abort_clients()
            await server.wait_closed()

    arun(main())


class SilentReclaimSession(ReclaimSession):
    """A peer that announces FEATURE_RECLAIM (and accepts RECLAIM frames) but never answers with RETURN."""

    __slots__ = ()

    def return_frame_due(self) -> bool:
        return False


def test_a_peer_that_never_answers_reclaim_is_failed_and_its_lease_reclaimed(
    arun: Runner[Any], rdma_addr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client announcing FEATURE_RECLAIM whose window on the server's shared receive queue grew under a
    burst, then idles: the server sends RECLAIM, the client (while holding credits to answer) never
    returns any; after ``reclaim_timeout`` the server fails that connection (a ProtocolError: its reads
    raise ConnectionAbortedError from it) and its lease goes back to the pool. Another connection on the
    pool is unaffected.

    Before the fix: RECLAIM had no deadline; the lease stayed lent (the wait for the failure timed out)."""
    server_options = rdmaio.Options(
        shared_receive_queue=True, srq_max_buffers=256, reclaim_timeout=2.0, slot_size=8192, recv_depth=32
    )
    original = rdmaio.core.dial.local_handshake

    def reclaiming(options: rdmaio.Options, *, grow: bool = True, caps: Any = None) -> Handshake:
        handshake = original(options, grow=grow, caps=caps)
        return dataclasses.replace(handshake, features=handshake.features | FEATURE_RECLAIM)

    silent = rdmaio.Options(slot_size=8192, recv_depth=32, send_depth=32, batch_limit=0)

    async def main() -> None:
        server = await rdmaio.listen(rdma_addr, 0, options=server_options)
        try:
            port = server.addresses[0][1]
            monkeypatch.setattr(rdmaio.core.dial, "local_handshake", reclaiming)
            monkeypatch.setattr(
                rdmaio.core.dial,
                "new_session",
                lambda local, peer, transport: SilentReclaimSession(local, peer),
            )
            bad = await rdmaio.connect(rdma_addr, port, options=silent, timeout=60)
            monkeypatch.undo()
            good = await rdmaio.connect(rdma_addr, port, timeout=60)
            bad_peer = await asyncio.wait_for(server.accept(), 60)
            good_peer = await asyncio.wait_for(server.accept(), 60)
            assert bad_peer._conn.session.reclaim  # both sides announced FEATURE_RECLAIM
            member = bad_peer._conn.transport.shared
            assert member is not None
            pool = member.pool
            # A burst the server does not read at once: its window grows beyond the reserve.
            # (Frames of at least half a slot count towards growth.)
            message = b"x" * 6000
            for _round in range(20):
                for _ in range(64):
                    await bad.send(message)
                for _ in range(64):
                    assert await asyncio.wait_for(bad_peer.recv(), 60) == message
                if pool.ledger.window(member.key) >= 2 * MIN_WINDOW:
                    break
            grown = pool.ledger.window(member.key)
            # RECLAIM is sent only if the peer would give back something (it keeps RETURN_KEEP).
            assert grown >= 2 * MIN_WINDOW, grown
            # Idle now: the server asks for the credits back and the client never answers.
            await until(lambda: bad_peer._conn.torn_down, "the silent peer failed", limit=120)
            with pytest.raises(rdmaio.ConnectionAbortedError, match="RECLAIM") as failure:
                await bad_peer.recv()
            assert isinstance(failure.value.__cause__, rdmaio.ProtocolError)
            assert member.key not in pool.members
            assert pool.ledger.connections == 1  # only the good connection's lease is left
            pool.ledger.check()
            await good.send(b"still served")
            assert await asyncio.wait_for(good_peer.recv(), 60) == b"still served"
            bad.abort()
            await good.aclose()
            await good_peer.aclose()
        finally:
            server.close()
            server.abort_clients()
            await server.wait_closed()

    arun(main())


class RawPeer:
    """An established connection of raw verbs objects (a QP of its own, four receives posted for the
    server's CREDIT frames): it puts on the wire whatever SENDs it is told to, credits or not. With
    ``header`` (a device without immediate data: iWARP) its frames are plain SENDs whose payload starts with
    the frame header, as the header framing has them."""

    SLOT = 4096

    def __init__(self, cm_id: CMId, header: bool = False) -> None:
        self.header = header
        ctx = cm_id.device()
        assert ctx is not None
        self.cm_id = cm_id
        self.pd = verbs.ProtectionDomain(ctx)
        self.buf = bytearray(self.SLOT * 8)
        self.mr = verbs.MemoryRegion(self.pd, self.buf)
        self.comp = verbs.CompletionChannel(ctx)
        self.cq = verbs.CompletionQueue(ctx, self.comp, 64)
        self.qp = cm_id.create_qp(self.pd, self.cq, self.cq, max_send_wr=32, max_recv_wr=8)
        lkeys = verbs.ffi.new("uint32_t[]", [self.mr.lkey] * 8)
        self._lkeys = lkeys
        self.qp.post_ring_slots(lkeys, self.mr.addr, self.SLOT, [4, 5, 6, 7], 0)

    def send_frames(self, count: int, payload: bytes) -> None:
        """Post ``count`` complete one-fragment messages (DATA_END frames granting nothing)."""
        imm = encode_imm(FrameKind.DATA_END, 0)
        if self.header:
            payload = encode_frame_header(imm) + payload
        self.buf[: len(payload)] = payload
        for i in range(count):
            s = self.qp.send_array[0]
            s.wr_id = i
            s.addr = self.mr.addr
            s.length = len(payload)
            s.lkey = self.mr.lkey
            s.imm_data = 0 if self.header else imm
            s.opcode = verbs.lib.IBV_WR_SEND if self.header else verbs.lib.IBV_WR_SEND_WITH_IMM
            s.send_flags = verbs.lib.IBV_SEND_SIGNALED
            self.qp.post_sends(1)

    def close(self) -> None:
        self.cm_id.close()
        for obj in (self.mr, self.cq, self.comp, self.pd):
            obj.close()


def test_a_peer_sending_beyond_its_credits_on_an_srq_fails_at_once(
    arun: Runner[Any], rdma_addr: str, provider: str
) -> None:
    """A raw peer on a shared receive queue sends 12 frames against the 4 credits its lease gave it: the
    receives it took beyond the lease are counted (``overruns``), the connection fails at once (a
    ProtocolError, before the frames of that completion batch are processed) and its teardown puts every
    buffer back, so the ledger agrees with the SRQ again and the other connection keeps working.

    Before the fix the overrun was only logged (the frame was then rejected by the session), and the
    ledger counted the receives taken beyond the lease as still posted.

    On iWARP the raw peer announces a device without immediate data and sends header-framed frames, and it
    sends 8 frames, not 12: a SEND that meets an empty receive queue there is no RNR but a TERMINATE that
    ends the connection at once, which would race the overrun's own failure. 8 frames take the bad lease
    and the good connection's receives (the overrun), and none meets an empty queue."""
    options = rdmaio.Options(shared_receive_queue=True, srq_max_buffers=64)
    iwarp = provider != "rxe"
    caps = Capabilities(immediate=False, atomics=False, memory_windows=False) if iwarp else None
    handshake = Handshake(recv_depth=4, slot_size=RawPeer.SLOT, max_message_size=1 << 20, caps=caps)
    flood = 2 * MIN_WINDOW if iwarp else 12

    async def main() -> None:
        server = await rdmaio.listen(rdma_addr, 0, options=options)
        hostile = HalfOpenClient()
        raw: RawPeer | None = None
        try:
            port = server.addresses[0][1]
            cm_id = CMId(hostile.channel)
            hostile.ids.append(cm_id)
            cm_id.resolve_addr(rdma_addr, port)
            await hostile.wait(cm_id, CMEventType.ADDR_RESOLVED)
            cm_id.resolve_route()
            await hostile.wait(cm_id, CMEventType.ROUTE_RESOLVED)
            raw = RawPeer(cm_id, header=iwarp)
            hostile.ids.remove(cm_id)  # closed by raw.close()
            cm_id.connect(handshake.encode(), rnr_retry_count=1)
            await hostile.wait(cm_id, CMEventType.ESTABLISHED)
            bad_peer = await asyncio.wait_for(server.accept(), 60)
            good = await rdmaio.connect(rdma_addr, port, timeout=60)
            good_peer = await asyncio.wait_for(server.accept(), 60)
            member = bad_peer._conn.transport.shared
            assert member is not None
            pool = member.pool
            assert pool.ledger.window(member.key) == MIN_WINDOW  # it cannot answer RECLAIM: the reserve
            # The pool holds the two leases (8 receives): the frames beyond the bad lease take the good
            # connection's receives (it sends nothing meanwhile), then meet an empty SRQ (RNR: the raw QP
            # retries once, then fails). That window is what an overrun can cost the others.
            assert pool.ledger.buffers - pool.ledger.free == 2 * MIN_WINDOW
            raw.send_frames(flood, b"flood")
            await until(lambda: bad_peer._conn.torn_down, "the flooding peer failed")
            # Frames within the lease that came in an earlier completion batch may have been delivered;
            # none of the batch that overran is, and the reads then fail.
            delivered = 0
            with pytest.raises(rdmaio.ConnectionAbortedError, match="beyond its credits") as failure:
                while True:
                    assert await bad_peer.recv() == b"flood"
                    delivered += 1
            assert delivered <= MIN_WINDOW
            assert isinstance(failure.value.__cause__, rdmaio.ProtocolError)
            assert pool.statistics()["overruns"] >= 1
            assert member.key not in pool.members and pool.ledger.connections == 1
            pool.ledger.check()
            await until(lambda: pool.ledger.posted == pool.ledger.buffers, "every buffer posted again")
            for i in range(20):  # the other connection on the pool is unaffected
                await good.send(b"good %d" % i)
                assert await asyncio.wait_for(good_peer.recv(), 60) == b"good %d" % i
            await good.aclose()
            await good_peer.aclose()
        finally:
            server.close()
            server.abort_clients()
            await server.wait_closed()
            if raw is not None:
                raw.close()
            hostile.close()

    arun(main())
