"""Sans-IO rendezvous: the descriptor of a large message and the per-message states of both sides.

Zero-copy large messages. When both handshakes announce :data:`~rdmaio.protocol.FEATURE_RNDV`, a
``send()`` of at least ``Options.rndv_threshold`` bytes does not copy the message into send slots. The
sender registers the caller's buffer for remote READ (its own memory region, for this transfer only) and
sends one RNDV frame whose payload is a :class:`Descriptor` (address, length, rkey, message id). The frame
travels in the send queue's order, so the message keeps its place among the eager ones. The receiver pulls
the data with RDMA READ (UCX calls this rendezvous "get") - straight into the buffer of a waiting
``recv_into()``, or into rdmaio's memory - and answers with a DONE control message; the sender's ``send()``
returns on it and deregisters the region, so the caller's buffer is never copied and is free when
``send()`` returns or raises.

Control messages (ACK and cancellation) are one-sided control messages of :mod:`rdmaio.core.onesided` (a SEND
without immediate data, paid with a credit, kinds from :data:`~rdmaio.core.onesided.CTL_FIRST_EXTERNAL`) whose
64-bit value is the message id: they need no ordering with the data and may be sent after EOF.

Cancellation (decided: *the cancellation waits for the peer*, never a withdrawn READ). An RC queue pair that
meets a remote access error goes to the error state, so a READ of a deregistered region would cost the
receiver its connection; instead:

* a descriptor still queued locally (never posted) is turned into a WITHDRAWN descriptor in place (the
  frame still goes out, as its credit was counted, and the receiver ignores it) and the region is
  deregistered at once: the peer never learned the rkey;
* a posted descriptor is followed by a CANCEL. The receiver withdraws the message if it has not started
  pulling it (answer WITHDRAWN) or finishes the READ and delivers it whole (answer DONE); the cancelled
  ``send()`` waits for that answer (at most ``Options.close_timeout``; then the connection is failed,
  which destroys the queue pair) before it deregisters and lets the cancellation propagate. The CANCEL is
  posted after the descriptor on the same queue pair, so the receiver always sees the descriptor first.

So a cancelled ``send()`` delivers the whole message or nothing, as an eager one, and the peer never reads
memory the caller got back.

Everything in this module is pure bookkeeping: the I/O is :mod:`rdmaio.core.rendezvous`'s.
"""

from __future__ import annotations

import collections
import enum
import struct
from dataclasses import dataclass
from typing import Any, Final

from rdmaio.errors import FrameError, ProtocolError
from rdmaio.protocol.frames import ReceivedMessageTooLargeError
from rdmaio.protocol.rxbuffer import Placeholder

__all__ = [
    "CTL_CANCEL",
    "CTL_DONE",
    "CTL_WITHDRAWN",
    "DESCRIPTOR_SIZE",
    "DESCRIPTOR_VERSION",
    "Descriptor",
    "Incoming",
    "Outgoing",
    "RecvState",
    "RecvTable",
    "SendState",
    "SendTable",
]

DESCRIPTOR_VERSION: Final = 1
"""Version byte of an RNDV frame's payload."""
# version u8, type u8, reserved u16 (0), rkey u32, message id u64, address u64, length u64; network order.
_DESC: Final = struct.Struct("!BBHIQQQ")
DESCRIPTOR_SIZE: Final = _DESC.size
"""Bytes of an RNDV frame's payload (32)."""
_TYPE_REQUEST: Final = 1
_TYPE_WITHDRAWN: Final = 2
_U64: Final = (1 << 64) - 1

CTL_DONE: Final = 16
"""Control kind, receiver to sender: the message was pulled and delivered; the region may go."""
CTL_WITHDRAWN: Final = 17
"""Control kind, receiver to sender: the message was withdrawn after a CANCEL, never read."""
CTL_CANCEL: Final = 18
"""Control kind, sender to receiver: the ``send()`` was cancelled; withdraw the message if not started."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What the receiver needs to pull one message: ``length`` bytes at ``addr`` under ``rkey``."""

    msg_id: int
    addr: int
    length: int
    rkey: int
    withdrawn: bool = False

    def encode(self) -> bytes:
        """The RNDV frame's payload (:data:`DESCRIPTOR_SIZE` bytes)."""
        kind = _TYPE_WITHDRAWN if self.withdrawn else _TYPE_REQUEST
        return _DESC.pack(DESCRIPTOR_VERSION, kind, 0, self.rkey, self.msg_id, self.addr, self.length)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, max_message_size: int) -> Descriptor:
        """Parse an RNDV frame's payload from an untrusted peer; :class:`FrameError` if malformed,
        :class:`~rdmaio.protocol.ReceivedMessageTooLargeError` above ``max_message_size``."""
        if len(data) != DESCRIPTOR_SIZE:
            raise FrameError(f"RNDV frame of {len(data)} bytes (a descriptor is {DESCRIPTOR_SIZE})")
        version, kind, reserved, rkey, msg_id, addr, length = _DESC.unpack(bytes(data))
        if version != DESCRIPTOR_VERSION:
            raise FrameError(f"unsupported rendezvous descriptor version {version}")
        if reserved or kind not in (_TYPE_REQUEST, _TYPE_WITHDRAWN):
            raise FrameError(f"malformed rendezvous descriptor (type {kind}, reserved {reserved:#x})")
        if kind == _TYPE_WITHDRAWN:
            return cls(msg_id, 0, 0, 0, withdrawn=True)
        if length > max_message_size:
            raise ReceivedMessageTooLargeError(
                f"peer announced a message of {length} bytes, more than our maximum message size of "
                f"{max_message_size} bytes"
            )
        if length < 1 or addr + length - 1 > _U64:
            raise FrameError(f"rendezvous descriptor with an impossible range ({length} bytes at {addr:#x})")
        return cls(msg_id, addr, length, rkey)

    def withdraw_in_place(self, encoded: bytearray) -> None:
        """Turn the encoded descriptor ``encoded`` (still queued, not posted) into a WITHDRAWN one: the
        rkey and address are zeroed, so the frame tells the peer nothing about our memory."""
        encoded[:] = Descriptor(self.msg_id, 0, 0, 0, withdrawn=True).encode()


# --- sender -------------------------------------------------------------------------------------------------


class SendState(enum.Enum):
    """Life cycle of one rendezvous send."""

    QUEUED = "queued"  # descriptor in the send queue, not posted: the peer knows nothing
    POSTED = "posted"  # descriptor posted: the peer may be reading the buffer
    CANCELLING = "cancelling"  # CANCEL sent, waiting for DONE or WITHDRAWN
    DONE = "done"  # the peer pulled it (DONE)
    WITHDRAWN = "withdrawn"  # withdrawn (locally before posting, or by the peer after a CANCEL)
    FAILED = "failed"  # the connection failed first


class Outgoing:
    """One rendezvous send in progress (``waiter`` and ``region`` belong to the I/O layer)."""

    __slots__ = ("length", "msg_id", "region", "state", "waiter")

    def __init__(self, msg_id: int, length: int) -> None:
        self.msg_id = msg_id
        self.length = length
        self.state = SendState.QUEUED
        self.waiter: Any = None
        self.region: Any = None

    @property
    def finished(self) -> bool:
        """True once the peer can no longer read the buffer through this transfer."""
        return self.state in (SendState.DONE, SendState.WITHDRAWN, SendState.FAILED)


class SendTable:
    """The rendezvous sends of one connection, by message id."""

    def __init__(self) -> None:
        self._next_id = 1
        self.active: dict[int, Outgoing] = {}

    def start(self, length: int) -> Outgoing:
        """A new send of ``length`` bytes (its descriptor is about to be queued)."""
        if length < 1:
            raise ValueError("a rendezvous message has at least one byte")
        out = Outgoing(self._next_id, length)
        self._next_id = (self._next_id + 1) & _U64 or 1
        self.active[out.msg_id] = out
        return out

    def posted(self, out: Outgoing) -> None:
        """Its descriptor was posted (or at least staged for posting)."""
        if out.state is SendState.QUEUED:
            out.state = SendState.POSTED

    def cancel(self, out: Outgoing) -> bool:
        """The ``send()`` was cancelled: True if a CANCEL must be sent and answered (descriptor posted),
        False if it was withdrawn locally (queued: the caller withdraws the encoded descriptor) or had
        already finished."""
        if out.state is SendState.QUEUED:
            out.state = SendState.WITHDRAWN
            self.active.pop(out.msg_id, None)
            return False
        if out.state is SendState.POSTED:
            out.state = SendState.CANCELLING
            return True
        return False

    def on_control(self, kind: int, msg_id: int) -> Outgoing:
        """The peer answered DONE or WITHDRAWN for ``msg_id``; :class:`ProtocolError` if that answer is
        impossible (unknown id, WITHDRAWN without a CANCEL)."""
        out = self.active.get(msg_id)
        # (QUEUED is fine: the I/O layer marks a send POSTED only when it needs to know, on cancellation.)
        if out is None:
            raise ProtocolError(f"rendezvous answer {kind} for message {msg_id}, which is not in flight")
        if kind == CTL_DONE:
            out.state = SendState.DONE
        elif kind == CTL_WITHDRAWN and out.state is SendState.CANCELLING:
            out.state = SendState.WITHDRAWN
        else:
            raise ProtocolError(f"rendezvous answer {kind} for message {msg_id} in state {out.state.value}")
        del self.active[msg_id]
        return out

    def finish(self, out: Outgoing) -> None:
        """Forget a send (it ended locally: an error or a timeout)."""
        self.active.pop(out.msg_id, None)

    def fail_all(self) -> list[Outgoing]:
        """The connection failed: every send in progress is FAILED (its region can go once the QP is gone)."""
        failed = list(self.active.values())
        for out in failed:
            out.state = SendState.FAILED
        self.active.clear()
        return failed


# --- receiver -----------------------------------------------------------------------------------------------


class RecvState(enum.Enum):
    """Life cycle of one announced message on the receiving side."""

    QUEUED = "queued"  # announced, not pulled (its placeholder keeps its place among the messages)
    PULLING = "pulling"  # READ in flight
    DONE = "done"  # pulled (DONE answered)
    WITHDRAWN = "withdrawn"  # the sender cancelled before we started (WITHDRAWN answered)
    FAILED = "failed"  # the connection failed


class Incoming(Placeholder):
    """One announced message: the placeholder in the receive buffer (the other fields are the I/O layer's)."""

    __slots__ = ("cancel_requested", "data", "desc", "error", "event", "into", "state")

    def __init__(self, desc: Descriptor) -> None:
        super().__init__(desc.length)
        self.desc = desc
        self.state = RecvState.QUEUED
        self.cancel_requested = False
        self.event: Any = None  # set when the pull ends (done or failed)
        self.into: Any = None  # the caller's buffer when pulled straight into a recv_into() buffer
        self.data: bytes | None = None
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"<rendezvous message {self.desc.msg_id} {self.length} bytes {self.state.value}>"


class RecvTable:
    """The announced messages of one connection not answered yet, by id, and those not pulled yet in the
    order they came (:meth:`next_queued`: O(1) amortized, whatever the number announced)."""

    def __init__(self, max_message_size: int) -> None:
        self.max_message_size = max_message_size
        self.active: dict[int, Incoming] = {}
        # QUEUED messages in arrival order; those that left QUEUED meanwhile are dropped when met.
        self._queued: collections.deque[Incoming] = collections.deque()

    def next_queued(self) -> Incoming | None:
        """The first announced message not pulled (nor withdrawn) yet, or None."""
        queued = self._queued
        while queued and queued[0].state is not RecvState.QUEUED:
            queued.popleft()
        return queued[0] if queued else None

    def on_descriptor(self, payload: bytes | bytearray | memoryview) -> Incoming | None:
        """An RNDV frame arrived: its message (None for a WITHDRAWN descriptor: nothing to do)."""
        desc = Descriptor.decode(payload, self.max_message_size)
        if desc.withdrawn:
            return None
        if desc.msg_id in self.active:
            raise FrameError(f"rendezvous message id {desc.msg_id} announced twice")
        msg = Incoming(desc)
        self.active[desc.msg_id] = msg
        self._queued.append(msg)
        return msg

    def start_pull(self, msg: Incoming) -> None:
        """The READ is about to be posted."""
        if msg.state is not RecvState.QUEUED:
            raise RuntimeError(f"cannot pull {msg!r}")
        msg.state = RecvState.PULLING

    def pulled(self, msg: Incoming) -> int:
        """The READ completed: the message is delivered; return the control kind to answer (DONE)."""
        msg.state = RecvState.DONE
        self.active.pop(msg.desc.msg_id, None)
        return CTL_DONE

    def on_cancel(self, msg_id: int) -> Incoming | None:
        """The sender cancelled ``msg_id``: the message to withdraw now (answer WITHDRAWN), or None if the
        READ is in flight (it will be answered DONE when it ends) or the message was already answered."""
        msg = self.active.get(msg_id)
        if msg is None:
            return None  # already pulled and answered: the DONE is on its way
        if msg.state is RecvState.QUEUED:
            msg.state = RecvState.WITHDRAWN
            del self.active[msg_id]
            return msg
        msg.cancel_requested = True
        return None

    def fail_all(self) -> list[Incoming]:
        """The connection failed: every message not answered is FAILED."""
        failed = list(self.active.values())
        for msg in failed:
            msg.state = RecvState.FAILED
        self.active.clear()
        self._queued.clear()
        return failed
