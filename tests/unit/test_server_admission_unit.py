"""The window a server grants in its handshake (rdmaio.core.negotiation.accepting_handshake): what an
accepted but not yet established connection holds is ``initial_depth`` receives whatever the peer
announces, and a peer that cannot answer RECLAIM gets the reserve of a shared receive queue. And the
admission of rdmaio.core.acceptor.Acceptor, with fakes: what it refuses before creating anything."""

from __future__ import annotations

import collections
import errno
from types import SimpleNamespace
from typing import Any

import pytest

from rdmaio import Options
from rdmaio.core import acceptor as acceptor_module
from rdmaio.core.acceptor import Acceptor
from rdmaio.core.negotiation import accepting_handshake, local_handshake
from rdmaio.core.port_retry import PORT_ATTEMPTS
from rdmaio.errors import VerbsError
from rdmaio.protocol import FEATURE_GROW, FEATURE_RECLAIM, Handshake, Session
from rdmaio.protocol.reclaim import MIN_WINDOW
from rdmaio.testing.fakes import FakeBackend, FakeReactor, FakeTransport
from rdmaio.verbs import CMEventType

NO_GROW = Handshake(recv_depth=32, slot_size=65536, max_message_size=1 << 20)


def answer(options: Options, peer: Handshake) -> Handshake:
    ours = local_handshake(options, grow=bool(peer.features & FEATURE_GROW))
    return accepting_handshake(ours, peer, options)


def test_a_peer_without_grow_gets_a_fixed_window_of_initial_depth() -> None:
    options = Options(recv_depth=32, initial_depth=4)
    ours = answer(options, NO_GROW)
    assert ours.recv_depth == ours.initial_depth == 4 and not ours.features & FEATURE_GROW
    # What the peer reads: 4 receives posted, and it may never be granted more.
    peer_view = Session(NO_GROW, Handshake.decode(ours.encode()))
    assert peer_view.send_credits == 4
    # Fixed rings on the server (initial_depth == recv_depth): its whole window, as it chose.
    assert answer(Options(recv_depth=8, initial_depth=8), NO_GROW).recv_depth == 8


def test_a_growing_peer_gets_the_usual_growing_window() -> None:
    options = Options(recv_depth=32, initial_depth=4)
    peer = local_handshake(Options())
    ours = answer(options, peer)
    assert ours == local_handshake(options)
    assert ours.features & FEATURE_GROW and (ours.initial_depth, ours.recv_depth) == (4, 32)


@pytest.mark.parametrize("peer_grows", [True, False])
def test_on_a_shared_receive_queue_a_peer_without_reclaim_gets_the_reserve(peer_grows: bool) -> None:
    options = Options(shared_receive_queue=True, recv_depth=32, initial_depth=16)
    peer = local_handshake(Options()) if peer_grows else NO_GROW
    assert not peer.features & FEATURE_RECLAIM
    ours = answer(options, peer)
    assert ours.recv_depth == ours.initial_depth == MIN_WINDOW and not ours.features & FEATURE_GROW
    # A peer that answers RECLAIM can be given more, and have it taken back.
    reclaiming = local_handshake(Options(shared_receive_queue=True))
    ours = answer(options, reclaiming)
    assert (ours.initial_depth, ours.recv_depth) == (16, 32) and ours.features & FEATURE_GROW


# --- the acceptor's admission, with fakes: what is refused before anything is created ---------------


def request(handle: int, source: str = "198.18.0.2", data: bytes | None = None) -> Any:
    hello = local_handshake(Options()).encode() if data is None else data
    return SimpleNamespace(
        event=CMEventType.CONNECT_REQUEST,
        id_handle=handle,
        source=source,
        private_data=hello,
        responder_resources=16,
        initiator_depth=16,
    )


@pytest.fixture
def acceptor(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Acceptor, FakeReactor, list[Any], collections.deque[Any]]:
    monkeypatch.setattr(FakeTransport, "made", [])  # restored after the test: the class is shared
    monkeypatch.setattr(acceptor_module, "Transport", FakeTransport.for_cm_id)
    monkeypatch.setattr(acceptor_module, "rd_atomic_depth", lambda device, wanted: 4)
    monkeypatch.setattr(acceptor_module, "Connection", lambda *args: SimpleNamespace(args=args))
    reactor = FakeReactor(FakeBackend())
    started: list[Any] = []
    queued: collections.deque[Any] = collections.deque()
    timed_out: list[None] = []
    options = Options(max_pending_per_source=2, initial_depth=4)
    acc = Acceptor(
        reactor,  # type: ignore[arg-type]
        options,
        3,
        queued=queued,
        on_connection=started.append,
        on_device_removal=lambda: None,
        on_timed_out=lambda: timed_out.append(None),
    )
    acc.listening = True  # as after listen(): no listener ids in these tests
    return acc, reactor, started, queued


def test_the_acceptor_refuses_before_creating_anything(
    acceptor: tuple[Acceptor, FakeReactor, list[Any], collections.deque[Any]],
) -> None:
    """Backlog (pending + the owner's queue), per-source limit and bad handshakes are refused with a REJ
    and their id released, no transport made; an admitted request is accepted with the depths both
    sides allow, becomes pending under a deadline, and starts a Connection on ESTABLISHED."""
    acc, reactor, started, queued = acceptor
    acc._on_listener_event(request(1))
    acc._on_listener_event(request(2))
    assert acc.pending == 2 and len(FakeTransport.made) == 2
    assert FakeTransport.made[0].initial == 4  # the window a half-open request holds
    assert FakeTransport.made[0].cm_id.accepted == {
        "rnr_retry_count": Options().rnr_retry_count,
        "responder_resources": 4,
        "initiator_depth": 4,
    }
    acc._on_listener_event(request(3))  # a third from the same source: its limit is 2
    assert acc.refused_source == 1 and acc.rejected == 1 and reactor.released[-1].rejected
    acc._on_listener_event(request(4, source="198.18.0.4", data=b"\x00garbage"))
    assert acc.rejected == 2 and acc.refused_source == 1 and reactor.released[-1].handle == 4
    queued.append(object())  # one established, not served yet: with 2 pending the backlog of 3 is full
    acc._on_listener_event(request(5, source="198.18.0.3"))
    assert acc.refused_backlog == 1 and acc.rejected == 3
    assert len(FakeTransport.made) == 2  # nothing was created for a refused request
    assert acc.peak_waiting == 2
    # ESTABLISHED: the connection starts and goes to the owner; its deadline is cancelled.
    reactor.handlers[1](SimpleNamespace(event=CMEventType.ESTABLISHED, id_handle=1))
    assert len(started) == 1 and acc.accepted == 1 and acc.pending == 1 and reactor.timers[0].cancelled
    # The other one never completes: at its deadline the waiting CM events are handled first, then it
    # is dropped with what it held.
    reactor.timers[1].callback()
    assert reactor.drained == 1 and acc.timed_out == 1 and acc.pending == 0
    assert FakeTransport.made[1].closed and reactor.released[-1].handle == 2
    acc.close()
    acc._on_listener_event(request(6))
    assert acc.rejected == 4 and len(FakeTransport.made) == 2  # closed: refused


def test_a_listen_on_port_0_draws_another_port_while_the_picked_one_is_taken(
    acceptor: tuple[Acceptor, FakeReactor, list[Any], collections.deque[Any]],
) -> None:
    """Soft-iWARP listens on a kernel TCP socket bound to the port rdma_cm picked, which TCP may still use:
    rdma_listen fails with EADDRINUSE. On port 0 the acceptor tries a new id (a new port), a bounded number
    of times; a port the caller chose is not changed behind their back; any other error is raised."""
    acc, reactor, _, _ = acceptor
    made: list[Any] = []
    outcomes: list[int] = []  # per new listener: the errno its listen() fails with, 0 for success

    class Listener:
        def __init__(self) -> None:
            self.fails = outcomes.pop(0)
            self.local_address = ("198.18.0.1", 5000 + len(made))

        def set_reuseaddr(self) -> None:
            pass

        def bind_addr(self, host: str, port: int) -> None:
            self.bound = (host, port)

        def listen(self, backlog: int) -> None:
            if self.fails:
                raise VerbsError.from_errno("rdma_listen", self.fails)

    def create_id(handler: Any) -> Listener:
        made.append(Listener())
        return made[-1]

    reactor.create_id = create_id  # type: ignore[attr-defined]
    outcomes[:] = [errno.EADDRINUSE, errno.EADDRINUSE, 0]
    acc.listen(["198.18.0.1"], 0)
    assert reactor.released == made[:2] and acc.addresses == [made[2].local_address]
    acc.close()
    # A port the caller chose: one attempt, its error.
    made.clear(), reactor.released.clear()
    outcomes[:] = [errno.EADDRINUSE]
    with pytest.raises(VerbsError) as chosen:
        acc.listen(["198.18.0.1"], 7471)
    assert chosen.value.errno == errno.EADDRINUSE and len(made) == 1 and reactor.released == made
    # Another error: at once. Taken every time: PORT_ATTEMPTS ids, then the last one's error.
    made.clear(), reactor.released.clear()
    outcomes[:] = [errno.EACCES]
    with pytest.raises(VerbsError, match="EACCES"):
        acc.listen(["198.18.0.1"], 0)
    assert len(made) == 1
    made.clear(), reactor.released.clear()
    outcomes[:] = [errno.EADDRINUSE] * PORT_ATTEMPTS
    with pytest.raises(VerbsError) as taken:
        acc.listen(["198.18.0.1"], 0)
    assert taken.value.errno == errno.EADDRINUSE and len(made) == PORT_ATTEMPTS
    assert reactor.released == made and not acc.addresses and not acc.listening
