"""The handshake each side sends in the rdma_cm private data (connect and accept), its limits and
feature bits. See :mod:`rdmaio.protocol` for the wire format."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from rdmaio.errors import (
    HandshakeError,
)

PROTOCOL_VERSION: Final = 1
HANDSHAKE_MAGIC: Final = b"RDIO"
MAX_PRIVATE_DATA: Final = 56  # rdma_cm limit for RDMA_PS_TCP connect private data

# recv_depth >= 4 so that the credit reserve (1) and a threshold in 2..recv_depth-1 both fit.
MIN_RECV_DEPTH: Final = 4
MAX_RECV_DEPTH: Final = 0xFFFF
MIN_SLOT_SIZE: Final = 64
MAX_SLOT_SIZE: Final = 16 * 1024 * 1024
MIN_MESSAGE_SIZE: Final = 1
MAX_MESSAGE_SIZE: Final = 2**40
MAX_CREDITS: Final = 0xFFFF  # width of the credit field of the immediate value

FEATURE_BATCH: Final = 0x01
"""Handshake feature bit: this side accepts DATA_BATCH frames (several small messages in one frame)."""
FEATURE_GROW: Final = 0x02
"""Handshake feature bit: this side posts ``initial_depth`` receives at first (an extra body field) and may
grow to ``recv_depth`` later, granting the new slots as credits; it also accepts such a peer."""
FEATURE_ONESIDED: Final = 0x04
"""Handshake feature bit: this side understands the one-sided frames (write notices, RDMA WRITEs with
immediate data, and the REVOKE/REVOKE_ACK control messages; docs/one-sided.md). Without it in the peer's
handshake, rdmaio sends none of them to that peer."""
FEATURE_RNDV: Final = 0x08
"""Handshake feature bit: this side accepts RNDV frames (rendezvous: a large message's descriptor, the data
is pulled with RDMA READ; :mod:`rdmaio.protocol.rendezvous`). Used only if both sides announce it."""
FEATURE_RECLAIM: Final = 0x10
"""Handshake feature bit: this side answers a RECLAIM frame with a RETURN frame that gives back the credits
it holds beyond a small reserve, and accepts both frames (a receiver drawing credits from a shared receive
queue uses them to take back idle credits; :mod:`rdmaio.protocol.reclaim`). Used only if both sides
announce it."""
FLAG_SOFTWARE: Final = 0x80
"""Handshake flag (not a feature: nothing is negotiated by it): the body ends with the sender's software
version, a length byte and up to :data:`MAX_SOFTWARE` ASCII bytes (``Handshake.software``). A peer that does
not know the flag ignores it and the field (bytes beyond what it reads are ignored)."""
FLAG_CAPS: Final = 0x40
"""Handshake flag (not a feature bit): the body ends with the sender's device capabilities
(:class:`Capabilities`, 4 bytes, after the software version if both are present). Its presence also says
the sender understands the header framing (:mod:`rdmaio.protocol.framing`). A peer that does not know the
flag ignores it and the bytes (an older peer is taken to offer immediate data only)."""
MAX_SOFTWARE: Final = 20
"""The most bytes of ``Handshake.software`` sent (longer versions are cut): the largest handshake, 28 bytes
with FEATURE_GROW, plus the version (1 + 20) and the capabilities (4), is 53 bytes, within
:data:`MAX_PRIVATE_DATA`. (24 before the capabilities were added: an older peer reads either.)"""
CAP_IMMEDIATE: Final = 0x01
"""Capability bit: the device sends and receives SEND/RDMA WRITE with immediate data (not iWARP)."""
CAP_ATOMICS: Final = 0x02
"""Capability bit: the device offers RDMA atomics (``atomic_cap`` not NONE)."""
CAP_MEMORY_WINDOWS: Final = 0x04
"""Capability bit: the device allocates memory windows (``max_mw`` > 0)."""
CAP_HEADER_FRAMING: Final = 0x08
"""Capability bit: this side asks for the header framing (``Options.framing == "header"``)."""
_KNOWN_CAPS: Final = CAP_IMMEDIATE | CAP_ATOMICS | CAP_MEMORY_WINDOWS | CAP_HEADER_FRAMING
KNOWN_FEATURES: Final = FEATURE_BATCH | FEATURE_GROW | FEATURE_ONESIDED | FEATURE_RNDV | FEATURE_RECLAIM
"""Every feature bit this version knows; other bits of the handshake's flags byte are ignored on receipt."""
# Header: magic, version, flags (feature bits, see KNOWN_FEATURES; unknown bits are ignored on receipt so
# that a later version can add features compatibly), body length.
_HEADER: Final = struct.Struct("!4sBBH")
# Version 1 body: recv_depth, slot_size, max_message_size. Wider than the ranges so that decode can see
# and reject out-of-range values instead of silently truncating them.
_BODY_V1: Final = struct.Struct("!IIQ")
# FEATURE_GROW extension, appended to the version 1 body: the receives posted at first.
_BODY_GROW: Final = struct.Struct("!I")
# FLAG_SOFTWARE extension, after the others: the length of the version string (its bytes follow).
_SOFTWARE_LEN: Final = struct.Struct("!B")
# FLAG_CAPS extension, last: capability bits, max inline bytes, READ scatter entries.
_CAPS: Final = struct.Struct("!BHB")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one side's device offers (announced in the handshake with :data:`FLAG_CAPS`).

    ``immediate``: SEND/RDMA WRITE with immediate data (false on iWARP); ``atomics``: RDMA atomics;
    ``memory_windows``: memory windows; ``max_inline``: inline bytes per send its queue pair takes (0..65535);
    ``max_read_sge``: scatter entries of one RDMA READ (0..255); ``header_framing``: this side asks for
    the header framing (``Options.framing == "header"``), whatever its device offers."""

    immediate: bool = True
    atomics: bool = True
    memory_windows: bool = True
    max_inline: int = 0
    max_read_sge: int = 1
    header_framing: bool = False

    def encode(self) -> bytes:
        """The 4 bytes of the FLAG_CAPS extension (sizes past their field are clamped)."""
        bits = (
            (CAP_IMMEDIATE if self.immediate else 0)
            | (CAP_ATOMICS if self.atomics else 0)
            | (CAP_MEMORY_WINDOWS if self.memory_windows else 0)
            | (CAP_HEADER_FRAMING if self.header_framing else 0)
        )
        return _CAPS.pack(bits, min(max(self.max_inline, 0), 0xFFFF), min(max(self.max_read_sge, 0), 0xFF))

    @classmethod
    def decode(cls, data: bytes, offset: int) -> Capabilities:
        """The capabilities at ``offset`` of ``data`` (unknown bits are ignored: later versions may add)."""
        bits, max_inline, max_read_sge = _CAPS.unpack_from(data, offset)
        return cls(
            bool(bits & CAP_IMMEDIATE),
            bool(bits & CAP_ATOMICS),
            bool(bits & CAP_MEMORY_WINDOWS),
            max_inline,
            max_read_sge,
            bool(bits & CAP_HEADER_FRAMING),
        )


def _check_fields(recv_depth: int, slot_size: int, max_message_size: int) -> None:
    """Raise HandshakeError if a handshake field is outside the range this version allows."""
    for name, value, low, high in (
        ("recv_depth", recv_depth, MIN_RECV_DEPTH, MAX_RECV_DEPTH),
        ("slot_size", slot_size, MIN_SLOT_SIZE, MAX_SLOT_SIZE),
        ("max_message_size", max_message_size, MIN_MESSAGE_SIZE, MAX_MESSAGE_SIZE),
    ):
        if not low <= value <= high:
            raise HandshakeError(f"{name} {value} is out of range {low}..{high}")


@dataclass(frozen=True, slots=True)
class Handshake:
    """Connection parameters one side announces in the rdma_cm private data.

    ``recv_depth`` receive buffers of ``slot_size`` bytes each are posted for the peer; ``max_message_size``
    is the largest message this side accepts. ``features`` is a set of feature bits (:data:`FEATURE_BATCH`,
    :data:`FEATURE_GROW`) this side supports; a feature is used only if both sides announce it, except that a
    side announcing :data:`FEATURE_GROW` posts only ``initial_depth`` receives at first (0 means
    ``recv_depth``): its peer starts with that many credits and may be granted up to ``recv_depth``.
    """

    recv_depth: int
    slot_size: int
    max_message_size: int
    version: int = PROTOCOL_VERSION
    features: int = 0
    initial_depth: int = 0
    software: str = ""
    """The sender's rdmaio version (informational: :attr:`rdmaio.PathInfo.peer_version`); ``""`` when the
    peer did not send one (older versions) or sent something that is not printable ASCII."""
    caps: Capabilities | None = None
    """The sender's device capabilities (:data:`FLAG_CAPS`); None when not announced (an older rdmaio:
    immediate data only, no header framing)."""

    def __post_init__(self) -> None:
        for name in ("recv_depth", "slot_size", "max_message_size", "version", "features", "initial_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Handshake.{name} must be an int, not {type(value).__name__}")
        if not isinstance(self.software, str):
            raise TypeError(f"Handshake.software must be a str, not {type(self.software).__name__}")
        if self.initial_depth == 0 or not self.features & FEATURE_GROW:
            object.__setattr__(self, "initial_depth", self.recv_depth)
        elif not MIN_RECV_DEPTH <= self.initial_depth <= self.recv_depth:
            raise HandshakeError(
                f"initial_depth {self.initial_depth} is out of range {MIN_RECV_DEPTH}..{self.recv_depth}"
            )
        if self.version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"unsupported protocol version {self.version} (this side supports {PROTOCOL_VERSION})"
            )
        if not (
            MIN_RECV_DEPTH <= self.recv_depth <= MAX_RECV_DEPTH
            and MIN_SLOT_SIZE <= self.slot_size <= MAX_SLOT_SIZE
            and MIN_MESSAGE_SIZE <= self.max_message_size <= MAX_MESSAGE_SIZE
        ):  # _check_fields() raises the error; called only then (setup's Python calls are budgeted)
            _check_fields(self.recv_depth, self.slot_size, self.max_message_size)
        if self.features & ~KNOWN_FEATURES:
            raise HandshakeError(
                f"unknown feature bits {self.features:#x} (this side knows {KNOWN_FEATURES:#x})"
            )

    def encode(self) -> bytes:
        """Return the private-data bytes (at most :data:`MAX_PRIVATE_DATA`) announcing this handshake."""
        body = _BODY_V1.pack(self.recv_depth, self.slot_size, self.max_message_size)
        if self.features & FEATURE_GROW:
            body += _BODY_GROW.pack(self.initial_depth)
        flags = self.features
        if self.software:
            software = self.software.encode("ascii", "replace")[:MAX_SOFTWARE]
            body += _SOFTWARE_LEN.pack(len(software)) + software
            flags |= FLAG_SOFTWARE
        caps = self.caps
        if caps is not None:
            # Capabilities.encode(), inline: connection setup's Python calls are budgeted.
            body += _CAPS.pack(
                (CAP_IMMEDIATE if caps.immediate else 0)
                | (CAP_ATOMICS if caps.atomics else 0)
                | (CAP_MEMORY_WINDOWS if caps.memory_windows else 0)
                | (CAP_HEADER_FRAMING if caps.header_framing else 0),
                min(max(caps.max_inline, 0), 0xFFFF),
                min(max(caps.max_read_sge, 0), 0xFF),
            )
            flags |= FLAG_CAPS
        return _HEADER.pack(HANDSHAKE_MAGIC, self.version, flags, len(body)) + body

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Handshake:
        """Parse a handshake received from an untrusted peer.

        Bytes beyond the declared length are ignored: rdma_cm pads private data with zeros, and later
        compatible extensions may append fields. Feature bits this version does not know are ignored too (a
        peer that announces a feature we lack simply does not get to use it). Raises
        :class:`HandshakeError` for anything malformed.
        """
        raw = bytes(data)
        if len(raw) < _HEADER.size:
            raise HandshakeError(
                f"handshake too short: {len(raw)} bytes, the header alone needs {_HEADER.size}"
            )
        magic, version, flags, body_len = _HEADER.unpack_from(raw)
        if magic != HANDSHAKE_MAGIC:
            raise HandshakeError(
                f"bad handshake magic {magic!r} (expected {HANDSHAKE_MAGIC!r}): the peer is not rdmaio"
            )
        if version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"unsupported protocol version {version} from the peer "
                f"(this side supports {PROTOCOL_VERSION})"
            )
        if body_len < _BODY_V1.size:
            raise HandshakeError(
                f"handshake declared length {body_len} is too small for version {version} "
                f"(needs at least {_BODY_V1.size})"
            )
        if len(raw) < _HEADER.size + body_len:
            raise HandshakeError(
                f"handshake too short: {len(raw)} bytes, the declared length needs {_HEADER.size + body_len}"
            )
        recv_depth, slot_size, max_message_size = _BODY_V1.unpack_from(raw, _HEADER.size)
        features = flags & KNOWN_FEATURES
        initial_depth = 0
        end = _BODY_V1.size  # of the fields read so far, in the body
        if features & FEATURE_GROW:
            if body_len >= _BODY_V1.size + _BODY_GROW.size:
                (initial_depth,) = _BODY_GROW.unpack_from(raw, _HEADER.size + _BODY_V1.size)
                end += _BODY_GROW.size
            else:
                features &= ~FEATURE_GROW  # the bit without its field: a peer that posted recv_depth
        software = ""
        body_end = _HEADER.size + body_len
        if flags & FLAG_SOFTWARE and body_len > end:
            # From an untrusted peer, and only ever shown: kept if it fits the body, is at most
            # MAX_SOFTWARE bytes and printable ASCII, else dropped rather than failing the connection.
            # (No helper function: connection setup's Python calls are budgeted.)
            first = _HEADER.size + end + 1
            length = raw[first - 1]
            text = raw[first : first + length]
            if length <= MAX_SOFTWARE and first + length <= body_end and text.isascii():
                software = text.decode("ascii")
                if not software.isprintable():
                    software = ""
            end += 1 + length
        caps = None
        if flags & FLAG_CAPS and _HEADER.size + end + _CAPS.size <= body_end:
            # Capabilities.decode(), inline (setup's Python calls are budgeted); unknown bits are ignored.
            bits, max_inline, max_read_sge = _CAPS.unpack_from(raw, _HEADER.size + end)
            caps = Capabilities(
                bool(bits & CAP_IMMEDIATE),
                bool(bits & CAP_ATOMICS),
                bool(bits & CAP_MEMORY_WINDOWS),
                max_inline,
                max_read_sge,
                bool(bits & CAP_HEADER_FRAMING),
            )
        try:
            if not (
                MIN_RECV_DEPTH <= recv_depth <= MAX_RECV_DEPTH
                and MIN_SLOT_SIZE <= slot_size <= MAX_SLOT_SIZE
                and MIN_MESSAGE_SIZE <= max_message_size <= MAX_MESSAGE_SIZE
            ):  # the fields first, before the constructor's other checks; the call only to raise
                _check_fields(recv_depth, slot_size, max_message_size)
            return cls(
                recv_depth, slot_size, max_message_size, version, features, initial_depth, software, caps
            )
        except HandshakeError as exc:
            raise HandshakeError(f"invalid handshake from the peer: {exc.message}") from None
