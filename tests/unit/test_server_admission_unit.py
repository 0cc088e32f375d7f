"""The window a server grants in its handshake (rdmaio.server.accepting_handshake): what an accepted but
not yet established connection holds is ``initial_depth`` receives whatever the peer announces, and a
peer that cannot answer RECLAIM gets the reserve of a shared receive queue."""

from __future__ import annotations

import pytest

from rdmaio import Options
from rdmaio.client import local_handshake
from rdmaio.protocol import FEATURE_GROW, FEATURE_RECLAIM, Handshake, Session
from rdmaio.protocol.reclaim import MIN_WINDOW
from rdmaio.server import accepting_handshake

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
