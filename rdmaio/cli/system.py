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

__all__ = ["PortState", "SysfsDevice", "System", "run_command"]

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
        elapsed = time.perf_counter() - start
    if reply != LOOPBACK_PAYLOAD:
        raise RuntimeError(f"the echo came back wrong: {reply!r}")
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

    @property
    def netdev(self) -> str | None:
        """The network device the port's GIDs are bound to (RoCE), if any."""
        return next((ndev for _gid, _type, ndev in self.gids if ndev), None)

    def roce_v2_ipv4(self) -> list[str]:
        """IPv4 addresses that have a RoCE v2 GID (``::ffff:a.b.c.d``): what rdma_cm over IPv4 uses."""
        found = []
        for gid, gid_type, _ndev in self.gids:
            parts = gid.split(":")
            if gid_type.lower() == "roce v2" and len(parts) == 8 and parts[:6] == ["0000"] * 5 + ["ffff"]:
                raw = int(parts[6] + parts[7], 16)
                found.append(".".join(str((raw >> s) & 0xFF) for s in (24, 16, 8, 0)))
        return found


@dataclass(frozen=True, slots=True)
class SysfsDevice:
    """One RDMA device under ``/sys/class/infiniband``."""

    name: str
    ports: tuple[PortState, ...]


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
        return [SysfsDevice(name, self._ports(name)) for name in names]

    def _ports(self, device: str) -> tuple[PortState, ...]:
        base = f"/sys/class/infiniband/{device}/ports"
        try:
            numbers = sorted(int(p.name) for p in self.path(base).iterdir() if p.name.isdigit())
        except OSError:
            return ()
        ports = []
        for number in numbers:
            state = (self.read(f"{base}/{number}/state") or "").strip()
            ports.append(
                PortState(
                    device=device,
                    number=number,
                    state=state.partition(": ")[2] or state or "unknown",
                    link_layer=(self.read(f"{base}/{number}/link_layer") or "unknown").strip(),
                    gids=self._gids(f"{base}/{number}"),
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
