"""rdma_cm objects: :class:`EventChannel`, :class:`CMId` and the :class:`CMEvent` record."""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass, field
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import AddressError, ProviderError, UnreachableError, VerbsError
from rdmaio.errors import ConnectionRefusedError as RefusedError
from rdmaio.verbs import _base
from rdmaio.verbs._base import _check, _check_ptr, _Resource, make_sockaddr, sockaddr_to_tuple
from rdmaio.verbs.cq import CompletionQueue
from rdmaio.verbs.device import DeviceContext
from rdmaio.verbs.enums import CMEventType
from rdmaio.verbs.memory import ProtectionDomain
from rdmaio.verbs.path import PathAttributes, query_path
from rdmaio.verbs.qp import QueuePair
from rdmaio.verbs.srq import SharedReceiveQueue

# --- rdma_cm ---------------------------------------------------------------------------------------


class ConnectRefusedError(RefusedError, VerbsError):
    """``rdma_connect`` itself was refused (``ECONNREFUSED``): :class:`rdmaio.ConnectionRefusedError`, and
    still the :class:`~rdmaio.errors.VerbsError` of the failed call it always was."""


class ConnectUnreachableError(UnreachableError, VerbsError):
    """``rdma_connect`` itself found no way to the peer (``ETIMEDOUT``, ``EHOSTUNREACH``, ``ENETUNREACH``,
    ``EHOSTDOWN``, ``ENETDOWN``): :class:`rdmaio.UnreachableError`, and still the
    :class:`~rdmaio.errors.VerbsError` of the failed call."""


class ConnectAddressError(AddressError, VerbsError):
    """``rdma_connect`` itself could not use the local address (``EADDRNOTAVAIL``, ``EADDRINUSE``):
    :class:`rdmaio.AddressError`, and still the :class:`~rdmaio.errors.VerbsError` of the failed call."""


# iWARP connects over the kernel's TCP inside rdma_connect: these errnos are TCP's verdict on the peer or
# on the local address, the same failures a RoCE connect reports later as UNREACHABLE/ADDR_ERROR events.
UNREACHABLE_ERRNOS: frozenset[int] = frozenset(
    {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
)
"""Errnos of a synchronous ``rdma_connect`` that mean the peer cannot be reached."""
LOCAL_ADDRESS_ERRNOS: frozenset[int] = frozenset({errno.EADDRNOTAVAIL, errno.EADDRINUSE})
"""Errnos of a synchronous ``rdma_connect`` that mean the local address cannot be used."""


# libsiw's value for "no key" (SIW_INVAL_UOBJ_KEY in rdma/siw-abi.h). The kernel's keys are mmap offsets
# (page offset << 12), so the queue that lands at page 0x90 of the process's device context gets this key,
# and libsiw destroys the queue and fails the call without setting errno.
SIW_INVAL_UOBJ_KEY = 0x90000


def _silent_create_qp_error(device: str, detail: str) -> ProviderError:
    """The error of an ``rdma_create_qp`` that failed and left errno 0 (no reason to report but that)."""
    message = f"the provider of {device} failed and gave no errno ({detail})"
    if device.startswith("siw"):
        message += (
            f"; on Soft-iWARP this is libsiw refusing a queue whose mmap key the kernel made "
            f"{SIW_INVAL_UOBJ_KEY:#x}, libsiw's invalid-key value (SIW_INVAL_UOBJ_KEY): see docs/providers.md"
        )
    return ProviderError(message, call="rdma_create_qp")


@dataclass(frozen=True, slots=True)
class CMEvent:
    """One rdma_cm event, copied out of librdmacm's buffer and already acked."""

    event: CMEventType
    status: int
    id_handle: int
    """Address of the ``rdma_cm_id`` the event is about (for a CONNECT_REQUEST: the new id)."""
    listen_id_handle: int
    private_data: bytes
    qp_num: int
    responder_resources: int
    initiator_depth: int
    rnr_retry_count: int
    raw_id: Any = field(repr=False, compare=False)
    """The ``struct rdma_cm_id *`` itself, used to wrap the new id of a CONNECT_REQUEST."""


class EventChannel(_Resource):
    """An rdma_cm event channel; its fd is non-blocking and meant for an event loop."""

    _call_destroy = "rdma_destroy_event_channel"

    def __init__(self) -> None:
        super().__init__()
        self._ptr = _check_ptr(lib.rdma_create_event_channel(), "rdma_create_event_channel")
        self.fd: int = self._ptr.fd
        os.set_blocking(self.fd, False)
        self._event = ffi.new("struct rdmaio_cm_event *")

    def get_event(self) -> CMEvent | None:
        """Return the next pending event (acked), or ``None`` if none is pending."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        ev = self._event
        rc = lib.rdmaio_get_cm_event(self._ptr, ev)
        if rc == -11:  # EAGAIN
            return None
        if rc < 0:
            raise VerbsError.from_errno("rdma_get_cm_event", -rc)
        try:
            event_type = CMEventType(ev.event)
        except ValueError:
            raise VerbsError(f"unknown rdma_cm event {ev.event}", call="rdma_get_cm_event") from None
        return CMEvent(
            event=event_type,
            status=int(ev.status),
            id_handle=int(ffi.cast("uintptr_t", ev.id)),
            listen_id_handle=int(ffi.cast("uintptr_t", ev.listen_id)),
            private_data=bytes(ffi.buffer(ev.private_data, ev.private_data_len)),
            qp_num=int(ev.qp_num),
            responder_resources=int(ev.responder_resources),
            initiator_depth=int(ev.initiator_depth),
            rnr_retry_count=int(ev.rnr_retry_count),
            raw_id=ev.id,
        )

    def _destroy(self) -> None:
        lib.rdma_destroy_event_channel(self._ptr)


class CMId(_Resource):
    """An ``rdma_cm_id`` (RDMA_PS_TCP, reliable connected) bound to an :class:`EventChannel`."""

    _call_destroy = "rdma_destroy_id"
    _close_rank = 1

    def __init__(self, channel: EventChannel, *, _raw: Any = None) -> None:
        super().__init__(channel)
        if _raw is None:
            out = ffi.new("struct rdma_cm_id **")
            _check(lib.rdma_create_id(channel._ptr, out, ffi.NULL, lib.RDMA_PS_TCP), "rdma_create_id")
            _raw = out[0]
        self._ptr = _raw
        self.handle: int = int(ffi.cast("uintptr_t", _raw))
        self.qp: QueuePair | None = None

    @classmethod
    def from_event(cls, channel: EventChannel, event: CMEvent) -> CMId:
        """Wrap the new id that a CONNECT_REQUEST event carries (it arrives on the listener's channel)."""
        return cls(channel, _raw=event.raw_id)

    # address handling
    def bind_addr(self, host: str, port: int) -> None:
        """Bind to a local numeric address and port (port 0 picks a free one)."""
        self._check_usable()
        addr = make_sockaddr(host, port)
        _check(
            lib.rdma_bind_addr(self._ptr, ffi.cast("struct sockaddr *", addr)),
            "rdma_bind_addr",
            f"{host} port {port}",
        )

    def set_reuseaddr(self, on: bool = True) -> None:
        """Set RDMA_OPTION_ID_REUSEADDR (like SO_REUSEADDR) before binding."""
        self._check_usable()
        value = ffi.new("int *", int(on))
        _check(
            lib.rdma_set_option(
                self._ptr, lib.RDMA_OPTION_ID, lib.RDMA_OPTION_ID_REUSEADDR, value, ffi.sizeof("int")
            ),
            "rdma_set_option",
            "REUSEADDR",
        )

    def set_ack_timeout(self, exponent: int) -> None:
        """Set RDMA_OPTION_ID_ACK_TIMEOUT: the QP's local ACK timeout is 4.096 us * 2**exponent.

        Must be called before ``connect``/``accept`` (rdma_cm applies it when moving the QP to RTS).
        """
        self._check_usable()
        if not 0 <= exponent <= 31:
            raise ValueError("ack timeout exponent must be between 0 and 31")
        value = ffi.new("uint8_t *", exponent)
        _check(
            lib.rdma_set_option(
                self._ptr, lib.RDMA_OPTION_ID, lib.RDMA_OPTION_ID_ACK_TIMEOUT, value, ffi.sizeof("uint8_t")
            ),
            "rdma_set_option",
            "ACK_TIMEOUT",
        )

    def resolve_addr(
        self, host: str, port: int, *, src: tuple[str, int] | None = None, timeout_ms: int = 2000
    ) -> None:
        """Start address resolution; completion arrives as ADDR_RESOLVED or ADDR_ERROR."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        dst = make_sockaddr(host, port)
        src_ptr = ffi.cast("struct sockaddr *", make_sockaddr(*src)) if src else ffi.NULL
        _check(
            lib.rdma_resolve_addr(self._ptr, src_ptr, ffi.cast("struct sockaddr *", dst), timeout_ms),
            "rdma_resolve_addr",
            f"{host} port {port}",
        )

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        """Start route resolution; completion arrives as ROUTE_RESOLVED or ROUTE_ERROR."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        _check(lib.rdma_resolve_route(self._ptr, timeout_ms), "rdma_resolve_route")

    def listen(self, backlog: int) -> None:
        """Listen for connection requests (after ``bind_addr``)."""
        self._check_usable()
        _check(lib.rdma_listen(self._ptr, backlog), "rdma_listen")

    @property
    def local_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the local side, once bound or resolved."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        return sockaddr_to_tuple(lib.rdma_get_local_addr(self._ptr))

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the remote side, once resolved or connected."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        return sockaddr_to_tuple(lib.rdma_get_peer_addr(self._ptr))

    @property
    def port_num(self) -> int:
        """The device port this id is bound to (valid after address resolution)."""
        return int(self._ptr.port_num)

    def device(self) -> DeviceContext | None:
        """The device context this id is bound to (owned by librdmacm), or None before resolution."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        verbs = self._ptr.verbs
        return None if verbs == ffi.NULL else DeviceContext(verbs)

    # connection
    def create_qp(
        self,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        *,
        max_send_wr: int,
        max_recv_wr: int,
        max_inline_data: int = 0,
        srq: SharedReceiveQueue | None = None,
        ack_timeout: int | None = None,
        fit_inline: bool = False,
    ) -> QueuePair:
        """Create the RC queue pair of this id (rdma_cm moves it through INIT/RTR/RTS for us).

        With ``srq`` its receives come from that shared receive queue (``max_recv_wr`` is then ignored,
        the QP has no receive queue of its own) and it is closed before the SRQ. ``ack_timeout`` (an
        exponent, see :meth:`set_ack_timeout`) is set on the id first; with ``fit_inline`` a device that
        refuses ``max_inline_data`` is asked again with half of it (above 32 bytes) or none. One C call
        (``rdmaio_setup_qp``) makes every step."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        if self.qp is not None and not self.qp.closed:
            raise VerbsError("this cm id already has a queue pair", call="rdma_create_qp")
        if ack_timeout is None:
            ack_timeout = lib.RDMAIO_SETUP_NO_ACK_TIMEOUT
        elif not 0 <= ack_timeout <= 31:
            raise ValueError("ack timeout exponent must be between 0 and 31")
        cap = ffi.new("struct ibv_qp_cap *")
        step = ffi.new("int *")
        rc = lib.rdmaio_setup_qp(
            self._ptr,
            pd._ptr,
            send_cq._ptr,
            recv_cq._ptr,
            ffi.NULL if srq is None else srq._ptr,
            max_send_wr,
            max_recv_wr,
            max_inline_data,
            fit_inline,
            ack_timeout,
            cap,
            step,
        )
        if rc < 0:
            if step[0] == lib.RDMAIO_SETUP_STEP_ACK_TIMEOUT:
                raise VerbsError.from_errno("rdma_set_option", -rc, "ACK_TIMEOUT")
            if step[0] == lib.RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO:
                detail = f"send_wr={max_send_wr} recv_wr={max_recv_wr} inline={cap.max_inline_data}"
                raise _silent_create_qp_error(pd.context.name, detail)
            raise VerbsError.from_errno(
                "rdma_create_qp",
                -rc,
                f"send_wr={max_send_wr} recv_wr={max_recv_wr} inline={cap.max_inline_data}",
            )
        self.qp = QueuePair(self, pd, send_cq, recv_cq, cap, srq)
        return self.qp

    def _conn_param(
        self,
        private_data: bytes,
        *,
        retry_count: int,
        rnr_retry_count: int,
        responder_resources: int,
        initiator_depth: int,
    ) -> tuple[Any, Any]:
        """A ``struct rdma_conn_param`` and the buffer its private data points to (keep both alive until the
        call that uses them returns). :meth:`connect` and :meth:`accept` build theirs in C; this is for a
        caller that calls ``rdma_connect`` itself with a field of its own (the tests' hostile peers)."""
        if len(private_data) > 255:
            raise ValueError("private data longer than 255 bytes")
        buf = ffi.new("uint8_t[]", private_data or b"\0")
        param = ffi.new("struct rdma_conn_param *")
        param.private_data = buf
        param.private_data_len = len(private_data)
        param.responder_resources = responder_resources
        param.initiator_depth = initiator_depth
        param.retry_count = retry_count
        param.rnr_retry_count = rnr_retry_count
        return param, buf

    def connect(
        self,
        private_data: bytes = b"",
        *,
        retry_count: int = 6,
        rnr_retry_count: int = 1,
        responder_resources: int = 1,
        initiator_depth: int = 1,
    ) -> None:
        """Send a connection request; the answer arrives as ESTABLISHED, REJECTED, UNREACHABLE, ...

        ``private_data`` (at most 255 bytes) carries the handshake; one C call (``rdmaio_setup_connect``)
        builds the connection parameters and connects.

        Raises :class:`~rdmaio.ConnectionRefusedError` when the call itself is refused: iWARP connects over
        TCP, so a port without a listener fails here at once (``ECONNREFUSED``) instead of as a later
        ``REJECTED`` event as on InfiniBand and RoCE. Likewise :class:`~rdmaio.UnreachableError` when TCP
        finds no way to the peer (:data:`UNREACHABLE_ERRNOS`: a later ``UNREACHABLE`` event elsewhere) and
        :class:`~rdmaio.AddressError` when the local address cannot be used (:data:`LOCAL_ADDRESS_ERRNOS`).
        Each is also the call's :class:`~rdmaio.errors.VerbsError`."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        if len(private_data) > 255:
            raise ValueError("private data longer than 255 bytes")
        rc = lib.rdmaio_setup_connect(
            self._ptr,
            private_data,
            len(private_data),
            retry_count,
            rnr_retry_count,
            responder_resources,
            initiator_depth,
        )
        if rc < 0:
            raise self._connect_failed(-rc)

    def _connect_failed(self, err: int) -> VerbsError:
        """The typed error of ``rdma_connect`` failing at once with ``err``."""
        if err == errno.ECONNREFUSED:
            return ConnectRefusedError(
                f"connection refused by {self._peer_words()}: no listener on that port",
                errno=err,
                call="rdma_connect",
            )
        if err in UNREACHABLE_ERRNOS:
            return ConnectUnreachableError(
                f"{self._peer_words()} unreachable: {os.strerror(err)}", errno=err, call="rdma_connect"
            )
        if err in LOCAL_ADDRESS_ERRNOS:
            return ConnectAddressError(
                f"cannot connect to {self._peer_words()} from this address: {os.strerror(err)}",
                errno=err,
                call="rdma_connect",
            )
        return VerbsError.from_errno("rdma_connect", err)

    def _peer_words(self) -> str:
        peer = None
        with contextlib.suppress(Exception):  # only for the message: the id may know no peer
            peer = self.peer_address
        return f"{peer[0]} port {peer[1]}" if peer else "the peer"

    def accept(
        self,
        private_data: bytes = b"",
        *,
        rnr_retry_count: int = 1,
        responder_resources: int = 1,
        initiator_depth: int = 1,
    ) -> None:
        """Accept a connection request on this (new) id; ESTABLISHED follows. One C call
        (``rdmaio_setup_accept``) builds the connection parameters and accepts."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        if len(private_data) > 255:
            raise ValueError("private data longer than 255 bytes")
        rc = lib.rdmaio_setup_accept(
            self._ptr, private_data, len(private_data), rnr_retry_count, responder_resources, initiator_depth
        )
        if rc < 0:
            raise VerbsError.from_errno("rdma_accept", -rc)

    def reject(self, private_data: bytes = b"") -> None:
        """Reject a connection request on this (new) id."""
        self._check_usable()
        buf = ffi.new("uint8_t[]", private_data or b"\0")
        _check(lib.rdma_reject(self._ptr, buf, len(private_data)), "rdma_reject")

    def disconnect(self) -> None:
        """Disconnect (sends DREQ); both sides then see DISCONNECTED and the QP moves to error."""
        if self.closed or self._generation != _base._generation:  # inline: no call when usable
            self._check_usable()
        _check(lib.rdma_disconnect(self._ptr), "rdma_disconnect")

    def query_path(self) -> PathAttributes:
        """The path of this connected id as the device holds it (port, GIDs and their type, MTUs): system
        calls, so ask once (:mod:`rdmaio.verbs.path`)."""
        self._check_usable()
        return query_path(self._ptr)

    def _destroy(self) -> None:
        # rdma_destroy_id blocks until every event of this id was acked; the helper acks at once.
        lib.rdma_destroy_id(self._ptr)
