"""Shared receive queue credits: RECLAIM/RETURN frames, ReclaimSession, SharedCreditLedger, and a randomized
simulation of many connections drawing on one pool (no RNR, no deadlock or starvation, the pool bound)."""

from __future__ import annotations

import ast
import functools
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmaio
from rdmaio.core import shared_receive
from rdmaio.errors import FrameError
from rdmaio.protocol import (
    FEATURE_GROW,
    KNOWN_FEATURES,
    FrameKind,
    Handshake,
    Session,
    decode_imm,
    encode_imm,
)
from rdmaio.protocol.credit_ledger import SharedCreditLedger
from rdmaio.protocol.frames import MAX_RETURN, encode_return_imm, returned_credits
from rdmaio.protocol.handshake import FEATURE_RECLAIM
from rdmaio.protocol.reclaim import MIN_WINDOW, RETURN_KEEP, ReclaimSession
from rdmaio.protocol.shared_session import SharedSession

# -- frames and handshake ---------------------------------------------------------------------------------


def test_feature_reclaim_is_the_next_free_bit_and_round_trips() -> None:
    assert FEATURE_RECLAIM == 0x10 and KNOWN_FEATURES & FEATURE_RECLAIM
    hs = Handshake(16, 64, 1024, features=FEATURE_RECLAIM | FEATURE_GROW, initial_depth=4)
    assert Handshake.decode(hs.encode()) == hs


@pytest.mark.parametrize(("returned", "credits"), [(0, 0), (1, 7), (MAX_RETURN, 65535), (17, 0)])
def test_return_imm_carries_the_count_in_bits_27_to_16(returned: int, credits: int) -> None:
    imm = encode_return_imm(returned, credits)
    assert imm >> 28 == FrameKind.RETURN
    assert decode_imm(imm) == (FrameKind.RETURN, credits)
    assert returned_credits(imm) == returned


def test_reserved_bits_stay_reserved_outside_return() -> None:
    with pytest.raises(FrameError, match="reserved bits"):
        decode_imm(int(FrameKind.RECLAIM) << 28 | 1 << 16)
    assert returned_credits(encode_imm(FrameKind.CREDIT, 5)) == 0
    with pytest.raises(ValueError, match="returned credits"):
        encode_return_imm(MAX_RETURN + 1, 0)
    with pytest.raises(ValueError, match="credits"):
        encode_return_imm(0, 65536)


@pytest.mark.parametrize("kind", [FrameKind.RECLAIM, FrameKind.RETURN])
def test_plain_session_rejects_reclaim_frames(kind: FrameKind) -> None:
    hs = Handshake(8, 64, 1024)
    s = Session(hs, hs)
    with pytest.raises(FrameError, match="FEATURE_RECLAIM was not negotiated"):
        s.on_frame(encode_imm(kind, 0), 0)


# -- ReclaimSession -----------------------------------------------------------------------------------------


def reclaim_pair(depth: int = 16, initial: int = 16) -> tuple[ReclaimSession, ReclaimSession]:
    """``lender`` draws its receives from a shared pool; ``peer`` sends to it and answers RECLAIM."""
    lender_hs = Handshake(depth, 64, 1024, features=FEATURE_RECLAIM | FEATURE_GROW, initial_depth=initial)
    peer_hs = Handshake(8, 64, 1024, features=FEATURE_RECLAIM)
    return ReclaimSession(lender_hs, peer_hs, shared=True), ReclaimSession(peer_hs, lender_hs)


def test_reclaim_and_return_shrink_the_window_to_the_reserve() -> None:
    lender, peer = reclaim_pair()
    assert lender.reclaim and peer.send_credits == 16
    lender.request_reclaim()
    assert lender.reclaim_frame_due()
    peer.on_frame(lender.take_reclaim_frame(), 0)
    assert lender.reclaim_pending and peer.return_due and peer.return_frame_due()
    imm = peer.take_return_frame()
    assert returned_credits(imm) == 16 - 1 - RETURN_KEEP
    assert peer.send_credits == RETURN_KEEP
    assert lender.on_frame(imm, 0) is FrameKind.RETURN
    assert lender.recv_depth == 16 - 12 and lender.posted == RETURN_KEEP
    assert not lender.reclaim_pending
    lender.on_recv_reposted(1)  # the RETURN frame's own receive
    assert lender.recv_depth == MIN_WINDOW and lender.credit_threshold == 2
    stats, peer_stats = lender.statistics(), peer.statistics()
    assert stats["credits_returned_received"] == peer_stats["credits_returned_sent"] == 12
    assert stats["credits_granted"] == 0 and peer_stats["credits_received"] == 0
    # Still a working connection: data flows, credits come back, the window can grow again.
    lender.on_frame(peer.take_data_frame(True, 10), 10)
    lender.on_recv_reposted(1)
    lender.grow_receives(4)
    peer.on_frame(lender.take_credit_frame(), 0)
    assert peer.send_credits == 2 + 2 + 4 and lender.recv_depth == 8  # 2 reposted, 4 new
    assert lender.statistics()["credits_granted"] == peer.statistics()["credits_received"]


def test_return_with_few_credits_gives_nothing_back_and_keeps_the_last_credit_rule() -> None:
    lender, peer = reclaim_pair(initial=4)
    for _ in range(3):
        lender.on_frame(peer.take_data_frame(True, 1), 1)
    lender.request_reclaim()
    assert not lender.reclaim_frame_due() or lender.send_credits >= 2
    peer.on_frame(lender.take_reclaim_frame(), 0)
    assert peer.send_credits == 1 and peer.ungranted == 0
    assert not peer.return_frame_due()  # the last credit only with a grant
    lender.on_frame(peer.take_credit_frame(), 0) if peer.credit_frame_due() else None
    peer.on_recv_reposted(1)  # the RECLAIM frame's receive: now the RETURN grants one
    imm = peer.take_return_frame()
    assert returned_credits(imm) == 0 and decode_imm(imm)[1] == 1
    lender.on_frame(imm, 0)
    assert lender.recv_depth == 4


def test_release_receives_shrinks_only_consumed_receives_and_never_below_the_reserve() -> None:
    lender, peer = reclaim_pair(initial=8)
    for _ in range(5):
        lender.on_frame(peer.take_data_frame(True, 1), 1)
    assert lender.unreturned == 5
    with pytest.raises(ValueError, match="cannot release 6"):
        lender.release_receives(6)
    lender.release_receives(4)
    assert lender.recv_depth == 4 and lender.credit_threshold == 2
    with pytest.raises(ValueError, match="below 4"):
        lender.release_receives(1)
    with pytest.raises(RuntimeError, match="shared pool"):
        peer.release_receives(0)
    lender.on_recv_reposted(1)
    assert lender.statistics()["released"] == 4


def test_bad_return_frames_abort() -> None:
    lender, peer = reclaim_pair()
    with pytest.raises(FrameError, match="without a RECLAIM"):
        lender.on_frame(encode_return_imm(1, 0), 0)
    lender, peer = reclaim_pair()
    lender.request_reclaim()
    peer.on_frame(lender.take_reclaim_frame(), 0)
    with pytest.raises(FrameError, match="gives back 16 credits"):
        lender.on_frame(encode_return_imm(16, 0), 0)
    lender, peer = reclaim_pair()
    with pytest.raises(FrameError, match="payload"):
        peer.on_frame(encode_imm(FrameKind.RECLAIM, 0), 3)
    with pytest.raises(ValueError, match="threshold must follow"):
        ReclaimSession(lender.local, lender.peer, shared=True, credit_threshold=3)


def test_without_the_feature_no_reclaim_is_sent() -> None:
    lender_hs = Handshake(16, 64, 1024, features=FEATURE_RECLAIM | FEATURE_GROW, initial_depth=4)
    old_hs = Handshake(8, 64, 1024)
    lender = ReclaimSession(lender_hs, old_hs, shared=True)
    lender.request_reclaim()
    assert not lender.reclaim and not lender.reclaim_frame_due()
    with pytest.raises(RuntimeError, match="no RECLAIM"):
        lender.take_reclaim_frame()


# -- SharedCreditLedger -------------------------------------------------------------------------------------


def test_ledger_admission_growth_and_release() -> None:
    ledger = SharedCreditLedger(buffers=8, max_buffers=16)
    assert ledger.open("a", 4, 16, reclaimable=True)
    assert ledger.open("b", 4, 16, reclaimable=True)
    assert not ledger.open("c", 4, 16, reclaimable=True)  # the pool is lent out
    assert ledger.want_buffers() == 4 and ledger.refused == 1
    ledger.on_buffers_added(4)
    assert ledger.open("c", 4, 16, reclaimable=True)
    ledger.check()
    ledger.request("a", 8)
    assert ledger.take_grants() == [] and ledger.want_buffers() == 4  # 8 wanted, 4 allowed
    ledger.on_buffers_added(4)
    assert ledger.take_grants() == [("a", 4)]
    assert ledger.window("a") == 8 and ledger.free == 0
    ledger.on_consumed("b")
    assert ledger.on_reposted("b", 1) == (1, 0)
    ledger.tick()
    ledger.tick()  # a and c consumed nothing for a whole tick: idle
    for _ in range(5):
        ledger.on_consumed("a")
    back, released = ledger.on_reposted("a", 5)
    assert released == 4 and back == 1 and ledger.window("a") == MIN_WINDOW
    ledger.check()
    assert all(ledger.on_consumed("c") for _ in range(ledger.outstanding("c")))
    assert not ledger.on_consumed("c")  # beyond its lease: counted, not raised
    assert ledger.overruns == 1
    ledger.check()


def test_ledger_close_keeps_outstanding_lent_until_retired() -> None:
    ledger = SharedCreditLedger(buffers=8, max_buffers=8)
    assert ledger.open("a", 8, 8, reclaimable=False)
    ledger.on_consumed("a")
    ledger.close("a")
    assert ledger.free == 0  # 7 receives may still be consumed by frames in flight
    with pytest.raises(ValueError, match="consumed buffers"):
        ledger.retire("a")
    assert ledger.on_reposted("a", 1) == (0, 1)
    ledger.retire("a")
    assert ledger.free == 8 and ledger.connections == 0
    ledger.check()


def test_ledger_limit_event_asks_for_growth() -> None:
    ledger = SharedCreditLedger(buffers=16, max_buffers=64)
    assert ledger.srq_limit == 4
    ledger.on_limit_event()
    assert ledger.want_buffers() == 8 and ledger.limit_events == 1


# -- SharedSession ------------------------------------------------------------------------------------------


def test_shared_session_reports_reposts_and_returns_to_its_ledger_through_callbacks() -> None:
    """The session of a connection on a shared queue keeps its window equal to its lease: reposts are split
    by the ledger (back to the connection or released to the pool) and a RETURN frame's credits go back to
    it, each report followed by one ``settled()``; nothing else of a pool is needed."""
    ledger = SharedCreditLedger(buffers=32, max_buffers=32)
    assert ledger.open("a", 16, 16, reclaimable=True)
    lender_hs = Handshake(16, 64, 1024, features=FEATURE_RECLAIM, initial_depth=16)
    peer_hs = Handshake(8, 64, 1024, features=FEATURE_RECLAIM)
    settled: list[int] = []
    lender = SharedSession(
        lender_hs,
        peer_hs,
        reposted=functools.partial(ledger.on_reposted, "a"),
        returned=functools.partial(ledger.on_returned, "a"),
        settled=lambda: settled.append(ledger.window("a")),
    )
    peer = ReclaimSession(peer_hs, lender_hs)

    def in_step() -> None:
        assert lender.recv_depth == ledger.window("a") and lender.posted == ledger.outstanding("a")
        ledger.check()

    for _ in range(3):
        assert ledger.on_consumed("a")
        lender.on_frame(peer.take_data_frame(True, 8), 8)
    lender.on_recv_reposted(3)  # the window is its target: every credit stays the connection's
    assert settled == [16] and lender.ungranted == 3
    in_step()
    ledger.tick()
    ledger.tick()  # idle for a whole tick: the target falls to the reserve, the peer is to be reclaimed
    assert ledger.take_reclaims() == ["a"]
    for _ in range(2):
        assert ledger.on_consumed("a")
        lender.on_frame(peer.take_data_frame(True, 8), 8)
    lender.on_recv_reposted(2)  # above the target: released to the pool, the window shrinks
    assert settled == [16, 14] and lender.statistics()["released"] == 2
    in_step()
    lender.request_reclaim()
    peer.on_frame(lender.take_reclaim_frame(), 0)
    imm = peer.take_return_frame()
    given_back = returned_credits(imm)
    assert given_back > 0
    assert ledger.on_consumed("a")
    assert lender.on_frame(imm, 0) is FrameKind.RETURN
    assert settled[-1] == 14 - given_back == lender.recv_depth == ledger.window("a")
    lender.on_recv_reposted(1)  # the RETURN frame's own receive
    in_step()
    assert lender.statistics()["credits_returned_received"] == given_back


def test_the_shared_receive_pool_does_not_import_the_transport_that_imports_it() -> None:
    """rdmaio.core.transport imports rdmaio.core.shared_receive; the pool knows a transport only by the
    shape new_session() needs (no import back, not even for type checking)."""
    source = (Path(rdmaio.__file__).parent / "core" / "shared_receive.py").read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert "rdmaio.core.transport" not in imported
    assert shared_receive.SharedSession is SharedSession  # the old import path still works


# -- simulation ---------------------------------------------------------------------------------------------


@dataclass
class Conn:
    """One connection: the server side draws receives from the shared pool; the client side has its own."""

    key: int
    server: ReclaimSession
    client: Session
    to_server: deque[int] = field(default_factory=deque)  # imm values in flight (data frames carry 1 byte)
    to_client: deque[int] = field(default_factory=deque)
    client_out: int = 0  # messages the client still has to send
    server_out: int = 0
    held: int = 0  # server receives consumed by data the server app has not read yet
    sent_to_server: int = 0
    got_by_server: int = 0
    sent_to_client: int = 0
    got_by_client: int = 0
    bursts_left: int = 0
    data_since_request: int = 0
    wait_steps: int = 0  # steps with data to send and no credit, for the starvation bound

    def client_wants(self) -> bool:
        return self.client_out > 0


class Sim:
    """Many connections against one :class:`SharedCreditLedger`; the SRQ itself is a counter kept apart
    from the ledger's, so the test checks the ledger rather than trusting it."""

    def __init__(self, rnd: random.Random, *, buffers: int, max_buffers: int, reclaim_share: float) -> None:
        self.rnd = rnd
        self.ledger = SharedCreditLedger(buffers=buffers, max_buffers=max_buffers)
        self.srq = buffers  # receives really posted in the SRQ
        self.conns: dict[int, Conn] = {}
        self.next_key = 0
        self.reclaim_share = reclaim_share
        self.opens_wanted = 0
        self.closed: list[Conn] = []
        self.max_wait = 0

    # -- connections --------------------------------------------------------------------------------------

    def try_open(self) -> bool:
        rnd = self.rnd
        initial = rnd.choice([4, 4, 6, 8])
        max_window = rnd.choice([initial, 16, 32])
        reclaimable = rnd.random() < self.reclaim_share
        key = self.next_key
        if not self.ledger.open(key, initial, max_window, reclaimable=reclaimable):
            return False
        self.next_key += 1
        server_hs = Handshake(
            max_window, 64, 1024, features=FEATURE_GROW | FEATURE_RECLAIM, initial_depth=initial
        )
        client_depth = rnd.randint(4, 8)
        client_hs = Handshake(client_depth, 64, 1024, features=FEATURE_RECLAIM if reclaimable else 0)
        client: Session = (
            ReclaimSession(client_hs, server_hs) if reclaimable else Session(client_hs, server_hs)
        )
        conn = Conn(key, ReclaimSession(server_hs, client_hs, shared=True), client)
        conn.bursts_left = rnd.randint(1, 4)
        self.conns[key] = conn
        return True

    def retire(self, conn: Conn, abrupt: bool) -> None:
        if abrupt:
            # The QP is destroyed: frames in flight never consume a receive; the app's unread data is dropped.
            conn.to_server.clear()
            conn.to_client.clear()
        if conn.held:
            self.repost(conn, conn.held)
            conn.held = 0
        self.ledger.close(conn.key)
        self.ledger.retire(conn.key)
        del self.conns[conn.key]
        if not abrupt:
            self.closed.append(conn)
        self.apply()

    # -- the server's receive path ------------------------------------------------------------------------

    def repost(self, conn: Conn, n: int) -> None:
        self.srq += n
        back, released = self.ledger.on_reposted(conn.key, n)
        if back:
            conn.server.on_recv_reposted(back)
        if released:
            conn.server.release_receives(released)

    def apply(self) -> None:
        for key, n in self.ledger.take_grants():
            self.conns[key].server.grow_receives(n)
        for key in self.ledger.take_reclaims():
            self.conns[key].server.request_reclaim()

    def deliver_to_server(self, conn: Conn) -> None:
        imm = conn.to_server.popleft()
        # The property under test: a SEND never meets an empty shared receive queue.
        assert self.srq > 0, "RNR: a SEND met an empty shared receive queue"
        self.srq -= 1
        self.ledger.on_consumed(conn.key)
        kind = conn.server.on_frame(imm, 1 if imm >> 28 == FrameKind.DATA_END else 0)
        if kind is FrameKind.DATA_END:
            conn.got_by_server += 1
            conn.held += 1
            conn.data_since_request += 1
            server = conn.server
            if server.can_grow and conn.data_since_request * 2 >= server.recv_depth:
                self.ledger.request(conn.key, server.recv_depth)
                conn.data_since_request = 0
            self.apply()
            return
        if kind is FrameKind.RETURN:
            self.ledger.on_returned(conn.key, returned_credits(imm))
        self.repost(conn, 1)  # control frames carry nothing to keep
        self.apply()

    def deliver_to_client(self, conn: Conn) -> None:
        imm = conn.to_client.popleft()
        assert conn.client.posted > 0, "RNR on the client's own queue"
        kind = conn.client.on_frame(imm, 1 if imm >> 28 == FrameKind.DATA_END else 0)
        if kind is FrameKind.DATA_END:
            conn.got_by_client += 1
        conn.client.on_recv_reposted(1)  # the client reads at once

    # -- the schedule -------------------------------------------------------------------------------------

    def actions(self, conn: Conn) -> list[str]:
        c, s = conn.client, conn.server
        acts = []
        if conn.client_out and c.can_send_data():
            acts.append("client_data")
        if c.credit_frame_due():
            acts.append("client_credit")
        if isinstance(c, ReclaimSession) and c.return_frame_due():
            acts.append("client_return")
        if conn.server_out and s.can_send_data():
            acts.append("server_data")
        if s.credit_frame_due():
            acts.append("server_credit")
        if s.reclaim_frame_due():
            acts.append("server_reclaim")
        if conn.to_server:
            acts.append("to_server")
        if conn.to_client:
            acts.append("to_client")
        if conn.held:
            acts.append("read")
        if not conn.client_out and not conn.server_out and conn.bursts_left:
            acts.append("burst")
        if self.finished(conn):
            acts.append("close")
        return acts

    def finished(self, conn: Conn) -> bool:
        c, s = conn.client, conn.server
        return not (
            conn.client_out
            or conn.server_out
            or conn.bursts_left
            or conn.to_server
            or conn.to_client
            or conn.held
            or c.credit_frame_due()
            or s.credit_frame_due()
            or s.reclaim_frame_due()
            or s.reclaim_pending
            or (isinstance(c, ReclaimSession) and c.return_due)
        )

    def step(self) -> bool:
        rnd = self.rnd
        choices = [(conn, name) for conn in self.conns.values() for name in self.actions(conn)]
        if self.ledger.want_buffers():
            choices.append((None, "add_buffers"))
        if self.opens_wanted:
            choices.append((None, "open"))
        if not choices:
            return False
        if rnd.random() < 0.02:
            choices.append((None, "tick"))
        conn, name = rnd.choice(choices)
        if conn is None:
            if name == "add_buffers":
                n = rnd.randint(1, self.ledger.want_buffers())
                self.srq += n
                self.ledger.on_buffers_added(n)
                self.apply()
            elif name == "open":
                if self.try_open():
                    self.opens_wanted -= 1
                elif not self.ledger.want_buffers():
                    self.ledger.tick()  # full pool: idle windows shrink, then try again
                    self.apply()
            else:
                self.ledger.tick()
                self.apply()
            return True
        if name == "client_data":
            conn.to_server.append(conn.client.take_data_frame(True, 1))
            conn.client_out -= 1
            conn.sent_to_server += 1
        elif name == "client_credit":
            conn.to_server.append(conn.client.take_credit_frame())
        elif name == "client_return":
            assert isinstance(conn.client, ReclaimSession)
            conn.to_server.append(conn.client.take_return_frame())
        elif name == "server_data":
            conn.to_client.append(conn.server.take_data_frame(True, 1))
            conn.server_out -= 1
            conn.sent_to_client += 1
        elif name == "server_credit":
            conn.to_client.append(conn.server.take_credit_frame())
        elif name == "server_reclaim":
            conn.to_client.append(conn.server.take_reclaim_frame())
        elif name == "to_server":
            self.deliver_to_server(conn)
        elif name == "to_client":
            self.deliver_to_client(conn)
        elif name == "read":
            n = rnd.randint(1, conn.held)
            conn.held -= n
            self.repost(conn, n)
            self.apply()
        elif name == "burst":
            conn.bursts_left -= 1
            conn.client_out = rnd.choice([0, 1, 3, 20, 60])
            conn.server_out = rnd.choice([0, 1, 5])
        elif name == "close":
            self.retire(conn, abrupt=False)
        return True

    def check(self) -> None:
        ledger = self.ledger
        ledger.check()
        assert self.srq == ledger.posted
        outstanding = 0
        for conn in self.conns.values():
            # Each session agrees with its lease, and what the client may send is within the lease.
            assert conn.server.posted == ledger.outstanding(conn.key)
            assert conn.server.recv_depth == ledger.window(conn.key) >= MIN_WINDOW
            in_flight = len(conn.to_server)
            assert conn.client.send_credits + in_flight <= ledger.outstanding(conn.key)
            outstanding += ledger.outstanding(conn.key)
            if conn.client_out and not conn.client.can_send_data():
                conn.wait_steps += 1
                self.max_wait = max(self.max_wait, conn.wait_steps)
            else:
                conn.wait_steps = 0
        # The guarantee: everything every peer may still send fits in what the SRQ holds.
        assert outstanding <= self.srq
        assert ledger.buffers <= ledger.max_buffers


def run_sim(
    rnd: random.Random,
    *,
    conns: int,
    opens: int,
    buffers: int,
    max_buffers: int,
    reclaim_share: float = 1.0,
    abrupt_share: float = 0.0,
    max_steps: int = 400_000,
) -> Sim:
    sim = Sim(rnd, buffers=buffers, max_buffers=max_buffers, reclaim_share=reclaim_share)
    for _ in range(conns):
        if not sim.try_open():
            sim.opens_wanted += 1
    sim.opens_wanted += opens
    steps = 0
    while steps < max_steps:
        if not sim.step():
            break
        steps += 1
        if abrupt_share and sim.conns and rnd.random() < abrupt_share:
            sim.retire(rnd.choice(list(sim.conns.values())), abrupt=True)
        sim.check()
    else:
        raise AssertionError(f"no quiescence after {max_steps} steps: {sim.ledger}, {len(sim.conns)} open")
    # Quiescent: nothing can happen. Every connection that was opened ran to its end and closed: nobody
    # was starved or deadlocked, every message arrived, and the pool got everything back.
    assert not sim.conns and not sim.opens_wanted
    for conn in sim.closed:
        assert conn.got_by_server == conn.sent_to_server and conn.got_by_client == conn.sent_to_client
        stats, client_stats = conn.server.statistics(), conn.client.statistics()
        assert stats["frames_received"] == client_stats["frames_sent"]
        assert stats["credits_granted"] == client_stats["credits_received"]
    assert sim.ledger.free == sim.ledger.posted == sim.ledger.buffers == sim.srq
    return sim


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rnd=st.randoms(use_true_random=False),
    conns=st.integers(1, 12),
    opens=st.integers(0, 8),
    buffers=st.integers(0, 48),
    extra=st.integers(0, 64),
    reclaim_share=st.sampled_from([0.0, 0.5, 1.0]),
    abrupt_share=st.sampled_from([0.0, 0.002]),
)
def test_simulation_shared_pool(
    rnd: random.Random,
    conns: int,
    opens: int,
    buffers: int,
    extra: int,
    reclaim_share: float,
    abrupt_share: float,
) -> None:
    """Random bursts, idle periods, opens (some refused until the pool grows or windows shrink), closes
    (some abrupt), peers with and without FEATURE_RECLAIM: no RNR, the pool bound, no starvation."""
    max_buffers = max(buffers, 8) + extra
    run_sim(
        rnd,
        conns=conns,
        opens=opens,
        buffers=buffers,
        max_buffers=max_buffers,
        reclaim_share=reclaim_share,
        abrupt_share=abrupt_share,
    )


@pytest.mark.parametrize("seed", range(4))
def test_simulation_many_connections_tight_pool(seed: int) -> None:
    """60 connections whose reserves nearly fill a pool that cannot grow: growth comes only from windows
    shrinking (releases on repost, RETURN frames); every burst still completes."""
    rnd = random.Random(seed)
    sim = run_sim(rnd, conns=60, opens=20, buffers=280, max_buffers=280)
    returned = sum(conn.server.statistics()["credits_returned_received"] for conn in sim.closed)
    released = sum(conn.server.statistics()["released"] for conn in sim.closed)
    grown = sum(conn.server.recv_depth > 8 for conn in sim.closed)
    assert len(sim.closed) == 80
    assert returned > 0 and released > 0 and grown > 0  # the pool was really shared, not just partitioned


def test_an_overrun_is_counted_as_missing_from_the_srq_until_its_buffer_is_reposted() -> None:
    """A peer sending beyond its credits takes receives the other leases count on: the ledger says so
    (posted drops below what is lent) instead of raising, and the repost of those buffers (the offending
    connection's teardown) restores the invariant."""
    ledger = SharedCreditLedger(buffers=12, max_buffers=12)
    assert ledger.open("good", 4, 4, reclaimable=False)
    assert ledger.open("bad", 4, 4, reclaimable=False)
    for _ in range(4):
        assert ledger.on_consumed("bad")
    overrun = 0
    while ledger.posted > 0 and not overrun:
        overrun += not ledger.on_consumed("bad")
    assert overrun == 1 and ledger.overruns == 1
    assert ledger.posted == 12 - 5 and ledger.outstanding("good") == 4
    ledger.check()  # consistent, with one buffer held by the overrun
    # Four more beyond the lease: only the good connection's 4 outstanding receives are left in the SRQ.
    for _ in range(3):
        assert not ledger.on_consumed("bad")
    assert ledger.posted == 4 == ledger.outstanding("good") and ledger.free == 0
    ledger.check()
    # Teardown of "bad": its 4 counted buffers go back to its lease, the 4 overrun ones to the SRQ.
    ledger.close("bad")
    assert ledger.on_reposted("bad", 4) == (0, 4)
    ledger.on_overrun_reposted(4)
    with pytest.raises(ValueError, match="overrun"):
        ledger.on_overrun_reposted(1)
    ledger.retire("bad")
    ledger.check()
    assert ledger.posted == 12 and ledger.free == 8


def test_a_refused_connection_counts_in_the_fair_share() -> None:
    """A pool lent out to reclaimable windows refuses a newcomer, but the refusal lowers every window to
    the share of one more connection, so a later attempt finds its reserve once the windows shrank."""
    ledger = SharedCreditLedger(buffers=24, max_buffers=24)
    for key in ("a", "b"):
        assert ledger.open(key, 12, 12, reclaimable=True)
    assert not ledger.open("c", 4, 8, reclaimable=True)
    assert sorted(ledger.take_reclaims()) == ["a", "b"]  # fair share 24 // 3 = 8: RECLAIM from both
    for key in ("a", "b"):  # each consumes and reposts: the windows shrink to their target
        for _ in range(12):
            ledger.on_consumed(key)
        ledger.on_reposted(key, 12)
    assert ledger.window("a") == ledger.window("b") == 8 and ledger.free == 8
    assert ledger.open("c", 4, 8, reclaimable=True)
    ledger.check()
