"""The path of one connection as the device holds it: :class:`PathAttributes` and :func:`query_path`.

One C call (``rdmaio_query_path``: ``ibv_query_port``, ``ibv_query_qp`` and ``ibv_query_gid_ex``) reads
the port, the GIDs the queue pair uses and their type; the caller does it once, when asked
(:meth:`rdmaio.verbs.CMId.query_path`), never in every connection's setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import VerbsError
from rdmaio.verbs.enums import MTU_BYTES

__all__ = ["GID_TYPES", "PathAttributes", "query_path", "transport_name"]

GID_TYPES: dict[int, str] = {
    lib.IBV_GID_TYPE_IB: "IB",
    lib.IBV_GID_TYPE_ROCE_V1: "RoCE v1",
    lib.IBV_GID_TYPE_ROCE_V2: "RoCE v2",
}
"""``enum ibv_gid_type`` by value, named as ``ibv_devinfo -v`` and sysfs' ``gid_attrs/types`` name them
(sysfs says ``IB/RoCE v1`` for both of the first two)."""

_LINK_LAYERS = {lib.IBV_LINK_LAYER_INFINIBAND: "InfiniBand", lib.IBV_LINK_LAYER_ETHERNET: "Ethernet"}


@dataclass(frozen=True, slots=True)
class PathAttributes:
    """What ``rdmaio_query_path`` read for one connected cm id."""

    port: int
    """The device port the id is bound to."""
    link_layer: str
    """``"InfiniBand"``, ``"Ethernet"`` or ``"unknown"`` (the port's)."""
    iwarp: bool
    """The device is an iWARP device (``IBV_TRANSPORT_IWARP``)."""
    local_gid: bytes
    """The 16 bytes of the local GID."""
    remote_gid: bytes
    """The 16 bytes of the remote GID."""
    gid_index: int
    """Index of the local GID in the port's table (-1: not found)."""
    gid_type: str
    """``"IB"``, ``"RoCE v1"``, ``"RoCE v2"`` or ``""`` (unknown)."""
    active_mtu: int
    """The port's active MTU in bytes (0: unknown)."""
    path_mtu: int
    """The MTU the queue pair uses, in bytes (0: unknown or no queue pair)."""


def transport_name(link_layer: str, iwarp: bool, gid_type: str) -> str:
    """The transport in words: ``"iWARP"``, ``"InfiniBand"``, ``"RoCE v2"`` or ``"RoCE v1"``."""
    if iwarp:
        return "iWARP"
    if link_layer == "InfiniBand":
        return "InfiniBand"
    return "RoCE v2" if gid_type == "RoCE v2" else "RoCE v1"


def query_path(raw_id: Any) -> PathAttributes:
    """Read the path of the connected ``struct rdma_cm_id *`` ``raw_id``; raise
    :class:`~rdmaio.errors.VerbsError` when a query fails."""
    out = ffi.new("struct rdmaio_path *")
    rc = lib.rdmaio_query_path(raw_id, out)
    if rc < 0:
        raise VerbsError.from_errno("rdmaio_query_path", -rc, "ibv_query_port/ibv_query_qp")
    return PathAttributes(
        port=int(out.port_num),
        link_layer=_LINK_LAYERS.get(int(out.link_layer), "unknown"),
        iwarp=int(out.transport_type) == lib.IBV_TRANSPORT_IWARP,
        local_gid=bytes(ffi.buffer(out.sgid)),
        remote_gid=bytes(ffi.buffer(out.dgid)),
        gid_index=int(out.sgid_index),
        gid_type=GID_TYPES.get(int(out.gid_type), ""),
        active_mtu=MTU_BYTES.get(int(out.active_mtu), 0),
        path_mtu=MTU_BYTES.get(int(out.path_mtu), 0),
    )
