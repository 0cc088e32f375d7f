"""The fields of a :class:`~rdmaio.protocol.session.Session`, declared once for the modules that make it up.

A Session is assembled from :class:`~rdmaio.protocol.credits.SendCredits` (what we send: credits taken and
granted), :class:`~rdmaio.protocol.intake.FrameIntake` (what we receive: frames validated and counted) and
:class:`~rdmaio.protocol.closestate.CloseState` (the close state machine); all of them work on these fields,
which :meth:`Session.__init__ <rdmaio.protocol.session.Session>` sets (they are ``__slots__``: a Session
has no ``__dict__``).
"""

from __future__ import annotations

from rdmaio.protocol.handshake import Handshake

__all__ = ["SessionFields"]


class SessionFields:
    """The slots of a Session and their types (the values are set by ``Session.__init__``)."""

    __slots__ = (
        "_abort_exc",
        "_aborted",
        "_batch_frames_received",
        "_batch_frames_sent",
        "_batch_pending",
        "_batched_messages_received",
        "_batched_messages_sent",
        "_batching",
        "_bytes_received",
        "_bytes_sent",
        "_credit_frames_received",
        "_credit_frames_sent",
        "_default_threshold",
        "_eof_requested",
        "_eof_sent",
        "_frames_received",
        "_frames_sent",
        "_grown",
        "_local",
        "_local_closed",
        "_local_max",
        "_max_fragment",
        "_messages_received",
        "_messages_sent",
        "_min_send_credits",
        "_onesided_received",
        "_onesided_sent",
        "_peer",
        "_peer_depth",
        "_peer_eof",
        "_peer_max",
        "_posted",
        "_recv_depth",
        "_recv_in_message",
        "_recv_max",
        "_recv_message_bytes",
        "_rndv",
        "_send_credits",
        "_send_in_message",
        "_send_message_bytes",
        "_slot_size",
        "_threshold",
        "_torn_down",
        "_transport_error",
        "_transport_lost",
        "_ungranted",
        "_ungranted_ctl",
        "_wire_down",
    )

    _abort_exc: BaseException | None
    _aborted: bool
    _batch_frames_received: int
    _batch_frames_sent: int
    _batch_pending: int
    _batched_messages_received: int
    _batched_messages_sent: int
    _batching: bool
    _bytes_received: int
    _bytes_sent: int
    _credit_frames_received: int
    _credit_frames_sent: int
    _default_threshold: bool
    _eof_requested: bool
    _eof_sent: bool
    _frames_received: int
    _frames_sent: int
    _grown: int
    _local: Handshake
    _local_closed: bool
    _local_max: int
    _max_fragment: int
    _messages_received: int
    _messages_sent: int
    _min_send_credits: int
    _onesided_received: int
    _onesided_sent: int
    _peer: Handshake
    _peer_depth: int
    _peer_eof: bool
    _peer_max: int
    _posted: int
    _recv_depth: int
    _recv_in_message: bool
    _recv_max: int
    _recv_message_bytes: int
    _rndv: bool
    _send_credits: int
    _send_in_message: bool
    _send_message_bytes: int
    _slot_size: int
    _threshold: int
    _torn_down: bool
    _transport_error: BaseException | None
    _transport_lost: bool
    _ungranted: int
    _ungranted_ctl: int  # the part of _ungranted owed for slots the peer's CREDIT frames consumed
    _wire_down: bool
