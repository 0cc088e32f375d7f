"""Unit tests of the benchmark harness's provider handling (:mod:`bench.provider`): which device and
transport it finds on a fake machine (Soft-iWARP and Soft-RoCE as the test host sets them up), perftest's
flags per transport, the measurements it leaves out on a device without atomics (with their reason, in the
plan, the printed output and the JSON report), and that nothing is left out on rxe."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

import bench.driver
from bench.driver import Run, drop_skipped, plan_runs, planned_skips, skipped_lines
from bench.driver import main as bench_main
from bench.external import ExternalConfig, perftest_command, run_external
from bench.model import CONTENDERS, ONESIDED_WORKLOADS, QUICK, Figure, Sample, Workload
from bench.provider import Provider, Skip, detect_provider, perftest_transport_args, plan_skips, unsupported
from bench.report import build_report, render_markdown, validate_report
from rdmaio.cli.system import System

# What `ibv_devinfo -v` said in the test host (trimmed to the parsed lines).
DEVINFO_SIW = (
    "hca_id:\tsiw0\n\ttransport:\t\t\tiWARP (1)\n\tmax_sge:\t\t\t6\n\tmax_sge_rd:\t\t\t1\n"
    "\tatomic_cap:\t\t\tATOMIC_NONE (0)\n\tmax_mw:\t\t\t\t0\n"
)
DEVINFO_RXE = (
    "hca_id:\trxe0\n\ttransport:\t\t\tInfiniBand (0)\n\tmax_sge:\t\t\t32\n\tmax_sge_rd:\t\t\t32\n"
    "\tatomic_cap:\t\t\tATOMIC_HCA (1)\n\tmax_mw:\t\t\t\t524287\n"
)
ATOMIC = (Workload.FETCH_ADD, Workload.FETCH_ADD_MANY)
OFFERED = {name: c.workloads for name, c in CONTENDERS.items()}


def _write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _machine(root: Path, provider: str, netdev: str = "dum0", addr: str = "198.18.0.1") -> System:
    """A fake machine with one device of ``provider`` (``siw`` or ``rxe``) on ``netdev`` holding ``addr``."""
    device = f"{provider}0"
    port = f"/sys/class/infiniband/{device}/ports/1"
    _write(root, f"{port}/state", "4: ACTIVE\n")
    _write(root, f"{port}/link_layer", "Ethernet\n")
    if provider == "siw":
        _write(root, f"/sys/class/infiniband/{device}/node_type", "4: RNIC\n")
        _write(root, f"{port}/gids/0", "7457:55ff:fe9a:9e19:0000:0000:0000:0000\n")  # MAC-based, no attrs
        devinfo = DEVINFO_SIW
    else:
        _write(root, f"/sys/class/infiniband/{device}/node_type", "1: CA\n")
        _write(root, f"{port}/gids/1", "0000:0000:0000:0000:0000:ffff:c612:0001\n")
        _write(root, f"{port}/gid_attrs/types/1", "RoCE v2\n")
        _write(root, f"{port}/gid_attrs/ndevs/1", f"{netdev}\n")
        devinfo = DEVINFO_RXE
    outputs = {
        ("rdma", "link", "show"): f"link {device}/1 state ACTIVE physical_state LINK_UP netdev {netdev} \n",
        ("ibv_devinfo", "-v"): devinfo,
        ("ip", "-4", "-o", "addr", "show", "dev", netdev): (
            f"2: {netdev}    inet {addr}/24 scope global {netdev}\\       valid_lft forever\n"
        ),
    }

    def run(args: Sequence[str]) -> str | None:
        return outputs.get(tuple(args))

    return System(root=root, run=run)


SIW = Provider("siw0", "siw", "iWARP", False, False, False, "address 198.18.0.1 on dum0")
RXE = Provider("rxe0", "rxe", "RoCE v2", True, True, True, "address 198.18.0.1 on dum0")


def test_detects_soft_iwarp_by_the_benchmark_address(tmp_path: Path) -> None:
    provider = detect_provider("198.18.0.1", None, _machine(tmp_path, "siw"))
    assert provider == SIW
    assert provider.iwarp and provider.framing == "header"
    assert provider.to_json()["framing"] == "header" and provider.to_json()["transport"] == "iWARP"
    assert "provider siw, transport iWARP, no atomics, no immediate data" in provider.describe()


def test_detects_soft_roce(tmp_path: Path) -> None:
    provider = detect_provider("198.18.0.1", None, _machine(tmp_path, "rxe"))
    assert provider == RXE
    assert not provider.iwarp and provider.framing == "immediate"


def test_device_option_wins_and_the_only_device_is_taken(tmp_path: Path) -> None:
    system = _machine(tmp_path, "siw")
    assert detect_provider("198.18.0.1", "siw0", system).source == "--device"
    missing = detect_provider("198.18.0.1", "mlx5_0", system)
    assert missing.device == "mlx5_0" and "not in /sys/class/infiniband" in missing.source
    assert missing.transport == "unknown" and missing.atomics is None
    only = detect_provider("10.9.9.9", None, system)  # no device holds it: the only one there is
    assert only.device == "siw0" and only.source == "the only device" and only.transport == "iWARP"


def test_no_device_leaves_nothing_out(tmp_path: Path) -> None:
    provider = detect_provider("127.0.0.1", None, System(root=tmp_path, run=lambda args: None))
    assert provider.device is None and "no RDMA device found" in provider.describe()
    assert plan_skips(provider, list(CONTENDERS), list(Workload), OFFERED) == []


def test_perftest_connects_through_rdma_cm_on_every_transport() -> None:
    # iWARP queue pairs connect only through rdma_cm: without -R perftest stops at "Failed to modify QP
    # to RTS" on siw0 (seen in the test host); on RoCE rdma_cm is the harness's choice, as before.
    for provider in (SIW, RXE, None):
        assert perftest_transport_args(provider) == ["-R"]
    assert perftest_command("ib_send_bw", 64, 10, 19500, "siw0", SIW)[:2] == ["ib_send_bw", "-R"]
    assert perftest_command("ib_read_lat", 64, 10, 19500, "rxe0", RXE) == perftest_command(
        "ib_read_lat", 64, 10, 19500, "rxe0"
    )


def test_without_atomics_the_atomic_contenders_are_left_out_with_the_reason() -> None:
    skips = plan_skips(SIW, list(CONTENDERS), list(Workload), OFFERED)
    assert {(s.contender, s.workloads) for s in skips} == {
        ("ib_atomic_bw", ATOMIC),
        ("rdmaio-asyncio", ATOMIC),
        ("rdmaio-uvloop", ATOMIC),
    }
    atomic_bw = next(s for s in skips if s.contender == "ib_atomic_bw")
    assert "siw0 (siw, iWARP) has no RDMA atomics (ATOMIC_NONE)" in atomic_bw.reason
    assert atomic_bw.line().startswith("not run: ib_atomic_bw fetch_add, fetch_add_many: siw0")
    rdmaio_skip = next(s for s in skips if s.contender == "rdmaio-uvloop")
    assert "FeatureNotSupportedError" in rdmaio_skip.reason
    # What iWARP does have still runs: READ, WRITE, the READ round trip, and every two-sided workload.
    for workload in (*[w for w in ONESIDED_WORKLOADS if w not in ATOMIC], Workload.STREAM, Workload.SETUP):
        for contender in CONTENDERS:
            assert unsupported(SIW, contender, workload) is None


def test_nothing_is_left_out_on_rxe() -> None:
    assert plan_skips(RXE, list(CONTENDERS), list(Workload), OFFERED) == []
    unknown = Provider("mlx5_0", "mlx5_core", "RoCE v2", None, True, None, "--device")
    assert plan_skips(unknown, list(CONTENDERS), list(Workload), OFFERED) == []  # unknown: try, and report


def test_the_plan_drops_only_the_skipped_measurements() -> None:
    contenders = ["ib_atomic_bw", "ib_read_bw", "rdmaio-asyncio"]
    workloads = list(ONESIDED_WORKLOADS)
    skips = plan_skips(SIW, contenders, workloads, OFFERED)
    planned = plan_runs(contenders, workloads, None, QUICK)
    runs = drop_skipped(planned, skips)
    assert all(w not in ATOMIC for run in runs for w in run.workloads)
    assert {(r.contender, r.workloads) for r in planned} - {(r.contender, r.workloads) for r in runs} == {
        ("ib_atomic_bw", (Workload.FETCH_ADD,)),
        ("ib_atomic_bw", (Workload.FETCH_ADD_MANY,)),
        ("rdmaio-asyncio", (Workload.FETCH_ADD,)),
        ("rdmaio-asyncio", (Workload.FETCH_ADD_MANY,)),
    }
    assert drop_skipped(planned, plan_skips(RXE, contenders, workloads, OFFERED)) == planned
    # A run that measures several workloads keeps those the device can do.
    both = Run("rdmaio-asyncio", (Workload.RDMA_READ, Workload.FETCH_ADD), 8, 0, 10)
    assert drop_skipped([both], skips) == [Run("rdmaio-asyncio", (Workload.RDMA_READ,), 8, 0, 10)]


def test_only_what_the_filters_planned_is_said_to_be_left_out() -> None:
    skips = plan_skips(SIW, ["ib_atomic_bw", "rdmaio-asyncio"], list(ONESIDED_WORKLOADS), OFFERED)
    # --sizes 64K: the 8 B fetch-and-add is not planned, so nothing is left out because of the device.
    assert (
        planned_skips(
            skips, plan_runs(["ib_atomic_bw", "rdmaio-asyncio"], list(ONESIDED_WORKLOADS), [65536], QUICK)
        )
        == []
    )
    only_many = plan_runs(["rdmaio-asyncio"], [Workload.FETCH_ADD_MANY], None, QUICK)
    assert [(s.contender, s.workloads) for s in planned_skips(skips, only_many)] == [
        ("rdmaio-asyncio", (Workload.FETCH_ADD_MANY,))
    ]


def test_the_report_records_the_provider_and_what_was_not_run() -> None:
    skips = plan_skips(SIW, ["ib_atomic_bw", "ib_read_bw"], list(ONESIDED_WORKLOADS), OFFERED)
    skipped = [s.to_json() for s in skips]
    meta = {"provider": SIW.to_json(), "skipped": skipped, "git_commit": "0" * 40, "command": ["x"]}
    read = Figure("ib_read_bw", Workload.RDMA_READ, 65536, [Sample(ok=True, bytes_per_s=1e6)])
    doc = build_report([read], meta, ["ib_atomic_bw", "ib_read_bw"])
    assert validate_report(doc) == []
    assert doc["meta"]["provider"]["transport"] == "iWARP" and doc["meta"]["provider"]["framing"] == "header"
    atomic = doc["contenders"]["ib_atomic_bw"]
    assert atomic["status"] == "not run" and atomic["errors"] == []
    assert atomic["skipped"] == [f"fetch_add, fetch_add_many: {skips[0].reason}"]
    assert "skipped" not in doc["contenders"]["ib_read_bw"]
    text = skipped_lines(skipped)
    assert "Not run on this device" in text and "ib_atomic_bw fetch_add, fetch_add_many: siw0" in text
    assert skipped_lines([]) == ""
    markdown = render_markdown([read], ["ib_atomic_bw", "ib_read_bw"], 1, meta=meta)
    assert "Device siw0: provider siw, transport iWARP, rdmaio's header framing." in markdown
    assert (
        "**Not run on this device**" in markdown and "- ib_atomic_bw fetch_add, fetch_add_many:" in markdown
    )


def test_external_runs_use_the_configured_provider(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def fake_pair(server_cmd: Sequence[str], client_cmd: Sequence[str], **_: object) -> object:
        seen.append(list(client_cmd))
        raise RuntimeError("stop here")

    monkeypatch.setattr("bench.external.run_pair", fake_pair)
    monkeypatch.setattr("bench.external.shutil.which", lambda tool: f"/usr/bin/{tool}")
    config = ExternalConfig(host="198.18.0.1", device="siw0", provider=SIW)
    with pytest.raises(RuntimeError, match="stop here"):
        run_external("ib_write_bw", [Workload.STREAM], 65536, 10, config)
    assert seen[0][:2] == ["ib_write_bw", "-R"] and seen[0][-1] == "198.18.0.1"
    assert seen[0][seen[0].index("-d") + 1] == "siw0"


def test_cli_on_siw_skips_the_atomics_and_writes_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench.driver, "detect_provider", lambda host, device: SIW)
    # Only atomics asked for: nothing can run; said before anything starts.
    with pytest.raises(SystemExit) as info:
        bench_main(["--contenders", "ib_atomic_bw", "--only", "fetch_add", "--host", "127.0.0.1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "nothing the filters leave can run on this device" in err and "ATOMIC_NONE" in err
    # The TCP stream runs; the atomics are left out, said in the progress, after the table, in the JSON.
    out = tmp_path / "bench.json"
    args = ["--quick", "--contenders", "tcp-asyncio,ib_atomic_bw", "--only", "stream,fetch_add"]
    args += ["--sizes", "64,8", "--host", "127.0.0.1", "--time-cap", "0.3", "--progress", "plain"]
    assert bench_main([*args, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "bench: device siw0 (address 198.18.0.1 on dum0): provider siw, transport iWARP" in captured.err
    assert "bench: not run: ib_atomic_bw fetch_add: siw0 (siw, iWARP) has no RDMA atomics" in captured.err
    assert "[1/1]" in captured.err  # only the TCP measurement was run
    assert "Not run on this device" in captured.out
    doc = json.loads(out.read_text())
    assert validate_report(doc) == []
    assert doc["meta"]["provider"]["provider"] == "siw" and doc["meta"]["provider"]["device"] == "siw0"
    assert doc["meta"]["skipped"] == [
        Skip(
            "ib_atomic_bw", (Workload.FETCH_ADD,), unsupported(SIW, "ib_atomic_bw", Workload.FETCH_ADD) or ""
        ).to_json()
    ]
    assert doc["contenders"]["ib_atomic_bw"]["status"] == "not run"
    assert [f["contender"] for f in doc["figures"]] == ["tcp-asyncio"]
