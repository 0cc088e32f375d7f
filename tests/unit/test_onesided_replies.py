"""Answers to the peer's one-sided control messages (a REVOKE's REVOKE_ACK, a rendezvous message's DONE or
WITHDRAWN) wait for a send credit: a peer must not be able to make them pile up without bound.

The argument "the peer pays a credit for every message it sends, so its credits bound our answers" holds
only for a peer that grants nothing at all. The credits it spends come back with every CREDIT frame we
send, and a CREDIT frame needs one credit of the peer's where an answer needs two (the last credit is kept
for CREDIT frames): a peer that grants us one credit whenever we hold none keeps us granting it a window of
credits per round while no answer ever goes out. These tests play that peer against a real
:class:`~rdmaio.protocol.Session` and the real one-sided engine on the fakes, and count the answers waiting
(``OperationEngine.waiting_for_credit``: nothing else waits here), never the time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from test_onesided_unit import RECV, settle

import rdmaio
from rdmaio._ffi import ffi, lib
from rdmaio.core.backend import AsyncioBackend
from rdmaio.core.onesided import ACCESS_READ, OneSidedEngine, RemoteKey
from rdmaio.core.onesided.exporter import CTL_REVOKE, CTL_REVOKE_ACK
from rdmaio.core.onesided.keys import KEY_VERSION
from rdmaio.core.rendezvous import RendezvousEngine
from rdmaio.options import Options
from rdmaio.protocol import Handshake, Session
from rdmaio.protocol.frames import FrameKind, encode_imm
from rdmaio.protocol.rendezvous import CTL_CANCEL, CTL_DONE, CTL_WITHDRAWN, Descriptor
from rdmaio.protocol.rxbuffer import ReceiveBuffer
from rdmaio.testing.fakes import FakeQP, FakeRegion, FakeRegistration
from rdmaio.testing.nullpair import NULL_OPTIONS, null_pair

Run = Callable[[Coroutine[Any, Any, Any]], Any]
DEPTH = 8  # both sides' receive window (fixed: no FEATURE_GROW)
_CONTROL = struct.Struct("!BB6xQ")


class Connection:
    """Our side: a real Session (its credits) under a real one-sided engine on a fake queue pair, and what
    the I/O layer does around them after every batch of receives (repost, pump, CREDIT frames), as
    ``Receiver.on_batch`` and the sender's end of batch do. ``fail`` is the connection's: the receive path
    fails the connection with any ProtocolError, which aborts the session and closes the engine."""

    def __init__(self, max_queued_replies: int | None = None) -> None:
        ours = Handshake(recv_depth=DEPTH, slot_size=1024, max_message_size=1 << 20)
        theirs = Handshake(recv_depth=DEPTH, slot_size=1024, max_message_size=1 << 20)
        self.session = Session(ours, theirs)
        self.qp = FakeQP()
        self.failures: list[BaseException] = []
        # The engine's own default unless asked: that is the bound a connection gets from Options.
        bound = {} if max_queued_replies is None else {"max_queued_replies": max_queued_replies}
        self.engine = OneSidedEngine(
            AsyncioBackend(asyncio.get_running_loop()),
            self.qp,
            self.session,
            register_local=FakeRegion,
            register_grant=lambda view, bits: FakeRegion(view, bits),
            cache_get=FakeRegistration,
            fail=self.fail,
            max_ops=16,
            max_inline=0,
            revoke_timeout=5.0,
            close_state=self.session.close_state,
            **bound,
        )
        self.completed = 0  # requests of qp.posted the NIC completed
        self.answers = 0  # answers that went out (each consumed one of the peer's receives)

    def fail(self, exc: BaseException) -> None:
        if not self.failures:
            self.failures.append(exc)
            self.session.abort(exc)
            self.engine.close(self.session.flush_error())

    def receive_control(self, payload: bytes) -> None:
        """A control message arrived in one of our receives: the exporter takes it, the slot is reposted;
        a ProtocolError fails the connection (and is raised again for the test)."""
        try:
            self.engine.on_recv(RECV, 0, len(payload), memoryview(payload), slot=0)
        except rdmaio.ProtocolError as exc:
            self.fail(exc)
            raise
        self.session.on_recv_reposted(1)

    def receive_credit_frame(self, grant: int) -> None:
        """The peer's CREDIT frame: its slot is reposted at once (CREDIT frames never hold their slot)."""
        self.session.on_frame(encode_imm(FrameKind.CREDIT, grant), 0)
        self.session.on_recv_reposted(1)

    def end_of_batch(self) -> int:
        """The NIC completes what was posted; the engine pumps; a CREDIT frame goes when due. Returns the
        credits that frame granted the peer (0: none was sent)."""
        posted = self.qp.posted
        while self.completed < len(posted):
            wr = posted[self.completed]
            self.completed += 1
            if wr["opcode"] == lib.IBV_WR_SEND:
                self.answers += 1
            self.engine.on_completion(wr["wr_id"], 0)
        self.engine.pump()
        if self.session.credit_frame_due():
            return self.session.take_credit_frame() & 0xFFFF
        return 0


class HostilePeer:
    """Sends REVOKEs (of key ids 1, 2, 3, ...: they cost our importer nothing to remember) with every credit
    it holds but one, and grants credits back only as ``policy`` says. It reposts the receives our answers
    consume but never grants them (it never reads). It keeps within the credits we grant it: our Session
    would fail the connection on the first message without one."""

    def __init__(self, ours: Connection) -> None:
        self.ours = ours
        self.credits = DEPTH  # our initial window
        self.next_id = 1
        self.revokes = 0

    def send_revokes(self) -> None:
        while self.credits >= 2:
            self.credits -= 1
            self.revokes += 1
            self.ours.receive_control(_CONTROL.pack(KEY_VERSION, CTL_REVOKE, self.next_id))
            self.next_id += 1

    def grant_one_if_starved(self) -> None:
        """A CREDIT frame granting exactly one credit whenever we hold none (one of its own credits pays
        for it): we can then send a CREDIT frame, never an answer."""
        if self.ours.session.send_credits == 0 and self.credits >= 1:
            self.credits -= 1
            self.ours.receive_credit_frame(1)


def test_a_peer_granting_one_credit_at_a_time_cannot_pile_up_revoke_acks(arun: Run) -> None:
    """The attack: every round the peer spends its credits on REVOKEs and grants us one credit, which we
    spend on the CREDIT frame that gives it a whole window back. Unbounded before (6 more answers waiting
    every round); now the answers waiting never exceed ``Options.max_queued_replies`` and one more fails
    the connection with ReplyQueueFullError."""

    async def main() -> None:
        bound = Options().max_queued_replies
        ours = Connection()  # the engine's default bound, which is Options' (checked at the end)
        peer = HostilePeer(ours)
        most = 0
        failure: BaseException | None = None
        for _round in range(1000):  # 6 REVOKEs a round: 6,000 in all, well past the bound
            try:
                peer.send_revokes()
            except rdmaio.ReplyQueueFullError as exc:
                failure = exc
                break
            waiting = ours.engine.operations.waiting_for_credit
            most = max(most, waiting)
            assert waiting <= bound, f"{waiting} answers wait for a credit after {peer.revokes} REVOKEs"
            peer.credits += ours.end_of_batch()
            peer.grant_one_if_starved()
        assert failure is not None, f"no failure after {peer.revokes} REVOKEs ({most} answers waiting)"
        # Only the first window of answers ever went out: the rest waited, up to the bound; the REVOKE
        # whose answer would have been one more failed the connection.
        assert ours.answers == DEPTH - 1
        assert peer.revokes - ours.answers == bound + 1 and most <= bound
        assert ours.engine.statistics()["control_replies_queued"] == 0  # the connection's end drops them
        # The connection failed with the typed error, which names the option; so does every later call.
        assert ours.failures == [failure]
        assert isinstance(failure, rdmaio.ProtocolError) and isinstance(failure, ConnectionAbortedError)
        assert "Options.max_queued_replies (4096)" in str(failure)
        assert ours.engine.operations.max_queued_replies == bound == 4096
        unrevoked = RemoteKey(0x10000, 0x77, 4096, ACCESS_READ, 1 << 40)
        with pytest.raises(rdmaio.ConnectionAbortedError, match="max_queued_replies") as info:
            await ours.engine.read(unrevoked, 0, 8)
        assert info.value.__cause__ is failure

    arun(main())


def test_a_smaller_bound_fails_sooner_and_answers_within_it_go_out_when_credits_come(arun: Run) -> None:
    async def main() -> None:
        ours = Connection(max_queued_replies=10)
        peer = HostilePeer(ours)
        peer.send_revokes()  # the first window: every answer goes out at once (8 credits)
        assert ours.engine.operations.waiting_for_credit == 0
        peer.credits += ours.end_of_batch()
        peer.grant_one_if_starved()
        peer.send_revokes()  # 6 more, no credit to answer them: they wait, within the bound
        ops = ours.engine.operations
        assert ops.waiting_for_credit == ops.replies_waiting == 6
        assert ours.engine.statistics()["control_replies_queued"] == 6
        # A peer that grants credits back gets its answers, in order.
        before = len(ours.qp.posted)
        peer.credits -= 1
        ours.receive_credit_frame(6)
        peer.credits += ours.end_of_batch()
        assert ops.replies_waiting == 0 and ours.failures == []
        acks = [
            _CONTROL.unpack(bytes(ffi.buffer(ffi.cast("char *", wr["local_addr"]), wr["length"])))
            for wr in ours.qp.posted[before:]
        ]
        assert [(kind, key_id) for _, kind, key_id in acks] == [(CTL_REVOKE_ACK, i) for i in range(8, 14)]
        # The bound counts answers only: this side's own control messages (a revoke()) never fail it.
        for i in range(20):
            ours.engine.exporter.send_control_message(CTL_REVOKE, 1000 + i)
        assert ops.replies_waiting == 0 and ops.waiting_for_credit == 20 and ours.failures == []
        # Answers beyond it fail the connection at the eleventh waiting.
        with pytest.raises(rdmaio.ReplyQueueFullError, match=r"11 answers .* \(10\)"):
            for _ in range(20):
                peer.send_revokes()
                peer.credits += ours.end_of_batch()
                peer.grant_one_if_starved()
        assert len(ours.failures) == 1

    arun(main())


def test_a_peer_that_grants_nothing_is_bounded_by_its_credits(arun: Run) -> None:
    """The case where the argument holds: without any grant from the peer we can send at most the credits
    of its first window, so it gets at most that many CREDIT frames' worth of credits back, and it stalls."""

    async def main() -> None:
        ours = Connection()
        peer = HostilePeer(ours)
        for _round in range(100):
            peer.send_revokes()
            peer.credits += ours.end_of_batch()
        ops = ours.engine.operations
        assert peer.credits <= 1  # stalled: nothing more to send with
        # Every REVOKE came out of a window we granted: the first, then one per CREDIT frame we could pay.
        assert peer.revokes <= DEPTH * (1 + DEPTH)
        assert ops.waiting_for_credit == peer.revokes - ours.answers <= DEPTH * DEPTH
        assert ours.failures == []

    arun(main())


def test_options_bound_the_answers_of_a_real_connection(arun: Run) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="max_queued_replies"):
            Options(max_queued_replies=0)
        a, _b, _device = null_pair(dataclasses.replace(NULL_OPTIONS, max_queued_replies=7))
        assert a._conn.onesided.operations.max_queued_replies == 7
        assert a.statistics()["control_replies_queued"] == 0

    arun(main())


# --- the rendezvous engine's answers ----------------------------------------------------------------------


class _Control:
    """The rendezvous engine's one-sided engine, as far as its control messages go: records them, and
    raises ``error`` when set (as the engine past its bound)."""

    def __init__(self) -> None:
        self.control_handler: Any = None
        self.sent: list[tuple[int, int, bool]] = []
        self.error: BaseException | None = None

    def send_control(self, kind: int, value: int, *, reply: bool = False) -> None:
        self.sent.append((kind, value, reply))
        if reply and self.error is not None:
            raise self.error


class _Endpoint:
    """What the rendezvous engine reads of its connection."""

    def __init__(self) -> None:
        self.io = AsyncioBackend(asyncio.get_running_loop())
        self.rxbuf = ReceiveBuffer(1 << 20)
        self.session = Session(
            Handshake(recv_depth=DEPTH, slot_size=1024, max_message_size=1 << 20),
            Handshake(recv_depth=DEPTH, slot_size=1024, max_message_size=1 << 20),
        )
        self.failures: list[BaseException] = []
        self.receiver = self

    def fail(self, exc: BaseException) -> None:
        self.failures.append(exc)

    def wake_reader(self) -> None:
        pass

    def repost_released(self) -> None:
        pass


def _rendezvous(endpoint: _Endpoint, control: _Control) -> RendezvousEngine:
    return RendezvousEngine(
        endpoint,
        onesided=control,  # type: ignore[arg-type]
        pd=None,
        cache=None,
        threshold=1024,
        max_message_size=1 << 20,
        close_timeout=1.0,
        stats=collections.Counter(),
    )


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_a_withdrawn_answer_counts_as_a_reply(arun: Run, full: bool) -> None:
    """The peer's CANCEL of a message not pulled yet is answered WITHDRAWN, an answer the peer provoked:
    it counts against the bound, and past it the error reaches the receive path (which fails the
    connection with it)."""

    async def main() -> None:
        endpoint, control = _Endpoint(), _Control()
        engine = _rendezvous(endpoint, control)
        if full:
            control.error = rdmaio.ReplyQueueFullError("full")
        engine.on_request(memoryview(Descriptor(7, 0x1000, 100, 0x55).encode()))
        if full:
            with pytest.raises(rdmaio.ReplyQueueFullError):
                engine.on_control(CTL_CANCEL, 7)
        else:
            engine.on_control(CTL_CANCEL, 7)
        assert control.sent == [(CTL_WITHDRAWN, 7, True)]
        engine.close(None)

    arun(main())


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_a_done_answer_counts_as_a_reply_and_past_the_bound_fails_the_connection(
    arun: Run, full: bool
) -> None:
    """A pulled message is answered DONE from the pull's own task: past the bound the error cannot go up a
    receive path, so the pull fails the connection with it (the data it read is delivered all the same)."""

    async def main() -> None:
        endpoint, control = _Endpoint(), _Control()
        engine = _rendezvous(endpoint, control)
        if full:
            control.error = rdmaio.ReplyQueueFullError("full")

        async def read_owned(msg: Any) -> bytes:
            return b"x" * msg.length

        engine._read_owned = read_owned  # type: ignore[method-assign]  # the READ, as the NIC completes it
        engine.on_request(memoryview(Descriptor(9, 0x1000, 100, 0x55).encode()))
        await settle()  # unclaimed: pulled two loop iterations later
        assert control.sent == [(CTL_DONE, 9, True)]
        assert endpoint.failures == ([control.error] if full else [])
        assert endpoint.rxbuf.pop_message() == b"x" * 100
        engine.close(None)

    arun(main())
