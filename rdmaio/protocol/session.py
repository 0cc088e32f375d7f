"""The :class:`Session` of one established connection: credit flow control, fragmentation accounting,
the close state machine and the one-sided credit hooks (sans-IO).

The work is split by job, one module each: :mod:`rdmaio.protocol.credits` (sending: credits taken and
granted), :mod:`rdmaio.protocol.intake` (receiving: frames validated and counted) and
:mod:`rdmaio.protocol.closestate` (the close state machine, as tables); this module assembles them with the
fields, the properties and the statistics.
"""

from __future__ import annotations

from rdmaio.protocol.closestate import EOF, EOFType, State
from rdmaio.protocol.credits import SendCredits
from rdmaio.protocol.handshake import FEATURE_BATCH, FEATURE_RNDV, Handshake
from rdmaio.protocol.intake import FrameIntake

__all__ = ["EOF", "EOFType", "Session", "State"]


class Session(SendCredits, FrameIntake):
    """Flow control, fragmentation accounting and close state of one established connection.

    ``local`` is the handshake this side sent, ``peer`` the one it received. See the module docstring for
    the credit rules and why ``credit_threshold`` must be in ``2..local.recv_depth-1``.

    Contract with the I/O layer:

    * send a frame only with an imm obtained from ``take_*_frame()`` right before posting it;
    * for every receive completion call :meth:`on_frame` first and :meth:`on_recv_reposted` only after the
      buffer was posted again (slots of CREDIT/EOF frames carry no payload: repost them right away);
    * when :meth:`on_frame` returns DATA_BATCH, pass the frame's payload to :meth:`on_batch` before the next
      :meth:`on_frame`; it returns the messages;
    * send a CREDIT frame whenever :meth:`credit_frame_due` is true, and the EOF frame once
      :meth:`eof_pending` and :meth:`can_send_eof` are true and all data written before ``write_eof()`` is
      sent.
    """

    __slots__ = ()  # the fields are SessionFields' slots (rdmaio.protocol.sessionfields)

    def __init__(self, local: Handshake, peer: Handshake, *, credit_threshold: int | None = None) -> None:
        # Receives posted at first: fewer than recv_depth only if we announced FEATURE_GROW.
        depth = local.initial_depth
        self._default_threshold = credit_threshold is None
        if credit_threshold is None:
            credit_threshold = depth // 2
        if not 2 <= credit_threshold <= depth - 1:
            raise ValueError(
                f"credit_threshold {credit_threshold} out of range 2..{depth - 1} "
                "(1 lets idle peers exchange CREDIT frames forever, recv_depth can deadlock)"
            )
        self._local = local
        self._peer = peer
        # Handshake fields the hot path reads, copied to avoid a second attribute lookup per frame.
        # _recv_depth is the receives we have added so far (posted or consumed by frames in flight);
        # grow_receives() raises it up to _recv_max.
        self._recv_depth = depth
        self._recv_max = local.recv_depth
        self._grown = 0
        self._slot_size = local.slot_size
        self._local_max = local.max_message_size
        self._peer_depth = peer.recv_depth
        self._max_fragment = peer.slot_size
        self._peer_max = peer.max_message_size
        self._batching = bool(local.features & peer.features & FEATURE_BATCH)
        self._rndv = bool(local.features & peer.features & FEATURE_RNDV)
        self._threshold = credit_threshold
        # The peer posted initial_depth receives; its recv_depth bounds what it may grant us later.
        self._send_credits = peer.initial_depth
        self._ungranted = 0
        self._ungranted_ctl = 0
        self._posted = depth
        self._recv_in_message = False
        self._recv_message_bytes = 0
        self._send_in_message = False
        self._send_message_bytes = 0
        self._batch_pending = -1  # payload size of the DATA_BATCH frame awaiting on_batch(), -1 if none
        self._eof_requested = False
        self._eof_sent = False
        self._peer_eof = False
        self._local_closed = False
        self._aborted = False
        self._abort_exc: BaseException | None = None
        self._transport_lost = False
        self._transport_error: BaseException | None = None
        self._torn_down = False
        self._wire_down = False  # aborted or transport lost or torn down: no frame may be sent
        # Counters. Those the statistics can derive (data frames, credits granted/received) are not kept.
        self._frames_sent = 0
        self._frames_received = 0
        self._bytes_sent = 0
        self._bytes_received = 0
        self._messages_sent = 0
        self._messages_received = 0
        self._credit_frames_sent = 0
        self._credit_frames_received = 0
        self._batch_frames_sent = 0
        self._batch_frames_received = 0
        self._batched_messages_sent = 0
        self._batched_messages_received = 0
        self._onesided_sent = 0  # peer receives consumed by our one-sided requests
        self._onesided_received = 0
        self._min_send_credits = self._send_credits

    def __repr__(self) -> str:
        return (
            f"<Session {self.state.name} send_credits={self._send_credits} ungranted={self._ungranted} "
            f"posted={self._posted} eof_sent={self._eof_sent} peer_eof={self._peer_eof}>"
        )

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def local(self) -> Handshake:
        """The handshake this side sent."""
        return self._local

    @property
    def peer(self) -> Handshake:
        """The handshake the peer sent."""
        return self._peer

    @property
    def send_credits(self) -> int:
        """Peer slots known to be posted for us: frames we may still send."""
        return self._send_credits

    @property
    def ungranted(self) -> int:
        """Slots reposted locally that the peer has not been told about yet."""
        return self._ungranted

    @property
    def ungranted_for_credit_frames(self) -> int:
        """The part of :attr:`ungranted` owed for slots the peer's CREDIT frames consumed (it does not count
        towards the credit threshold: see :meth:`credit_frame_due`)."""
        return self._ungranted_ctl

    @property
    def posted(self) -> int:
        """Receive slots currently posted locally."""
        return self._posted

    @property
    def credit_threshold(self) -> int:
        """Number of ungranted credits that makes a standalone CREDIT frame due."""
        return self._threshold

    @property
    def max_fragment(self) -> int:
        """The most payload bytes one frame may carry (the peer's slot size)."""
        return self._max_fragment

    @property
    def batching(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_BATCH`: DATA_BATCH frames may be sent."""
        return self._batching

    @property
    def rendezvous(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_RNDV`: RNDV frames may be sent."""
        return self._rndv

    @property
    def peer_eof(self) -> bool:
        """True once the peer's EOF frame was received."""
        return self._peer_eof

    @property
    def eof_sent(self) -> bool:
        """True once our EOF frame was taken (:meth:`take_eof_frame`)."""
        return self._eof_sent

    # -- statistics ---------------------------------------------------------------------------------------

    def statistics(self) -> dict[str, int]:
        """Counters and current credit state, for monitoring and tuning.

        ``data_frames_*`` count DATA_MORE/DATA_END frames, ``batch_frames_*`` DATA_BATCH frames and
        ``batched_messages_*`` the messages those carried; ``messages_*`` and ``bytes_*`` count every
        message and its bytes however it travelled (batch record headers are not counted).
        """
        eof_sent = int(self._eof_sent)
        eof_received = int(self._peer_eof)
        frames_sent = self._frames_sent
        frames_received = self._frames_received
        return {
            "frames_sent": frames_sent,
            "frames_received": frames_received,
            "data_frames_sent": frames_sent - self._credit_frames_sent - self._batch_frames_sent - eof_sent,
            "data_frames_received": (
                frames_received - self._credit_frames_received - self._batch_frames_received - eof_received
            ),
            "bytes_sent": self._bytes_sent,
            "bytes_received": self._bytes_received,
            "messages_sent": self._messages_sent,
            "messages_received": self._messages_received,
            "credit_frames_sent": self._credit_frames_sent,
            "credit_frames_received": self._credit_frames_received,
            "batch_frames_sent": self._batch_frames_sent,
            "batch_frames_received": self._batch_frames_received,
            "batched_messages_sent": self._batched_messages_sent,
            "batched_messages_received": self._batched_messages_received,
            "eof_sent": eof_sent,
            "eof_received": eof_received,
            # Every repost became an ungranted credit and every grant came out of those; reposts are the
            # posted slots minus the initial ones plus those consumed by received frames.
            # Growth adds slots to both posted and recv_depth, and grants them like reposts.
            "credits_granted": (
                self._posted
                - self._recv_depth
                + self._grown
                + frames_received
                + self._onesided_received
                - self._ungranted
            ),
            # send_credits = peer.initial_depth - frames and one-sided requests sent + credits received.
            "credits_received": (
                self._send_credits - self._peer.initial_depth + frames_sent + self._onesided_sent
            ),
            "onesided_slots_sent": self._onesided_sent,
            "onesided_slots_received": self._onesided_received,
            "send_credits": self._send_credits,
            "min_send_credits": self._min_send_credits,
            "ungranted": self._ungranted,
            "posted": self._posted,
            "credit_threshold": self._threshold,
            "recv_depth": self._recv_depth,
            "batching": int(self._batching),
        }
