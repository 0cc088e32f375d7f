"""``python -m bench --only onesided`` end to end in the test host (a quick, one-repetition run).

It checks that the harness found the test host's device and provider, that every one-sided workload the
device can do runs against its perftest tool (on a device without atomics, Soft-iWARP, the fetch-and-add
workloads are left out with their reason), and that the one-sided ratios are
computed from figures of the same run; it asserts no figure's value (the VM is noisy and shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


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
    # The harness found the device the test host set up, and its provider.
    provider = doc["meta"]["provider"]
    assert provider["device"] == os.environ.get("RDMAIO_TEST_DEVICE", provider["device"])
    assert provider["provider"] == os.environ.get("RDMAIO_TEST_PROVIDER", provider["provider"])
    if provider["atomics"] is False:  # Soft-iWARP: no atomics, so neither side's fetch-and-add is run
        assert provider["transport"] == "iWARP" and provider["framing"] == "header"
        _check_atomics_left_out(doc, result.stdout + result.stderr)
        workloads: tuple[str, ...] = ("rdma_write", "rdma_read", "read_lat")
    else:
        assert doc["meta"]["skipped"] == []
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
    # rdmaio's connections used the framing the harness expects of the device (header on iWARP).
    for workload in workloads:
        assert f"{provider['framing']} framing" in figures[("rdmaio-asyncio", workload)]["note"], workload
    ratios = {(r["key"], r["loop"]): r for r in doc["ratios"]}
    assert ratios[("read_lat_64b_vs_ib_read_lat", "asyncio")]["value"] is not None
    if "fetch_add" not in workloads:
        return
    batched = figures[("rdmaio-asyncio", "fetch_add_many")]
    assert "fetch_add_many" in batched["samples"][0]["note"]
    for key in ("fetch_add_vs_ib_atomic_bw", "fetch_add_many_vs_ib_atomic_bw"):
        assert ratios[(key, "asyncio")]["value"] is not None, key
    assert "fetch_add_many ops/s (batches)" in result.stdout  # the targets table names it


def _check_atomics_left_out(doc: dict[str, Any], output: str) -> None:
    """On a device without atomics: ib_atomic_bw and rdmaio's fetch-and-add workloads were not run, each
    with the reason (in the report and the output), and no figure stands for them."""
    device = doc["meta"]["provider"]["device"]
    skipped = {item["contender"]: item for item in doc["meta"]["skipped"]}
    assert set(skipped) == {"ib_atomic_bw", "rdmaio-asyncio"}
    for name, item in skipped.items():
        assert item["workloads"] == ["fetch_add", "fetch_add_many"]
        assert f"{device} (" in item["reason"] and "ATOMIC_NONE" in item["reason"]
        assert doc["contenders"][name]["skipped"], name
        assert f"not run: {name} fetch_add, fetch_add_many: {device}" in output
    assert doc["contenders"]["ib_atomic_bw"]["status"] == "not run"
    assert not [f for f in doc["figures"] if f["workload"] in ("fetch_add", "fetch_add_many")]
    assert "Not run on this device" in output
