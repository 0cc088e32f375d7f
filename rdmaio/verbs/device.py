"""Devices: :class:`DeviceContext`, port and device attributes, :func:`list_devices`, async events."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import DeviceError, VerbsError
from rdmaio.verbs._base import _check
from rdmaio.verbs.enums import MTU_BYTES

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
    max_srq: int = 0
    """Shared receive queues the device supports (0: none)."""
    max_srq_wr: int = 0
    """Receives one shared receive queue holds at most."""


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
        max_srq=int(attr.max_srq),
        max_srq_wr=int(attr.max_srq_wr),
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


def cm_device_handles() -> set[int]:
    """Handles of the device contexts librdmacm offers now (``rdma_get_devices``).

    Listing also makes librdmacm compare its devices with the kernel's: a device that was removed is
    marked dead, and its context (with the device's uverbs fd, which the kernel's removal waits for) is
    closed at once if no cm id uses it, else when the last one is destroyed.
    """
    count = ffi.new("int *")
    contexts = lib.rdma_get_devices(count)
    if contexts == ffi.NULL:
        return set()
    try:
        return {int(ffi.cast("uintptr_t", contexts[i])) for i in range(count[0])}
    finally:
        lib.rdma_free_devices(contexts)


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


class DeviceContext:
    """A device context opened by librdmacm (``cm_id->verbs``): not owned, never closed by us."""

    def __init__(self, raw: Any) -> None:
        self._ptr = raw
        self.handle = int(ffi.cast("uintptr_t", raw))
        # Read once (a context's device never changes): every connection's setup reads it several times.
        self.name: str = ffi.string(lib.ibv_get_device_name(raw.device)).decode()
        """Device name, e.g. ``rxe0``."""

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

    def query_onesided_caps(self) -> OneSidedCaps:
        """Query what the device offers one-sided RDMA: atomics, READ/atomic depths, memory windows."""
        caps = ffi.new("struct rdmaio_onesided_caps *")
        rc = lib.rdmaio_query_onesided_caps(self._ptr, caps)
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
