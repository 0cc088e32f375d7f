"""What ``rdmaio doctor`` reads from the machine, behind one object that tests replace with fakes.

Every file is read below :attr:`System.root` (``/`` for real, a temporary directory holding a fake
``sys/``, ``proc/``, ``dev/``, ``etc/`` and ``lib/modules/`` in tests), and every command goes through
:attr:`System.run`, so each check can be exercised without RDMA hardware.
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing verbs loads the extension, which is one of the things doctor checks
    from rdmaio.verbs import DeviceInfo

__all__ = [
    "DeviceCaps",
    "LoopbackTime",
    "PortState",
    "SysfsDevice",
    "System",
    "parse_devinfo",
    "run_command",
    "transport_of",
]

# The administrator's tools (ldconfig, rdma, ip) live in sbin, which is often not on a user's PATH.
_SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"
_CAP_IPC_LOCK = 14
LOOPBACK_PAYLOAD = b"rdmaio doctor loopback"


def run_command(args: Sequence[str]) -> str | None:
    """Run a command briefly and return its standard output, or None when it is missing or fails."""
    path = f"{os.environ.get('PATH', '')}:{_SBIN_PATH}"
    exe = shutil.which(args[0], path=path)
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *args[1:]], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _real_list_devices() -> list[DeviceInfo]:
    from rdmaio.verbs import list_devices

    return list_devices()


def _real_import_extension() -> None:
    import rdmaio._rdmaio_cffi  # noqa: F401


class LoopbackTime(float):
    """The seconds a loopback connect and echo took, with what the connection got from the device."""

    max_inline: int | None = None
    """The inline data size of the connection's send queue (bytes), when known."""


async def _echo_once(addr: str) -> float:
    import rdmaio

    async def handler(ep: rdmaio.Endpoint) -> None:
        async with ep:
            msg = await ep.recv()
            if msg is not None:
                await ep.send(msg)

    server = await rdmaio.serve(handler, addr, 0)
    async with server:
        port = server.addresses[0][1]
        start = time.perf_counter()
        async with await rdmaio.connect(addr, port) as ep:
            await ep.send(LOOPBACK_PAYLOAD)
            reply = await ep.recv()
            inline = ep.get_extra_info("max_inline")
        elapsed = LoopbackTime(time.perf_counter() - start)
    if reply != LOOPBACK_PAYLOAD:
        raise RuntimeError(f"the echo came back wrong: {reply!r}")
    elapsed.max_inline = inline if isinstance(inline, int) else None
    return elapsed


def _real_loopback(addr: str, timeout: float) -> float:
    async def bounded() -> float:
        return await asyncio.wait_for(_echo_once(addr), timeout)

    return asyncio.run(bounded())


def _read_write(path: Path) -> bool:
    return os.access(path, os.R_OK | os.W_OK)


def _real_memlock() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


@dataclass(frozen=True, slots=True)
class PortState:
    """One port of a device as sysfs shows it."""

    device: str
    number: int
    state: str
    """``ACTIVE``, ``DOWN``, ... (the text after ``4: `` in the ``state`` file)."""
    link_layer: str
    gids: tuple[tuple[str, str, str], ...]
    """The non-zero GIDs: (gid, type such as ``RoCE v2``, netdev) each."""
    transport: str = "unknown"
    """``InfiniBand``, ``RoCE v2``, ``RoCE v1``, ``RoCE v1/v2``, ``RoCE``, ``iWARP`` or ``unknown``
    (:func:`transport_of`)."""
    link_netdev: str | None = None
    """The netdev ``rdma link`` names for the port (iWARP ports have no GID attributes that name it)."""

    @property
    def netdev(self) -> str | None:
        """The network device the port's GIDs are bound to (RoCE), else the one ``rdma link`` names."""
        return next((ndev for _gid, _type, ndev in self.gids if ndev), self.link_netdev)

    def roce_v2_ipv4(self) -> list[str]:
        """IPv4 addresses that have a RoCE v2 GID (``::ffff:a.b.c.d``): what rdma_cm over IPv4 uses."""
        found = []
        for gid, gid_type, _ndev in self.gids:
            parts = gid.split(":")
            if gid_type.lower() == "roce v2" and len(parts) == 8 and parts[:6] == ["0000"] * 5 + ["ffff"]:
                raw = int(parts[6] + parts[7], 16)
                found.append(".".join(str((raw >> s) & 0xFF) for s in (24, 16, 8, 0)))
        return found


def transport_of(node_type: str, link_layer: str, gid_types: Sequence[str] = ()) -> str:
    """The transport of a port: from the device's ``node_type`` (``RNIC`` is iWARP), else the port's link
    layer and, on Ethernet, its GID types (RoCE v1 and/or v2)."""
    if node_type.upper() == "RNIC":
        return "iWARP"
    if link_layer == "InfiniBand":
        return "InfiniBand"
    if link_layer == "Ethernet":
        kinds = {t.strip().lower() for t in gid_types}
        v1 = bool(kinds & {"ib/roce v1", "roce v1"})
        v2 = "roce v2" in kinds
        if v1 and v2:
            return "RoCE v1/v2"
        if v1:
            return "RoCE v1"
        return "RoCE v2" if v2 else "RoCE"
    return "unknown"


@dataclass(frozen=True, slots=True)
class DeviceCaps:
    """What a device offers that changes what rdmaio does on it (from ``ibv_devinfo -v``)."""

    transport: str
    """``ibv_devinfo``'s transport (``InfiniBand`` covers RoCE, ``iWARP``)."""
    atomic_cap: str
    """``ATOMIC_NONE``, ``ATOMIC_HCA``, ``ATOMIC_GLOB``."""
    max_mw: int
    """Memory windows (0: none)."""
    max_sge_rd: int
    """Scatter entries of one RDMA READ."""
    max_sge: int
    """Scatter/gather entries of one send or receive."""

    @property
    def atomics(self) -> bool:
        """Whether the device performs RDMA atomics."""
        return self.atomic_cap not in ("", "ATOMIC_NONE")

    @property
    def immediate_data(self) -> bool:
        """Whether SEND and RDMA WRITE can carry immediate data (iWARP has none)."""
        return self.transport != "iWARP"


def parse_devinfo(text: str) -> dict[str, DeviceCaps]:
    """The capabilities of each device in the output of ``ibv_devinfo -v``."""
    found: dict[str, DeviceCaps] = {}
    name: str | None = None
    fields: dict[str, str] = {}

    def flush() -> None:
        if name is None:
            return

        def number(key: str) -> int:
            match = re.match(r"\s*(\d+)", fields.get(key, ""))
            return int(match.group(1)) if match else 0

        found[name] = DeviceCaps(
            transport=fields.get("transport", "").split(" (")[0].strip() or "unknown",
            atomic_cap=fields.get("atomic_cap", "").split(" (")[0].strip(),
            max_mw=number("max_mw"),
            max_sge_rd=number("max_sge_rd"),
            max_sge=number("max_sge"),
        )

    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        if key == "hca_id":
            flush()
            name, fields = value.strip(), {}
        elif name is not None and key not in fields:
            fields[key] = value.strip()
    flush()
    return found


@dataclass(frozen=True, slots=True)
class SysfsDevice:
    """One RDMA device under ``/sys/class/infiniband``."""

    name: str
    ports: tuple[PortState, ...]
    node_type: str = ""
    """``CA`` (InfiniBand/RoCE), ``RNIC`` (iWARP), ... (the text after ``1: `` in ``node_type``)."""


@dataclass
class System:
    """The machine as doctor sees it; every field can be replaced by a fake."""

    root: Path = Path("/")
    run: Callable[[Sequence[str]], str | None] = run_command
    release: str = field(default_factory=platform.release)
    memlock: Callable[[], tuple[int, int]] = _real_memlock
    list_devices: Callable[[], list[DeviceInfo]] = _real_list_devices
    import_extension: Callable[[], None] = _real_import_extension
    access: Callable[[Path], bool] = _read_write
    """Whether this process may open a file read-write."""
    loopback: Callable[[str, float], float] = _real_loopback
    """Listen on an address, connect to it, echo one message; return the seconds taken (or raise)."""

    def path(self, absolute: str) -> Path:
        """``absolute`` (such as ``/sys/class/infiniband``) below :attr:`root`."""
        return self.root / absolute.lstrip("/")

    def read(self, absolute: str) -> str | None:
        """The text of a file below :attr:`root`, or None when it cannot be read."""
        try:
            return self.path(absolute).read_text(errors="replace")
        except OSError:
            return None

    def has_cap_ipc_lock(self) -> bool:
        """Whether this process may lock memory beyond ``RLIMIT_MEMLOCK`` (root has CAP_IPC_LOCK)."""
        status = self.read("/proc/self/status") or ""
        match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.MULTILINE)
        return match is not None and bool(int(match.group(1), 16) >> _CAP_IPC_LOCK & 1)

    def sysfs_devices(self) -> list[SysfsDevice]:
        """The devices in ``/sys/class/infiniband`` with their ports, sorted by name."""
        base = self.path("/sys/class/infiniband")
        try:
            names = sorted(p.name for p in base.iterdir())
        except OSError:
            return []
        if not names:
            return []
        links = self.link_netdevs()
        devices = []
        for name in names:
            node = (self.read(f"/sys/class/infiniband/{name}/node_type") or "").strip()
            node_type = node.partition(": ")[2] or node
            devices.append(SysfsDevice(name, self._ports(name, node_type, links), node_type))
        return devices

    def link_netdevs(self) -> dict[str, str]:
        """``DEVICE/PORT`` to netdev, from ``rdma link show`` (empty when the command is missing)."""
        found: dict[str, str] = {}
        for line in (self.run(["rdma", "link", "show"]) or "").splitlines():
            tokens = line.split()
            if len(tokens) >= 2 and tokens[0] == "link" and "netdev" in tokens[2:-1]:
                found[tokens[1]] = tokens[tokens.index("netdev", 2) + 1]
        return found

    def device_caps(self) -> dict[str, DeviceCaps]:
        """The capabilities of each device (``ibv_devinfo -v``; empty when it is missing or fails)."""
        return parse_devinfo(self.run(["ibv_devinfo", "-v"]) or "")

    def _ports(
        self, device: str, node_type: str = "", links: dict[str, str] | None = None
    ) -> tuple[PortState, ...]:
        base = f"/sys/class/infiniband/{device}/ports"
        try:
            numbers = sorted(int(p.name) for p in self.path(base).iterdir() if p.name.isdigit())
        except OSError:
            return ()
        ports = []
        for number in numbers:
            state = (self.read(f"{base}/{number}/state") or "").strip()
            link_layer = (self.read(f"{base}/{number}/link_layer") or "unknown").strip()
            gids = self._gids(f"{base}/{number}")
            ports.append(
                PortState(
                    device=device,
                    number=number,
                    state=state.partition(": ")[2] or state or "unknown",
                    link_layer=link_layer,
                    gids=gids,
                    transport=transport_of(node_type, link_layer, [t for _g, t, _n in gids]),
                    link_netdev=(links or {}).get(f"{device}/{number}"),
                )
            )
        return tuple(ports)

    def _gids(self, port_dir: str) -> tuple[tuple[str, str, str], ...]:
        try:
            indexes = sorted(int(p.name) for p in self.path(f"{port_dir}/gids").iterdir() if p.name.isdigit())
        except OSError:
            return ()
        found = []
        for i in indexes:
            gid = (self.read(f"{port_dir}/gids/{i}") or "").strip()
            if not gid or set(gid) <= {"0", ":"}:
                continue  # an empty table slot
            gid_type = (self.read(f"{port_dir}/gid_attrs/types/{i}") or "").strip()
            ndev = (self.read(f"{port_dir}/gid_attrs/ndevs/{i}") or "").strip()
            found.append((gid, gid_type, ndev))
        return tuple(found)

    def ipv4_addresses(self, netdev: str) -> list[str]:
        """The IPv4 addresses of ``netdev`` (from ``ip -4 -o addr show dev NETDEV``)."""
        out = self.run(["ip", "-4", "-o", "addr", "show", "dev", netdev]) or ""
        return re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out)
