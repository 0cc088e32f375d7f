"""The path record of a connection: what carries it, as ``ep.get_extra_info("rdma")`` returns it (the
public name is :class:`rdmaio.PathInfo`, re-exported by :mod:`rdmaio.path`).

:class:`PathInfo` names the device and port, the transport (InfiniBand, RoCE v1 or v2, iWARP), the local
and remote GID with the local entry's type and index, the port's active MTU and the MTU the queue pair
uses, the inline limit, the credit window and receive depth, the rendezvous threshold, whether a shared
receive queue feeds it, the features both sides negotiated, and the peer's rdmaio version.

A connection that exists *is* on RDMA (rdmaio has no TCP fallback); the record tells which RDMA: the GID
type and index a RoCE connection really uses (a RoCE v1 GID chosen where v2 was meant, or an IPv6
link-local GID where the routable IPv4-mapped one was meant, is a classic silent misconfiguration), and
the MTU both sides agreed on. It is read from the device once, on the first request (``ibv_query_port``,
``ibv_query_qp`` and ``ibv_query_gid_ex`` are system calls, never made in every connection's setup), and
kept: later requests return the same object. docs/monitoring.md shows how to use it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rdmaio.protocol import (
    FEATURE_BATCH,
    FEATURE_GROW,
    FEATURE_ONESIDED,
    FEATURE_RECLAIM,
    FEATURE_RNDV,
)
from rdmaio.verbs.neighbour import iwarp_gid
from rdmaio.verbs.path import PathAttributes, transport_name

if TYPE_CHECKING:
    from rdmaio.core.connection import Connection

__all__ = ["FEATURE_NAMES", "PathInfo", "format_gid", "iwarp_gids", "path_info", "query_connection_path"]

FEATURE_NAMES: dict[int, str] = {
    FEATURE_BATCH: "batch",
    FEATURE_GROW: "grow",
    FEATURE_ONESIDED: "onesided",
    FEATURE_RNDV: "rndv",
    FEATURE_RECLAIM: "reclaim",
}
"""The name of each handshake feature bit, as :attr:`PathInfo.features` lists it."""


def format_gid(raw: bytes) -> str:
    """A GID's 16 bytes as an IPv6 address in its compressed form, as ``ibv_devinfo -v`` prints GIDs
    (``fe80::5054:ff:fe12:3456``, ``::ffff:198.18.0.1`` for a RoCE v2 GID of an IPv4 address)."""
    address = ipaddress.IPv6Address(bytes(raw))
    mapped = address.ipv4_mapped
    # inet_ntop's form for IPv4-mapped GIDs on every Python (3.13 prints it so, older ones in hex)
    return f"::ffff:{mapped}" if mapped is not None else str(address)


@dataclass(frozen=True, slots=True)
class PathInfo:
    """What carries one connection (see the module docstring). Frozen; :meth:`as_dict` and
    :meth:`describe` present it."""

    device: str
    """The RDMA device, e.g. ``"rxe0"``, ``"mlx5_0"``."""
    port: int
    """The device's port number (1-based)."""
    transport: str
    """``"InfiniBand"``, ``"RoCE v1"``, ``"RoCE v2"`` or ``"iWARP"``."""
    link_layer: str
    """The port's link layer: ``"InfiniBand"`` or ``"Ethernet"`` (``"unknown"`` if the device says
    neither)."""
    local_gid: str
    """The local GID the connection uses, as an IPv6 address (:func:`format_gid`). On iWARP: the device's
    MAC-based GID (the netdev's MAC, then zeros: ``ceba:f7cc:83aa::``), its port's one GID entry."""
    remote_gid: str
    """The peer's GID, as an IPv6 address. On iWARP: the peer device's MAC-based GID, from the MAC this
    host knows for the peer's IP address (``::`` when it knows none)."""
    gid_type: str
    """The type of the local GID entry: ``"IB"``, ``"RoCE v1"``, ``"RoCE v2"`` (``""`` if unknown)."""
    gid_index: int
    """Index of the local GID in the port's table (``/sys/class/infiniband/<dev>/ports/<n>/gids/<i>``;
    -1 if unknown)."""
    active_mtu: int
    """The port's active MTU, in bytes."""
    path_mtu: int
    """The MTU the queue pair uses (at most both ports' active MTU), in bytes (0 if unknown)."""
    max_inline: int
    """The largest send posted inline, in bytes (0: none)."""
    credit_window: int
    """Frames this side may have in flight to the peer at most: the receive depth the peer announced
    (its window may start smaller and grow to this)."""
    recv_depth: int
    """Receive slots this side may post for the peer (its announced receive depth)."""
    rndv_threshold: int
    """Messages of at least this many bytes go by rendezvous (zero-copy RDMA READ); 0: rendezvous is not
    used on this connection (turned off here, or the peer does not support it)."""
    srq: bool
    """True when this side's receives come from the device's shared receive queue."""
    features: tuple[str, ...]
    """The features both sides announced (sorted names of :data:`FEATURE_NAMES`), and ``"header-framing"``
    when the connection uses the header framing (:mod:`rdmaio.protocol.framing`)."""
    peer_version: str | None
    """The peer's rdmaio version from its handshake; None for a peer that does not send it (rdmaio
    0.1.0 builds before the handshake carried it)."""
    qp_num: int
    """The local queue pair number (as ``rdma resource show qp`` lists it)."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict (``features`` as a list), ready for ``json.dumps``."""
        record = asdict(self)
        record["features"] = list(self.features)
        return record

    def describe(self) -> str:
        """A few lines for people (``rdmaio ping -v``, ``rdmaio perf``, ``doctor --peer``)."""
        mtu = f"MTU {self.path_mtu}" if self.path_mtu else "MTU ?"
        if self.active_mtu and self.active_mtu != self.path_mtu:
            mtu += f" (port {self.active_mtu})"
        index = f"[{self.gid_index}]" if self.gid_index >= 0 else ""
        gid_type = f", {self.gid_type}" if self.gid_type else ""
        rndv = f"rendezvous from {self.rndv_threshold} B" if self.rndv_threshold else "no rendezvous"
        peer = f"rdmaio {self.peer_version}" if self.peer_version else "rdmaio (version not sent)"
        return "\n".join(
            [
                f"path: {self.device} port {self.port}, {self.transport} over {self.link_layer}, {mtu}, "
                f"qp {self.qp_num}",
                f"  GID{index} {self.local_gid} -> {self.remote_gid}{gid_type}",
                f"  credits {self.credit_window}, receive depth {self.recv_depth}, "
                f"inline {self.max_inline} B, {rndv}, SRQ {'on' if self.srq else 'off'}",
                f"  features: {', '.join(self.features) or 'none'}; peer {peer}",
            ]
        )


_NO_GID = bytes(16)


def iwarp_gids(attributes: PathAttributes, local_ip: str | None, peer_ip: str | None) -> tuple[bytes, bytes]:
    """The local and remote GID of an iWARP connection: what the device read where it knew it, else the
    MAC-based GID of the netdev behind each side's IP address (:func:`rdmaio.verbs.neighbour.iwarp_gid`).
    iWARP's connection manager leaves the peer's GID (and on the connecting side its own) all zeros: the
    connection runs over TCP, whose addresses are all it knows. System calls (netlink): only on request."""
    local_gid, remote_gid = attributes.local_gid, attributes.remote_gid
    if local_gid == _NO_GID and local_ip is not None:
        local_gid = iwarp_gid(local_ip) or local_gid
    if remote_gid == _NO_GID and peer_ip is not None:
        remote_gid = iwarp_gid(peer_ip) or remote_gid
    return local_gid, remote_gid


def path_info(connection: Connection, attributes: PathAttributes) -> PathInfo:
    """The record of ``connection`` from the ``attributes`` its cm id's
    :meth:`~rdmaio.verbs.CMId.query_path` read (the rest comes from the connection; on iWARP the GIDs
    rdma_cm does not know come from :func:`iwarp_gids`)."""
    session = connection.session
    local, peer = session.local, session.peer
    negotiated = local.features & peer.features
    rndv = connection.rndv
    local_gid, remote_gid = attributes.local_gid, attributes.remote_gid
    if attributes.iwarp:
        local_gid, remote_gid = iwarp_gids(
            attributes, _ip_of(connection.extra.get("sockname")), _ip_of(connection.extra.get("peername"))
        )
    return PathInfo(
        device=str(connection.extra["device"]),
        port=attributes.port or int(connection.extra["port"]),
        transport=transport_name(attributes.link_layer, attributes.iwarp, attributes.gid_type),
        link_layer=attributes.link_layer,
        local_gid=format_gid(local_gid),
        remote_gid=format_gid(remote_gid),
        gid_type=attributes.gid_type,
        gid_index=attributes.gid_index,
        active_mtu=attributes.active_mtu,
        path_mtu=attributes.path_mtu,
        max_inline=int(connection.max_inline),
        credit_window=peer.recv_depth,
        recv_depth=local.recv_depth,
        rndv_threshold=connection.options.rndv_threshold if rndv is not None and session.rendezvous else 0,
        srq=connection.transport.shared is not None,
        # The header framing (no immediate data: a device is iWARP, or a side forced it) is listed as
        # "header-framing" among the features.
        features=tuple(
            sorted(
                [name for bit, name in FEATURE_NAMES.items() if negotiated & bit]
                + ([] if session.framing.immediate else ["header-framing"])
            )
        ),
        peer_version=peer.software or None,
        qp_num=int(connection.extra["qp_num"]),
    )


def _ip_of(address: Any) -> str | None:
    """The host part of a ``(host, port)`` address, or None."""
    return str(address[0]) if isinstance(address, tuple) and address else None


def query_connection_path(connection: Connection) -> PathInfo:
    """Read ``connection``'s path from the device (system calls: :meth:`rdmaio.Endpoint.get_extra_info`
    does it once and keeps the record). Raises :class:`~rdmaio.errors.VerbsError` when the connection's
    resources are gone (closed) or a query fails."""
    attributes: PathAttributes = connection._cm_id.query_path()  # the connection's own cm id
    return path_info(connection, attributes)
