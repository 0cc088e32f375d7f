"""Verbs object layer: thin, synchronous, checked wrappers over librdmacm and libibverbs objects.

Lifetime model (after pyverbs): every object registers with the objects it depends on; ``close()`` first
closes its dependents (a PD closes its MRs and QPs, a CQ the QPs using it, a CM id its QP), then destroys
itself. ``close()`` is idempotent, objects are context managers, and a garbage-collected object is closed.
Every failing C call raises :class:`~rdmaio.errors.VerbsError` (or a subclass) carrying errno and the call.

After ``fork()`` the verbs objects inherited by the child are unusable (``ibv_fork_init(3)``): any use
raises :class:`~rdmaio.errors.ForkError`, and closing them in the child only forgets them, so that the
child cannot destroy the parent's resources through the shared device file.

Nothing here knows about event loops; the reactor layer puts the file descriptors on a loop.
"""

from __future__ import annotations

import enum
import os
import resource
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Self

from rdmaio._ffi import ffi, lib
from rdmaio.errors import DeviceError, ForkError, MemoryRegistrationError, VerbsError

__all__ = [
    "EVENT_COMM_EST",
    "EVENT_CQ_ERR",
    "EVENT_DEVICE_FATAL",
    "EVENT_PORT_ACTIVE",
    "EVENT_PORT_ERR",
    "EVENT_QP_ACCESS_ERR",
    "EVENT_QP_FATAL",
    "EVENT_QP_REQ_ERR",
    "MAX_POLL",
    "SEND_INLINE",
    "SEND_SIGNALED",
    "WC_WITH_IMM",
    "WR_INDEX_MASK",
    "WR_KIND_CONTROL",
    "WR_KIND_ONESIDED",
    "WR_KIND_RECV",
    "WR_KIND_SEND",
    "WR_RDMA_WRITE_WITH_IMM",
    "WR_SEND_WITH_IMM",
    "WR_TAG_MASK",
    "AsyncEvent",
    "CMEvent",
    "CMEventType",
    "CMId",
    "CompletionBatch",
    "CompletionChannel",
    "CompletionQueue",
    "DeviceContext",
    "DeviceInfo",
    "EventChannel",
    "MemoryRegion",
    "PortInfo",
    "ProtectionDomain",
    "QueuePair",
    "WcOpcode",
    "WcStatus",
    "dispatch_key",
    "fork_generation",
    "list_devices",
    "make_wr_id",
    "wc_status_str",
    "wr_index",
    "wr_kind",
    "wr_tag",
]

# --- fork detection --------------------------------------------------------------------------------

_generation = 0


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_generation() -> int:
    """How many forks separate this process from the original one (0 in the original)."""
    return _generation


# --- enums -----------------------------------------------------------------------------------------


class CMEventType(enum.IntEnum):
    """``enum rdma_cm_event_type``."""

    ADDR_RESOLVED = lib.RDMA_CM_EVENT_ADDR_RESOLVED
    ADDR_ERROR = lib.RDMA_CM_EVENT_ADDR_ERROR
    ROUTE_RESOLVED = lib.RDMA_CM_EVENT_ROUTE_RESOLVED
    ROUTE_ERROR = lib.RDMA_CM_EVENT_ROUTE_ERROR
    CONNECT_REQUEST = lib.RDMA_CM_EVENT_CONNECT_REQUEST
    CONNECT_RESPONSE = lib.RDMA_CM_EVENT_CONNECT_RESPONSE
    CONNECT_ERROR = lib.RDMA_CM_EVENT_CONNECT_ERROR
    UNREACHABLE = lib.RDMA_CM_EVENT_UNREACHABLE
    REJECTED = lib.RDMA_CM_EVENT_REJECTED
    ESTABLISHED = lib.RDMA_CM_EVENT_ESTABLISHED
    DISCONNECTED = lib.RDMA_CM_EVENT_DISCONNECTED
    DEVICE_REMOVAL = lib.RDMA_CM_EVENT_DEVICE_REMOVAL
    MULTICAST_JOIN = lib.RDMA_CM_EVENT_MULTICAST_JOIN
    MULTICAST_ERROR = lib.RDMA_CM_EVENT_MULTICAST_ERROR
    ADDR_CHANGE = lib.RDMA_CM_EVENT_ADDR_CHANGE
    TIMEWAIT_EXIT = lib.RDMA_CM_EVENT_TIMEWAIT_EXIT


class WcStatus(enum.IntEnum):
    """The ``enum ibv_wc_status`` values rdmaio distinguishes."""

    SUCCESS = lib.IBV_WC_SUCCESS
    LOC_LEN_ERR = lib.IBV_WC_LOC_LEN_ERR
    LOC_QP_OP_ERR = lib.IBV_WC_LOC_QP_OP_ERR
    LOC_PROT_ERR = lib.IBV_WC_LOC_PROT_ERR
    WR_FLUSH_ERR = lib.IBV_WC_WR_FLUSH_ERR
    RNR_RETRY_EXC_ERR = lib.IBV_WC_RNR_RETRY_EXC_ERR
    RETRY_EXC_ERR = lib.IBV_WC_RETRY_EXC_ERR
    REM_ACCESS_ERR = lib.IBV_WC_REM_ACCESS_ERR
    REM_OP_ERR = lib.IBV_WC_REM_OP_ERR
    REM_INV_REQ_ERR = lib.IBV_WC_REM_INV_REQ_ERR


class WcOpcode(enum.IntEnum):
    """``enum ibv_wc_opcode`` (receive opcodes have bit 7 set)."""

    SEND = lib.IBV_WC_SEND
    RDMA_WRITE = lib.IBV_WC_RDMA_WRITE
    RDMA_READ = lib.IBV_WC_RDMA_READ
    RECV = lib.IBV_WC_RECV
    RECV_RDMA_WITH_IMM = lib.IBV_WC_RECV_RDMA_WITH_IMM


# Work-request constants the data path fills into struct rdmaio_send.
WR_SEND_WITH_IMM: int = lib.IBV_WR_SEND_WITH_IMM
WR_RDMA_WRITE_WITH_IMM: int = lib.IBV_WR_RDMA_WRITE_WITH_IMM
SEND_SIGNALED: int = lib.IBV_SEND_SIGNALED
SEND_INLINE: int = lib.IBV_SEND_INLINE
WC_WITH_IMM: int = lib.IBV_WC_WITH_IMM  # wc_flags bit: the completion carries immediate data
# Async event types the reactor routes: a CQ error concerns the connections of that CQ, a device fatal
# error every connection on the device, the QP errors one QP; COMM_EST is informational.
EVENT_CQ_ERR: int = lib.IBV_EVENT_CQ_ERR
EVENT_DEVICE_FATAL: int = lib.IBV_EVENT_DEVICE_FATAL
EVENT_QP_FATAL: int = lib.IBV_EVENT_QP_FATAL
EVENT_QP_REQ_ERR: int = lib.IBV_EVENT_QP_REQ_ERR
EVENT_QP_ACCESS_ERR: int = lib.IBV_EVENT_QP_ACCESS_ERR
EVENT_COMM_EST: int = lib.IBV_EVENT_COMM_EST
EVENT_PORT_ERR: int = lib.IBV_EVENT_PORT_ERR
EVENT_PORT_ACTIVE: int = lib.IBV_EVENT_PORT_ACTIVE


# --- wr_id layout ------------------------------------------------------------------------------------
# Every work request rdmaio posts carries, in its 64-bit wr_id: bits 56..63 the operation kind, bits 32..55
# the 24-bit connection tag its Domain assigned, bits 0..31 the index (slot number, op number). A
# completion is dispatched to its connection by dispatch_key(wc.qp_num, tag): QP numbers are reused once a
# QP is destroyed, and the tag keeps a destroyed QP's late completions (rxe may leave some in a shared CQ)
# away from a new connection that got the same QP number. The C helper (helper.h) uses the same layout.

WR_KIND_SEND = 0
"""wr_id kind: a send slot (index = send slot number)."""
WR_KIND_RECV = 1
"""wr_id kind: a receive slot (index = receive slot number)."""
WR_KIND_ONESIDED = 2
"""wr_id kind: a one-sided operation (index = operation number)."""
WR_KIND_CONTROL = 3
"""wr_id kind: a control or keepalive work request."""
WR_KIND_SHIFT = 56
WR_TAG_SHIFT = 32
WR_TAG_BITS = 24
WR_TAG_MASK = (1 << WR_TAG_BITS) - 1
"""Largest connection tag (tags are 24 bits)."""
WR_INDEX_MASK = 0xFFFFFFFF
"""``wr_id & WR_INDEX_MASK`` is the index (slot or operation number)."""
MAX_POLL: int = lib.RDMAIO_MAX_POLL
"""The largest batch :meth:`CompletionQueue.poll_grouped` takes in one call."""


def make_wr_id(kind: int, tag: int, index: int) -> int:
    """The wr_id of a work request of ``kind`` (``WR_KIND_*``) on the connection ``tag`` at ``index``."""
    if not 0 <= kind <= 0xFF or not 0 <= tag <= WR_TAG_MASK or not 0 <= index <= WR_INDEX_MASK:
        raise ValueError(f"wr_id field out of range: kind={kind} tag={tag} index={index}")
    return (kind << WR_KIND_SHIFT) | (tag << WR_TAG_SHIFT) | index


def wr_kind(wr_id: int) -> int:
    """The operation kind (``WR_KIND_*``) of a wr_id."""
    return wr_id >> WR_KIND_SHIFT


def wr_tag(wr_id: int) -> int:
    """The connection tag of a wr_id."""
    return (wr_id >> WR_TAG_SHIFT) & WR_TAG_MASK


def wr_index(wr_id: int) -> int:
    """The index (slot or operation number) of a wr_id."""
    return wr_id & WR_INDEX_MASK


def dispatch_key(qp_num: int, tag: int) -> int:
    """The key completions are dispatched by: ``(qp_num << 24) | tag`` (what ``poll_grouped`` groups)."""
    return (qp_num << WR_TAG_BITS) | tag


def wc_status_str(status: int) -> str:
    """Return libibverbs' description of a work-completion status."""
    return str(ffi.string(lib.ibv_wc_status_str(status)).decode())


MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


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

    def __init__(self, *parents: _Resource | None) -> None:
        self._generation = _generation
        self._closed = False
        self._dependents: dict[int, _Resource] = {}
        self._parents = [p for p in parents if p is not None]
        for parent in self._parents:
            parent._check_usable()
            parent._dependents[id(self)] = self

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran (or the object was inherited across ``fork()``)."""
        return self._closed

    def _check_usable(self) -> None:
        if self._generation != _generation:
            raise ForkError(
                f"{type(self).__name__} was created before fork(); RDMA resources cannot be used in the "
                "child process: create new ones there"
            )
        if self._closed:
            raise VerbsError(f"{type(self).__name__} is closed", call=self._call_destroy)

    def close(self) -> None:
        """Destroy the object (after its dependents). Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
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
        if not getattr(self, "_closed", True):
            with suppress(Exception):
                self.close()


# --- rdma_cm ---------------------------------------------------------------------------------------


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
        self._check_usable()
        _check(lib.rdma_resolve_route(self._ptr, timeout_ms), "rdma_resolve_route")

    def listen(self, backlog: int) -> None:
        """Listen for connection requests (after ``bind_addr``)."""
        self._check_usable()
        _check(lib.rdma_listen(self._ptr, backlog), "rdma_listen")

    @property
    def local_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the local side, once bound or resolved."""
        self._check_usable()
        return sockaddr_to_tuple(lib.rdma_get_local_addr(self._ptr))

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the remote side, once resolved or connected."""
        self._check_usable()
        return sockaddr_to_tuple(lib.rdma_get_peer_addr(self._ptr))

    @property
    def port_num(self) -> int:
        """The device port this id is bound to (valid after address resolution)."""
        return int(self._ptr.port_num)

    def device(self) -> DeviceContext | None:
        """The device context this id is bound to (owned by librdmacm), or None before resolution."""
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
    ) -> QueuePair:
        """Create the RC queue pair of this id (rdma_cm moves it through INIT/RTR/RTS for us)."""
        self._check_usable()
        if self.qp is not None and not self.qp.closed:
            raise VerbsError("this cm id already has a queue pair", call="rdma_create_qp")
        attr = ffi.new("struct ibv_qp_init_attr *")
        attr.send_cq = send_cq._ptr
        attr.recv_cq = recv_cq._ptr
        attr.qp_type = lib.IBV_QPT_RC
        attr.sq_sig_all = 0
        attr.cap.max_send_wr = max_send_wr
        attr.cap.max_recv_wr = max_recv_wr
        attr.cap.max_send_sge = 1
        attr.cap.max_recv_sge = 1
        attr.cap.max_inline_data = max_inline_data
        _check(
            lib.rdma_create_qp(self._ptr, pd._ptr, attr),
            "rdma_create_qp",
            f"send_wr={max_send_wr} recv_wr={max_recv_wr} inline={max_inline_data}",
        )
        self.qp = QueuePair(self, pd, send_cq, recv_cq, attr.cap)
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
        retry_count: int = 7,
        rnr_retry_count: int = 1,
        responder_resources: int = 1,
        initiator_depth: int = 1,
    ) -> None:
        """Send a connection request; the answer arrives as ESTABLISHED, REJECTED, UNREACHABLE, ..."""
        self._check_usable()
        param, _keep = self._conn_param(
            private_data,
            retry_count=retry_count,
            rnr_retry_count=rnr_retry_count,
            responder_resources=responder_resources,
            initiator_depth=initiator_depth,
        )
        _check(lib.rdma_connect(self._ptr, param), "rdma_connect")

    def accept(
        self,
        private_data: bytes = b"",
        *,
        rnr_retry_count: int = 1,
        responder_resources: int = 1,
        initiator_depth: int = 1,
    ) -> None:
        """Accept a connection request on this (new) id; ESTABLISHED follows."""
        self._check_usable()
        param, _keep = self._conn_param(
            private_data,
            retry_count=7,
            rnr_retry_count=rnr_retry_count,
            responder_resources=responder_resources,
            initiator_depth=initiator_depth,
        )
        _check(lib.rdma_accept(self._ptr, param), "rdma_accept")

    def reject(self, private_data: bytes = b"") -> None:
        """Reject a connection request on this (new) id."""
        self._check_usable()
        buf = ffi.new("uint8_t[]", private_data or b"\0")
        _check(lib.rdma_reject(self._ptr, buf, len(private_data)), "rdma_reject")

    def disconnect(self) -> None:
        """Disconnect (sends DREQ); both sides then see DISCONNECTED and the QP moves to error."""
        self._check_usable()
        _check(lib.rdma_disconnect(self._ptr), "rdma_disconnect")

    def _destroy(self) -> None:
        # rdma_destroy_id blocks until every event of this id was acked; the helper acks at once.
        lib.rdma_destroy_id(self._ptr)


# --- device ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PortInfo:
    """State of one device port (``ibv_query_port``)."""

    number: int
    state: str
    active: bool
    active_mtu: int
    max_mtu: int
    link_layer: str
    gid_table_len: int
    max_msg_size: int


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Capabilities of one RDMA device (``ibv_query_device``) and its ports."""

    name: str
    fw_ver: str
    max_qp: int
    max_qp_wr: int
    max_cq: int
    max_cqe: int
    max_mr: int
    max_mr_size: int
    max_sge: int
    ports: tuple[PortInfo, ...]


_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


def _query_port(ctx: Any, port: int) -> PortInfo:
    attr = ffi.new("struct ibv_port_attr *")
    _check(lib.ibv_query_port(ctx, port, attr), "ibv_query_port", f"port {port}")
    link = {lib.IBV_LINK_LAYER_ETHERNET: "Ethernet", lib.IBV_LINK_LAYER_INFINIBAND: "InfiniBand"}
    return PortInfo(
        number=port,
        state=_PORT_STATES.get(attr.state, str(attr.state)),
        active=attr.state == lib.IBV_PORT_ACTIVE,
        active_mtu=MTU_BYTES.get(attr.active_mtu, 0),
        max_mtu=MTU_BYTES.get(attr.max_mtu, 0),
        link_layer=link.get(attr.link_layer, "unknown"),
        gid_table_len=int(attr.gid_tbl_len),
        max_msg_size=int(attr.max_msg_sz),
    )


def _query_device(ctx: Any) -> DeviceInfo:
    attr = ffi.new("struct ibv_device_attr *")
    _check(lib.ibv_query_device(ctx, attr), "ibv_query_device")
    ports = tuple(_query_port(ctx, p) for p in range(1, attr.phys_port_cnt + 1))
    return DeviceInfo(
        name=ffi.string(lib.ibv_get_device_name(ctx.device)).decode(),
        fw_ver=ffi.string(attr.fw_ver).decode(errors="replace"),
        max_qp=int(attr.max_qp),
        max_qp_wr=int(attr.max_qp_wr),
        max_cq=int(attr.max_cq),
        max_cqe=int(attr.max_cqe),
        max_mr=int(attr.max_mr),
        max_mr_size=int(attr.max_mr_size),
        max_sge=int(attr.max_sge),
        ports=ports,
    )


def list_devices() -> list[DeviceInfo]:
    """Return every RDMA device on this host with its ports; raise DeviceError if there is none."""
    count = ffi.new("int *")
    devices = lib.ibv_get_device_list(count)
    if devices == ffi.NULL:
        raise DeviceError(
            "no RDMA device: ibv_get_device_list failed (is rdma_rxe or a NIC driver loaded?)",
            errno=ffi.errno,
            call="ibv_get_device_list",
        )
    try:
        result = []
        for i in range(count[0]):
            ctx = lib.ibv_open_device(devices[i])
            if ctx == ffi.NULL:
                raise VerbsError.from_errno("ibv_open_device", ffi.errno or 5)
            try:
                result.append(_query_device(ctx))
            finally:
                lib.ibv_close_device(ctx)
    finally:
        lib.ibv_free_device_list(devices)
    if not result:
        raise DeviceError(
            "no RDMA device found (is rdma_rxe or a NIC driver loaded?)", call="ibv_get_device_list"
        )
    return result


@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """One device async event (``ibv_get_async_event``), already acked."""

    event_type: int
    description: str
    kind: str
    """``"qp"``, ``"port"`` or ``"device"``: what ``element`` names."""
    element: int
    """QP number for QP events, port number for port events, else 0."""
    obj: int = 0
    """Address of the QP, CQ or SRQ the event is about (compare with their ``handle``), else 0."""


_QP_EVENTS = {
    lib.IBV_EVENT_QP_FATAL,
    lib.IBV_EVENT_QP_REQ_ERR,
    lib.IBV_EVENT_QP_ACCESS_ERR,
    lib.IBV_EVENT_COMM_EST,
}
_PORT_EVENTS = {lib.IBV_EVENT_PORT_ACTIVE, lib.IBV_EVENT_PORT_ERR}


class DeviceContext:
    """A device context opened by librdmacm (``cm_id->verbs``): not owned, never closed by us."""

    def __init__(self, raw: Any) -> None:
        self._ptr = raw
        self.handle = int(ffi.cast("uintptr_t", raw))

    @property
    def name(self) -> str:
        """Device name, e.g. ``rxe0``."""
        return str(ffi.string(lib.ibv_get_device_name(self._ptr.device)).decode())

    @property
    def async_fd(self) -> int:
        """The device's async-event fd (set non-blocking by :meth:`set_async_nonblocking`)."""
        return int(self._ptr.async_fd)

    def set_async_nonblocking(self) -> None:
        """Make the async-event fd non-blocking so it can sit on an event loop."""
        os.set_blocking(self.async_fd, False)

    def get_async_event(self) -> AsyncEvent | None:
        """Return the next pending async event (acked), or None when none is pending."""
        event_type = ffi.new("int *")
        element = ffi.new("uint32_t *")
        obj = ffi.new("uintptr_t *")
        rc = lib.rdmaio_get_async_event(self._ptr, event_type, element, obj)
        if rc == -11:
            return None
        if rc < 0:
            raise VerbsError.from_errno("ibv_get_async_event", -rc)
        etype = int(event_type[0])
        desc = ffi.string(lib.ibv_event_type_str(etype)).decode()
        kind = "qp" if etype in _QP_EVENTS else "port" if etype in _PORT_EVENTS else "device"
        return AsyncEvent(etype, desc, kind, int(element[0]), int(obj[0]))

    def query(self) -> DeviceInfo:
        """Query device and port attributes."""
        return _query_device(self._ptr)

    def query_port(self, port: int) -> PortInfo:
        """Query one port's attributes."""
        return _query_port(self._ptr, port)


# --- PD, MR ----------------------------------------------------------------------------------------


class ProtectionDomain(_Resource):
    """A protection domain on a device context."""

    _call_destroy = "ibv_dealloc_pd"

    def __init__(self, context: DeviceContext) -> None:
        super().__init__()
        self.context = context
        self._ptr = _check_ptr(lib.ibv_alloc_pd(context._ptr), "ibv_alloc_pd")

    def _destroy(self) -> None:
        lib.ibv_dealloc_pd(self._ptr)


class MemoryRegion(_Resource):
    """A registered buffer. The Python buffer is kept alive (and pinned) until ``close()``."""

    _call_destroy = "ibv_dereg_mr"
    _close_rank = 2

    def __init__(
        self,
        pd: ProtectionDomain,
        buffer: Any,
        *,
        remote_write: bool = False,
        remote_read: bool = False,
        remote_atomic: bool = False,
        readonly: bool = False,
    ) -> None:
        super().__init__(pd)
        self.buffer = buffer
        # readonly (zero-copy sends of bytes): the NIC only reads it, so no LOCAL_WRITE, and a read-only
        # buffer is accepted; REMOTE_WRITE/ATOMIC need LOCAL_WRITE and are refused by the device then.
        self._cbuf = ffi.from_buffer(buffer, require_writable=not readonly)
        access = 0 if readonly else lib.IBV_ACCESS_LOCAL_WRITE
        if remote_write:
            access |= lib.IBV_ACCESS_REMOTE_WRITE
        if remote_read:
            access |= lib.IBV_ACCESS_REMOTE_READ
        if remote_atomic:
            access |= lib.IBV_ACCESS_REMOTE_ATOMIC
        self.access: int = access
        self.length = len(self._cbuf)
        ptr = lib.ibv_reg_mr(pd._ptr, self._cbuf, self.length, access)
        if ptr == ffi.NULL:
            err = ffi.errno or 12
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
            raise MemoryRegistrationError(
                f"{os.strerror(err)} registering {self.length} bytes; RLIMIT_MEMLOCK (ulimit -l) is {limit}",
                errno=err,
                call="ibv_reg_mr",
            )
        self._ptr = ptr
        self.addr: int = int(ffi.cast("uintptr_t", self._cbuf))
        self.lkey: int = int(ptr.lkey)
        self.rkey: int = int(ptr.rkey)

    def _destroy(self) -> None:
        lib.ibv_dereg_mr(self._ptr)
        self._cbuf = None
        # self.buffer is released by the owner; keeping it here costs nothing until the MR is dropped.


# --- completion channel, CQ ------------------------------------------------------------------------


class CompletionChannel(_Resource):
    """A completion channel whose non-blocking fd signals armed CQs."""

    _call_destroy = "ibv_destroy_comp_channel"

    def __init__(self, context: DeviceContext) -> None:
        super().__init__()
        self.context = context
        self._ptr = _check_ptr(lib.ibv_create_comp_channel(context._ptr), "ibv_create_comp_channel")
        self.fd: int = int(self._ptr.fd)
        os.set_blocking(self.fd, False)
        self._fired = ffi.new("struct ibv_cq *[]", 64)
        self._fired_max = 64
        self._events = ffi.new("unsigned int *")
        self._err = ffi.new("int *")

    def drain_events(self) -> tuple[list[int], bool, int]:
        """Read every pending event, ack them per CQ and re-arm each CQ that fired (one C call, GIL
        released). Return ``(handles, overflow, events)``: the :attr:`CompletionQueue.handle` of each CQ
        that fired (in the order of their first event), whether more CQs fired than could be listed (then
        poll every CQ), and how many events were read. A failed read or re-arm raises
        :class:`~rdmaio.errors.VerbsError` after everything read was acked (so poll every CQ then too)."""
        self._check_usable()
        n = lib.rdmaio_drain_channel(self._ptr, self._fired, self._fired_max, self._events, self._err)
        listed = min(n, self._fired_max)
        fired = self._fired
        handles = [int(ffi.cast("uintptr_t", fired[i])) for i in range(listed)]
        if self._err[0]:
            raise VerbsError.from_errno("ibv_get_cq_event/ibv_req_notify_cq", self._err[0])
        return handles, n > self._fired_max, int(self._events[0])

    def _destroy(self) -> None:
        lib.ibv_destroy_comp_channel(self._ptr)


class CompletionBatch:
    """Preallocated buffers of :meth:`CompletionQueue.poll_grouped`: ``records`` (the completions, grouped
    by dispatch key) and ``groups`` (``key``, ``start``, ``count`` of each run), ``size`` entries each."""

    def __init__(self, size: int) -> None:
        if not 1 <= size <= MAX_POLL:
            raise ValueError(f"a completion batch holds 1 to {MAX_POLL} records, not {size}")
        self.size = size
        self.records: Any = ffi.new("struct rdmaio_wc[]", size)
        self.groups: Any = ffi.new("struct rdmaio_wc_group[]", size)
        self._scratch = ffi.new("struct rdmaio_wc[]", size)
        self._ngroups = ffi.new("int *")
        self.ngroups = 0

    def copy_records(self, start: int, count: int) -> Any:
        """A copy of ``records[start:start + count]`` (a new ``struct rdmaio_wc[count]``)."""
        if not (start >= 0 and count >= 0 and start + count <= self.size):
            raise IndexError(f"records {start}..{start + count} of a batch of {self.size}")
        if not count:
            return []
        copy = ffi.new("struct rdmaio_wc[]", count)  # len(copy) == count
        ffi.memmove(copy, self.records + start, count * ffi.sizeof("struct rdmaio_wc"))
        return copy


class CompletionQueue(_Resource):
    """A CQ attached to a :class:`CompletionChannel`, armed at creation.

    Two ways to consume it. A channel serving this CQ alone: :meth:`drain` reads and acks the channel's
    events, re-arms and polls into a preallocated record array in one C call. A channel serving a pool of
    CQs (:mod:`rdmaio.completions`): :meth:`CompletionChannel.drain_events` acks and re-arms every CQ that
    fired, then :meth:`poll_grouped` polls each of them, grouping the completions by dispatch key.
    """

    _call_destroy = "ibv_destroy_cq"
    _close_rank = 3

    def __init__(
        self, context: DeviceContext, channel: CompletionChannel, cqe: int, *, batch: int = 256
    ) -> None:
        super().__init__(channel)
        self.channel = channel
        self._ptr = _check_ptr(
            lib.ibv_create_cq(context._ptr, cqe, ffi.NULL, channel._ptr, 0), "ibv_create_cq", f"cqe={cqe}"
        )
        self.cqe = int(self._ptr.cqe)
        self.handle = int(ffi.cast("uintptr_t", self._ptr))  # what AsyncEvent.obj names for CQ_ERR
        self.batch = batch
        self.records = ffi.new("struct rdmaio_wc[]", batch)
        self._events = ffi.new("unsigned int *")
        self.events_total = 0
        self.completions_total = 0
        self.drain_calls = 0
        _check(lib.rdmaio_req_notify(self._ptr), "ibv_req_notify_cq")

    def drain(self) -> int:
        """Drain channel events and completions; return how many records were filled in ``records``.

        A return equal to ``batch`` means more may be waiting: call again.
        """
        self._check_usable()
        n = lib.rdmaio_drain_cq(self.channel._ptr, self._ptr, self.records, self.batch, self._events)
        if n < 0:
            raise VerbsError.from_errno("ibv_get_cq_event/ibv_poll_cq", -n)
        self.drain_calls += 1
        self.events_total += self._events[0]
        self.completions_total += n
        return int(n)

    def poll_grouped(self, batch: CompletionBatch) -> int:
        """Poll up to ``batch.size`` completions into ``batch.records`` grouped by dispatch key (stable:
        CQ order kept within a key), the runs in ``batch.groups[0:batch.ngroups]``. Return the number of
        records; ``batch.size`` means more may be waiting. Does not read channel events (see
        :meth:`CompletionChannel.drain_events`)."""
        self._check_usable()
        n = lib.rdmaio_poll_grouped(
            self._ptr, batch._scratch, batch.records, batch.size, batch.groups, batch._ngroups
        )
        if n < 0:
            raise VerbsError.from_errno("ibv_poll_cq", -n)
        batch.ngroups = int(batch._ngroups[0])
        self.completions_total += n
        return int(n)

    def iter_drain(self) -> Iterator[Any]:
        """Yield every completion record available now (re-draining while batches come back full)."""
        while True:
            n = self.drain()
            records = self.records
            for i in range(n):
                yield records[i]
            if n < self.batch:
                return

    def _destroy(self) -> None:
        lib.ibv_destroy_cq(self._ptr)


# --- QP --------------------------------------------------------------------------------------------


class QueuePair(_Resource):
    """The RC queue pair of a :class:`CMId` (created by ``CMId.create_qp``)."""

    _call_destroy = "rdma_destroy_qp"
    _close_rank = 0

    def __init__(
        self, cm_id: CMId, pd: ProtectionDomain, send_cq: CompletionQueue, recv_cq: CompletionQueue, cap: Any
    ) -> None:
        super().__init__(cm_id, pd, send_cq, recv_cq)
        self._cm_id = cm_id
        self._ptr = cm_id._ptr.qp
        self.qp_num: int = int(self._ptr.qp_num)
        self.max_send_wr: int = int(cap.max_send_wr)
        self.max_recv_wr: int = int(cap.max_recv_wr)
        self.max_inline_data: int = int(cap.max_inline_data)
        self._slots = ffi.new("uint32_t[]", max(self.max_recv_wr, 1))
        self._sends = ffi.new("struct rdmaio_send[]", max(self.max_send_wr, 1))
        self._bad = ffi.new("int *")
        # Its own one-entry array: the send engine stages frames in _sends and posts them later in the
        # loop iteration, so a probe written there could overwrite a staged frame.
        self._probe = ffi.new("struct rdmaio_send[1]")

    def post_recv_slots(
        self, mr: MemoryRegion, slot_size: int, slots: list[int], wr_id_base: int = 0
    ) -> None:
        """Post one receive per slot index (chained, one call) at ``mr.addr + slot * slot_size``; its
        ``wr_id`` is ``wr_id_base | slot`` (``wr_id_base``: ``make_wr_id(WR_KIND_RECV, tag, 0)``)."""
        self._check_usable()
        n = len(slots)
        if n > len(self._slots):
            raise ValueError(f"cannot post {n} receives on a queue of {len(self._slots)}")
        self._slots[0:n] = slots
        rc = lib.rdmaio_post_recv_slots(self._ptr, mr.lkey, mr.addr, slot_size, wr_id_base, self._slots, n)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_recv", -rc, f"{n} receives")

    def post_ring_slots(
        self, lkeys: Any, addr: int, slot_size: int, slots: list[int], wr_id_base: int = 0
    ) -> None:
        """Post one receive per slot of a ring registered chunk by chunk: slot ``s`` covers
        ``addr + s * slot_size`` with local key ``lkeys[s]`` (a ``uint32_t[]``); ``wr_id`` is
        ``wr_id_base | s`` (``wr_id_base``: ``make_wr_id(WR_KIND_RECV, tag, 0)``)."""
        self._check_usable()
        n = len(slots)
        if n > len(self._slots):
            raise ValueError(f"cannot post {n} receives on a queue of {len(self._slots)}")
        self._slots[0:n] = slots
        rc = lib.rdmaio_post_recv_ring(self._ptr, lkeys, addr, slot_size, wr_id_base, self._slots, n)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_recv", -rc, f"{n} receives")

    @property
    def send_array(self) -> Any:
        """Scratch ``struct rdmaio_send[max_send_wr]`` to fill before :meth:`post_sends`."""
        return self._sends

    def post_sends(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`send_array` as one chain."""
        self._check_usable()
        rc = lib.rdmaio_post_sends(self._ptr, self._sends, count, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, f"request {self._bad[0]} of {count}")

    # one-sided operations (issue 11): a scratch array of their own, so that posting one never clobbers
    # the frames the send engine staged in send_array but has not posted yet.
    @property
    def rdma_array(self) -> Any:
        """Scratch ``struct rdmaio_rdma_op[16]`` to fill before :meth:`post_rdma`."""
        array = getattr(self, "_rdma_ops", None)
        if array is None:
            array = self._rdma_ops = ffi.new("struct rdmaio_rdma_op[]", 16)
        return array

    def post_rdma(self, count: int) -> None:
        """Post the first ``count`` entries of :attr:`rdma_array` (one-sided requests) as one chain."""
        self._check_usable()
        rc = lib.rdmaio_post_rdma(self._ptr, self.rdma_array, count, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, f"one-sided request {self._bad[0]} of {count}")

    def remote_access(self) -> tuple[int, int, int]:
        """``(qp_access_flags, max_rd_atomic, max_dest_rd_atomic)`` as the device reports them."""
        self._check_usable()
        acc, rd, drd = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        _check(lib.rdmaio_qp_access(self._ptr, acc, rd, drd), "ibv_query_qp")
        return int(acc[0]), int(rd[0]), int(drd[0])

    def post_empty_write(self, wr_id: int) -> None:
        """Post one signalled zero-length RDMA WRITE (a liveness probe, see :mod:`rdmaio.keepalive`).

        It carries no data, needs no remote key (IBTA C9-88: a zero-length RDMA operation checks none),
        consumes no receive at the peer and produces no completion there. Its completion here is
        success once the peer's RC transport acknowledged it, or ``RETRY_EXC_ERR`` after the QP's ACK
        timeout and retry count ran out.
        """
        self._check_usable()
        wr = self._probe[0]
        wr.wr_id = wr_id
        wr.addr = 0
        wr.length = 0
        wr.lkey = 0
        wr.imm_data = 0
        wr.opcode = lib.IBV_WR_RDMA_WRITE
        wr.send_flags = lib.IBV_SEND_SIGNALED
        wr.rkey = 0
        wr.remote_addr = 0
        rc = lib.rdmaio_post_sends(self._ptr, self._probe, 1, self._bad)
        if rc < 0:
            raise VerbsError.from_errno("ibv_post_send", -rc, "zero-length RDMA WRITE")

    def query_timeouts(self) -> tuple[int, int]:
        """``(timeout, retry_cnt)`` of the QP as the device holds them (``ibv_query_qp``)."""
        self._check_usable()
        attr = ffi.new("struct ibv_qp_attr *")
        init = ffi.new("struct ibv_qp_init_attr *")
        _check(
            lib.ibv_query_qp(self._ptr, attr, lib.IBV_QP_TIMEOUT | lib.IBV_QP_RETRY_CNT, init),
            "ibv_query_qp",
        )
        return int(attr.timeout), int(attr.retry_cnt)

    def to_error(self) -> None:
        """Move the QP to the error state: outstanding work requests complete with WR_FLUSH_ERR."""
        self._check_usable()
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = lib.IBV_QPS_ERR
        _check(lib.ibv_modify_qp(self._ptr, attr, lib.IBV_QP_STATE), "ibv_modify_qp", "to ERR")

    def _destroy(self) -> None:
        lib.rdma_destroy_qp(self._cm_id._ptr)
        self._cm_id.qp = None
