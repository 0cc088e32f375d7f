"""Sans-IO core of one rdmaio connection: handshake, frame encoding, credit flow control and close states.

Nothing in this module does I/O. The I/O layer posts RDMA SEND-with-immediate work requests and receive
buffers; it asks a :class:`Session` which 32-bit immediate value to attach to every frame it sends and feeds
it every received ``(imm, byte_len)``. Keeping the rules here makes them testable without an RDMA device.

Wire format
-----------
A frame is one SEND with immediate data (or, in the header framing of :mod:`rdmaio.protocol.framing`, a
plain SEND whose first 4 payload bytes carry the same value in network byte order). The immediate value
(host order) is laid out as::

    bits 31..28  kind      (FrameKind)
    bits 27..16  reserved  (must be 0)
    bits 15..0   credits   granted to the receiver of this frame

Every SEND consumes one receive buffer ("slot") that the peer posted. The peer advertises ``recv_depth``
slots of ``slot_size`` bytes each in the :class:`Handshake` (rdma_cm private data); a message larger than
one slot travels as DATA_MORE fragments followed by one DATA_END.

If both handshakes announce :data:`FEATURE_BATCH`, a DATA_BATCH frame may carry several complete messages in
one slot: its payload is a sequence of records ``[u32 little-endian length][bytes]`` (see
:func:`pack_batch_into` and :func:`unpack_batch`). A DATA_BATCH frame is a frame like any other (one slot,
one credit, the two-credit rule of DATA frames) and may not arrive between a DATA_MORE and its DATA_END:
messages are never interleaved.

Flow control and liveness
-------------------------
A sender holds one credit per peer slot it knows to be posted and free. Whenever the I/O layer reposts slots
(:meth:`Session.on_recv_reposted`) they become *ungranted* credits; every frame we send piggybacks all of
them, and a standalone CREDIT frame is sent once ``credit_threshold`` have accumulated.

* No RNR: a frame is only sent while holding a credit, and a credit only exists for a posted slot.
* Reserve: DATA frames need two credits, so one credit is always left for a control frame. A frame may use
  the *last* credit only if it grants at least one credit itself (CREDIT frames always do; EOF must).
* No deadlock: suppose nothing is in flight and both applications have consumed everything, so every slot
  is reposted. Then ``peer.ungranted == peer.recv_depth - our.send_credits``. If we are stuck (fewer than
  two credits), the peer owes us at least ``recv_depth - 1 >= threshold`` credits, so its CREDIT frame is
  due as soon as it holds one credit. Both sides cannot hold zero: a side left with zero received no grant
  after its last send, and that send, having taken the last credit, granted at least one. Whichever of
  the two last sends came later delivers its grant after the other's last send - a contradiction. So one
  side can always send a CREDIT frame, and the other side's answer (it then owes ``recv_depth``) unblocks.
* No ping-pong: a CREDIT frame costs its sender at least ``threshold >= 2`` owed credits and makes the
  receiver owe exactly one more (the slot it consumed, once reposted). While no data flows the total owed
  by both sides therefore drops by at least one per CREDIT frame, so idle peers exchange at most
  ``local.recv_depth + peer.recv_depth`` CREDIT frames and then stop. A threshold of 1 would allow an
  endless exchange, a threshold of ``recv_depth`` could deadlock; hence ``2 <= threshold <= recv_depth-1``
  and the default ``recv_depth // 2`` (``recv_depth >= 4``).

Growing windows
---------------
A side that announces :data:`FEATURE_GROW` posts only ``initial_depth`` receives at first (an idle
connection then pins few buffers) and adds more up to its ``recv_depth`` when it sees load
(:meth:`Session.grow_receives`); the new slots are granted like reposted ones. The peer starts with
``initial_depth`` credits and rejects grants beyond ``recv_depth``. The argument above holds for the current
window at every moment: growth raises the window and the owed credits by the same amount, and the default
threshold is half the current window. ``tests/unit/test_protocol.py`` simulates growth at random moments.

Hot path
--------
:meth:`Session.take_data_frame`, :meth:`Session.on_frame`, :meth:`Session.on_recv_reposted`,
:meth:`Session.can_send_data` and :meth:`Session.credit_frame_due` run once per frame. They work on plain
ints (kinds are decoded with ``imm >> 28`` and compared with module-level constants; :meth:`Session.on_frame`
returns a pre-bound :class:`FrameKind` member, no enum is constructed), validate a frame with one combined
test and only fall back to the slower, message-building checks (``_frame_error``) when that test fails, and
derive rarely-read statistics instead of counting them per frame. Every check of the straightforward version
is still made, in the same order for the purpose of error messages; ``tools/bench_protocol.py`` measures it.

Modules
-------
* :mod:`~rdmaio.protocol.handshake`: the handshake in rdma_cm private data, its limits and feature bits.
* :mod:`~rdmaio.protocol.frames`: frame kinds and credits in immediate values; DATA_BATCH payloads.
* :mod:`~rdmaio.protocol.framing`: the framing negotiated from both sides' device capabilities: SEND with
  immediate data, or the header framing (the same 32-bit word in a 4-byte header of a plain SEND's payload,
  for devices without immediate data: iWARP).
* :mod:`~rdmaio.protocol.session`: the :class:`Session` (credits taken and granted, frames validated and
  counted, receives reposted and grown): one class, so the per-frame path makes no call of its own.
* :mod:`~rdmaio.protocol.sessionstate`: the Session's per-frame counters as one object (``SessionState``);
  the core injects a C struct with the same fields, on which C applies the hot rules (the Session is their
  reference model).
* :mod:`~rdmaio.protocol.closestate`: the close state a Session holds as an object, with its rules as tables.
* :mod:`~rdmaio.protocol.reclaim`: the reclaim protocol of one connection (RECLAIM/RETURN frames, a window
  that shrinks): ``ReclaimSession``.
* :mod:`~rdmaio.protocol.credit_ledger`: the credit ledger of one shared receive queue (per device).
* :mod:`~rdmaio.protocol.shared_session`: the session of a connection on a shared receive queue, reporting
  to the pool's ledger through callbacks.
* :mod:`~rdmaio.protocol.sendqueue`: the send queue (fragmentation, coalescing into DATA_BATCH frames).
* :mod:`~rdmaio.protocol.rxbuffer`: the receive buffer (reassembly, reads, slots back-pressure may hold).
* :mod:`~rdmaio.protocol.rendezvous`: the rendezvous descriptors and transfer states.
"""

from __future__ import annotations

from rdmaio.protocol.frames import (
    BATCH_RECORD_HEADER,
    BytesLike,
    FrameKind,
    ReceivedMessageTooLargeError,
    batch_record_size,
    decode_imm,
    encode_imm,
    pack_batch_into,
    unpack_batch,
)
from rdmaio.protocol.handshake import (
    FEATURE_BATCH,
    FEATURE_GROW,
    FEATURE_ONESIDED,
    FEATURE_RECLAIM,
    FEATURE_RNDV,
    HANDSHAKE_MAGIC,
    KNOWN_FEATURES,
    MAX_CREDITS,
    MAX_MESSAGE_SIZE,
    MAX_PRIVATE_DATA,
    MAX_RECV_DEPTH,
    MAX_SLOT_SIZE,
    MIN_MESSAGE_SIZE,
    MIN_RECV_DEPTH,
    MIN_SLOT_SIZE,
    PROTOCOL_VERSION,
    Capabilities,
    Handshake,
)
from rdmaio.protocol.session import EOF, EOFType, Session, State

__all__ = [
    "BATCH_RECORD_HEADER",
    "EOF",
    "FEATURE_BATCH",
    "FEATURE_GROW",
    "FEATURE_ONESIDED",
    "FEATURE_RECLAIM",
    "FEATURE_RNDV",
    "HANDSHAKE_MAGIC",
    "KNOWN_FEATURES",
    "MAX_CREDITS",
    "MAX_MESSAGE_SIZE",
    "MAX_PRIVATE_DATA",
    "MAX_RECV_DEPTH",
    "MAX_SLOT_SIZE",
    "MIN_MESSAGE_SIZE",
    "MIN_RECV_DEPTH",
    "MIN_SLOT_SIZE",
    "PROTOCOL_VERSION",
    "BytesLike",
    "Capabilities",
    "EOFType",
    "FrameKind",
    "Handshake",
    "ReceivedMessageTooLargeError",
    "Session",
    "State",
    "batch_record_size",
    "decode_imm",
    "encode_imm",
    "pack_batch_into",
    "unpack_batch",
]
