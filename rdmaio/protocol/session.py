"""The :class:`Session` of one established connection (sans-IO): credit flow control, fragmentation
accounting, frame validation and the one-sided credit hooks, with its close state as an object.

A Session is one object on the per-frame path: what we send (credits taken and granted, imm values) and
what we receive (frames validated and counted, receives reposted and grown) work on the fields of one
state object (:mod:`rdmaio.protocol.sessionstate`), so that :meth:`Session.take_data_frame`,
:meth:`Session.on_frame`, :meth:`Session.on_recv_reposted`, :meth:`Session.can_send_data` and
:meth:`Session.credit_frame_due` make no call of their own. The core gives its sessions a C struct as that
object and applies these hot rules to it in C (rdmaio/_ffi/session.c): this class is the reference model
of those ports, and what they leave (every error, EOF, RNDV, extension frames) it applies itself. The
close state machine is a :class:`~rdmaio.protocol.closestate.CloseState` the
Session holds and tells every close event (:meth:`Session.close`, :meth:`Session.abort`, ...); its
answers (:meth:`~rdmaio.protocol.closestate.CloseState.send_error`, ``flush_error``, ``recv_outcome``)
are bound to the Session once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from rdmaio.errors import EndpointClosedError, FrameError, MessageTooLargeError, ProtocolError
from rdmaio.protocol.closestate import EOF, CloseState, EOFType, State
from rdmaio.protocol.frames import (
    _BAD_IMM_BITS,
    _CREDIT,
    _CREDIT_MASK,
    _DATA_BATCH,
    _DATA_END,
    _DATA_MORE,
    _EOF_KIND,
    _IMM_BATCH,
    _IMM_CREDIT,
    _IMM_END,
    _IMM_EOF,
    _IMM_MORE,
    _IMM_RNDV,
    _K_BATCH,
    _K_CREDIT,
    _K_END,
    _K_EOF,
    _K_MORE,
    _K_RNDV,
    _KIND_SHIFT,
    _RNDV,
    BATCH_RECORD_HEADER,
    BytesLike,
    FrameKind,
    ReceivedMessageTooLargeError,
    decode_imm,
    unpack_batch,
)
from rdmaio.protocol.framing import IMMEDIATE_FRAMING, Framing, negotiate_framing
from rdmaio.protocol.handshake import FEATURE_BATCH, FEATURE_RNDV, MAX_CREDITS, Handshake
from rdmaio.protocol.sessionstate import SessionState

__all__ = ["EOF", "EOFType", "Session", "State"]


class Session:
    """Flow control, fragmentation accounting and close state of one established connection.

    ``local`` is the handshake this side sent, ``peer`` the one it received. See the module docstring for
    the credit rules and why ``credit_threshold`` must be in ``2..local.recv_depth-1``.

    Every per-frame counter is a field of one state object (:attr:`rules_state`): a
    :class:`~rdmaio.protocol.sessionstate.SessionState` unless ``state`` gives another object with the same
    fields (the core gives a C struct, to which C functions apply the hot rules; this class is their
    reference model). The Session initialises every field of the object it is given.

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

    __slots__ = (
        "_close",
        "_peer",
        "_s",
        "close_state",
        "flush_error",
        "framing",
        "local",
        "recv_outcome",
        "rules_state",
        "send_error",
    )

    # The close state's answers: bound methods of the Session's CloseState, set once by __init__, so that a
    # send or an empty read asks the close state with one call, as when they were the Session's own methods.
    #: The exception a send/write/drain must raise now, or None (:meth:`CloseState.send_error`).
    send_error: Callable[[], BaseException | None]
    #: The exception a wait for accepted data must raise now, or None (:meth:`CloseState.flush_error`).
    flush_error: Callable[[], BaseException | None]
    #: What a read that finds no buffered data gets: None, :data:`EOF` or an exception
    #: (:meth:`CloseState.recv_outcome`).
    recv_outcome: Callable[[], BaseException | EOFType | None]
    #: The state object this Session's rules work on (a :class:`SessionState`, or the object the I/O layer
    #: injected with ``state=``): another implementation of the rules may work on it too. (An attribute,
    #: not a property: the core reads it once per connection, at no call.)
    rules_state: SessionState
    #: The :class:`~rdmaio.protocol.closestate.CloseState` this Session tells its close events, for a part of
    #: the I/O layer that watches it (:meth:`CloseState.watch`), or whose send or empty read tests its
    #: ``clear`` before asking it. (An attribute: read once per connection.)
    close_state: CloseState
    #: The framing negotiated from both handshakes (:mod:`rdmaio.protocol.framing`): in the header framing a
    #: frame's payload is at most the peer's slot size minus the header (:attr:`max_fragment`).
    framing: Framing
    _s: SessionState

    def __init__(
        self,
        local: Handshake,
        peer: Handshake,
        *,
        credit_threshold: int | None = None,
        state: SessionState | None = None,
    ) -> None:
        # Receives posted at first: fewer than recv_depth only if we announced FEATURE_GROW.
        depth = local.initial_depth
        if credit_threshold is None:
            default_threshold = 1
            credit_threshold = depth // 2
        else:
            default_threshold = 0
        if not 2 <= credit_threshold <= depth - 1:
            raise ValueError(
                f"credit_threshold {credit_threshold} out of range 2..{depth - 1} "
                "(1 lets idle peers exchange CREDIT frames forever, recv_depth can deadlock)"
            )
        self.local = local
        """The handshake this side sent (a plain attribute: the core reads it at connection setup, whose
        Python calls are budgeted)."""
        self._peer = peer
        # The framing: the immediate one unless a side lacks immediate data or asks for the header framing
        # (tested inline: connection setup's Python calls are budgeted); HandshakeError if they cannot agree.
        mine = local.caps
        theirs = peer.caps
        if (mine is None or (mine.immediate and not mine.header_framing)) and (
            theirs is None or (theirs.immediate and not theirs.header_framing)
        ):
            framing = self.framing = IMMEDIATE_FRAMING
        else:
            framing = self.framing = negotiate_framing(local, peer)
        # Every per-frame counter lives in one state object: a SessionState, or the object the I/O layer
        # injected (a C struct with the same fields, which C functions apply the hot rules to).
        s = self._s = self.rules_state = SessionState() if state is None else state
        s.default_threshold = default_threshold
        # Handshake fields the hot path reads, copied to avoid a second attribute lookup per frame.
        # recv_depth is the receives we have added so far (posted or consumed by frames in flight);
        # grow_receives() raises it up to recv_max.
        s.recv_depth = depth
        s.recv_max = local.recv_depth
        s.grown = 0
        s.slot_size = local.slot_size
        s.local_max = local.max_message_size
        s.peer_depth = peer.recv_depth
        s.max_fragment = peer.slot_size - framing.header  # the header framing's header is in the slot
        s.peer_max = peer.max_message_size
        s.batching = int(bool(local.features & peer.features & FEATURE_BATCH))
        s.rndv = int(bool(local.features & peer.features & FEATURE_RNDV))
        s.threshold = credit_threshold
        # The peer posted initial_depth receives; its recv_depth bounds what it may grant us later.
        s.send_credits = peer.initial_depth
        s.ungranted = 0
        s.ungranted_ctl = 0
        s.posted = depth
        s.recv_in_message = 0
        s.recv_message_bytes = 0
        s.send_in_message = 0
        s.send_message_bytes = 0
        s.batch_pending = -1  # payload size of the DATA_BATCH frame awaiting on_batch(), -1 if none
        # The close state is an object of its own; the per-frame path reads its copies of two facts.
        close = self._close = self.close_state = CloseState()
        s.wire_down = 0  # close.wire_down, copied by every close event: no frame may be sent
        s.peer_eof = 0  # the peer's EOF frame arrived (also told to the close state)
        s.eof_sent = 0  # our EOF frame was taken
        s.eof_due = 0  # write_eof()/close() asked for an EOF frame that was not taken yet
        # The close state's answers, bound once: a send or an empty read asks them, at no extra call.
        self.send_error = close.send_error
        self.flush_error = close.flush_error
        self.recv_outcome = close.recv_outcome
        # Counters. Those the statistics can derive (data frames, credits granted/received) are not kept.
        s.frames_sent = 0
        s.frames_received = 0
        s.bytes_sent = 0
        s.bytes_received = 0
        s.messages_sent = 0
        s.messages_received = 0
        s.credit_frames_sent = 0
        s.credit_frames_received = 0
        s.batch_frames_sent = 0
        s.batch_frames_received = 0
        s.batched_messages_sent = 0
        s.batched_messages_received = 0
        s.onesided_sent = 0  # peer receives consumed by our one-sided requests
        s.onesided_received = 0
        s.min_send_credits = s.send_credits
        s.fast = 1  # a subclass whose frames or reposts must reach its own methods sets 0

    def __repr__(self) -> str:
        return (
            f"<Session {self.state.name} send_credits={self._s.send_credits} ungranted={self._s.ungranted} "
            f"posted={self._s.posted} eof_sent={self._s.eof_sent} peer_eof={self._s.peer_eof}>"
        )

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def peer(self) -> Handshake:
        """The handshake the peer sent."""
        return self._peer

    @property
    def send_credits(self) -> int:
        """Peer slots known to be posted for us: frames we may still send."""
        return self._s.send_credits

    @property
    def ungranted(self) -> int:
        """Slots reposted locally that the peer has not been told about yet."""
        return self._s.ungranted

    @property
    def ungranted_for_credit_frames(self) -> int:
        """The part of :attr:`ungranted` owed for slots the peer's CREDIT frames consumed (it does not count
        towards the credit threshold: see :meth:`credit_frame_due`)."""
        return self._s.ungranted_ctl

    @property
    def posted(self) -> int:
        """Receive slots currently posted locally."""
        return self._s.posted

    @property
    def credit_threshold(self) -> int:
        """Number of ungranted credits that makes a standalone CREDIT frame due."""
        return self._s.threshold

    @property
    def max_fragment(self) -> int:
        """The most payload bytes one frame may carry (the peer's slot size)."""
        return self._s.max_fragment

    @property
    def batching(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_BATCH`: DATA_BATCH frames may be sent."""
        return bool(self._s.batching)

    @property
    def rendezvous(self) -> bool:
        """True if both handshakes announced :data:`FEATURE_RNDV`: RNDV frames may be sent."""
        return bool(self._s.rndv)

    @property
    def peer_eof(self) -> bool:
        """True once the peer's EOF frame was received."""
        return bool(self._s.peer_eof)

    @property
    def eof_sent(self) -> bool:
        """True once our EOF frame was taken (:meth:`take_eof_frame`)."""
        return bool(self._s.eof_sent)

    # -- close (the CloseState decides; the Session keeps its copy of wire_down) -------------------------

    @property
    def state(self) -> State:
        """The connection's :class:`State`, derived from the events seen so far."""
        return self._close.state

    def close(self) -> None:
        """Graceful local close: implies :meth:`write_eof`; the state becomes CLOSING. Idempotent."""
        self._close.close()
        self._s.eof_due = int(not self._s.eof_sent)

    def abort(self, exc: BaseException | None = None) -> None:
        """Abort the connection now (state ABORTED); ``exc``, if any, is reported to pending operations.

        Idempotent: the first cause is kept. A no-op once :meth:`mark_closed` was called.
        """
        close = self._close
        close.abort(exc)
        self._s.wire_down = int(close.wire_down)

    def on_disconnected(self) -> None:
        """The transport reported DISCONNECTED (the peer left or our disconnect completed)."""
        close = self._close
        close.on_disconnected()
        self._s.wire_down = int(close.wire_down)

    def on_transport_error(self, exc: BaseException) -> None:
        """A completion or rdma_cm error made the transport unusable (only the first cause is kept)."""
        close = self._close
        close.on_transport_error(exc)
        self._s.wire_down = int(close.wire_down)

    def mark_closed(self) -> None:
        """The I/O layer finished tearing the connection down; the state becomes CLOSED."""
        close = self._close
        close.mark_closed()
        self._s.wire_down = int(close.wire_down)

    def check_wire(self) -> None:
        """Raise the connection's error if no frame may be sent any more (aborted, transport lost or torn
        down): what taking a frame raises then. Nothing while the transport is usable."""
        error = self._close.wire_error()
        if error is not None:
            raise error

    # -- statistics ---------------------------------------------------------------------------------------

    def statistics(self) -> dict[str, int]:
        """Counters and current credit state, for monitoring and tuning.

        ``data_frames_*`` count DATA_MORE/DATA_END frames, ``batch_frames_*`` DATA_BATCH frames and
        ``batched_messages_*`` the messages those carried; ``messages_*`` and ``bytes_*`` count every
        message and its bytes however it travelled (batch record headers are not counted).
        """
        s = self._s
        eof_sent = int(s.eof_sent)
        eof_received = int(s.peer_eof)
        frames_sent = s.frames_sent
        frames_received = s.frames_received
        return {
            "frames_sent": frames_sent,
            "frames_received": frames_received,
            "data_frames_sent": frames_sent - s.credit_frames_sent - s.batch_frames_sent - eof_sent,
            "data_frames_received": (
                frames_received - s.credit_frames_received - s.batch_frames_received - eof_received
            ),
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
            "messages_sent": s.messages_sent,
            "messages_received": s.messages_received,
            "credit_frames_sent": s.credit_frames_sent,
            "credit_frames_received": s.credit_frames_received,
            "batch_frames_sent": s.batch_frames_sent,
            "batch_frames_received": s.batch_frames_received,
            "batched_messages_sent": s.batched_messages_sent,
            "batched_messages_received": s.batched_messages_received,
            "eof_sent": eof_sent,
            "eof_received": eof_received,
            # Every repost became an ungranted credit and every grant came out of those; reposts are the
            # posted slots minus the initial ones plus those consumed by received frames.
            # Growth adds slots to both posted and recv_depth, and grants them like reposts.
            "credits_granted": (
                s.posted - s.recv_depth + s.grown + frames_received + s.onesided_received - s.ungranted
            ),
            # send_credits = peer.initial_depth - frames and one-sided requests sent + credits received.
            "credits_received": (s.send_credits - self._peer.initial_depth + frames_sent + s.onesided_sent),
            "onesided_slots_sent": s.onesided_sent,
            "onesided_slots_received": s.onesided_received,
            "send_credits": s.send_credits,
            "min_send_credits": s.min_send_credits,
            "ungranted": s.ungranted,
            "posted": s.posted,
            "credit_threshold": s.threshold,
            "recv_depth": s.recv_depth,
            "batching": int(s.batching),
        }

    # -- sending: credits taken and granted ----------------------------------------------------------------

    def check_message_size(self, n: int) -> None:
        """Raise :class:`MessageTooLargeError` if the peer does not accept a message of ``n`` bytes."""
        if n < 0:
            raise ValueError(f"message size {n} is negative")
        if n > self._s.peer_max:
            raise MessageTooLargeError(
                f"message of {n} bytes exceeds the peer's maximum message size of {self._s.peer_max} bytes"
            )

    def fragment_count(self, n: int) -> int:
        """Number of frames a message of ``n`` bytes needs (an empty message still needs one)."""
        if n < 0:
            raise ValueError(f"message size {n} is negative")
        return max(1, -(-n // self._s.max_fragment))

    def can_send_data(self) -> bool:
        """True if a DATA frame may be posted now (transport usable, EOF not sent, two credits held).

        The same holds for a DATA_BATCH frame (which also needs :attr:`batching` and no message in progress).
        Data accepted before ``write_eof()``/``close()`` may still be flushed; whether the application may
        hand over *new* data is :meth:`send_error`'s business.
        """
        return self._s.send_credits >= 2 and not (self._s.eof_sent or self._s.wire_down)

    def take_data_frame(self, last: bool, nbytes: int = 0) -> int:
        """Account for one DATA frame about to be posted and return its immediate value.

        ``last`` selects DATA_END (end of message) over DATA_MORE. ``nbytes`` (the payload size) is
        optional; when given it is checked against :attr:`max_fragment` and the peer's maximum message
        size and counted in :meth:`statistics`. Raises the connection's error if the transport is unusable,
        :class:`EndpointClosedError` after the EOF frame, RuntimeError without two credits.
        """
        s = self._s
        send_credits = s.send_credits - 1
        if s.wire_down or s.eof_sent or send_credits < 1 or not 0 <= nbytes <= s.max_fragment:
            self._raise_send_error(nbytes, 2)
        message_bytes = s.send_message_bytes + nbytes
        if message_bytes > s.peer_max:
            raise MessageTooLargeError(
                f"message exceeds the peer's maximum message size of {s.peer_max} bytes"
            )
        # Every frame piggybacks everything we owe: fewer standalone CREDIT frames. The cap is a guard only:
        # ungranted <= posted <= recv_depth <= MAX_CREDITS as long as on_frame accepts the frames.
        grant = s.ungranted
        if grant:
            if grant > _CREDIT_MASK:
                grant = _CREDIT_MASK
            s.ungranted -= grant
            if s.ungranted_ctl > s.ungranted:
                s.ungranted_ctl = s.ungranted
        s.send_credits = send_credits
        if send_credits < s.min_send_credits:
            s.min_send_credits = send_credits
        s.frames_sent += 1
        s.bytes_sent += nbytes
        if last:
            s.messages_sent += 1
            if s.send_in_message:
                s.send_in_message = 0
                s.send_message_bytes = 0
            return _IMM_END | grant
        s.send_in_message = 1
        s.send_message_bytes = message_bytes
        return _IMM_MORE | grant

    def take_batch_frame(self, nbytes: int, messages: int) -> int:
        """Account for one DATA_BATCH frame about to be posted and return its immediate value.

        ``nbytes`` is the payload size (the value :func:`pack_batch_into` returned, at most
        :attr:`max_fragment`), ``messages`` the number of messages in it (at least one). The frame costs one
        credit and needs two, like a DATA_END frame, and may not be sent in the middle of a fragmented
        message. Each message's size must have passed :meth:`check_message_size`. Raises the connection's
        error if the transport is unusable, :class:`EndpointClosedError` after the EOF frame, RuntimeError
        if batching was not negotiated (:attr:`batching`), in the middle of a message or without two
        credits, ValueError for an impossible ``nbytes``/``messages``.
        """
        s = self._s
        if s.wire_down or s.eof_sent:
            self._raise_send_error(nbytes, 2)
        if not s.batching:
            raise RuntimeError("cannot send a DATA_BATCH frame: batching was not negotiated")
        if s.send_in_message:
            raise RuntimeError("cannot send a DATA_BATCH frame in the middle of a message (DATA_END missing)")
        if not 1 <= messages <= nbytes // BATCH_RECORD_HEADER:
            raise ValueError(f"{messages} messages cannot make a DATA_BATCH payload of {nbytes} bytes")
        if nbytes > s.max_fragment:
            raise ValueError(f"DATA_BATCH frame of {nbytes} bytes out of range 0..{s.max_fragment}")
        if s.send_credits < 2:
            raise RuntimeError(f"no credit for a DATA frame (send_credits={s.send_credits}, need 2)")
        s.batch_frames_sent += 1
        s.batched_messages_sent += messages
        s.messages_sent += messages
        s.bytes_sent += nbytes - BATCH_RECORD_HEADER * messages
        return self._take(_IMM_BATCH)

    def take_rndv_frame(self, nbytes: int) -> int:
        """Account for one RNDV frame (a rendezvous descriptor, ``nbytes`` of payload) about to be posted and
        return its immediate value. It follows the rules of a DATA_END frame (two credits, not after EOF, not
        in the middle of a message); the message it announces is counted by the rendezvous layer."""
        if (
            self._s.wire_down
            or self._s.eof_sent
            or self._s.send_credits < 2
            or not 0 < nbytes <= self._s.max_fragment
        ):
            self._raise_send_error(nbytes, 2)
        if not self._s.rndv:
            raise RuntimeError("cannot send an RNDV frame: rendezvous was not negotiated")
        if self._s.send_in_message:
            raise RuntimeError("cannot send an RNDV frame in the middle of a message (DATA_END missing)")
        return self._take(_IMM_RNDV)

    def credit_frame_due(self) -> bool:
        """True if a standalone CREDIT frame should be sent now: ``threshold`` credits are owed for slots that
        data (or EOF) frames consumed, or the peer may be stuck (``recv_depth - 1`` owed in all).

        Credits owed for the slots of the peer's own CREDIT frames do not count towards the threshold: with
        a 4-slot window (threshold 2) one request plus the slot of the requester's CREDIT frame made a CREDIT
        frame due before the reply could carry the credits, and a request/reply connection once out of step
        sent a CREDIT frame with every message in both directions. They are granted on the next frame, and
        the liveness rule (a peer with fewer than two credits is owed ``recv_depth - 1``) still sends one.
        """
        s = self._s
        owed = s.ungranted
        return (
            (owed - s.ungranted_ctl >= s.threshold or owed >= s.recv_depth - 1)
            and s.send_credits >= 1
            and not s.wire_down
        )

    def control_frame_due(self) -> bool:
        """``eof_pending() or credit_frame_due()`` in one call: whether a sender with no data to send has a
        control frame to look at (its early-out after a completion batch asks only this)."""
        s = self._s
        if s.wire_down:
            return False
        if s.eof_due:
            return True
        owed = s.ungranted
        return (owed - s.ungranted_ctl >= s.threshold or owed >= s.recv_depth - 1) and s.send_credits >= 1

    def take_credit_frame(self) -> int:
        """Account for one CREDIT frame about to be posted and return its immediate value.

        Allowed with a single credit left, but only if it grants at least one credit (the liveness argument
        relies on that). Send it when :meth:`credit_frame_due` says so to keep idle peers quiet.
        """
        s = self._s
        grant = s.ungranted
        send_credits = s.send_credits - 1
        if s.wire_down or send_credits < 0 or grant < 1:
            self.check_wire()
            if send_credits < 0:
                raise RuntimeError("no credit left for a CREDIT frame")
            raise RuntimeError("a CREDIT frame must grant at least one credit (ungranted is 0)")
        if grant > _CREDIT_MASK:
            grant = _CREDIT_MASK
        s.ungranted -= grant
        if s.ungranted_ctl > s.ungranted:
            s.ungranted_ctl = s.ungranted
        s.send_credits = send_credits
        if send_credits < s.min_send_credits:
            s.min_send_credits = send_credits
        s.frames_sent += 1
        s.credit_frames_sent += 1
        return _IMM_CREDIT | grant

    def write_eof(self) -> None:
        """Half-close: request an EOF frame after the pending data; new data is refused from now on."""
        self._close.write_eof()
        self._s.eof_due = int(not self._s.eof_sent)

    def eof_pending(self) -> bool:
        """True if ``write_eof()``/``close()`` asked for an EOF frame that was not sent yet.

        False once the transport is gone, as there is no one left to tell.
        """
        return bool(self._s.eof_due and not self._s.wire_down)

    def can_send_eof(self) -> bool:
        """True if the pending EOF frame may be posted now as far as credits and framing go.

        EOF may use the last credit only if it grants one too (see the module docstring).
        """
        return self.eof_pending() and not self._s.send_in_message and self._eof_credit_ok()

    def _eof_credit_ok(self) -> bool:
        # The last credit may go to EOF only if EOF grants one back; otherwise both sides could end up
        # holding zero credits with nothing in flight.
        return self._s.send_credits >= 2 or (self._s.send_credits == 1 and self._s.ungranted >= 1)

    def take_eof_frame(self) -> int:
        """Account for the EOF frame about to be posted and return its immediate value (once only)."""
        self.check_wire()
        if self._s.eof_sent:
            raise RuntimeError("EOF was already sent")
        if self._s.send_in_message:
            raise RuntimeError("cannot send EOF in the middle of a message (DATA_END missing)")
        if not self._eof_credit_ok():
            raise RuntimeError(
                f"no credit for the EOF frame "
                f"(send_credits={self._s.send_credits}, ungranted={self._s.ungranted})"
            )
        self._close.write_eof()
        self._s.eof_sent = 1
        self._s.eof_due = 0
        return self._take(_IMM_EOF)

    def _grant_owed(self, limit: int) -> int:
        """Take up to ``limit`` owed credits for a frame about to be posted and return them (the part owed
        for CREDIT-frame slots shrinks with them). take_data_frame/take_credit_frame inline it."""
        grant = min(self._s.ungranted, limit)
        self._s.ungranted -= grant
        if self._s.ungranted_ctl > self._s.ungranted:
            self._s.ungranted_ctl = self._s.ungranted
        return grant

    def _take(self, kind_bits: int) -> int:
        # Shared by the less frequent frames (EOF, DATA_BATCH); take_data_frame/take_credit_frame inline it.
        grant = self._grant_owed(MAX_CREDITS)
        self._s.send_credits -= 1
        self._s.min_send_credits = min(self._s.min_send_credits, self._s.send_credits)
        self._s.frames_sent += 1
        return kind_bits | grant

    def _raise_send_error(self, nbytes: int, needed: int) -> NoReturn:
        """Raise what a DATA/DATA_BATCH take must raise, in the order of the checks (slow path only)."""
        self.check_wire()
        if self._s.eof_sent:
            raise EndpointClosedError("cannot send data: EOF was already sent (write_eof() was called)")
        if not 0 <= nbytes <= self._s.max_fragment:
            raise ValueError(f"fragment of {nbytes} bytes out of range 0..{self._s.max_fragment}")
        # The last credit is reserved so that a CREDIT/EOF frame can always be sent.
        raise RuntimeError(f"no credit for a DATA frame (send_credits={self._s.send_credits}, need {needed})")

    # -- one-sided operations -----------------------------------------------------------------------------
    # An RDMA WRITE with immediate data and a one-sided control message (a SEND without immediate data)
    # consume one of the peer's posted receives exactly as a frame does, so they are paid for with a
    # credit like one. They grant nothing (their immediate value belongs to the user, or there is none), and
    # they follow the DATA rule of two credits, so the reserve for CREDIT/EOF frames is never touched.

    def can_take_slot(self) -> bool:
        """True if a one-sided request that consumes a peer receive may be posted now (two credits)."""
        return self._s.send_credits >= 2 and not self._s.wire_down

    def take_slot(self) -> None:
        """Account for one WRITE-with-immediate or one-sided control message about to be posted.

        Raises the connection's error if the transport is unusable, RuntimeError without two credits.
        """
        if self._s.wire_down:
            self.check_wire()
        if self._s.send_credits < 2:
            raise RuntimeError(f"no credit for a one-sided request (send_credits={self._s.send_credits})")
        self._s.send_credits -= 1
        self._s.onesided_sent += 1
        if self._s.send_credits < self._s.min_send_credits:
            self._s.min_send_credits = self._s.send_credits

    # -- receiving: frames validated and counted, receives reposted and grown --------------------------------

    @property
    def recv_depth(self) -> int:
        """Receives added so far (posted, or consumed by frames not yet reposted): the current window."""
        return self._s.recv_depth

    @property
    def can_grow(self) -> int:
        """How many more receives :meth:`grow_receives` may add (0 unless we announced FEATURE_GROW)."""
        return self._s.recv_max - self._s.recv_depth

    def grow_receives(self, n: int) -> None:
        """The I/O layer posted ``n`` receives on new slots: the window grows and they become credits owed
        to the peer (the next frame grants them).

        The credit argument of the module docstring holds for the current window at every moment:
        ``peer.ungranted == recv_depth - our.send_credits`` when nothing is in flight keeps holding because
        growth raises both sides of it by ``n``, and the default threshold follows the window (half of it),
        staying in ``2..recv_depth-1``.
        """
        s = self._s
        if not 0 < n <= s.recv_max - s.recv_depth:
            raise ValueError(f"cannot grow by {n}: {s.recv_depth} of at most {s.recv_max} posted")
        s.recv_depth += n
        s.posted += n
        s.ungranted += n
        s.grown += n
        if s.default_threshold:
            s.threshold = s.recv_depth // 2

    def on_recv_reposted(self, n: int) -> None:
        """The I/O layer posted ``n`` receive buffers again; they become credits owed to the peer."""
        s = self._s
        posted = s.posted + n
        if n < 0 or posted > s.recv_depth:
            if n < 0:
                raise ValueError(f"reposted count {n} is negative")
            raise RuntimeError(f"{posted} receives posted, more than recv_depth {s.recv_depth}")
        s.posted = posted
        s.ungranted += n

    def on_frame(self, imm: int, byte_len: int) -> FrameKind:
        """Validate and apply one received frame; return its kind (DATA_END completes a message).

        The kind returned is a :class:`FrameKind` member (an int): compare it with ``is`` or ``==``. After
        DATA_BATCH, hand the payload to :meth:`on_batch`. Raises a :class:`~rdmaio.errors.ProtocolError`
        (:class:`FrameError`, or :class:`ReceivedMessageTooLargeError`) if the peer broke the protocol; the
        session is then aborted with that error, as its accounting can no longer be trusted.
        """
        s = self._s
        # Fast path: one combined test of what every frame must satisfy (imm well-formed, a slot posted and
        # granted for it, credits not overflowing, length within the slot), then the kind's own rules. Any
        # failure goes to _reject(), which re-checks in the documented order to pick the error message.
        # Nothing is changed before every check passed, so a rejected frame leaves the counters intact.
        send_credits = s.send_credits + (imm & _CREDIT_MASK)
        if (
            imm & _BAD_IMM_BITS
            # posted - ungranted = the peer's credits + frames and grants in flight: this frame must be one
            # of them. (ungranted >= 0, so this also means a receive is posted: no RNR.)
            or s.posted <= s.ungranted
            or send_credits > s.peer_depth
            or not 0 <= byte_len <= s.slot_size
        ):
            self._reject(imm, byte_len)
        kind = imm >> _KIND_SHIFT
        if kind == _K_END:
            if s.peer_eof or s.recv_message_bytes + byte_len > s.local_max:
                self._reject(imm, byte_len)
            s.bytes_received += byte_len
            s.messages_received += 1
            if s.recv_in_message:
                s.recv_in_message = 0
                s.recv_message_bytes = 0
            result = _DATA_END
        elif kind == _K_MORE:
            size = s.recv_message_bytes + byte_len
            if s.peer_eof or size > s.local_max:
                self._reject(imm, byte_len)
            s.bytes_received += byte_len
            s.recv_in_message = 1
            s.recv_message_bytes = size
            result = _DATA_MORE
        elif kind == _K_CREDIT:
            if byte_len:
                self._reject(imm, byte_len)
            s.credit_frames_received += 1
            s.ungranted_ctl += 1  # its slot is re-posted at once: owed, but no reason for a CREDIT frame
            result = _CREDIT
        elif kind == _K_BATCH:
            if not s.batching or s.peer_eof or s.recv_in_message or byte_len < BATCH_RECORD_HEADER:
                self._reject(imm, byte_len)
            s.batch_frames_received += 1
            s.batch_pending = byte_len
            result = _DATA_BATCH
        elif kind == _K_EOF:
            if byte_len or s.peer_eof or s.recv_in_message:
                self._reject(imm, byte_len)
            s.peer_eof = 1
            self._close.on_peer_eof()
            result = _EOF_KIND
        elif kind == _K_RNDV:
            if not s.rndv or s.peer_eof or s.recv_in_message or not byte_len:
                self._reject(imm, byte_len)
            result = _RNDV
        else:
            self._reject(imm, byte_len)
        s.posted -= 1
        s.send_credits = send_credits
        s.frames_received += 1
        return result

    def on_batch(self, payload: BytesLike) -> list[bytes]:
        """Unpack the payload of the DATA_BATCH frame :meth:`on_frame` just accepted; return its messages.

        ``payload`` is the frame's ``byte_len`` bytes of the receive slot (a memoryview slice is fine; the
        messages are copied, so the slot may be reposted at once). Raises :class:`FrameError` (or
        :class:`ReceivedMessageTooLargeError` for a message above our ``max_message_size``) if the payload is
        malformed - the session is then aborted - and RuntimeError if no DATA_BATCH frame is waiting for
        it or ``payload`` has a different length.
        """
        s = self._s
        expected = s.batch_pending
        if expected < 0:
            raise RuntimeError("on_batch() called without a DATA_BATCH frame from on_frame()")
        if len(payload) != expected:
            raise RuntimeError(f"on_batch() got {len(payload)} bytes, the DATA_BATCH frame had {expected}")
        s.batch_pending = -1
        try:
            messages = unpack_batch(payload, s.local_max)
        except ProtocolError as exc:
            self.abort(exc)
            raise
        count = len(messages)
        s.messages_received += count
        s.batched_messages_received += count
        s.bytes_received += expected - BATCH_RECORD_HEADER * count
        return messages

    def _reject(self, imm: int, byte_len: int) -> NoReturn:
        """Abort with the protocol violation the received frame commits, and raise it (slow path only)."""
        exc = self._frame_error(imm, byte_len)
        self.abort(exc)
        raise exc

    def _frame_error(self, imm: int, byte_len: int) -> ProtocolError:
        """The error that an invalid received frame commits: the first failing check, in a fixed order."""
        s = self._s
        try:
            kind, credits = decode_imm(imm)
        except FrameError as exc:
            return exc
        name = kind.name
        if kind is FrameKind.RECLAIM or kind is FrameKind.RETURN:  # shared receive queues (FEATURE_RECLAIM)
            return FrameError(f"{name} frame although FEATURE_RECLAIM was not negotiated")
        is_data = kind in (_DATA_MORE, _DATA_END, _DATA_BATCH, _RNDV)
        if s.posted <= 0:
            return FrameError(
                f"{name} frame arrived with no receive posted (RNR): the peer overran its credits"
            )
        # Stricter than posted > 0, which misses a peer that uses slots we reposted but never granted.
        if s.posted - s.ungranted <= 0:
            return FrameError(f"{name} frame arrived although the peer held no credit for it")
        if not 0 <= byte_len <= s.slot_size:
            return FrameError(f"{name} frame of {byte_len} bytes exceeds the slot size of {s.slot_size}")
        if not is_data and byte_len != 0:
            return FrameError(f"{name} frame carries {byte_len} payload bytes, it must carry none")
        if s.send_credits + credits > s.peer_depth:
            return FrameError(
                f"peer granted {credits} credits, more than its recv_depth {s.peer_depth} allows "
                f"(we hold {s.send_credits})"
            )
        if is_data and s.peer_eof:
            return FrameError(f"{name} frame after the peer's EOF")
        if kind is _DATA_BATCH:
            if not s.batching:
                return FrameError("DATA_BATCH frame although batching was not negotiated")
            if s.recv_in_message:
                return FrameError("DATA_BATCH frame in the middle of a message (DATA_END missing)")
            if byte_len < BATCH_RECORD_HEADER:
                return FrameError(f"DATA_BATCH frame of {byte_len} bytes is too short for one record")
        elif kind is _RNDV:
            if not s.rndv:
                return FrameError("RNDV frame although rendezvous was not negotiated")
            if s.recv_in_message:
                return FrameError("RNDV frame in the middle of a message (DATA_END missing)")
            if not byte_len:
                return FrameError("RNDV frame without a descriptor")
        elif is_data:
            size = s.recv_message_bytes + byte_len
            if size > s.local_max:
                return ReceivedMessageTooLargeError(
                    f"peer sent a message of at least {size} bytes, more than our maximum message size "
                    f"of {s.local_max} bytes"
                )
        elif kind is _EOF_KIND:
            if s.peer_eof:
                return FrameError("second EOF frame from the peer")
            if s.recv_in_message:
                return FrameError("EOF frame in the middle of a message (DATA_END missing)")
        # Unreachable while the fast path in on_frame and these checks agree (the tests hold them to it).
        return ProtocolError(f"frame {imm:#010x} of {byte_len} bytes rejected")  # pragma: no cover

    def on_slot_used(self) -> None:
        """A receive completed for a WRITE-with-immediate or a one-sided control message of the peer.

        Raises :class:`FrameError` (and aborts) if the peer held no credit for it.
        """
        if self._s.posted - self._s.ungranted <= 0:
            exc = FrameError("a one-sided request consumed a receive the peer held no credit for")
            self.abort(exc)
            raise exc
        self._s.posted -= 1
        self._s.onesided_received += 1

    # -- control frames of protocol extensions ------------------------------------------------------------
    # The reclaim protocol (rdmaio.protocol.reclaim) adds two control frames and a window that shrinks.
    # These are the accounting steps it is built from: its rules stay in its module, the fields in this one.

    def can_send_control(self) -> bool:
        """True if a control frame that grants every credit owed may be posted now: the transport is usable
        and two credits are held, or only the last one if the frame grants one back (the rule of EOF)."""
        return not self._s.wire_down and (
            self._s.send_credits >= 2 or (self._s.send_credits == 1 and self._s.ungranted >= 1)
        )

    def take_control_frame(self, imm_bits: int, give_back: int = 0) -> int:
        """Account for a control frame about to be posted and return its immediate value: ``imm_bits`` (its
        kind and fields of its own) with every credit owed granted. It costs one credit, plus ``give_back``
        credits it hands back to the peer. The caller has checked that the frame may be sent."""
        grant = self._grant_owed(MAX_CREDITS)
        self._s.send_credits -= 1 + give_back
        self._s.min_send_credits = min(self._s.min_send_credits, self._s.send_credits)
        self._s.frames_sent += 1
        return imm_bits | grant

    def check_control_frame(self, imm: int, byte_len: int, name: str) -> None:
        """The checks every received control frame of an extension passes, in :meth:`on_frame`'s order: the
        peer held a credit for it, it carries no payload, its grant stays within the peer's recv_depth. A
        failure aborts the session and raises :class:`FrameError` (``name`` is the frame's, for the message).
        """
        if self._s.posted <= self._s.ungranted:
            self._abort_frame(f"{name} frame arrived although the peer held no credit for it")
        if byte_len:
            self._abort_frame(f"{name} frame carries {byte_len} payload bytes, it must carry none")
        if self._s.send_credits + (imm & _CREDIT_MASK) > self._s.peer_depth:
            self._abort_frame(
                f"peer granted {imm & _CREDIT_MASK} credits, more than its recv_depth {self._s.peer_depth}"
            )

    def count_control_frame(self, imm: int, given_back: int = 0) -> None:
        """Apply a received control frame that passed every check: its receive was consumed, its grant is
        ours, and ``given_back`` posted receives the peer held credits for leave the window (the default
        threshold follows the window)."""
        self._s.posted -= given_back + 1
        if given_back:
            self._s.recv_depth -= given_back
            if self._s.default_threshold:
                self._s.threshold = self._s.recv_depth // 2
        self._s.send_credits += imm & _CREDIT_MASK
        self._s.frames_received += 1

    def shrink_receives(self, n: int) -> None:
        """``n`` consumed receives leave the window instead of being reposted (the inverse of
        :meth:`grow_receives`, for a window lent from a shared pool); the default threshold follows."""
        if not 0 <= n <= self._s.recv_depth - self._s.posted:
            raise ValueError(
                f"cannot shrink by {n}: {self._s.recv_depth - self._s.posted} consumed and unreposted"
            )
        self._s.recv_depth -= n
        if self._s.default_threshold:
            self._s.threshold = self._s.recv_depth // 2

    def _abort_frame(self, message: str) -> NoReturn:
        exc = FrameError(message)
        self.abort(exc)
        raise exc
