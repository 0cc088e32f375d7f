"""Remote keys of one-sided RDMA: the access bits, the wire form of a key, and the write notice.

A :class:`RemoteKey` is what an exporter hands to its peer (see :mod:`rdmaio.core.onesided` for the model):
address, rkey, length, access bits and a key id, 32 bytes on the wire with a version byte, and one flag: the
exporter's device has no remote atomics (so no key of it can ever grant them). Parsing is strict: the key
comes from an untrusted peer. A :class:`WriteNotice` is what a peer's RDMA WRITE with immediate data
through a key leaves on the exporter's side. Plain values, no verbs: the engine's objects and the public API
share them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rdmaio.errors import InvalidRemoteKeyError

__all__ = [
    "ACCESS_ATOMIC",
    "ACCESS_READ",
    "ACCESS_WRITE",
    "KEY_FLAG_NO_ATOMICS",
    "KEY_VERSION",
    "RemoteKey",
    "WriteNotice",
    "access_str",
    "parse_access",
]

ACCESS_READ = 0x1
"""Key access bit: RDMA READ (``"r"``)."""
ACCESS_WRITE = 0x2
"""Key access bit: RDMA WRITE, with or without immediate data (``"w"``)."""
ACCESS_ATOMIC = 0x4
"""Key access bit: fetch-and-add and compare-and-swap (``"a"``)."""
_ACCESS_ALL = ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC
_ACCESS_CHARS = {"r": ACCESS_READ, "w": ACCESS_WRITE, "a": ACCESS_ATOMIC}

KEY_VERSION = 1
"""Version byte of the wire form of a :class:`RemoteKey`."""
KEY_FLAG_NO_ATOMICS = 0x8000
"""Key flag (the high bit of the u16 after the access bits, reserved before): the exporter's device has no
remote atomics (``atomic_cap`` NONE, e.g. siw), so the importer raises
:class:`~rdmaio.FeatureNotSupportedError` for an atomic on the key instead of a plain access error. Keys of
devices with atomics leave it 0: their wire form is what it always was."""
_KNOWN_FLAGS = KEY_FLAG_NO_ATOMICS
# version u8, access u8, flags u16 (reserved bits 0), rkey u32, key id u64, address u64, length u64;
# network order.
_KEY = struct.Struct("!BBHIQQQ")
_U64 = (1 << 64) - 1


def parse_access(access: str) -> int:
    """Turn an access string of ``"r"``, ``"w"``, ``"a"`` (e.g. ``"rw"``, ``"rwa"``) into access bits."""
    if not isinstance(access, str) or not access:
        raise ValueError(f"access must be a non-empty string of 'r', 'w', 'a', not {access!r}")
    bits = 0
    for char in access:
        bit = _ACCESS_CHARS.get(char)
        if bit is None or bits & bit:
            raise ValueError(f"access must be a string of distinct 'r', 'w', 'a', not {access!r}")
        bits |= bit
    return bits


def access_str(bits: int) -> str:
    """The access string of access bits (the inverse of :func:`parse_access`): e.g. ``"rw"``."""
    return "".join(c for c, b in _ACCESS_CHARS.items() if bits & b)


@dataclass(frozen=True, slots=True)
class RemoteKey:
    """A bounded grant of access to ``length`` bytes of the exporter's memory.

    ``bytes(key)`` is the wire form (32 bytes; see docs/one-sided.md): a version byte, the access bits, the
    rkey, a key id, the address and the length. :meth:`from_bytes` parses and validates it. A key is meant
    for the connection it was exported on; the importer uses it with ``ep.rdma_read`` and friends.
    """

    addr: int
    """Remote virtual address of the first byte of the grant."""
    rkey: int
    """The NIC's remote key of the grant."""
    length: int
    """Bytes the grant covers (offsets ``0 .. length - 1``)."""
    access_bits: int
    """:data:`ACCESS_READ` | :data:`ACCESS_WRITE` | :data:`ACCESS_ATOMIC`."""
    key_id: int
    """The exporter's identifier of this grant (used to revoke it)."""
    exporter_atomics: bool = True
    """False: the exporter's device has no remote atomics (:data:`KEY_FLAG_NO_ATOMICS`), so atomics on
    this key raise :class:`~rdmaio.FeatureNotSupportedError` (never granted, never possible)."""

    def __post_init__(self) -> None:
        if not 0 <= self.addr <= _U64 or not 0 <= self.rkey <= 0xFFFF_FFFF or not 0 <= self.key_id <= _U64:
            raise InvalidRemoteKeyError("remote key field out of range")
        if not 1 <= self.length <= _U64 or self.addr + self.length - 1 > _U64:
            raise InvalidRemoteKeyError(f"remote key length {self.length} out of range")
        if not self.access_bits or self.access_bits & ~_ACCESS_ALL:
            raise InvalidRemoteKeyError(f"remote key access bits {self.access_bits:#x} invalid")
        if self.access_bits & ACCESS_ATOMIC and not self.exporter_atomics:
            raise InvalidRemoteKeyError("remote key grants atomics from a device without atomics")

    @property
    def access(self) -> str:
        """The access granted, as given to ``export``: a string of ``"r"``, ``"w"``, ``"a"``."""
        return access_str(self.access_bits)

    def __bytes__(self) -> bytes:
        flags = 0 if self.exporter_atomics else KEY_FLAG_NO_ATOMICS
        return _KEY.pack(KEY_VERSION, self.access_bits, flags, self.rkey, self.key_id, self.addr, self.length)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | None) -> RemoteKey:
        """Parse the wire form of a key received from a peer; :class:`~rdmaio.InvalidRemoteKeyError` if
        it is not exactly one valid key of a version this side knows."""
        if data is None:
            raise InvalidRemoteKeyError("no remote key (None: the peer closed the stream)")
        raw = bytes(data)
        if len(raw) != _KEY.size:
            raise InvalidRemoteKeyError(f"a remote key is {_KEY.size} bytes, got {len(raw)}")
        version, access, flags, rkey, key_id, addr, length = _KEY.unpack(raw)
        if version != KEY_VERSION:
            raise InvalidRemoteKeyError(f"unsupported remote key version {version} (expected {KEY_VERSION})")
        if flags & ~_KNOWN_FLAGS:
            raise InvalidRemoteKeyError("remote key has reserved bits set")
        return cls(addr, rkey, length, access, key_id, not flags & KEY_FLAG_NO_ATOMICS)

    def __repr__(self) -> str:
        return f"<RemoteKey id={self.key_id:#x} length={self.length} access={self.access!r}>"


@dataclass(frozen=True, slots=True)
class WriteNotice:
    """The peer wrote into memory we exported with ``imm=`` set: ``length`` bytes, its 32-bit ``imm``."""

    length: int
    imm: int
