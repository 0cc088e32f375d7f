"""``python -m bench --only onesided`` end to end in the test host (a quick, one-repetition run).

It checks that every one-sided workload runs against its perftest tool and that the one-sided ratios are
computed from figures of the same run; it asserts no figure's value (the VM is noisy and shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_quick_onesided_bench_measures_every_workload_against_its_tool(
    rdma_addr: str, tmp_path: Path
) -> None:
    report = tmp_path / "onesided.json"
    cmd = [
        sys.executable, "-m", "bench", "--quick", "--only", "onesided",
        "--contenders", "rdmaio-asyncio,ib_read_bw,ib_write_bw,ib_atomic_bw,ib_read_lat",
        "--reps", "1", "--time-cap", "1", "--host", rdma_addr, "--progress", "plain", "--json", str(report),
    ]  # fmt: skip
    # The harness is not installed: the checkout on PYTHONPATH makes ``python -m bench`` importable.
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(report.read_text())
    figures = {(f["contender"], f["workload"]): f for f in doc["figures"]}
    workloads = ("rdma_write", "rdma_read", "fetch_add", "fetch_add_many", "read_lat")
    tools = {
        "rdma_write": "ib_write_bw",
        "rdma_read": "ib_read_bw",
        "fetch_add": "ib_atomic_bw",
        "fetch_add_many": "ib_atomic_bw",
        "read_lat": "ib_read_lat",
    }
    for workload in workloads:
        for contender in ("rdmaio-asyncio", tools[workload]):
            figure = figures[(contender, workload)]
            assert figure["status"] == "ok", (contender, workload, figure["errors"])
            assert figure["value"] > 0
            assert len(figure["samples"]) == 1  # one run each: a tool's run counts for its own workload
    batched = figures[("rdmaio-asyncio", "fetch_add_many")]
    assert "fetch_add_many" in batched["samples"][0]["note"]
    ratios = {(r["key"], r["loop"]): r for r in doc["ratios"]}
    for key in ("fetch_add_vs_ib_atomic_bw", "fetch_add_many_vs_ib_atomic_bw", "read_lat_64b_vs_ib_read_lat"):
        assert ratios[(key, "asyncio")]["value"] is not None, key
    assert "fetch_add_many ops/s (batches)" in result.stdout  # the targets table names it
