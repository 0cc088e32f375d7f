"""Requests of the one-sided engine: RDMA READ, WRITE (with or without immediate data) and atomics.

Every call is checked locally (range, access, alignment, revocation) before anything is posted; the op's
slots, memory, posting and completion are :mod:`rdmaio.core.onesided_life`'s.
"""

from __future__ import annotations

import sys
from typing import Any

from rdmaio.core.onesided_base import MAX_OP_BYTES
from rdmaio.core.onesided_life import (
    _U64,
    _WR_CSWAP,
    _WR_FADD,
    _WR_READ,
    _WR_WRITE,
    _WR_WRITE_IMM,
    OpLifecycle,
    _Op,
)
from rdmaio.core.remotekey import ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, RemoteKey, access_str
from rdmaio.errors import (
    EndpointClosedError,
    FeatureNotSupportedError,
    MessageTooLargeError,
    RemoteAccessError,
    RemoteKeyRevokedError,
)

__all__ = ["Operations"]


class Operations(OpLifecycle):
    """The importer side of a one-sided engine (a part of it): requests, posting and completions."""

    def _check_key(self, key: RemoteKey, offset: int, length: int, need: int) -> None:
        if not isinstance(key, RemoteKey):
            raise TypeError(f"expected a RemoteKey, got {type(key).__name__}")
        if key.key_id in self.revoked_ids:
            raise RemoteKeyRevokedError(f"{key!r} was revoked by the peer")
        if not key.access_bits & need:
            raise RemoteAccessError(f"{key!r} does not grant {access_str(need)!r} access")
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
        op = self._start_now(key, _WR_READ, length) or await self._start(key, _WR_READ, length)
        self._post(op, key.addr + offset, key.rkey)
        if self._must_await(op):
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
            await self._wait(op)
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
        opcode = _WR_WRITE if imm is None else _WR_WRITE_IMM
        op = self._start_now(key, opcode, length) or await self._start(key, opcode, length)
        if length:
            assert op.buffer is not None
            op.buffer[:length] = view  # copied: the caller's buffer is free when this call returns
        self._post(op, key.addr + offset, key.rkey, imm=imm or 0)
        if self._must_await(op):
            await self._finish(op)
        self._release(op)

    async def fetch_add(self, key: RemoteKey, offset: int, add: int) -> int:
        """Atomic fetch-and-add on a u64; see ``Endpoint.fetch_add``."""
        self._check_atomic(key, offset)
        if not isinstance(add, int) or not -(1 << 63) <= add <= _U64:
            raise ValueError(f"add must be an int in -2**63..2**64-1, not {add!r}")
        op = self._start_now(key, _WR_FADD, 8) or await self._start(key, _WR_FADD, 8)
        self._post(op, key.addr + offset, key.rkey, compare_add=add & _U64)
        return await self._atomic_result(op)

    async def compare_swap(self, key: RemoteKey, offset: int, expected: int, desired: int) -> int:
        """Atomic compare-and-swap on a u64; see ``Endpoint.compare_swap``."""
        self._check_atomic(key, offset)
        for name, value in (("expected", expected), ("desired", desired)):
            if not isinstance(value, int) or not 0 <= value <= _U64:
                raise ValueError(f"{name} must be an int in 0..2**64-1, not {value!r}")
        op = self._start_now(key, _WR_CSWAP, 8) or await self._start(key, _WR_CSWAP, 8)
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
        if self._must_await(op):
            await self._finish(op)
        assert op.buffer is not None
        # The NIC stores the original value as a u64 in this host's byte order.
        old = int.from_bytes(op.buffer[:8], sys.byteorder)
        self._release(op)
        return old
