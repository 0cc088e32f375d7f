"""The memory workload: registered bytes and RSS growth per idle connection, server and client side.

How it measures (``--only memory``, one measurement per connection count of ``--conns``):

1. one warm-up connection is opened and closed, so that what lives as long as the loop (the rdma_cm event
   channel, the device's protection domain, librdmacm's device handles) exists on both sides before the
   baseline and is not charged to the connections;
2. baseline, after both processes returned their free heap memory to the kernel (:func:`trim_heap`):
   the registered bytes of each process (the sum of ``mrlen`` over the memory regions that
   ``rdma -j resource show mr`` lists for its pid: the kernel's account, which sees every MR however it
   was registered) and each process's ``VmRSS`` (``/proc/PID/status``);
3. N connections are opened one after another and left idle (the server's handler waits in ``recv()``);
   the client waits until the server reports N established clients, then measures again: growth / N is
   the figure, for each side;
4. everything is closed and measured once more; what did not come back is reported as ``*_left``.

A connection count that does not fit (registration fails, the fd limit, the machine's memory running low)
yields a failed sample saying how many connections were opened and why, with the per-connection figures
of those that were: nothing crashes and nothing is made up. Before each connection the client checks
``MemAvailable``; below :data:`MEMORY_RESERVE` it stops rather than let the kernel's OOM killer pick a
process of the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import resource
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MEMORY_RESERVE",
    "MemoryProbe",
    "MemoryProbeError",
    "Snapshot",
    "mem_available",
    "parse_vmrss",
    "per_connection",
    "raise_fd_limit",
    "registered_bytes",
    "rss_bytes",
    "sum_mrlen",
]

MEMORY_RESERVE = 192 * 1024 * 1024
"""Bytes of ``MemAvailable`` below which the memory workload stops opening connections."""


class MemoryProbeError(RuntimeError):
    """A figure the memory workload needs could not be read (no ``rdma`` tool, no /proc)."""


def sum_mrlen(rdma_json: str, pid: int) -> int:
    """Total ``mrlen`` of the memory regions of process ``pid`` in ``rdma -j resource show mr`` output.

    Raises :class:`MemoryProbeError` when the output is not the JSON list that iproute2 prints.
    """
    text = rdma_json.strip()
    if not text:
        return 0  # no MR at all: iproute2 prints nothing
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise MemoryProbeError(f"rdma printed something that is not JSON: {text[:200]!r}") from exc
    if not isinstance(entries, list):
        raise MemoryProbeError(f"rdma -j resource show mr: expected a list, got {type(entries).__name__}")
    total = 0
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("pid") != pid:
            continue
        length = entry.get("mrlen")
        if not isinstance(length, int):
            raise MemoryProbeError(f"MR without an integer mrlen: {entry!r}")
        total += length
    return total


def registered_bytes(pid: int) -> int:
    """Bytes registered (pinned for the NIC) by process ``pid`` on every RDMA device, per the kernel."""
    try:
        out = subprocess.run(
            ["rdma", "-j", "resource", "show", "mr"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError as exc:
        raise MemoryProbeError("the rdma tool (iproute2) is not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise MemoryProbeError("rdma -j resource show mr did not answer within 60 s") from exc
    if out.returncode != 0:
        raise MemoryProbeError(f"rdma -j resource show mr failed: {out.stderr.strip()[:200]}")
    return sum_mrlen(out.stdout, pid)


def parse_vmrss(status: str) -> int:
    """``VmRSS`` of a ``/proc/PID/status`` text, in bytes."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                unit = fields[2].lower() if len(fields) > 2 else "kb"
                return int(fields[1]) * (1024 if unit == "kb" else 1)
    raise MemoryProbeError("no VmRSS line in /proc/PID/status")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return parse_vmrss(status.read())
    except OSError as exc:
        raise MemoryProbeError(f"cannot read /proc/{pid}/status: {exc}") from exc


def mem_available() -> int | None:
    """``MemAvailable`` of the machine in bytes (None when /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def trim_heap() -> bool:
    """Give the C heap's free memory back to the kernel (glibc ``malloc_trim(0)``); False where there is
    no glibc.

    The memory workload calls it in both processes before its baseline only: freed slot rings that glibc
    kept from an earlier measurement would otherwise be reused and hide this one's growth. Nothing is
    trimmed after the close, so "left after close" includes what the allocator keeps (measured in the
    test host: all of it, 4 MiB per closed connection and side, until a trim).
    """
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the new soft limit.

    Every connection holds at least one fd (its completion channel) on each side, so a thousand idle
    connections do not fit in the usual soft limit of 1024.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Registered bytes and RSS of the server and the client process at one moment."""

    registered_server: int
    registered_client: int
    rss_server: int
    rss_client: int


def per_connection(
    before: Snapshot, during: Snapshot, after: Snapshot | None, opened: int
) -> dict[str, float]:
    """Growth per connection from ``before`` to ``during`` (``opened`` connections), per side, and what
    was still held ``after`` they were all closed (absolute bytes over the baseline, not per connection).
    """
    n = max(opened, 1)
    figures: dict[str, float] = {"connections": float(opened)}
    for side in ("server", "client"):
        reg_before = getattr(before, f"registered_{side}")
        rss_before = getattr(before, f"rss_{side}")
        figures[f"registered_per_conn_{side}"] = (getattr(during, f"registered_{side}") - reg_before) / n
        figures[f"rss_per_conn_{side}"] = (getattr(during, f"rss_{side}") - rss_before) / n
        figures[f"registered_total_{side}"] = float(getattr(during, f"registered_{side}"))
        if after is not None:
            figures[f"registered_left_{side}"] = float(getattr(after, f"registered_{side}") - reg_before)
            figures[f"rss_left_{side}"] = float(getattr(after, f"rss_{side}") - rss_before)
    return figures


class MemoryProbe:
    """Takes :class:`Snapshot` s of the benchmark's server process (``server_pid``) and of this one."""

    def __init__(self, server_pid: int, client_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.client_pid = client_pid if client_pid is not None else os.getpid()

    def snapshot(self) -> Snapshot:
        """Both processes' registered bytes and RSS now (after a garbage collection here)."""
        gc.collect()
        return Snapshot(
            registered_server=registered_bytes(self.server_pid),
            registered_client=registered_bytes(self.client_pid),
            rss_server=rss_bytes(self.server_pid),
            rss_client=rss_bytes(self.client_pid),
        )


ServerClients = Callable[[], Awaitable[Mapping[str, Any]]]
"""Asks the benchmark server for its statistics (``{"clients": N, ...}``)."""


async def wait_for_clients(server_stats: ServerClients, want: int, patience: float) -> int:
    """Poll the server until it holds ``want`` established clients, for ``patience`` seconds at most;
    return the last count seen (the caller compares it: a mismatch is reported, not raised)."""
    deadline = time.monotonic() + patience
    clients = -1
    while True:
        stats = await server_stats()
        clients = int(stats.get("clients", -1))
        if clients == want or time.monotonic() >= deadline:
            return clients
        await asyncio.sleep(0.2)
