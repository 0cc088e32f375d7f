"""Shared by the verbs objects: errno checks, the fork guard, sockaddr conversion, and
:class:`_Resource` (the dependency-ordered, idempotent close every verbs object has)."""

from __future__ import annotations

import os
from contextlib import suppress
from typing import Any, Self

from rdmaio._ffi import ffi, lib
from rdmaio.errors import ForkError, VerbsError

# --- fork detection --------------------------------------------------------------------------------

_generation = 0


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_generation() -> int:
    """How many forks separate this process from the original one (0 in the original)."""
    return _generation


# --- helpers ---------------------------------------------------------------------------------------


def _errno_of(rc: int) -> int:
    """ibv_* calls return a positive errno, rdma_* calls return -1 and set errno; normalise both."""
    if rc > 0:
        return rc
    return ffi.errno or 5  # EIO when the library did not say


def _check(rc: int, call: str, detail: str = "") -> int:
    if rc != 0 and rc is not None:
        if rc < 0 and rc != -1:  # our helper's -errno convention
            raise VerbsError.from_errno(call, -rc, detail)
        raise VerbsError.from_errno(call, _errno_of(rc), detail)
    return rc


def _check_ptr(ptr: Any, call: str, detail: str = "") -> Any:
    if ptr == ffi.NULL:
        raise VerbsError.from_errno(call, ffi.errno or 5, detail)
    return ptr


def make_sockaddr(host: str, port: int) -> Any:
    """Return a ``struct sockaddr_storage *`` for a numeric IPv4/IPv6 address and port."""
    storage = ffi.new("struct sockaddr_storage *")
    rc = lib.rdmaio_sockaddr_from_string(host.encode(), port, storage)
    if rc < 0:
        raise VerbsError(f"not a numeric IPv4/IPv6 address: {host!r}", errno=-rc, call="inet_pton")
    return storage


def sockaddr_to_tuple(addr: Any) -> tuple[str, int] | None:
    """Convert a ``struct sockaddr *`` to ``(host, port)``; ``None`` for NULL or an unknown family."""
    if addr == ffi.NULL:
        return None
    buf = ffi.new("char[64]")
    port = ffi.new("uint16_t *")
    if lib.rdmaio_sockaddr_to_string(addr, buf, 64, port) < 0:
        return None
    return ffi.string(buf).decode(), int(port[0])


class _Resource:
    """Base of every verbs object: dependency tracking, idempotent close, fork guard."""

    _call_destroy = "close"
    # Dependents close in rank order: QPs before the MRs and CQs they use (the NIC may still touch them).
    _close_rank = 9

    #: True once ``close()`` ran. A plain attribute, not a property: the core reads it on every poll and
    #: every connection's setup, where a property would cost a Python call each time.
    closed: bool

    def __init__(self, *parents: _Resource | None) -> None:
        self._generation = generation = _generation
        self.closed = False
        self._dependents: dict[int, _Resource] = {}
        self._parents: list[_Resource] = []
        kept = self._parents
        for parent in parents:
            if parent is not None:
                # Inline check (the usual case costs no Python call); _check_usable raises the error. A
                # stand-in parent without the attributes (the unit tests' fakes) is asked through it.
                if getattr(parent, "closed", True) or getattr(parent, "_generation", None) != generation:
                    parent._check_usable()
                parent._dependents[id(self)] = self
                kept.append(parent)

    def _check_usable(self) -> None:
        """Raise ForkError when the object was created before a fork, VerbsError when it is closed.

        Hot callers test ``self.closed or self._generation != _base._generation`` inline first and call
        this only when one is true (it raises then): the usual case costs no Python call."""
        if self._generation != _generation:
            raise ForkError(
                f"{type(self).__name__} was created before fork(); RDMA resources cannot be used in the "
                "child process: create new ones there"
            )
        if self.closed:
            raise VerbsError(f"{type(self).__name__} is closed", call=self._call_destroy)

    def close(self) -> None:
        """Destroy the object (after its dependents). Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        try:
            for dependent in sorted(self._dependents.values(), key=lambda d: d._close_rank):
                dependent.close()
            if self._generation == _generation:
                self._destroy()
            # In a forked child the objects belong to the parent: forget them, destroy nothing.
        finally:
            for parent in self._parents:
                parent._dependents.pop(id(self), None)
            self._parents = []

    def _destroy(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Leaked objects would otherwise hold kernel resources until exit.
        if not getattr(self, "closed", True):
            with suppress(Exception):
                self.close()
