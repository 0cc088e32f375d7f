"""Verbs object layer: thin, synchronous, checked wrappers over librdmacm and libibverbs objects.

Lifetime model (after pyverbs): every object registers with the objects it depends on; ``close()`` first
closes its dependents (a PD closes its MRs and QPs, a CQ the QPs using it, a CM id its QP), then destroys
itself. ``close()`` is idempotent, objects are context managers, and a garbage-collected object is closed.
Every failing C call raises :class:`~rdmaio.errors.VerbsError` (or a subclass) carrying errno and the call.

After ``fork()`` the verbs objects inherited by the child are unusable (``ibv_fork_init(3)``): any use
raises :class:`~rdmaio.errors.ForkError`, and closing them in the child only forgets them, so that the
child cannot destroy the parent's resources through the shared device file.

Nothing here knows about event loops; the reactor layer puts the file descriptors on a loop.

Modules:

* :mod:`rdmaio.verbs.cm`: rdma_cm event channels, ids and events (``EventChannel``, ``CMId``, ``CMEvent``).
* :mod:`rdmaio.verbs.device`: device contexts, port and device attributes, async events.
* :mod:`rdmaio.verbs.memory`: protection domains and memory regions (and type 2 memory windows).
* :mod:`rdmaio.verbs.cq`: completion channels, completion queues and batches of completion records.
* :mod:`rdmaio.verbs.qp`: queue pairs and their chained posts.
* :mod:`rdmaio.verbs.srq`: shared receive queues.
* :mod:`rdmaio.verbs.path`: the path of a connected id (port, GIDs and their type, MTUs), read on request.
* :mod:`rdmaio.verbs.neighbour`: the MAC behind an IP address (netlink), for iWARP's MAC-based GIDs.
* :mod:`rdmaio.verbs.siw_key_guard`: the CQ that keeps Soft-iWARP's queues off the mmap key libsiw refuses.
* :mod:`rdmaio.verbs.wr`: the ``wr_id`` layout (``make_wr_id``, ``wr_kind``, ``wr_tag``, ``wr_index``).
* :mod:`rdmaio.verbs.enums`: the verbs constants as enums.
* :mod:`rdmaio.verbs._base`: checks, the fork guard, and the dependency-ordered ``close()``.
* :mod:`rdmaio.verbs.native`: the one gateway through which the core takes ``ffi``/``lib``.
"""

from __future__ import annotations

from rdmaio._ffi import ffi, lib
from rdmaio.verbs._base import fork_generation, make_sockaddr, sockaddr_to_tuple
from rdmaio.verbs.cm import CMEvent, CMId, EventChannel
from rdmaio.verbs.cq import CompletionBatch, CompletionChannel, CompletionQueue
from rdmaio.verbs.device import (
    AsyncEvent,
    DeviceContext,
    DeviceInfo,
    OneSidedCaps,
    PortInfo,
    cm_device_handles,
    list_devices,
)
from rdmaio.verbs.enums import (
    EVENT_COMM_EST,
    EVENT_CQ_ERR,
    EVENT_DEVICE_FATAL,
    EVENT_PORT_ACTIVE,
    EVENT_PORT_ERR,
    EVENT_QP_ACCESS_ERR,
    EVENT_QP_FATAL,
    EVENT_QP_REQ_ERR,
    EVENT_SRQ_ERR,
    EVENT_SRQ_LIMIT_REACHED,
    MTU_BYTES,
    SEND_INLINE,
    SEND_SIGNALED,
    WC_WITH_IMM,
    WR_RDMA_WRITE_WITH_IMM,
    WR_SEND_WITH_IMM,
    CMEventType,
    WcOpcode,
    WcStatus,
    wc_status_str,
)
from rdmaio.verbs.memory import MemoryRegion, MemoryWindow, ProtectionDomain
from rdmaio.verbs.qp import (
    POSTED,
    POSTED_DONE,
    POSTED_OTHER,
    POSTED_POLL_FAILED,
    OneSidedPort,
    QueuePair,
)
from rdmaio.verbs.srq import SharedReceiveQueue
from rdmaio.verbs.wr import (
    MAX_POLL,
    RDMA_OP,
    WR_INDEX_MASK,
    WR_KIND_CONTROL,
    WR_KIND_ONESIDED,
    WR_KIND_RECV,
    WR_KIND_SEND,
    WR_KIND_SHIFT,
    WR_TAG_BITS,
    WR_TAG_MASK,
    WR_TAG_SHIFT,
    dispatch_key,
    make_wr_id,
    wr_index,
    wr_kind,
    wr_tag,
)

__all__ = [
    "EVENT_COMM_EST",
    "EVENT_CQ_ERR",
    "EVENT_DEVICE_FATAL",
    "EVENT_PORT_ACTIVE",
    "EVENT_PORT_ERR",
    "EVENT_QP_ACCESS_ERR",
    "EVENT_QP_FATAL",
    "EVENT_QP_REQ_ERR",
    "EVENT_SRQ_ERR",
    "EVENT_SRQ_LIMIT_REACHED",
    "MAX_POLL",
    "MTU_BYTES",
    "POSTED",
    "POSTED_DONE",
    "POSTED_OTHER",
    "POSTED_POLL_FAILED",
    "RDMA_OP",
    "SEND_INLINE",
    "SEND_SIGNALED",
    "WC_WITH_IMM",
    "WR_INDEX_MASK",
    "WR_KIND_CONTROL",
    "WR_KIND_ONESIDED",
    "WR_KIND_RECV",
    "WR_KIND_SEND",
    "WR_KIND_SHIFT",
    "WR_RDMA_WRITE_WITH_IMM",
    "WR_SEND_WITH_IMM",
    "WR_TAG_BITS",
    "WR_TAG_MASK",
    "WR_TAG_SHIFT",
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
    "MemoryWindow",
    "OneSidedCaps",
    "OneSidedPort",
    "PortInfo",
    "ProtectionDomain",
    "QueuePair",
    "SharedReceiveQueue",
    "WcOpcode",
    "WcStatus",
    "cm_device_handles",
    "dispatch_key",
    "ffi",
    "fork_generation",
    "lib",
    "list_devices",
    "make_sockaddr",
    "make_wr_id",
    "sockaddr_to_tuple",
    "wc_status_str",
    "wr_index",
    "wr_kind",
    "wr_tag",
]
