"""Observing what a test leaves behind: kernel RDMA resources and open file descriptors."""

from __future__ import annotations

import os
import re
import subprocess

KINDS = ("qp", "cq", "mr", "pd", "cm_id")


def rdma_resources() -> dict[str, int]:
    """Counts of QPs, CQs, MRs, PDs and cm ids over all devices, from ``rdma resource show``."""
    out = subprocess.run(["rdma", "resource", "show"], check=True, capture_output=True, text=True).stdout
    totals: dict[str, int] = dict.fromkeys(KINDS, 0)
    for name, count in re.findall(r"(\w+) (\d+)", out):
        if name in totals:
            totals[name] += int(count)
    return totals


def open_fds() -> int:
    """Number of open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))
