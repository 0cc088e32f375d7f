"""The exporter side of the one-sided engine, and what arrives without being asked for.

:meth:`Exports.export` registers a range with exactly the remote access asked for and returns its
:class:`~rdmaio.core.remotekey.RemoteKey`; :meth:`Exports.revoke` tells the peer, waits for its answer and
deregisters. :meth:`Exports.on_recv` takes receives that are not frames: write notices (queued for
:meth:`Exports.wait_write_notice`, holding their receive beyond a limit) and control messages (REVOKE and its
ACK, and those of other layers, handed to ``control_handler``).
"""

from __future__ import annotations

import builtins
import secrets
import struct
from typing import Any

from rdmaio import verbs
from rdmaio.core.backend import Waiter
from rdmaio.core.onesided_base import EngineCore, Region
from rdmaio.core.remotekey import ACCESS_ATOMIC, KEY_VERSION, RemoteKey, WriteNotice, parse_access
from rdmaio.errors import (
    FeatureNotSupportedError,
    ProtocolError,
    RemoteAccessError,
)

__all__ = ["CTL_FIRST_EXTERNAL", "Exports"]


# control messages: version u8, type u8, 6 bytes padding, key id u64
_CONTROL = struct.Struct("!BB6xQ")
_CTL_REVOKE = 1
_CTL_REVOKE_ACK = 2
CTL_FIRST_EXTERNAL = 16
"""Control message kinds from here on belong to other layers (:meth:`Exports.send_control`)."""
_WC_RECV_RDMA_WITH_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)


class _Grant:
    __slots__ = ("ack", "key", "mr", "revoked")

    def __init__(self, key: RemoteKey, mr: Region) -> None:
        self.key = key
        self.mr = mr
        self.ack: Waiter | None = None
        self.revoked = False


class Exports(EngineCore):
    """Grants, revocation, write notices and control messages of a one-sided engine (a part of it)."""

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
