"""The per-frame state of a :class:`~rdmaio.protocol.session.Session` as an object of its own:
:class:`SessionState`.

A Session keeps every counter its per-frame rules read and write (credits, posted receives, the window,
the message in progress, the frame/byte/message statistics, the copies of two close facts) in one state
object, ``Session._s``. By default it is a :class:`SessionState`, a plain ``__slots__`` object. The I/O
layer may inject another object with exactly the same field names instead (``Session(..., state=...)``):
the core injects a C struct, so that C functions can apply the hot rules to the same fields the Python
rules use, and the Python Session stays the reference model of those rules. This module knows nothing
of C: an injected object only has to accept and return ints for every field.

Flags are ints (0/1) here as in C, so that both kinds of state hold the same values.
"""

from __future__ import annotations

from typing import Final

__all__ = ["STATE_FIELDS", "SessionState"]


class SessionState:
    """The default state of a :class:`~rdmaio.protocol.session.Session`: every field of
    :data:`STATE_FIELDS` (ints; flags are 0/1), all 0 until the Session sets them."""

    __slots__ = (
        "batch_frames_received",
        "batch_frames_sent",
        "batch_pending",
        "batched_messages_received",
        "batched_messages_sent",
        "batching",
        "bytes_received",
        "bytes_sent",
        "credit_frames_received",
        "credit_frames_sent",
        "default_threshold",
        "eof_due",
        "eof_sent",
        "fast",
        "frames_received",
        "frames_sent",
        "grown",
        "local_max",
        "max_fragment",
        "messages_received",
        "messages_sent",
        "min_send_credits",
        "onesided_received",
        "onesided_sent",
        "peer_depth",
        "peer_eof",
        "peer_max",
        "posted",
        "recv_depth",
        "recv_in_message",
        "recv_max",
        "recv_message_bytes",
        "rndv",
        "send_credits",
        "send_in_message",
        "send_message_bytes",
        "slot_size",
        "threshold",
        "ungranted",
        "ungranted_ctl",
        "wire_down",
    )

    # credits and receives
    send_credits: int  # peer slots known to be posted for us: frames we may still send
    ungranted: int  # slots reposted locally that the peer has not been told about yet
    ungranted_ctl: int  # the part of ungranted owed for the slots of the peer's CREDIT frames
    posted: int  # receive slots currently posted locally
    recv_depth: int  # receives added so far (the current window)
    recv_max: int  # the most receives the window may grow to (our handshake's recv_depth)
    grown: int  # receives added by grow_receives()
    peer_depth: int  # the peer's recv_depth: bounds what it may grant us
    slot_size: int  # our slot size: the most bytes a received frame may carry
    local_max: int  # our maximum message size
    peer_max: int  # the peer's maximum message size
    max_fragment: int  # the peer's slot size: the most bytes a frame we send may carry
    threshold: int  # ungranted credits that make a CREDIT frame due
    default_threshold: int  # 1 if the threshold follows the window (half of it)
    min_send_credits: int  # the fewest send credits held so far
    # features negotiated
    batching: int  # 1 if DATA_BATCH frames may be sent and received
    rndv: int  # 1 if RNDV frames may be sent and received
    # close facts the per-frame path reads (copies of the close state's)
    wire_down: int  # no frame may be sent any more
    peer_eof: int  # the peer's EOF frame arrived
    eof_sent: int  # our EOF frame was taken
    eof_due: int  # write_eof()/close() asked for an EOF frame not taken yet
    # messages in progress
    send_in_message: int
    send_message_bytes: int
    recv_in_message: int
    recv_message_bytes: int
    batch_pending: int  # payload size of the DATA_BATCH frame awaiting on_batch(), -1 if none
    # statistics
    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    credit_frames_sent: int
    credit_frames_received: int
    batch_frames_sent: int
    batch_frames_received: int
    batched_messages_sent: int
    batched_messages_received: int
    onesided_sent: int  # peer receives consumed by our one-sided requests
    onesided_received: int
    # 1: the I/O layer may apply the hot rules to this state with its own implementation of them; 0: every
    # frame must go through the Session's methods (a subclass that reports frames or reposts elsewhere).
    fast: int

    def __init__(self) -> None:
        for name in STATE_FIELDS:
            setattr(self, name, 0)

    def __repr__(self) -> str:
        fields = " ".join(f"{name}={getattr(self, name)}" for name in STATE_FIELDS)
        return f"<SessionState {fields}>"


STATE_FIELDS: Final[tuple[str, ...]] = SessionState.__slots__
"""The fields of a Session's state, sorted by name (the C struct the core injects has them in this order)."""
