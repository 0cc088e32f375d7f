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
MAX_SOFTWARE: Final = 24
"""The most bytes of ``Handshake.software`` sent (longer versions are cut): the largest handshake, 28 bytes
with FEATURE_GROW, stays within :data:`MAX_PRIVATE_DATA` with it."""
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
        if flags & FLAG_SOFTWARE and body_len > end:
            # From an untrusted peer, and only ever shown: kept if it fits the body, is at most
            # MAX_SOFTWARE bytes and printable ASCII, else dropped rather than failing the connection.
            # (No helper function: connection setup's Python calls are budgeted.)
            first = _HEADER.size + end + 1
            length = raw[first - 1]
            text = raw[first : first + length]
            if length <= MAX_SOFTWARE and first + length <= _HEADER.size + body_len and text.isascii():
                software = text.decode("ascii")
                if not software.isprintable():
                    software = ""
        try:
            _check_fields(recv_depth, slot_size, max_message_size)
            return cls(recv_depth, slot_size, max_message_size, version, features, initial_depth, software)
        except HandshakeError as exc:
            raise HandshakeError(f"invalid handshake from the peer: {exc.message}") from None
