"""Constants of the verbs layer: CM event types, work-completion statuses and opcodes, flags."""

from __future__ import annotations

import enum

from rdmaio._ffi import ffi, lib

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
EVENT_SRQ_ERR: int = lib.IBV_EVENT_SRQ_ERR
EVENT_SRQ_LIMIT_REACHED: int = lib.IBV_EVENT_SRQ_LIMIT_REACHED
EVENT_QP_LAST_WQE_REACHED: int = lib.IBV_EVENT_QP_LAST_WQE_REACHED


def wc_status_str(status: int) -> str:
    """Return libibverbs' description of a work-completion status."""
    return str(ffi.string(lib.ibv_wc_status_str(status)).decode())


MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
