"""Exception hierarchy of rdmaio.

Every exception raised by rdmaio derives from :class:`RdmaError`. Where a builtin exception describes the
same failure (a refused or reset connection, a timeout, a bad argument) our class derives from that builtin
too, so ``except ConnectionResetError:`` written for TCP code keeps working unchanged.

Errors that come from a failing C call carry ``errno`` and ``call`` (the name of the librdmacm/libibverbs
function that failed), in the manner of pyverbs.
"""

from __future__ import annotations

import builtins
import errno as errno_mod
import os

__all__ = [
    "AddressError",
    "BindQueueFullError",
    "ConnectionAbortedError",
    "ConnectionRefusedError",
    "ConnectionResetError",
    "DeviceError",
    "EndpointClosedError",
    "FeatureNotSupportedError",
    "ForkError",
    "FrameError",
    "HandshakeError",
    "InvalidRemoteKeyError",
    "MemoryRegistrationError",
    "MessageTooLargeError",
    "ProtocolError",
    "ProviderError",
    "RdmaError",
    "RemoteAccessError",
    "RemoteKeyRevokedError",
    "RendezvousTimeoutError",
    "ReplyQueueFullError",
    "TimeoutError",
    "UnreachableError",
    "VerbsError",
]


class RdmaError(Exception):
    """Base class of every rdmaio error.

    ``errno`` is the C errno when one applies (else ``None``); ``call`` names the failing C function or the
    operation that failed (else ``None``).
    """

    errno: int | None
    call: str | None

    def __init__(self, message: str, *, errno: int | None = None, call: str | None = None) -> None:
        if isinstance(self, OSError):
            # OSError's (errno, strerror) form fills .errno/.strerror like socket errors do.
            if errno is not None:
                OSError.__init__(self, errno, message)
            else:
                OSError.__init__(self, message)
        else:
            Exception.__init__(self, message)
        #: The errno of the failure (also ``OSError.errno`` for the builtin subclasses), or None.
        self.errno = errno
        #: The C call that failed (``"ibv_reg_mr"``, ``"rdma_connect"``, ...), or "".
        self.call = call
        #: The explanation, without the call and errno prefix.
        self.message = message

    def __str__(self) -> str:
        parts = []
        if self.call:
            parts.append(f"{self.call}()")
        if self.errno is not None:
            parts.append(f"[{errno_mod.errorcode.get(self.errno, self.errno)}]")
        prefix = " ".join(parts)
        return f"{prefix}: {self.message}" if prefix else self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.message, self.errno, self.call))


def _rebuild(cls: type[RdmaError], message: str, errno: int | None, call: str | None) -> RdmaError:
    return cls(message, errno=errno, call=call)


class VerbsError(RdmaError, OSError):
    """A librdmacm/libibverbs call failed; ``call`` and ``errno`` say which and why."""

    @classmethod
    def from_errno(cls, call: str, err: int, detail: str = "") -> VerbsError:
        """Build the error for C function ``call`` failing with errno ``err``."""
        message = os.strerror(err) if err else "failed"
        if detail:
            message = f"{message} ({detail})"
        return cls(message, errno=err, call=call)


class ProviderError(VerbsError):
    """The device's provider failed a call without saying why: it returned an error and left errno 0.

    ``errno`` is None (no reason was given; rdmaio does not make one up) and the message says what is
    known of the cause on that provider. On Soft-iWARP, ``rdma_create_qp`` fails so when the kernel hands
    libsiw a queue whose mmap key is its own invalid-key value (docs/providers.md)."""


class DeviceError(RdmaError, OSError):
    """No usable RDMA device, or the device went away (``DEVICE_REMOVAL``)."""


class MemoryRegistrationError(VerbsError):
    """``ibv_reg_mr`` failed, typically because ``RLIMIT_MEMLOCK`` (``ulimit -l``) is too low."""


class AddressError(RdmaError, OSError):
    """A host name or address could not be resolved to an RDMA-capable address (``ADDR_ERROR``)."""


class UnreachableError(RdmaError, OSError):
    """The peer could not be reached (``ROUTE_ERROR``, ``UNREACHABLE``, ``CONNECT_ERROR``)."""


class ConnectionRefusedError(RdmaError, builtins.ConnectionRefusedError):
    """Nobody listens on that port, or the listener rejected us (``REJECTED``)."""


class ConnectionResetError(RdmaError, builtins.ConnectionResetError):
    """The peer disconnected or died; pending and later operations fail with this."""


class ConnectionAbortedError(RdmaError, builtins.ConnectionAbortedError):
    """The connection was aborted locally (``abort()``, a protocol violation or a transport error)."""


class EndpointClosedError(RdmaError, builtins.ConnectionError):
    """An operation was attempted on an endpoint or server that this side already closed."""


class TimeoutError(RdmaError, builtins.TimeoutError):
    """An operation did not finish within its timeout."""


class ProtocolError(RdmaError):
    """The peer sent something the rdmaio wire protocol does not allow."""


class HandshakeError(ProtocolError, ValueError):
    """The connection handshake (rdma_cm private data) is malformed or of an unsupported version."""


class FrameError(ProtocolError, ValueError):
    """A received frame is malformed (unknown kind, bad size, data after EOF, ...)."""


class MessageTooLargeError(RdmaError, ValueError):
    """A message exceeds the negotiated maximum message size."""


class ForkError(RdmaError, RuntimeError):
    """An rdmaio object created before ``fork()`` was used in the child process, where verbs are invalid."""


class RemoteAccessError(RdmaError, PermissionError):
    """A one-sided operation is outside its key's range, lacks the key's access, or is misaligned.

    Raised before anything is posted when rdmaio's local checks catch it (the connection stays usable), or
    by the pending call whose request the peer's NIC refused (``IBV_WC_REM_ACCESS_ERR``; that error also
    ends the connection, as it moves the queue pair to the error state).
    """


class RemoteKeyRevokedError(RemoteAccessError):
    """The exporter revoked this :class:`~rdmaio.RemoteKey`; nothing was posted."""


class RemoteAccessRefusedError(RemoteAccessError, builtins.ConnectionResetError):
    """The peer's NIC refused a one-sided request that passed the local checks (``IBV_WC_REM_ACCESS_ERR``).

    Either the key is stale or forged (its memory was deregistered without a revocation, or it claims more
    than was granted), or the peer is dying: a process that dies has its memory deregistered by its kernel
    before its connection goes, so requests in flight then are refused. Either way the error moved the queue
    pair to the error state and the connection is lost, so this is also a ``ConnectionResetError``: code
    that handles a dead peer with ``except ConnectionError`` handles it too.
    """


class FeatureNotSupportedError(RdmaError, NotImplementedError):
    """The peer did not announce, in its handshake, a protocol feature this call needs (an older rdmaio),
    or a device of the connection lacks a capability the call needs: remote atomics (``atomic_cap`` NONE on
    this side's device, or on the exporter's, which its :class:`~rdmaio.RemoteKey` says) or memory windows
    (``max_mw`` 0). The message names the device (the exporter's is known only as "the peer's") and what
    it lacks; iWARP devices (siw, E810, Chelsio) have neither.

    Raised locally before anything is sent or posted: the connection stays usable for everything else.
    """


class InvalidRemoteKeyError(RdmaError, ValueError):
    """Bytes given to :meth:`rdmaio.RemoteKey.from_bytes` are not a valid key (size, version, fields)."""


class RendezvousTimeoutError(TimeoutError):
    """A rendezvous ``send()`` was not pulled by the peer within ``Options.rndv_timeout``.

    The message was withdrawn (never delivered), or, if the peer did not answer the cancellation within
    ``close_timeout``, the connection was failed (its queue pair destroyed) before the buffer was given
    back: the peer cannot read it any more either way.
    """


class BindQueueFullError(RdmaError, BlockingIOError):
    """``export()`` found the connection's memory-window binds in flight at their bound
    (``rdmaio.core.onesided.MAX_BINDS_IN_FLIGHT``) even after polling for their completions: let the
    event loop run (any await) and export again. Nothing was registered or posted."""


class ReplyQueueFullError(ProtocolError, ConnectionAbortedError):
    """More answers to the peer's one-sided control messages (the REVOKE_ACK of a revocation, the DONE or
    WITHDRAWN of a rendezvous message) waited for a send credit than ``Options.max_queued_replies`` allows.

    The peer pays a credit for each message it sends, but it gets its credits back with every CREDIT frame
    this side sends, which needs one credit of the peer's where an answer needs two (the last one is kept
    for CREDIT frames): a peer that keeps sending such messages and grants one credit at a time would have
    the answers pile up without end. The connection is aborted (this is also a
    :class:`ConnectionAbortedError`); pending and later calls raise the connection's error.
    """
