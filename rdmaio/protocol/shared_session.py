"""The session of a connection on a shared receive queue (sans-IO): :class:`SharedSession`.

Its receives come from a pool shared by every connection of a device, whose
:class:`~rdmaio.protocol.credit_ledger.SharedCreditLedger` decides how many credits each connection may
grant. The session reports what the ledger must know (buffers reposted, credits the peer gave back) through
callbacks given at construction, so it knows nothing of the pool that keeps the ledger: the I/O layer binds
the callbacks to its pool (for one connection's lease) and grows the window when the pool grants it more
(:meth:`~rdmaio.protocol.session.Session.grow_receives`).
"""

from __future__ import annotations

from collections.abc import Callable

from rdmaio.protocol.frames import FrameKind, returned_credits
from rdmaio.protocol.handshake import Handshake
from rdmaio.protocol.reclaim import ReclaimSession
from rdmaio.protocol.sessionstate import SessionState

__all__ = ["SharedSession"]


class SharedSession(ReclaimSession):
    """A :class:`~rdmaio.protocol.reclaim.ReclaimSession` lending its receives from a shared pool
    (``shared=True``) that reports every reposted buffer and every RETURN frame to the pool's ledger.

    ``reposted(n)`` is told that ``n`` consumed buffers were posted in the pool again and returns
    ``(back, released)``: ``back`` credits stay this connection's, ``released`` receives go to the pool.
    ``returned(n)`` is told the credits a RETURN frame gave back. ``settled()`` is called after either
    report, once the session has applied it: the pool then carries out what its ledger decided (which may
    grow this very session).
    """

    __slots__ = ("_reposted", "_returned", "_settled")

    def __init__(
        self,
        local: Handshake,
        peer: Handshake,
        *,
        reposted: Callable[[int], tuple[int, int]],
        returned: Callable[[int], None],
        settled: Callable[[], None],
        state: SessionState | None = None,
    ) -> None:
        super().__init__(local, peer, shared=True, state=state)
        # Every received frame and repost must reach on_frame/on_recv_reposted below (they report to the
        # ledger): no other implementation of the rules may apply them to the state behind our back.
        self._s.fast = 0
        self._reposted = reposted
        self._returned = returned
        self._settled = settled

    def on_frame(self, imm: int, byte_len: int) -> FrameKind:
        """:meth:`ReclaimSession.on_frame`; a RETURN frame's credits go back to the pool. (The consumed
        receive itself was reported to the ledger when its completion arrived.)"""
        kind = super().on_frame(imm, byte_len)
        if kind is FrameKind.RETURN:
            self._returned(returned_credits(imm))
            self._settled()
        return kind

    def on_recv_reposted(self, n: int) -> None:
        """``n`` buffers were posted on the shared queue again: the ledger says how many credits stay ours."""
        back, released = self._reposted(n)
        if back:
            super().on_recv_reposted(back)
        if released:
            self.release_receives(released)
        self._settled()
