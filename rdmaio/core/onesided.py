"""One-sided RDMA: exported memory, remote keys, RDMA READ / WRITE / atomics on the event loop.

Model (see docs/one-sided.md). The *exporter* calls ``ep.export(buffer, offset, length, access)``: rdmaio
registers exactly that range as its own memory region (MR) in the connection's protection domain with only
the remote access flags asked for, and returns a :class:`RemoteKey` (address, rkey, length, access and a
key id). The exporter sends ``bytes(key)`` to the peer by any means (usually ``ep.send``). The *importer*
parses it with :meth:`RemoteKey.from_bytes` and calls ``ep.rdma_read`` / ``rdma_read_into`` /
``rdma_write`` / ``fetch_add`` / ``compare_swap`` on it. Every call is checked locally (range, access,
alignment, revocation) before anything is posted, so a mistake costs a :class:`~rdmaio.RemoteAccessError`
and never the connection; the NIC enforces the same range and access for peers that do not use rdmaio.

Why one MR per export and not memory windows: the test host's rxe (Debian 12, Linux 6.1) allocates type 1
and type 2 windows, but binding them is a work request whose completion ``export()`` (a synchronous call)
could not wait for, and a bound window needs its MR registered with MW_BIND. One MR per export gives the same
bounds, needs nothing from the device beyond registration, and deregistering it revokes at the NIC. The
price: two exports of the same range are two registrations (the Domain's cache is used for the local side
of reads and writes, not for grants, because a cached grant would outlive its revocation), and an rkey is
valid on every queue pair of the protection domain (the per-device Domain), not only on the connection
that exported it (type 2 windows would bind it to one QP).

Revocation. ``await ep.revoke(key)`` sends the peer a REVOKE control message and waits (at most
``Options.close_timeout``) for its REVOKE_ACK, then deregisters the MR. The importer marks the key id
revoked when the REVOKE arrives, before it answers: every later call on that key raises
:class:`~rdmaio.RemoteKeyRevokedError` without posting. Requests it posted earlier precede the ACK on the
same reliable connection, so the exporter's NIC has executed them before the exporter deregisters. After
``revoke`` returns, the NIC refuses the rkey: the memory is never touched through it again.

Control messages are SENDs *without* immediate data (rdmaio frames always carry one) and write notices are
RDMA WRITEs *with* immediate data (completion opcode ``IBV_WC_RECV_RDMA_WITH_IMM``); both consume one of the
peer's posted receives, so both are paid for with a send credit like a frame (:meth:`Session.take_slot`).

Work requests of one-sided operations carry ``wr_id = 2 << 56 | tag << 32 | op index`` (kind 2; kind 0 is
the send slots of frames, kind 3 is reserved for keepalive; the tag routes the completion through the
Domain's shared CQ) and are always signalled.
"""

from __future__ import annotations

import builtins
import collections
import itertools
import secrets
import struct
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rdmaio import verbs
from rdmaio._ffi import ffi, lib
from rdmaio.core.backend import Backend, Waiter
from rdmaio.errors import (
    EndpointClosedError,
    FeatureNotSupportedError,
    InvalidRemoteKeyError,
    MessageTooLargeError,
    ProtocolError,
    RdmaError,
    RemoteAccessError,
    RemoteKeyRevokedError,
    VerbsError,
)
from rdmaio.protocol import FEATURE_ONESIDED

__all__ = [
    "ACCESS_ATOMIC",
    "ACCESS_READ",
    "ACCESS_WRITE",
    "CTL_FIRST_EXTERNAL",
    "KEY_VERSION",
    "MAX_OP_BYTES",
    "WR_KIND_ONESIDED",
    "OneSidedCaps",
    "OneSidedEngine",
    "RemoteKey",
    "WriteNotice",
    "parse_access",
    "query_caps",
    "rd_atomic_depth",
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
# version u8, access u8, reserved u16 (0), rkey u32, key id u64, address u64, length u64; network order.
_KEY = struct.Struct("!BBHIQQQ")
MAX_OP_BYTES = 1 << 30
"""Largest single READ or WRITE (1 GiB; rxe's limit is 2 GiB - 1)."""
WR_KIND_ONESIDED = verbs.WR_KIND_ONESIDED
"""``wr_id >> 56`` of one-sided work requests (the verbs layer's wr_id layout)."""
_INDEX_MASK = verbs.WR_INDEX_MASK  # bits 32..55 are the connection's tag (shared-CQ dispatch)
_STAGING_SLOT = 64 * 1024  # bytes of rdmaio-owned registered memory per op; larger ops get their own MR
# Larger ops' MRs are kept for reuse, in power-of-two size classes, up to this many bytes per connection:
# registering (pinning) 1 MiB per op cost more than the op itself (docs/benchmarks.md, "One-sided").
_LARGE_POOL_BYTES = 32 << 20

# control messages: version u8, type u8, 6 bytes padding, key id u64
_CONTROL = struct.Struct("!BB6xQ")
_CTL_REVOKE = 1
_CTL_REVOKE_ACK = 2
CTL_FIRST_EXTERNAL = 16
"""Control message kinds from here on belong to other layers (:meth:`OneSidedEngine.send_control`)."""

_WR_READ: int = lib.IBV_WR_RDMA_READ
_WR_WRITE: int = lib.IBV_WR_RDMA_WRITE
_WR_WRITE_IMM: int = lib.IBV_WR_RDMA_WRITE_WITH_IMM
_WR_SEND: int = lib.IBV_WR_SEND
_WR_FADD: int = lib.IBV_WR_ATOMIC_FETCH_AND_ADD
_WR_CSWAP: int = lib.IBV_WR_ATOMIC_CMP_AND_SWP
_SEND_SIGNALED: int = lib.IBV_SEND_SIGNALED
_SEND_INLINE: int = lib.IBV_SEND_INLINE
_WC_REM_ACCESS_ERR = int(verbs.WcStatus.REM_ACCESS_ERR)
_WC_FLUSH = int(verbs.WcStatus.WR_FLUSH_ERR)
_WC_RECV_RDMA_WITH_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)
_U64 = (1 << 64) - 1
_DOORBELL = 16  # requests per ibv_post_send at most (the QP's scratch array has 16 entries)


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


def _access_str(bits: int) -> str:
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

    def __post_init__(self) -> None:
        if not 0 <= self.addr <= _U64 or not 0 <= self.rkey <= 0xFFFF_FFFF or not 0 <= self.key_id <= _U64:
            raise InvalidRemoteKeyError("remote key field out of range")
        if not 1 <= self.length <= _U64 or self.addr + self.length - 1 > _U64:
            raise InvalidRemoteKeyError(f"remote key length {self.length} out of range")
        if not self.access_bits or self.access_bits & ~_ACCESS_ALL:
            raise InvalidRemoteKeyError(f"remote key access bits {self.access_bits:#x} invalid")

    @property
    def access(self) -> str:
        """The access granted, as given to ``export``: a string of ``"r"``, ``"w"``, ``"a"``."""
        return _access_str(self.access_bits)

    def __bytes__(self) -> bytes:
        return _KEY.pack(KEY_VERSION, self.access_bits, 0, self.rkey, self.key_id, self.addr, self.length)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | None) -> RemoteKey:
        """Parse the wire form of a key received from a peer; :class:`~rdmaio.InvalidRemoteKeyError` if
        it is not exactly one valid key of a version this side knows."""
        if data is None:
            raise InvalidRemoteKeyError("no remote key (None: the peer closed the stream)")
        raw = bytes(data)
        if len(raw) != _KEY.size:
            raise InvalidRemoteKeyError(f"a remote key is {_KEY.size} bytes, got {len(raw)}")
        version, access, reserved, rkey, key_id, addr, length = _KEY.unpack(raw)
        if version != KEY_VERSION:
            raise InvalidRemoteKeyError(f"unsupported remote key version {version} (expected {KEY_VERSION})")
        if reserved:
            raise InvalidRemoteKeyError("remote key has reserved bits set")
        return cls(addr, rkey, length, access, key_id)

    def __repr__(self) -> str:
        return f"<RemoteKey id={self.key_id:#x} length={self.length} access={self.access!r}>"


@dataclass(frozen=True, slots=True)
class WriteNotice:
    """The peer wrote into memory we exported with ``imm=`` set: ``length`` bytes, its 32-bit ``imm``."""

    length: int
    imm: int


@dataclass(frozen=True, slots=True)
class OneSidedCaps:
    """What a device offers one-sided operations (``ibv_query_device``)."""

    atomic_cap: str
    """``"NONE"``, ``"HCA"`` (atomic among this device's requests) or ``"GLOB"``."""
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    max_mw: int
    mw_type1: bool
    mw_type2: bool


def query_caps(device: verbs.DeviceContext) -> OneSidedCaps:
    """Query the one-sided capabilities of a device."""
    caps = ffi.new("struct rdmaio_onesided_caps *")
    rc = lib.rdmaio_query_onesided_caps(device._ptr, caps)
    if rc < 0:
        raise VerbsError.from_errno("ibv_query_device", -rc)
    names = {lib.IBV_ATOMIC_NONE: "NONE", lib.IBV_ATOMIC_HCA: "HCA", lib.IBV_ATOMIC_GLOB: "GLOB"}
    flags = int(caps.device_cap_flags)
    return OneSidedCaps(
        atomic_cap=names.get(int(caps.atomic_cap), str(caps.atomic_cap)),
        max_qp_rd_atom=int(caps.max_qp_rd_atom),
        max_qp_init_rd_atom=int(caps.max_qp_init_rd_atom),
        max_mw=int(caps.max_mw),
        mw_type1=bool(flags & lib.IBV_DEVICE_MEM_WINDOW),
        mw_type2=bool(flags & (lib.IBV_DEVICE_MEM_WINDOW_TYPE_2A | lib.IBV_DEVICE_MEM_WINDOW_TYPE_2B)),
    )


_DEPTH_LIMITS: dict[tuple[int, str], int] = {}
"""Per device (context handle, name): the READ/atomic depth limit, queried once per process (device
attributes do not change, and ``ibv_query_device`` is a system call in every connection's setup path)."""


def rd_atomic_depth(device: verbs.DeviceContext, wanted: int) -> int:
    """The READ/atomic depth to negotiate (``responder_resources``/``initiator_depth``): ``wanted``, capped
    by the device's limits. rdma_cm grants the QP remote READ/atomic access only when it is above 0."""
    key = (device.handle, device.name)
    limit = _DEPTH_LIMITS.get(key)
    if limit is None:
        try:
            caps = query_caps(device)
        except VerbsError:
            return 1
        limit = _DEPTH_LIMITS[key] = min(caps.max_qp_rd_atom, caps.max_qp_init_rd_atom, 255)
    return max(1, min(wanted, limit))


# --- what the engine needs of the connection (the unit tests give fakes) --------------------------------


class Region(Protocol):
    """A registered memory region: address, keys, close()."""

    addr: int
    lkey: int
    rkey: int

    def close(self) -> None:
        """Deregister."""


class RdmaQueue(Protocol):
    """What the engine needs of a queue pair."""

    @property
    def rdma_array(self) -> Any:
        """``struct rdmaio_rdma_op[]`` scratch entries."""

    def post_rdma(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`rdma_array`."""


class Credits(Protocol):
    """The credit side of :class:`rdmaio.protocol.Session` that one-sided requests use."""

    def can_take_slot(self) -> bool:
        """Two credits are held and the wire is up."""

    def take_slot(self) -> None:
        """Spend one credit on a request that consumes a peer receive."""

    def on_slot_used(self) -> None:
        """The peer consumed one of our receives with such a request."""

    def flush_error(self) -> BaseException | None:
        """The error of the connection, or None while it is usable."""


# --- operations ----------------------------------------------------------------------------------------


class _Op:
    __slots__ = (
        "buffer",
        "done",
        "error",
        "index",
        "key_id",
        "length",
        "mr",
        "opcode",
        "orphan",
        "pooled",
        "posted",
        "result",
        "staging",
        "waiter",
        "wr",
    )

    def __init__(self, index: int, waiter: Waiter) -> None:
        self.index = index
        self.waiter = waiter
        self.done = False
        self.posted = False
        self.orphan = False  # nobody waits for it any more: its completion releases its memory
        self.error: BaseException | None = None
        self.result: Any = None
        self.staging: int | None = None  # staging slot index, or None
        self.mr: Any = None  # a Registration (rdma_read_into)
        self.pooled: _Large | None = None  # a large op's registered memory, from the pool
        self.buffer: Any = None  # memoryview of the local memory the NIC reads or writes
        self.key_id: int | None = None
        self.length = 0
        self.opcode = 0
        self.wr: tuple[int, ...] = ()


class _Large:
    """A registered rdmaio-owned buffer for ops above the staging slot (reused through the pool)."""

    __slots__ = ("region", "size", "view")

    def __init__(self, region: Region, view: memoryview) -> None:
        self.region = region
        self.view = view
        self.size = view.nbytes


class _Grant:
    __slots__ = ("ack", "key", "mr", "revoked")

    def __init__(self, key: RemoteKey, mr: Region) -> None:
        self.key = key
        self.mr = mr
        self.ack: Waiter | None = None
        self.revoked = False


class OneSidedEngine:
    """The one-sided side of one connection: grants, pending operations, write notices, revocation.

    ``register_local(buffer)`` registers rdmaio-owned or caller memory for local access only (no remote
    flags) and ``register_grant(view, access_bits)`` registers an exported range with exactly the remote
    access of ``access_bits``; ``cache_get(buffer)`` returns a Domain-cached local registration (with
    ``region``/``release()``). ``fail(exc)`` fails the whole connection (used when a cancelled
    ``rdma_read_into`` must stop the NIC writing into the caller's buffer).
    """

    def __init__(
        self,
        io: Backend,
        qp: RdmaQueue,
        credits: Credits,
        *,
        register_local: Callable[[Any], Region],
        register_grant: Callable[[memoryview, int], Region],
        cache_get: Callable[[Any], Any],
        fail: Callable[[BaseException], None],
        max_ops: int,
        max_inline: int,
        revoke_timeout: float,
        atomics: bool = True,
        stats: collections.Counter[str] | None = None,
        tag: int = 0,
        peer_onesided: bool = True,
        notice_limit: int = 64,
        repost: Callable[[int], None] | None = None,
    ) -> None:
        self._io = io
        # The connection's tag routes our completions to us through the Domain's shared CQ.
        self._wr_base = verbs.make_wr_id(WR_KIND_ONESIDED, tag, 0)
        self._qp = qp
        self._credits = credits
        self._register_local = register_local
        self._register_grant = register_grant
        self._cache_get = cache_get
        self._fail_connection = fail
        self.max_ops = max_ops
        self._max_inline = max_inline
        self._revoke_timeout = revoke_timeout
        self._atomics = atomics
        self._stats = stats if stats is not None else collections.Counter()
        self._index = itertools.count(1)
        self.ops: dict[int, _Op] = {}  # posted or waiting for a credit, by op index
        self._slot_waiters: collections.deque[Waiter] = collections.deque()
        self._credit_queue: collections.deque[_Op] = collections.deque()
        self._staging: Any = None  # registered rdmaio-owned memory: max_ops slots of _STAGING_SLOT bytes
        self._staging_view: memoryview | None = None
        self._free_staging: list[int] = list(range(max_ops))
        self._doorbell: list[_Op] = []  # requests to post together at the end of this loop iteration
        self._ring_handle: Any = None
        self._large_pool: dict[int, list[_Large]] = {}  # free large buffers by size class
        self._large_pooled = 0  # bytes in _large_pool
        self.grants: dict[int, _Grant] = {}  # what we exported, by key id
        self.revoked_ids: set[int] = set()  # keys the peer revoked
        self._pending_acks: collections.deque[int] = collections.deque()
        self._notices: collections.deque[WriteNotice] = collections.deque()
        self._notice_waiter: Waiter | None = None
        # The peer announced FEATURE_ONESIDED: it understands write notices and control messages.
        self.peer_onesided = peer_onesided
        # Write notices queued beyond notice_limit keep the receive they consumed (held_slots) until
        # wait_write_notice() takes one: the writer's credit comes back only then (back-pressure).
        self.notice_limit = notice_limit
        self._held_slots: collections.deque[int] = collections.deque()
        self._repost = repost
        self._error: BaseException | None = None
        self.closed = False
        # Control messages of kind >= CTL_FIRST_EXTERNAL go here (the rendezvous engine's ACK/CANCEL).
        self.control_handler: Callable[[int, int], None] | None = None

    @classmethod
    def for_connection(cls, conn: Any, transport: Any, session: Credits, options: Any) -> OneSidedEngine:
        """The engine of a :class:`~rdmaio.core.connection.Connection` (an :class:`~rdmaio.Endpoint`'s core):
        its memory goes into the Domain's protection domain.

        Only grants get remote access flags; staging memory and the caller buffers of ``rdma_read_into``
        are registered for local access only (the latter through the Domain's registration cache).
        """
        pd = transport.pd
        domain = transport.domain

        def register_local(buffer: Any) -> Region:
            return verbs.MemoryRegion(pd, buffer)

        def register_grant(view: memoryview, bits: int) -> Region:
            return verbs.MemoryRegion(
                pd,
                view,
                remote_read=bool(bits & ACCESS_READ),
                remote_write=bool(bits & ACCESS_WRITE),
                remote_atomic=bool(bits & ACCESS_ATOMIC),
            )

        # A weak reference: a strong one (engine -> connection -> engine) would make every connection a
        # reference cycle, keeping its loop and the loop's Domain (PD, event channel fd) alive until the
        # cyclic GC runs instead of freeing them when the last reference goes.
        fail_ref = weakref.WeakMethod(conn.fail)

        def fail(exc: BaseException) -> None:
            method = fail_ref()
            if method is not None:
                method(exc)

        try:
            atomics = query_caps(transport.device).atomic_cap != "NONE"
        except VerbsError:
            atomics = False
        conn_ref = weakref.ref(conn)

        def repost(slot: int) -> None:
            # A held receive (write-notice back-pressure) goes back to the NIC; its credit is granted.
            owner = conn_ref()
            if owner is not None and not owner.torn_down:
                transport.post_receives([slot])
                session.on_recv_reposted(1)  # type: ignore[attr-defined]
                owner.pump()

        peer = getattr(session, "peer", None)
        return cls(
            conn.io,
            transport.qp,
            session,
            register_local=register_local,
            register_grant=register_grant,
            cache_get=lambda view: domain.registrations.get(view, 0),
            fail=fail,
            max_ops=options.max_rdma_ops,
            max_inline=conn.max_inline,
            revoke_timeout=options.close_timeout,
            atomics=atomics,
            tag=transport.tag or 0,
            stats=conn.stats,
            peer_onesided=peer is None or bool(peer.features & FEATURE_ONESIDED),
            notice_limit=options.max_write_notices,
            repost=repost,
        )

    # --- export / revoke (exporter side) ------------------------------------------------------------------

    def export(
        self, buffer: Any, offset: int = 0, length: int | None = None, access: str = "rw"
    ) -> RemoteKey:
        """Register ``buffer[offset:offset+length]`` for the peer with ``access``; see ``Endpoint.export``."""
        self._check_open()
        bits = parse_access(access)
        if bits & ACCESS_ATOMIC and not self._atomics:
            raise RemoteAccessError("this device does not support remote atomics (atomic_cap NONE)")
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError("export() needs a writable buffer (bytearray, memoryview, mmap, numpy array)")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        size = view.nbytes
        if length is None:
            length = size - offset
        if not (0 <= offset <= size and 1 <= length <= size - offset):
            raise ValueError(f"export range offset={offset} length={length} outside a buffer of {size} bytes")
        region = self._register_grant(view[offset : offset + length], bits)
        key = RemoteKey(region.addr, region.rkey, length, bits, secrets.randbits(64))
        self.grants[key.key_id] = _Grant(key, region)
        self._stats["exports"] += 1
        return key

    async def revoke(self, key: RemoteKey) -> None:
        """Revoke a key this side exported; see ``Endpoint.revoke``."""
        grant = self.grants.get(key.key_id)
        if grant is None or grant.key != key:
            raise ValueError(f"{key!r} was not exported on this connection (or is already revoked)")
        if grant.revoked:
            raise ValueError(f"{key!r} is already being revoked")
        grant.revoked = True
        try:
            usable = self._error is None and not self.closed and self._credits.flush_error() is None
            # A peer without FEATURE_ONESIDED would fail on a REVOKE: deregistering alone revokes at the NIC.
            if usable and self.peer_onesided:
                grant.ack = waiter = self._io.waiter()
                self._send_control(_CTL_REVOKE, key.key_id)
                async with self._io.timeout(self._revoke_timeout):
                    await waiter.wait()
        except builtins.TimeoutError:
            # The peer did not answer: deregistering alone still makes the NIC refuse the key.
            self._stats["revoke_timeouts"] += 1
        finally:
            # Always, even when cancelled or the connection failed: after this the NIC refuses the rkey.
            self.grants.pop(key.key_id, None)
            grant.mr.close()
            self._stats["revokes"] += 1

    # --- notices and control messages (both sides) --------------------------------------------------------

    def on_recv(self, opcode: int, imm: int, byte_len: int, payload: memoryview, slot: int = -1) -> bool:
        """A receive completed that is not a frame: a write notice or a one-sided control message.

        Returns True when the caller should repost ``slot`` now; False when the engine holds it (a write
        notice beyond ``notice_limit`` queued ones: it is reposted, through ``repost``, once
        :meth:`wait_write_notice` takes a notice). The credit it consumed was accounted for here.
        """
        self._credits.on_slot_used()
        if opcode == _WC_RECV_RDMA_WITH_IMM:
            self._notices.append(WriteNotice(byte_len, imm))
            self._stats["write_notices"] += 1
            if self._notice_waiter is not None:
                self._notice_waiter.set()
            if len(self._notices) > self.notice_limit and self._repost is not None and slot >= 0:
                self._held_slots.append(slot)
                self._stats["write_notice_slots_held"] += 1
                return False
            return True
        if byte_len != _CONTROL.size:
            raise ProtocolError(f"one-sided control message of {byte_len} bytes (expected {_CONTROL.size})")
        version, kind, key_id = _CONTROL.unpack(payload[: _CONTROL.size])
        if version == KEY_VERSION and kind >= CTL_FIRST_EXTERNAL and self.control_handler is not None:
            # Rendezvous (rdmaio.core.rndv_engine): raises if the kind is unknown.
            self.control_handler(kind, key_id)
            return True
        if version != KEY_VERSION or kind not in (_CTL_REVOKE, _CTL_REVOKE_ACK):
            raise ProtocolError(f"unknown one-sided control message version {version} type {kind}")
        if kind == _CTL_REVOKE:
            # Mark first: no request on that key is posted from now on; those posted earlier come before
            # the ACK on this connection, so the exporter's NIC has run them when the ACK arrives.
            self.revoked_ids.add(key_id)
            self._send_control(_CTL_REVOKE_ACK, key_id)
        else:
            grant = self.grants.get(key_id)
            if grant is not None and grant.ack is not None:
                grant.ack.set()
        return True

    async def wait_write_notice(self) -> WriteNotice:
        """The next write notice; raises the connection's error once none is left and it failed."""
        while not self._notices:
            self._raise_if_failed()
            if not self.peer_onesided:
                raise FeatureNotSupportedError(
                    "the peer's rdmaio does not support one-sided frames (no FEATURE_ONESIDED in its "
                    "handshake): it cannot send write notices"
                )
            waiter = self._notice_waiter = self._io.waiter()
            try:
                await waiter.wait()
            finally:
                self._notice_waiter = None
        notice = self._notices.popleft()
        if self._held_slots and not self.closed and self._repost is not None:
            # One queued notice fewer: the oldest held receive goes back, and with it one writer credit.
            self._repost(self._held_slots.popleft())
        return notice

    def send_control(self, kind: int, value: int) -> None:
        """Queue a control message of another layer (``kind >= CTL_FIRST_EXTERNAL``, a u64 ``value``);
        the peer's engine hands it to its :attr:`control_handler`. Sent in call order, after a credit."""
        if not CTL_FIRST_EXTERNAL <= kind <= 0xFF:
            raise ValueError(f"control kind {kind} is reserved")
        self._send_control(kind, value)

    def _send_control(self, kind: int, key_id: int) -> None:
        """Queue a control SEND (it needs a credit and an op slot; the ACK may wait for either)."""
        self._pending_acks.append((kind << 64) | key_id)
        self.pump()

    # --- operations (importer side) -----------------------------------------------------------------------

    def _check_key(self, key: RemoteKey, offset: int, length: int, need: int) -> None:
        if not isinstance(key, RemoteKey):
            raise TypeError(f"expected a RemoteKey, got {type(key).__name__}")
        if key.key_id in self.revoked_ids:
            raise RemoteKeyRevokedError(f"{key!r} was revoked by the peer")
        if not key.access_bits & need:
            raise RemoteAccessError(f"{key!r} does not grant {_access_str(need)!r} access")
        if not isinstance(offset, int) or not isinstance(length, int):
            raise TypeError("offset and length must be ints")
        if offset < 0 or length < 0 or offset + length > key.length:
            raise RemoteAccessError(
                f"range offset={offset} length={length} is outside {key!r} (0..{key.length})"
            )

    async def read(self, key: RemoteKey, offset: int, length: int) -> bytes:
        """RDMA READ into rdmaio-owned memory; see ``Endpoint.rdma_read``."""
        self._check_key(key, offset, length, ACCESS_READ)
        if length > MAX_OP_BYTES:
            raise MessageTooLargeError(f"one RDMA READ is at most {MAX_OP_BYTES} bytes")
        if length == 0:
            self._raise_if_failed()
            return b""
        op = await self._start(key, _WR_READ, length)
        self._post(op, key.addr + offset, key.rkey)
        await self._finish(op)
        assert op.buffer is not None
        data = bytes(op.buffer[:length])
        self._release(op)
        return data

    async def read_into(self, key: RemoteKey, offset: int, buffer: Any) -> int:
        """RDMA READ straight into a caller buffer; see ``Endpoint.rdma_read_into``."""
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError("rdma_read_into() needs a writable buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        length = view.nbytes
        self._check_key(key, offset, length, ACCESS_READ)
        if length > MAX_OP_BYTES:
            raise MessageTooLargeError(f"one RDMA READ is at most {MAX_OP_BYTES} bytes")
        if length == 0:
            self._raise_if_failed()
            return 0
        op = await self._start(key, _WR_READ, length, staging=False)
        try:
            registration = self._cache_get(view)
        except BaseException:
            self._abandon(op)
            raise
        op.mr = registration
        op.buffer = view
        self._post(op, key.addr + offset, key.rkey, local=(registration.addr, registration.lkey))
        try:
            await op.waiter.wait()
        except BaseException:
            if not op.done:
                # The NIC may still write into the caller's buffer: the only way to stop it before we
                # return is to destroy the queue pair. Documented in Endpoint.rdma_read_into.
                self._fail_connection(
                    EndpointClosedError("rdma_read_into() was cancelled with the READ in flight")
                )
            self._release(op)
            raise
        self._release(op)
        if op.error is not None:
            raise op.error
        return length

    async def write(self, key: RemoteKey, offset: int, data: Any, imm: int | None = None) -> None:
        """RDMA WRITE (with immediate data when ``imm`` is given); see ``Endpoint.rdma_write``."""
        view = memoryview(data)
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        length = view.nbytes
        self._check_key(key, offset, length, ACCESS_WRITE)
        if imm is not None and not (isinstance(imm, int) and 0 <= imm <= 0xFFFF_FFFF):
            raise ValueError(f"imm must be an int in 0..2**32-1, not {imm!r}")
        if imm is not None and not self.peer_onesided:
            raise FeatureNotSupportedError(
                "rdma_write(imm=...) needs a peer that understands write notices (FEATURE_ONESIDED in its "
                "handshake); this peer's rdmaio does not: write without imm and notify it with send()"
            )
        if length > MAX_OP_BYTES:
            raise MessageTooLargeError(f"one RDMA WRITE is at most {MAX_OP_BYTES} bytes")
        if length == 0 and imm is None:
            self._raise_if_failed()
            return
        op = await self._start(key, _WR_WRITE if imm is None else _WR_WRITE_IMM, length)
        if length:
            assert op.buffer is not None
            op.buffer[:length] = view  # copied: the caller's buffer is free when this call returns
        self._post(op, key.addr + offset, key.rkey, imm=imm or 0)
        await self._finish(op)
        self._release(op)

    async def fetch_add(self, key: RemoteKey, offset: int, add: int) -> int:
        """Atomic fetch-and-add on a u64; see ``Endpoint.fetch_add``."""
        self._check_atomic(key, offset)
        if not isinstance(add, int) or not -(1 << 63) <= add <= _U64:
            raise ValueError(f"add must be an int in -2**63..2**64-1, not {add!r}")
        op = await self._start(key, _WR_FADD, 8)
        self._post(op, key.addr + offset, key.rkey, compare_add=add & _U64)
        return await self._atomic_result(op)

    async def compare_swap(self, key: RemoteKey, offset: int, expected: int, desired: int) -> int:
        """Atomic compare-and-swap on a u64; see ``Endpoint.compare_swap``."""
        self._check_atomic(key, offset)
        for name, value in (("expected", expected), ("desired", desired)):
            if not isinstance(value, int) or not 0 <= value <= _U64:
                raise ValueError(f"{name} must be an int in 0..2**64-1, not {value!r}")
        op = await self._start(key, _WR_CSWAP, 8)
        self._post(op, key.addr + offset, key.rkey, compare_add=expected, swap=desired)
        return await self._atomic_result(op)

    def _check_atomic(self, key: RemoteKey, offset: int) -> None:
        self._check_key(key, offset, 8, ACCESS_ATOMIC)
        if (key.addr + offset) % 8:
            raise RemoteAccessError(
                f"atomic at offset {offset} of {key!r} is not 8-byte aligned (remote address "
                f"{key.addr + offset:#x})"
            )

    async def _atomic_result(self, op: _Op) -> int:
        await self._finish(op)
        assert op.buffer is not None
        # The NIC stores the original value as a u64 in this host's byte order.
        old = int.from_bytes(op.buffer[:8], sys.byteorder)
        self._release(op)
        return old

    # --- the op life cycle ---------------------------------------------------------------------------------

    async def _start(self, key: RemoteKey, opcode: int, length: int, *, staging: bool = True) -> _Op:
        """Wait for an op slot (at most ``max_ops`` in flight), then give the op its local memory."""
        self._raise_if_failed()
        while len(self.ops) >= self.max_ops or self._slot_waiters:
            waiter = self._io.waiter()
            self._slot_waiters.append(waiter)
            try:
                await waiter.wait()
            except BaseException:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
                else:
                    self._wake_slot_waiter()  # we were woken but give up: pass the wake-up on
                raise
            self._raise_if_failed()
            if len(self.ops) < self.max_ops:
                break
        # Re-checked after the wait: a REVOKE may have arrived meanwhile.
        if key.key_id in self.revoked_ids:
            self._wake_slot_waiter()
            raise RemoteKeyRevokedError(f"{key!r} was revoked by the peer")
        op = _Op(next(self._index) & _INDEX_MASK, self._io.waiter())
        op.key_id = key.key_id
        op.length = length
        op.opcode = opcode
        if staging and length:
            self._give_memory(op, length)
        self.ops[op.index] = op
        return op

    def _give_memory(self, op: _Op, length: int) -> None:
        if length <= _STAGING_SLOT:
            if self._staging is None:
                buf = bytearray(_STAGING_SLOT * self.max_ops)
                self._staging = self._register_local(buf)
                self._staging_view = memoryview(buf)
            slot = self._free_staging.pop()
            op.staging = slot
            assert self._staging_view is not None
            op.buffer = self._staging_view[slot * _STAGING_SLOT : slot * _STAGING_SLOT + length]
        else:
            size = 1 << (length - 1).bit_length()  # size class: the next power of two
            free = self._large_pool.get(size)
            if free:
                large = free.pop()
                self._large_pooled -= size
                self._stats["rdma_large_reused"] += 1
            else:
                buf = bytearray(size)
                large = _Large(self._register_local(buf), memoryview(buf))
                self._stats["rdma_large_registered"] += 1
            op.pooled = large
            op.buffer = large.view[:length]

    def _local_of(self, op: _Op) -> tuple[int, int]:
        if op.staging is not None:
            return self._staging.addr + op.staging * _STAGING_SLOT, self._staging.lkey
        if op.pooled is not None:
            return op.pooled.region.addr, op.pooled.region.lkey
        if op.mr is not None:
            return op.mr.addr, op.mr.lkey
        return 0, 0

    def _post(
        self,
        op: _Op,
        remote_addr: int,
        rkey: int,
        *,
        imm: int = 0,
        compare_add: int = 0,
        swap: int = 0,
        local: tuple[int, int] | None = None,
    ) -> None:
        addr, lkey = local if local is not None else self._local_of(op)
        op.wr = (addr, lkey, remote_addr, rkey, imm, compare_add, swap)
        if op.opcode == _WR_WRITE_IMM:
            self._credit_queue.append(op)  # consumes a peer receive: needs a credit
            self.pump()
        elif len(self.ops) == 1 and not self._doorbell:
            self._post_now(op)  # alone in flight: post at once (nothing to share a doorbell with)
        else:
            # Others are in flight: more calls are likely in this same loop iteration (tasks woken by
            # one batch of completions). Post them together at its end: one ibv_post_send (on rxe one
            # system call that runs the requester) for up to _DOORBELL requests.
            self._doorbell.append(op)
            if len(self._doorbell) >= _DOORBELL:
                self._ring()
            elif self._ring_handle is None:
                self._ring_handle = self._io.call_soon(self._ring)

    def _ring(self) -> None:
        """Post the requests collected for one doorbell, as one chain."""
        if self._ring_handle is not None:
            self._ring_handle.cancel()
            self._ring_handle = None
        ops = [op for op in self._doorbell if not op.done]
        self._doorbell.clear()
        if not ops or self._error is not None or self.closed:
            return
        for i, op in enumerate(ops):
            self._fill(i, op)
        try:
            self._qp.post_rdma(len(ops))
        except Exception as exc:
            # Requests before the failing one may have been posted; the connection fails either way
            # (its QP is destroyed), which completes every op.
            self._fail_connection(exc)
            for op in ops:
                self._complete(op, exc)
            return
        for op in ops:
            op.posted = True
        self._stats["rdma_ops_posted"] += len(ops)
        self._stats["rdma_doorbells"] += 1

    def _post_now(self, op: _Op) -> None:
        self._fill(0, op)
        try:
            self._qp.post_rdma(1)
        except Exception as exc:
            self._complete(op, exc)
            self._fail_connection(exc)
            return
        op.posted = True
        self._stats["rdma_ops_posted"] += 1
        self._stats["rdma_doorbells"] += 1

    def _fill(self, index: int, op: _Op) -> None:
        """Write ``op``'s work request into entry ``index`` of the QP's scratch array."""
        addr, lkey, remote_addr, rkey, imm, compare_add, swap = op.wr
        wr = self._qp.rdma_array[index]
        wr.wr_id = self._wr_base | op.index
        wr.local_addr = addr
        wr.length = op.length
        wr.lkey = lkey
        wr.opcode = op.opcode
        flags = _SEND_SIGNALED
        if op.opcode in (_WR_WRITE, _WR_WRITE_IMM, _WR_SEND) and 0 < op.length <= self._max_inline:
            flags |= _SEND_INLINE
        wr.send_flags = flags
        wr.imm_data = imm
        wr.rkey = rkey
        wr.remote_addr = remote_addr
        wr.compare_add = compare_add
        wr.swap = swap

    def pump(self) -> None:
        """Post what waits for a credit: control messages first, then writes with immediate data.

        Called after every batch of completions (credits may have arrived) and when something is queued.
        """
        if self._error is not None or self.closed:
            return
        credits = self._credits
        while self._pending_acks and len(self.ops) < self.max_ops and credits.can_take_slot():
            word = self._pending_acks.popleft()
            op = _Op(next(self._index) & _INDEX_MASK, self._io.waiter())
            op.opcode = _WR_SEND
            op.orphan = True
            op.length = _CONTROL.size
            self._give_memory(op, _CONTROL.size)
            assert op.buffer is not None
            op.buffer[:] = _CONTROL.pack(KEY_VERSION, word >> 64, word & _U64)
            addr, lkey = self._local_of(op)
            op.wr = (addr, lkey, 0, 0, 0, 0, 0)
            self.ops[op.index] = op
            credits.take_slot()
            self._post_now(op)
            self._stats["control_sent"] += 1
        while self._credit_queue and credits.can_take_slot():
            op = self._credit_queue.popleft()
            if op.done:
                continue
            if op.key_id in self.revoked_ids:
                self._complete(op, RemoteKeyRevokedError("the key was revoked by the peer"))
                continue
            credits.take_slot()
            self._post_now(op)

    async def _finish(self, op: _Op) -> None:
        """Wait for the op's completion. A cancelled wait leaves the op to complete on its own: its memory
        is rdmaio's (staging or a private MR) and is released only by the completion."""
        try:
            await op.waiter.wait()
        except BaseException:
            if op.done:
                self._release(op)
            else:
                op.orphan = True
            raise
        if op.error is not None:
            self._release(op)
            raise op.error

    def on_completion(self, wr_id: int, status: int, vendor_err: int = 0) -> None:
        """A completion of one of our work requests (``wr_id >> 56 == 2``), successful or not."""
        op = self.ops.get(wr_id & _INDEX_MASK)
        if op is None:
            return
        if status == 0:
            self._complete(op, None)
            return
        if status == _WC_REM_ACCESS_ERR:
            error: BaseException = RemoteAccessError(
                "the peer's NIC refused the request (remote access error); the connection is lost",
                call="ibv_poll_cq",
            )
        elif status == _WC_FLUSH:
            error = self._error or EndpointClosedError("the request was flushed: the connection is closing")
        else:
            error = EndpointClosedError(
                f"one-sided request failed: {verbs.wc_status_str(status)} (vendor {vendor_err})",
                call="ibv_poll_cq",
            )
        self._complete(op, error)

    def _complete(self, op: _Op, error: BaseException | None) -> None:
        if op.done:
            return
        op.done = True
        op.error = error
        self.ops.pop(op.index, None)
        if op.orphan:  # a cancelled call or a control message: nobody will release its memory
            self._release(op)
        op.waiter.set()
        self._wake_slot_waiter()

    def _wake_slot_waiter(self) -> None:
        if self._slot_waiters and len(self.ops) < self.max_ops:
            self._slot_waiters.popleft().set()
        if self._pending_acks:
            self.pump()

    def _release(self, op: _Op) -> None:
        """Give back the op's local memory (only once the NIC is done with it)."""
        if op.staging is not None:
            self._free_staging.append(op.staging)
            op.staging = None
        if op.pooled is not None:
            large, op.pooled = op.pooled, None
            if not self.closed and self._large_pooled + large.size <= _LARGE_POOL_BYTES:
                self._large_pool.setdefault(large.size, []).append(large)
                self._large_pooled += large.size
            else:
                large.region.close()
        if op.mr is not None:
            mr, op.mr = op.mr, None
            if hasattr(mr, "release"):
                mr.release()
            else:
                mr.close()
        op.buffer = None

    def _abandon(self, op: _Op) -> None:
        self.ops.pop(op.index, None)
        self._release(op)
        self._wake_slot_waiter()

    # --- failure and teardown ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise _fresh(self._error)
        error = self._credits.flush_error()
        if error is not None:
            raise error
        if self.closed:
            raise EndpointClosedError("endpoint is closed")

    def close(self, error: BaseException | None) -> None:
        """The connection is gone (its QP destroyed, so the NIC touches none of our memory any more):
        fail every pending op with ``error``, deregister every grant and the staging memory."""
        if self.closed:
            return
        self.closed = True
        self._error = error or EndpointClosedError("endpoint is closed")
        # Waiting calls release their op's memory when they resume, cancelled ones (orphans) right here.
        for op in list(self.ops.values()):
            self._complete(op, _fresh(self._error))
        self._credit_queue.clear()
        self._doorbell.clear()
        if self._ring_handle is not None:
            self._ring_handle.cancel()
            self._ring_handle = None
        self._held_slots.clear()  # the QP and its receives are gone
        while self._slot_waiters:
            self._slot_waiters.popleft().set()
        for grant in list(self.grants.values()):
            if grant.ack is not None:
                grant.ack.set()
            grant.mr.close()
        self.grants.clear()
        if self._notice_waiter is not None:
            self._notice_waiter.set()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for pooled in self._large_pool.values():
            for large in pooled:
                large.region.close()
        self._large_pool.clear()
        self._large_pooled = 0

    def statistics(self) -> dict[str, int]:
        """Pending ops, grants, queued notices and revoked keys."""
        return {
            "rdma_ops_pending": len(self.ops),
            "grants": len(self.grants),
            "write_notices_queued": len(self._notices),
            "write_notice_slots_held": len(self._held_slots),
            "keys_revoked_by_peer": len(self.revoked_ids),
        }


def _fresh(error: BaseException) -> BaseException:
    """A new instance of a stored error (an exception instance raised twice accumulates tracebacks)."""
    if isinstance(error, RdmaError):
        copy = type(error)(error.message, errno=error.errno, call=error.call)
        copy.__cause__ = error.__cause__
        return copy
    return error
