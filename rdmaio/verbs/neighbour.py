"""The link-layer (MAC) address behind an IP address, from the kernel's routing netlink: what an iWARP
path record needs for the peer's GID.

An iWARP device's GID is its netdev's MAC address followed by ten zero bytes (siw, cxgb4 and irdma all
fill their one GID entry so; ``/sys/class/infiniband/<dev>/ports/<n>/gids/0``). The iWARP connection
manager never learns the peer's: the connection runs over TCP, and rdma_cm's route holds zeros for it.
This host knows it all the same: an address of this host is its netdev's MAC, any other one on the link
is in the neighbour (ARP/NDP) table, which the TCP connection under the queue pair filled.

Two netlink dumps (``RTM_GETADDR``, ``RTM_GETNEIGH``), made when a path record is first asked for, never
in a connection's setup.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

__all__ = ["iwarp_gid", "link_address_of"]

_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_RTATTR = struct.Struct("=HH")  # length, type
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, interface index
_NDMSG = struct.Struct("=BxxxiHBB")  # family, interface index, state, flags, type
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_RTM_NEWNEIGH, _RTM_GETNEIGH = 28, 30
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_NDA_DST, _NDA_LLADDR = 1, 2
_NUD_INCOMPLETE, _NUD_FAILED = 0x01, 0x20
_SYSFS_NET = Path("/sys/class/net")


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attributes(data: bytes, offset: int, end: int) -> dict[int, bytes]:
    """The route attributes in ``data[offset:end]``, by type (the last of a type wins)."""
    found: dict[int, bytes] = {}
    while offset + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, offset)
        if length < _RTATTR.size or offset + length > end:
            break  # malformed: stop rather than read past the message
        found[kind] = data[offset + _RTATTR.size : offset + length]
        offset += _align(length)
    return found


def _dump(request_type: int, body: bytes, reply_type: int) -> Iterator[bytes]:
    """Each reply message of a netlink dump, without its netlink header."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(5.0)  # the kernel answers at once; never hang a path query on it
        header = _NLMSG_HEADER.pack(
            _NLMSG_HEADER.size + len(body), request_type, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
        )
        sock.sendall(header + body)
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _NLMSG_HEADER.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSG_HEADER.unpack_from(data, offset)
                if length < _NLMSG_HEADER.size or offset + length > len(data):
                    return
                if kind in (_NLMSG_DONE, _NLMSG_ERROR):
                    return
                if kind == reply_type:
                    yield data[offset + _NLMSG_HEADER.size : offset + length]
                offset += _align(length)


def _packed(address: str) -> tuple[int, bytes]:
    ip = ipaddress.ip_address(address)
    return (socket.AF_INET if ip.version == 4 else socket.AF_INET6), ip.packed


def _netdev_address(index: int) -> bytes | None:
    """The MAC of the interface with this index (sysfs), or None."""
    try:
        text = (_SYSFS_NET / socket.if_indextoname(index) / "address").read_text().strip()
        return bytes.fromhex(text.replace(":", ""))
    except (OSError, ValueError):
        return None


def _local_interface(family: int, packed: bytes) -> int | None:
    """The index of the interface holding this address of this host, or None."""
    for message in _dump(_RTM_GETADDR, _IFADDRMSG.pack(family, 0, 0, 0, 0), _RTM_NEWADDR):
        if len(message) < _IFADDRMSG.size:
            continue
        msg_family, _prefix, _flags, _scope, index = _IFADDRMSG.unpack_from(message)
        if msg_family != family:
            continue
        attrs = _attributes(message, _IFADDRMSG.size, len(message))
        if packed in (attrs.get(_IFA_LOCAL), attrs.get(_IFA_ADDRESS)):
            return int(index)
    return None


def _neighbour(family: int, packed: bytes) -> bytes | None:
    """The link-layer address the neighbour table holds for this address, or None."""
    for message in _dump(_RTM_GETNEIGH, _NDMSG.pack(family, 0, 0, 0, 0), _RTM_NEWNEIGH):
        if len(message) < _NDMSG.size:
            continue
        msg_family, _index, state, _flags, _type = _NDMSG.unpack_from(message)
        if msg_family != family or state & (_NUD_INCOMPLETE | _NUD_FAILED):
            continue
        attrs = _attributes(message, _NDMSG.size, len(message))
        lladdr = attrs.get(_NDA_LLADDR)
        if attrs.get(_NDA_DST) == packed and lladdr:
            return lladdr
    return None


def link_address_of(address: str) -> bytes | None:
    """The link-layer address behind the IP ``address``: its netdev's when it is this host's, else the
    neighbour table's entry; None when neither knows it (or netlink cannot be asked)."""
    with contextlib.suppress(OSError, ValueError):
        family, packed = _packed(address)
        index = _local_interface(family, packed)
        if index is not None:
            return _netdev_address(index)
        return _neighbour(family, packed)
    return None


def iwarp_gid(address: str) -> bytes | None:
    """The GID an iWARP device behind the IP ``address`` has (its netdev's 6-byte MAC then ten zero bytes),
    or None when the MAC is not known here."""
    mac = link_address_of(address)
    if mac is None or len(mac) != 6:
        return None
    return mac + bytes(10)
