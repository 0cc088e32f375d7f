"""Addresses of the ``rdma://`` scheme: which local IP address an RDMA listener should use.

rdma_cm cannot use the loopback interface, yet ``distributed`` defaults to ``127.0.0.1`` (``LocalCluster``)
and to wildcard addresses (``dask scheduler``). So on this scheme a loopback host means "this machine's
RDMA address", and a wildcard listener advertises that address. It is the dask config value
``distributed.comm.rdma.host`` when set (``DASK_DISTRIBUTED__COMM__RDMA__HOST``), else the first IPv4
address of an RDMA device port (an ACTIVE one if there is one), read from the port's GID table in sysfs
(RoCE GIDs embed the interface's IPv4 addresses as ``::ffff:a.b.c.d``). iWARP GIDs embed no address, only
the port's MAC address (its first 6 bytes): an iWARP port's address is that of the network interface with
that MAC address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

import dask.config

__all__ = ["interface_ipv4", "is_loopback", "is_wildcard", "rdma_host", "sysfs_ipv4_addresses"]

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
SYSFS_NET = Path("/sys/class/net")
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (primary) IPv4 address


def _natural(path: Path) -> tuple[int, str]:
    return (int(path.name), path.name) if path.name.isdigit() else (-1, path.name)


def sysfs_ipv4_addresses(root: Path | None = None, net_root: Path | None = None) -> list[str]:
    """IPv4 addresses of every RDMA device port, without repeats: those of ACTIVE ports first, each group
    in device, port and GID index order (a port whose state cannot be read counts as active).

    ``root`` defaults to :data:`SYSFS_INFINIBAND`. These files are what libibverbs' own
    ``ibv_query_gid`` reads, so this is the verbs view of the GID table without opening a device. An iWARP
    device's (``node_type`` RNIC) GIDs are MAC addresses: its port's addresses are those of the network
    interfaces under ``net_root`` (default :data:`SYSFS_NET`) with that MAC address.
    """
    active: list[str] = []
    inactive: list[str] = []
    try:
        devices = sorted((root or SYSFS_INFINIBAND).iterdir())
    except OSError:
        return active
    for device in devices:
        try:
            ports = sorted((device / "ports").iterdir(), key=_natural)
        except OSError:
            continue
        iwarp = _is_iwarp(device)
        for port in ports:
            found = active if _port_active(port) else inactive
            try:
                gids = sorted((port / "gids").iterdir(), key=_natural)
            except OSError:
                continue
            for gid_file in gids:
                addresses = _ipv4_of_iwarp_gid(gid_file, net_root) if iwarp else [_ipv4_of_gid(gid_file)]
                for address in addresses:
                    if address is not None and address not in active and address not in inactive:
                        found.append(address)
    return active + inactive


def _is_iwarp(device: Path) -> bool:
    try:
        return "RNIC" in (device / "node_type").read_text()  # "4: RNIC": the iWARP transport
    except OSError:
        return False


def _ipv4_of_iwarp_gid(gid_file: Path, net_root: Path | None) -> list[str | None]:
    """The IPv4 address of each network interface whose MAC address is the iWARP GID's first 6 bytes."""
    try:
        raw = ipaddress.IPv6Address(gid_file.read_text().strip()).packed
    except (OSError, ValueError):
        return []
    if not any(raw[:6]):
        return []  # an empty table slot
    mac = ":".join(f"{byte:02x}" for byte in raw[:6])
    try:
        netdevs = sorted((net_root or SYSFS_NET).iterdir())
    except OSError:
        return []
    found: list[str | None] = []
    for netdev in netdevs:
        try:
            if (netdev / "address").read_text().strip().lower() != mac:
                continue
        except OSError:
            continue
        found.append(interface_ipv4(netdev.name))
    return found


def interface_ipv4(netdev: str) -> str | None:
    """The (primary) IPv4 address of the network interface ``netdev``; None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", netdev.encode()[:15]))
        except OSError:  # EADDRNOTAVAIL: no IPv4 address; ENODEV: gone meanwhile
            return None
    return socket.inet_ntoa(answer[20:24])  # struct ifreq: 16 B name, then sockaddr_in (port at 18)


def _port_active(port: Path) -> bool:
    try:
        state = (port / "state").read_text()  # e.g. "4: ACTIVE"
    except OSError:
        return True
    return "ACTIVE" in state


def _ipv4_of_gid(gid_file: Path) -> str | None:
    try:
        text = gid_file.read_text().strip()
        mapped = ipaddress.IPv6Address(text).ipv4_mapped
    except (OSError, ValueError):  # unreadable entries (EINVAL for empty slots on some kernels)
        return None
    if mapped is None or mapped.is_unspecified:
        return None
    return str(mapped)


def rdma_host() -> str:
    """The address this machine's RDMA listeners advertise (see the module docstring).

    Raises ``OSError`` when no address is configured and no RDMA port has an IPv4 address.
    """
    configured = dask.config.get("distributed.comm.rdma.host", None)
    if configured:
        return str(configured)
    addresses = sysfs_ipv4_addresses()
    if not addresses:
        raise OSError(
            "no RDMA device port with an IPv4 address found in /sys/class/infiniband; pass an explicit "
            "RDMA address (rdma://ADDRESS:PORT) or set the dask config distributed.comm.rdma.host"
        )
    return addresses[0]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True for an empty host, ``0.0.0.0`` and ``::`` (listen on every interface)."""
    return host in ("", "0.0.0.0", "::")
