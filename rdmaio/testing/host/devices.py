"""Device detection: whether this machine has a usable RDMA device, so CMD can run here without a VM.

Usable means an ACTIVE ``rdma link`` port of a device listed in sysfs whose netdev has an IPv4 address.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rdmaio.cli.system import run_command

SYSFS_INFINIBAND = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class RdmaLink:
    """One line of ``rdma link show``."""

    device: str
    port: str
    state: str
    netdev: str | None


@dataclass(frozen=True)
class LocalRdma:
    """A usable RDMA device on this machine."""

    device: str
    netdev: str
    addr: str


def parse_rdma_links(text: str) -> list[RdmaLink]:
    """Parse the output of ``rdma link show``."""
    links: list[RdmaLink] = []
    for line in text.splitlines():
        tokens = line.split()
        if len(tokens) < 2 or tokens[0] != "link" or "/" not in tokens[1]:
            continue
        device, _, port = tokens[1].partition("/")
        fields: dict[str, str] = {}
        for i in range(2, len(tokens) - 1):
            fields.setdefault(tokens[i], tokens[i + 1])
        links.append(RdmaLink(device, port, fields.get("state", ""), fields.get("netdev")))
    return links


def _ipv4_addresses(netdev: str) -> list[str]:
    out = run_command(["ip", "-4", "-o", "addr", "show", "dev", netdev])
    return re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out or "")


def find_local_rdma(
    sysfs: Path = SYSFS_INFINIBAND,
    rdma_link_output: str | None = None,
    ipv4_of: Callable[[str], list[str]] | None = None,
) -> LocalRdma | None:
    """This machine's usable RDMA device, or None.

    Usable means: ``sysfs`` lists a device, and ``rdma link`` shows an ACTIVE port of it whose netdev has
    an IPv4 address. ``rdma_link_output`` and ``ipv4_of`` replace the ``rdma link`` and ``ip addr``
    commands (for tests).
    """
    try:
        devices = {p.name for p in sysfs.iterdir()}
    except OSError:
        return None
    if not devices:
        return None
    if rdma_link_output is None:
        rdma_link_output = run_command(["rdma", "link", "show"]) or ""
    lookup = ipv4_of if ipv4_of is not None else _ipv4_addresses
    for link in parse_rdma_links(rdma_link_output):
        if link.device in devices and link.state == "ACTIVE" and link.netdev:
            addrs = lookup(link.netdev)
            if addrs:
                return LocalRdma(link.device, link.netdev, addrs[0])
    return None


def have_local_rdma(
    sysfs: Path = SYSFS_INFINIBAND,
    rdma_link_output: str | None = None,
    ipv4_of: Callable[[str], list[str]] | None = None,
) -> bool:
    """Whether this machine has a usable RDMA device (see :func:`find_local_rdma`)."""
    return find_local_rdma(sysfs, rdma_link_output, ipv4_of) is not None
