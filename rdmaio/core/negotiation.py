"""Handshake negotiation: what each side of a new connection announces in its rdma_cm private data.

Both ends of connection setup need it: :mod:`rdmaio.core.dial` announces :func:`local_handshake` in its
connect request, and :mod:`rdmaio.core.acceptor` answers with :func:`accepting_handshake`, which bounds
the receive window a server grants a peer before the connection is established (what a half-open request
can make it hold).
"""

from __future__ import annotations

import dataclasses
import sys

from rdmaio.options import Options
from rdmaio.protocol import (
    FEATURE_BATCH,
    FEATURE_GROW,
    FEATURE_ONESIDED,
    FEATURE_RECLAIM,
    FEATURE_RNDV,
    Capabilities,
    Handshake,
)
from rdmaio.protocol.reclaim import MIN_WINDOW

__all__ = ["accepting_handshake", "local_handshake"]

# rdmaio.__version__, announced in every handshake (shown to the peer's user, never acted on). Read from the
# package this module is part of, which sets it before importing anything (the core does not import the
# package's facade: docs/architecture.md's layers).
_SOFTWARE_VERSION: str = getattr(sys.modules.get("rdmaio"), "__version__", "")


def local_handshake(options: Options, *, grow: bool = True, caps: Capabilities | None = None) -> Handshake:
    """The handshake this side announces for ``options``: a growing receive window (FEATURE_GROW, starting
    at ``options.initial_depth``) unless ``grow`` is false (a server answering a peer that cannot grow),
    and the device's capabilities ``caps`` (:func:`rdmaio.core.capabilities.device_capabilities`) when
    given.

    FEATURE_GROW is announced even when ``initial_depth`` equals ``recv_depth`` (a fixed ring): the bit also
    says this side accepts a growing peer, and a server gives a peer without it only a small fixed window
    (:attr:`Options.initial_depth`), since it must post that window before it accepts."""
    initial = min(options.initial_depth, options.recv_depth)
    return Handshake(
        recv_depth=options.recv_depth,
        slot_size=options.slot_size,
        max_message_size=options.max_message_size,
        features=(FEATURE_BATCH if options.batch_limit else 0)
        | (FEATURE_GROW if grow else 0)
        | FEATURE_ONESIDED
        | (FEATURE_RNDV if options.rndv_threshold else 0)
        | (FEATURE_RECLAIM if options.shared_receive_queue else 0),
        initial_depth=initial if grow else 0,
        software=_SOFTWARE_VERSION,
        caps=caps,
    )


def accepting_handshake(handshake: Handshake, peer: Handshake, options: Options) -> Handshake:
    """``handshake`` (this side's, from :func:`local_handshake`) with the receive window a server may grant
    ``peer``.

    The receives a peer may use must be posted before rdma_accept (it may send as soon as it is connected),
    so they are what an accepted but never established request holds. A peer that announced
    ``FEATURE_GROW`` starts with ``initial_depth`` and is grown once it is established and sends. A peer
    without it cannot be grown later (it reads only ``recv_depth``), so it gets a *fixed* window of
    ``initial_depth`` receives rather than ``recv_depth`` (announced as ``recv_depth``, without the bit):
    what a half-open request pins is then the same for every peer. On a shared receive queue a peer that
    does not answer RECLAIM keeps its lease for life, so it gets the reserve (:data:`MIN_WINDOW`): what
    the documented capacity (a quarter of ``srq_max_buffers`` connections) assumes.
    """
    if options.shared_receive_queue and not peer.features & FEATURE_RECLAIM:
        fixed = MIN_WINDOW
    elif not peer.features & FEATURE_GROW:
        fixed = options.initial_depth
    else:
        return handshake
    fixed = min(fixed, handshake.recv_depth)
    if handshake.recv_depth == fixed and not handshake.features & FEATURE_GROW:
        return handshake
    return dataclasses.replace(
        handshake, recv_depth=fixed, features=handshake.features & ~FEATURE_GROW, initial_depth=0
    )
