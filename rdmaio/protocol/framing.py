"""The framing a connection uses, negotiated from both handshakes' capabilities (sans-IO).

Two framings carry the same 32-bit frame word (kind, credits, RETURN count: :mod:`rdmaio.protocol.frames`):

* **immediate** (the default where both devices offer immediate data): every frame is one SEND with
  immediate data, the word is the immediate value; one-sided control messages are SENDs *without*
  immediate data and write notices RDMA WRITEs with immediate data.
* **header** (when either side's device lacks immediate data, i.e. iWARP, or either side forces it with
  ``Options.framing = "header"``): every frame is a plain SEND whose payload starts with the word as 4
  bytes in network byte order (:data:`FRAME_HEADER`), the frame's payload after it; a slot therefore
  carries ``slot_size - FRAME_HEADER`` payload bytes. One-sided control messages are plain SENDs too,
  told apart by their own kind in the header (:data:`CONTROL_KIND`, every other bit 0).

The receive side turns a header-framed receive back into what the immediate framing delivers
(:func:`unframe_receive`: the word as the immediate value, the payload moved to the slot's start, the
length without the header), so the frame rules and every reader of a slot are the same in both framings.
The C port of it is ``rdmaio_rx_unframe`` (rdmaio/_ffi/session.c); a unit test holds the two together.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from rdmaio.errors import HandshakeError
from rdmaio.protocol.handshake import Capabilities, Handshake

__all__ = [
    "CONTROL_KIND",
    "CONTROL_WORD",
    "FRAME_HEADER",
    "IMMEDIATE_FRAMING",
    "Framing",
    "encode_frame_header",
    "negotiate_framing",
    "unframe_receive",
]

FRAME_HEADER: Final = 4
"""Bytes of the frame header in front of every SEND's payload in the header framing."""
CONTROL_KIND: Final = 9
"""Kind (bits 31..28 of the header) of a one-sided control message in the header framing."""
CONTROL_WORD: Final = CONTROL_KIND << 28
"""The whole header of a one-sided control message (it carries no credits)."""
_WORD: Final = struct.Struct("!I")
_WC_WITH_IMM: Final = 1 << 1  # IBV_WC_WITH_IMM (a unit test checks it against the verbs constant)
_REJECTED_WORD: Final = 0  # kind 0: the frame rules reject it as an unknown frame kind


@dataclass(frozen=True, slots=True)
class Framing:
    """The framing of one connection, negotiated once (:func:`negotiate_framing`).

    ``immediate``: frames are SENDs with immediate data (else the header framing); ``header``: the bytes
    of the frame header in every SEND's payload (0 or :data:`FRAME_HEADER`); ``local``/``peer``: the
    capabilities each side announced (None: not announced, an older rdmaio)."""

    immediate: bool
    header: int
    name: str
    """``"immediate"`` or ``"header"``."""
    local: Capabilities | None = None
    peer: Capabilities | None = None


IMMEDIATE_FRAMING: Final = Framing(True, 0, "immediate")
"""The framing of a connection where neither side announced capabilities (both immediate)."""


def negotiate_framing(local: Handshake, peer: Handshake) -> Framing:
    """The framing of a connection between handshakes ``local`` and ``peer``: the header framing if either
    side's device lacks immediate data or either side asks for it, else the immediate framing.

    Raises :class:`HandshakeError` if the header framing is needed and a side did not announce
    capabilities (an rdmaio that predates the header framing cannot use it)."""
    mine = local.caps
    theirs = peer.caps
    if mine is None and theirs is None:
        return IMMEDIATE_FRAMING
    # No generator or helper call: connection setup's Python calls are budgeted.
    need_header = (mine is not None and (not mine.immediate or mine.header_framing)) or (
        theirs is not None and (not theirs.immediate or theirs.header_framing)
    )
    if not need_header:
        return Framing(True, 0, "immediate", mine, theirs)
    if theirs is None:
        reason = (
            "our device has no immediate data"
            if mine is not None and not mine.immediate
            else "Options.framing is 'header'"
        )
        raise HandshakeError(
            f"the header framing is needed ({reason}) and the peer's rdmaio does not support it "
            "(no capabilities in its handshake)"
        )
    if mine is None:
        raise HandshakeError("the peer needs the header framing and this side did not announce it")
    return Framing(False, FRAME_HEADER, "header", mine, theirs)


def encode_frame_header(word: int) -> bytes:
    """The 4 header bytes of a frame whose immediate value would be ``word`` (network byte order)."""
    return _WORD.pack(word)


def unframe_receive(flags: int, byte_len: int, slot: bytearray | memoryview) -> tuple[int, int, int]:
    """A successful plain receive (IBV_WC_RECV) of the header framing made into what the immediate framing
    delivers: returns ``(flags, imm, byte_len)`` and moves the payload to the start of ``slot`` (the
    receive slot's bytes). The reference model of C's ``rdmaio_rx_unframe``.

    A frame: the header is the immediate value (``flags`` gains IBV_WC_WITH_IMM). A control message (the
    header is :data:`CONTROL_WORD`): no immediate data, as the immediate framing delivers it. Anything
    malformed - shorter than the header, a control header with other bits, a SEND *with* immediate data
    (never sent in this framing) - becomes a frame of kind 0 and no payload, which the frame rules reject.
    """
    if flags & _WC_WITH_IMM or byte_len < FRAME_HEADER or byte_len > len(slot):
        return flags | _WC_WITH_IMM, _REJECTED_WORD, 0
    (word,) = _WORD.unpack_from(slot, 0)
    n = byte_len - FRAME_HEADER
    if word >> 28 == CONTROL_KIND:
        if word != CONTROL_WORD:
            return flags | _WC_WITH_IMM, _REJECTED_WORD, 0
        slot[0:n] = bytes(slot[FRAME_HEADER:byte_len])
        return flags, 0, n
    slot[0:n] = bytes(slot[FRAME_HEADER:byte_len])
    return flags | _WC_WITH_IMM, word, n
