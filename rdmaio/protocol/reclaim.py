"""The reclaim protocol of one connection (sans-IO): :class:`ReclaimSession`, a
:class:`~rdmaio.protocol.session.Session` whose receive window can shrink as well as grow, and the two
frames of :data:`~rdmaio.protocol.handshake.FEATURE_RECLAIM`: RECLAIM (the lender asks for unused credits
back) and RETURN (the peer gives back what it holds beyond :data:`RETURN_KEEP`).

It exists for shared receive queues: a connection whose receives come from a pool shared by every
connection of a device (the pool's :class:`~rdmaio.protocol.credit_ledger.SharedCreditLedger`) must be
able to give idle credits back to it, and any peer of such a connection must answer when asked. The
argument, the choices and what other stacks do are in docs/protocol.md ("Shared receive queue and
credits"); ``tests/unit/test_shared_credits.py`` tests it, alone and against a ledger.
"""

from __future__ import annotations

from typing import Final, NoReturn

from rdmaio.errors import FrameError
from rdmaio.protocol.frames import (
    _IMM_RECLAIM,
    _KIND_SHIFT,
    _RESERVED_MASK,
    MAX_RETURN,
    FrameKind,
    encode_return_imm,
    returned_credits,
)
from rdmaio.protocol.handshake import FEATURE_RECLAIM, MIN_RECV_DEPTH, Handshake
from rdmaio.protocol.session import Session
from rdmaio.protocol.sessionstate import SessionState

__all__ = ["MIN_WINDOW", "RETURN_KEEP", "ReclaimSession"]

MIN_WINDOW: Final = MIN_RECV_DEPTH
"""The smallest receive window a connection on a shared queue is ever shrunk to (its reserve): with the
default threshold (half the window) a window of 4 keeps ``2 <= threshold <= window - 1``, which the
no-deadlock argument of :mod:`rdmaio.protocol` needs, and lets the peer send DATA (two credits) at once."""

RETURN_KEEP: Final = MIN_WINDOW - 1
"""Credits a side keeps when it answers RECLAIM: with the RETURN frame's own receive, the lender's window
stays at least :data:`MIN_WINDOW`."""

_K_RECLAIM: Final = int(FrameKind.RECLAIM)
_K_RETURN: Final = int(FrameKind.RETURN)
_U32_MAX: Final = 0xFFFF_FFFF


class ReclaimSession(Session):
    """A :class:`Session` for connections whose receives come from a shared pool, or whose peer's do.

    Both roles need the peer to have announced :data:`FEATURE_RECLAIM` for the frames to be used:

    * **answering** (any side that announces the feature): a received RECLAIM makes :meth:`return_due`
      true; :meth:`take_return_frame` then gives back every credit above :data:`RETURN_KEEP`.
    * **lending** (``shared=True``, the side drawing receives from a
      :class:`~rdmaio.protocol.credit_ledger.SharedCreditLedger`): the window shrinks with
      :meth:`release_receives` (consumed receives that go back to the pool) and with the RETURN frames the
      peer sends after :meth:`request_reclaim`. The credit threshold follows the window (half of it), so it
      must be left at its default.

    Without the feature negotiated the frames are never sent, a received one is a protocol violation, and
    the window can still shrink by :meth:`release_receives`.
    """

    __slots__ = (
        "_reclaim",
        "_reclaim_pending",
        "_reclaim_wanted",
        "_released",
        "_return_due",
        "_returned_in",
        "_returned_out",
        "_shared",
    )

    def __init__(
        self,
        local: Handshake,
        peer: Handshake,
        *,
        credit_threshold: int | None = None,
        shared: bool = False,
        state: SessionState | None = None,
    ) -> None:
        if shared and credit_threshold is not None:
            raise ValueError("a window drawn from a shared pool shrinks: its credit threshold must follow it")
        super().__init__(local, peer, credit_threshold=credit_threshold, state=state)
        if shared and self.recv_depth < MIN_WINDOW:  # pragma: no cover - MIN_RECV_DEPTH enforces it
            raise ValueError(f"a shared window starts at {MIN_WINDOW} receives at least")
        self._shared = shared
        self._reclaim = bool(local.features & peer.features & FEATURE_RECLAIM)
        self._return_due = False  # the peer sent RECLAIM and is owed a RETURN
        self._reclaim_wanted = False  # the ledger asked for our credits back; RECLAIM not sent yet
        self._reclaim_pending = False  # RECLAIM sent, RETURN not received yet
        self._released = 0  # consumed receives given to the pool (window shrunk), for statistics
        self._returned_in = 0  # credits the peer gave back
        self._returned_out = 0  # credits we gave back

    @property
    def reclaim(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_RECLAIM`."""
        return self._reclaim

    # -- lending side ---------------------------------------------------------------------------------------

    @property
    def unreturned(self) -> int:
        """Receives of this window consumed by frames and not yet reposted or released."""
        return self.recv_depth - self.posted

    def release_receives(self, n: int) -> None:
        """``n`` consumed receives of this window go back to the shared pool, not to this connection: the
        window shrinks by ``n``. It may not shrink below :data:`MIN_WINDOW`."""
        if not self._shared:
            raise RuntimeError("only a session drawing from a shared pool releases receives")
        window = self.recv_depth
        if not 0 <= n <= window - self.posted:
            raise ValueError(f"cannot release {n}: {window - self.posted} consumed and unreturned")
        if window - n < MIN_WINDOW:
            raise ValueError(f"cannot shrink the window {window} by {n} below {MIN_WINDOW}")
        self.shrink_receives(n)  # the threshold follows: a shared window keeps the default one
        self._released += n

    def request_reclaim(self) -> None:
        """Ask the peer for its unused credits back (a RECLAIM frame, once :meth:`reclaim_frame_due`).

        A no-op without :data:`FEATURE_RECLAIM` or while a RECLAIM is already unanswered."""
        if self._reclaim and self._shared and not self._reclaim_pending:
            self._reclaim_wanted = True

    @property
    def reclaim_pending(self) -> bool:
        """True from :meth:`take_reclaim_frame` until the peer's RETURN arrives."""
        return self._reclaim_pending

    def reclaim_frame_due(self) -> bool:
        """True if a RECLAIM frame should be posted now. It follows the DATA rule (two credits), so it never
        takes the credit kept for CREDIT and EOF frames."""
        return self._reclaim_wanted and self.can_take_slot()  # the DATA rule, as for a one-sided request

    def take_reclaim_frame(self) -> int:
        """Account for the RECLAIM frame about to be posted; return its immediate value (it grants every
        credit owed, like every frame)."""
        if not self.reclaim_frame_due():
            self.check_wire()
            raise RuntimeError("no RECLAIM frame is due")
        self._reclaim_wanted = False
        self._reclaim_pending = True
        return self.take_control_frame(_IMM_RECLAIM)

    # -- answering side -------------------------------------------------------------------------------------

    @property
    def return_due(self) -> bool:
        """True once the peer's RECLAIM arrived and until :meth:`take_return_frame`."""
        return self._return_due

    def return_frame_due(self) -> bool:
        """True if the RETURN frame answering a RECLAIM may be posted now (the last credit only if the frame
        also grants one, the rule EOF follows)."""
        return self._return_due and self.can_send_control()

    def take_return_frame(self) -> int:
        """Account for the RETURN frame about to be posted and return its immediate value: it gives back every
        credit above :data:`RETURN_KEEP` (at most :data:`~rdmaio.protocol.frames.MAX_RETURN`; the rest stay
        ours) and grants every credit owed."""
        if not self.return_frame_due():
            self.check_wire()
            raise RuntimeError("no RETURN frame is due")
        returned = min(max(0, self.send_credits - 1 - RETURN_KEEP), MAX_RETURN)
        self._return_due = False
        self._returned_out += returned
        return self.take_control_frame(encode_return_imm(returned, 0), give_back=returned)

    # -- receiving ------------------------------------------------------------------------------------------

    def on_frame(self, imm: int, byte_len: int) -> FrameKind:
        """:meth:`Session.on_frame`, plus RECLAIM and RETURN when :data:`FEATURE_RECLAIM` was negotiated.

        After a RETURN frame the caller tells its ledger how many credits came back
        (:func:`~rdmaio.protocol.frames.returned_credits` of ``imm``)."""
        if 0 <= imm <= _U32_MAX and self._reclaim:
            kind = imm >> _KIND_SHIFT
            if kind in (_K_RECLAIM, _K_RETURN):
                return self._on_reclaim_frame(kind, imm, byte_len)
        return super().on_frame(imm, byte_len)

    def _on_reclaim_frame(self, kind: int, imm: int, byte_len: int) -> FrameKind:
        # The checks of a control frame, in Session's order; the reserved bits carry the count in RETURN.
        self.check_control_frame(imm, byte_len, "RECLAIM" if kind == _K_RECLAIM else "RETURN")
        if kind == _K_RECLAIM:
            if imm & _RESERVED_MASK:
                self._fail(f"immediate value {imm:#010x} has reserved bits set")
            self._return_due = True
            self.count_control_frame(imm)
            return FrameKind.RECLAIM
        # The peer cannot give back more than it may hold: what we count as its credits and frames in
        # flight, less this frame itself.
        returned = returned_credits(imm)
        if not self._reclaim_pending:
            self._fail("RETURN frame without a RECLAIM")
        held = self.posted - self.ungranted - 1
        if returned > held:
            self._fail(f"RETURN frame gives back {returned} credits, the peer holds at most {held}")
        self._reclaim_pending = False
        self._returned_in += returned
        self.count_control_frame(imm, returned)  # the returned receives leave the window
        return FrameKind.RETURN

    def _fail(self, message: str) -> NoReturn:
        exc = FrameError(message)
        self.abort(exc)
        raise exc

    def statistics(self) -> dict[str, int]:
        """:meth:`Session.statistics` plus ``credits_returned_*`` (RETURN frames) and ``released`` (receives
        given back to the shared pool); the credit totals stay comparable between the two sides."""
        stats = super().statistics()
        # Released receives shrank the window without a grant; credits we gave back were received once.
        stats["credits_granted"] -= self._released
        stats["credits_received"] += self._returned_out
        stats["credits_returned_sent"] = self._returned_out
        stats["credits_returned_received"] = self._returned_in
        stats["released"] = self._released
        return stats
