"""Observing what a test leaves behind: kernel RDMA resources and open file descriptors."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Collection

KINDS = ("qp", "cq", "mr", "pd", "cm_id")


def rdma_resources(pids: Collection[int] | None = None) -> dict[str, int]:
    """Counts of QPs, CQs, MRs, PDs and cm ids over all devices, from ``rdma resource show``.

    With ``pids``, only the objects those processes own (``rdma -j resource show KIND``, by ``pid``): a
    test that compares two snapshots of its own processes is then blind to what other processes of the
    test host (earlier tests' peers still exiting) create or destroy in between."""
    if pids is not None:
        return {kind: _owned(kind, set(pids)) for kind in KINDS}
    out = subprocess.run(["rdma", "resource", "show"], check=True, capture_output=True, text=True).stdout
    totals: dict[str, int] = dict.fromkeys(KINDS, 0)
    for name, count in re.findall(r"(\w+) (\d+)", out):
        if name in totals:
            totals[name] += int(count)
    return totals


def _owned(kind: str, pids: set[int]) -> int:
    """How many objects of ``kind`` (a ``rdma resource show`` object: qp, cq, mr, pd, cm_id) ``pids`` own."""
    out = subprocess.run(
        ["rdma", "-j", "resource", "show", kind], check=True, capture_output=True, text=True
    ).stdout
    return sum(1 for entry in json.loads(out or "[]") if entry.get("pid") in pids)


def open_fds() -> int:
    """Number of open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))
