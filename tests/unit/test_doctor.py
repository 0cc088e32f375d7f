"""Unit tests of ``rdmaio doctor`` (rdmaio/cli): every check against a fake machine (a temporary root
with ``sys/``, ``proc/``, ``dev/``, ``etc/``, ``lib/modules/`` and fake command output), and the real CLI
on this machine, which (outside the test host) has no RDMA device."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from fake_machine import DUM0_IPV4, LDCONFIG, RELEASE, fake_system, rdma_core_root, write

from rdmaio.cli import doctor
from rdmaio.cli.checks import (
    CHECKS,
    CheckResult,
    Verdict,
    check_dev_nodes,
    check_devices,
    check_driver,
    check_gids,
    check_libraries,
    check_loopback,
    check_memlock,
    check_module,
    check_mtu,
    check_netns,
    check_providers,
)
from rdmaio.cli.system import PortState, System
from rdmaio.verbs import DeviceInfo, PortInfo

REPO = Path(__file__).resolve().parents[2]
GID_V4 = "0000:0000:0000:0000:0000:ffff:c612:0001"  # ::ffff:198.18.0.1
GID_LINK_LOCAL = "fe80:0000:0000:0000:b4f2:1cff:fe11:2233"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def healthy_root(root: Path) -> Path:
    """A machine with rxe0 on dum0 (198.18.0.1), its modules loaded and rdma-core installed."""
    port = "/sys/class/infiniband/rxe0/ports/1"
    write(root, f"{port}/state", "4: ACTIVE\n")
    write(root, f"{port}/link_layer", "Ethernet\n")
    for i, (gid, kind) in enumerate([(GID_LINK_LOCAL, "RoCE v2"), (GID_V4, "RoCE v2"), (ZERO_GID, "")]):
        write(root, f"{port}/gids/{i}", gid + "\n")
        if kind:
            write(root, f"{port}/gid_attrs/types/{i}", kind + "\n")
            write(root, f"{port}/gid_attrs/ndevs/{i}", "dum0\n")
    modules = "rdma_rxe 139264 0 - Live 0x0\nrdma_ucm 32768 0 - Live 0x0\n"
    return rdma_core_root(root, modules=modules, drivers=("rxe", "mlx5"))


def port_info(mtu: int = 1024) -> PortInfo:
    return PortInfo(1, "ACTIVE", True, mtu, 4096, "Ethernet", 1024, 1 << 31)


def device_info(mtu: int = 1024) -> DeviceInfo:
    return DeviceInfo("rxe0", "0.0.0", 1048560, 1048576, 1, 1, 1, 1 << 40, 32, (port_info(mtu),))


def rxe_system(root: Path, **overrides: object) -> System:
    """The machine of ``healthy_root`` (or another root) with rxe0 as its one device."""
    outputs = {
        ("ldconfig", "-p"): LDCONFIG,
        ("rdma", "system"): "netns shared copy-on-fork on\n",
        **DUM0_IPV4,
    }
    return fake_system(root, outputs, lambda: [device_info()], **overrides)


@pytest.fixture
def healthy(tmp_path: Path) -> System:
    return rxe_system(healthy_root(tmp_path))


def by_name(results: Sequence[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def test_healthy_machine_passes_every_check(healthy: System, capsys: pytest.CaptureFixture[str]) -> None:
    results = doctor.run_checks(healthy)
    assert [r.verdict for r in results] == [Verdict.OK] * len(CHECKS), results
    found = by_name(results)
    assert found["libraries"].summary == "libibverbs 1.14.44.0, librdmacm 1.3.44.0 (rdma-core 44)"
    assert found["gids"].summary == "rxe0/1: netdev dum0, RoCE v2 IPv4 198.18.0.1"
    assert found["loopback"].summary == "rxe0 198.18.0.1: connect+echo ok (2.0 ms)"
    assert doctor.main([], system=healthy) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CHECKS) + 2  # the banner, one line per check, the conclusion
    assert lines[-1] == "doctor: no check failed: rdmaio connections can work on this machine"


def test_json_output(healthy: System, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--json"], system=healthy) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    assert [c["name"] for c in doc["checks"]][:3] == ["libraries", "providers", "extension"]
    assert {c["verdict"] for c in doc["checks"]} == {"ok"}
    assert doc["checks"][-1]["data"] == {"targets": {"rxe0": "198.18.0.1"}}


def test_no_rdma_at_all_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    system = rxe_system(tmp_path, run=lambda args: None, list_devices=lambda: pytest.fail("not called"))
    assert doctor.main([], system=system) == 1
    out = capsys.readouterr().out
    found = by_name(doctor.run_checks(system))
    assert found["devices"].verdict is Verdict.FAIL
    assert "no RDMA device on this machine" in found["devices"].summary
    assert "-m rdmaio.testing.host --" in (found["devices"].fix or "")
    for name in ("verbs", "gids", "mtu", "netns", "loopback"):
        assert found[name].verdict is Verdict.SKIP, found[name]
    failed = [r.name for r in found.values() if r.verdict is Verdict.FAIL]
    assert failed == ["libraries", "providers", "ib_uverbs", "rdma_ucm", "driver", "dev-nodes", "devices"]
    assert "doctor: 7 check(s) failed: libraries, providers, ib_uverbs" in out
    assert "no RDMA device here; to run on Soft-RoCE in the test host:" in out


def test_module_installed_but_not_loaded(healthy: System) -> None:
    assert check_module("rdma_ucm", "rdma_cm")(healthy).verdict is Verdict.OK  # listed in /proc/modules
    (healthy.root / "proc/modules").write_text("")
    write(
        healthy.root,
        f"/lib/modules/{RELEASE}/modules.dep",
        "kernel/drivers/infiniband/core/rdma_ucm.ko.xz:\n",
    )
    result = check_module("rdma_ucm", "rdma_cm")(healthy)
    assert (result.verdict, result.fix) == (Verdict.FAIL, "sudo modprobe rdma_ucm")
    driver = check_driver(healthy)  # rdma_rxe no longer loaded, and modules.dep no longer lists it
    assert driver.verdict is Verdict.FAIL and "none installed" in driver.summary


def test_driver_installed_not_loaded_suggests_soft_roce(healthy: System) -> None:
    (healthy.root / "proc/modules").write_text("")
    result = check_driver(healthy)
    assert result.verdict is Verdict.FAIL
    assert result.fix is not None and "modprobe rdma_rxe" in result.fix and "rdma link add rxe0" in result.fix


def test_dev_nodes_missing_or_not_writable(healthy: System) -> None:
    denied = rxe_system(healthy.root, access=lambda path: path.name != "uverbs0")
    result = check_dev_nodes(denied)
    assert (
        result.verdict is Verdict.FAIL
        and result.summary == "no read-write access to /dev/infiniband/{uverbs0}"
    )
    (healthy.root / "dev/infiniband/uverbs0").unlink()
    result = check_dev_nodes(healthy)
    assert result.verdict is Verdict.FAIL and "lacks uverbs*" in result.summary


def test_no_active_port(healthy: System) -> None:
    write(healthy.root, "/sys/class/infiniband/rxe0/ports/1/state", "1: DOWN\n")
    result = check_devices(healthy)
    assert result.verdict is Verdict.FAIL
    assert result.summary == "no ACTIVE port: rxe0/1 DOWN Ethernet"
    assert check_loopback(healthy).verdict is Verdict.SKIP


def test_roce_port_without_ipv4_gid(healthy: System) -> None:
    (healthy.root / "sys/class/infiniband/rxe0/ports/1/gids/1").write_text(ZERO_GID + "\n")
    result = check_gids(healthy)
    assert result.verdict is Verdict.FAIL
    assert "RoCE v2 IPv4 none" in result.summary
    assert result.fix == "sudo ip addr add ADDR/PREFIX dev NETDEV (the netdev of rxe0/1)"
    # the loopback then finds the address with `ip addr` on the port's netdev
    assert check_loopback(healthy).verdict is Verdict.OK


def test_roce_v2_ipv4_only_from_mapped_roce_v2_gids() -> None:
    port = PortState(
        "rxe0",
        1,
        "ACTIVE",
        "Ethernet",
        ((GID_V4, "RoCE v2", "dum0"), (GID_V4, "IB/RoCE v1", "dum0"), (GID_LINK_LOCAL, "RoCE v2", "dum0")),
    )
    assert port.roce_v2_ipv4() == ["198.18.0.1"]
    assert port.netdev == "dum0"


def test_small_mtu_warns(healthy: System) -> None:
    system = rxe_system(healthy.root, list_devices=lambda: [device_info(mtu=256)])
    result = check_mtu(system)
    assert result.verdict is Verdict.WARN
    assert "ip link set dev NETDEV mtu 1500" in (result.fix or "")
    broken = rxe_system(healthy.root, list_devices=lambda: (_ for _ in ()).throw(OSError("no provider")))
    assert check_mtu(broken).verdict is Verdict.SKIP


def test_memlock(healthy: System) -> None:
    per_conn = 4 << 20  # (32 + 32) * 64 KiB
    low = check_memlock(rxe_system(healthy.root, memlock=lambda: (64 << 10, 64 << 10)))
    assert low.verdict is Verdict.FAIL
    assert low.summary.startswith("ulimit -l 64 KiB: room for 0 connection(s)")
    assert low.fix is not None and low.fix.startswith("ulimit -l 64 ")
    some = check_memlock(rxe_system(healthy.root, memlock=lambda: (8 << 20, resource.RLIM_INFINITY)))
    assert some.verdict is Verdict.WARN and (some.fix or "").startswith("ulimit -l unlimited ")
    assert some.data["per_connection"] == per_conn
    unlimited = rxe_system(healthy.root, memlock=lambda: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert check_memlock(unlimited).verdict is Verdict.OK
    write(healthy.root, "/proc/self/status", "CapEff:\t000001ffffffffff\n")  # root: CAP_IPC_LOCK
    capable = check_memlock(rxe_system(healthy.root, memlock=lambda: (64 << 10, 64 << 10)))
    assert capable.verdict is Verdict.OK and "CAP_IPC_LOCK" in capable.summary


def test_netns_modes(healthy: System) -> None:
    def with_output(text: str | None) -> System:
        return rxe_system(healthy.root, run=lambda args: text)

    assert (
        check_netns(with_output("netns shared privileged-qkey off copy-on-fork on\n")).verdict is Verdict.OK
    )
    assert "exclusive" in check_netns(with_output("netns exclusive copy-on-fork on\n")).summary
    missing = check_netns(with_output(None))
    assert missing.verdict is Verdict.WARN and missing.fix == "sudo apt-get install iproute2"


def test_loopback_failure_and_timeout(healthy: System) -> None:
    def refuse(addr: str, timeout: float) -> float:
        raise ConnectionRefusedError("refused")

    result = check_loopback(rxe_system(healthy.root, loopback=refuse))
    assert result.verdict is Verdict.FAIL
    assert result.summary == "rxe0 198.18.0.1: ConnectionRefusedError: refused"

    def hang(addr: str, timeout: float) -> float:
        raise TimeoutError

    result = check_loopback(rxe_system(healthy.root, loopback=hang), timeout=3)
    assert result.summary == "rxe0 198.18.0.1: no echo within 3 s"


def test_libraries_and_providers_missing(tmp_path: Path) -> None:
    system = rxe_system(tmp_path, run=lambda args: "0 libs found\n")
    libs = check_libraries(system)
    assert libs.verdict is Verdict.FAIL
    assert libs.fix is not None and "apt-get install libibverbs1 librdmacm1" in libs.fix
    providers = check_providers(system)
    assert providers.verdict is Verdict.FAIL and providers.fix == "sudo apt-get install ibverbs-providers"


def test_a_crashing_check_is_reported_not_raised(healthy: System) -> None:
    def check_boom(system: System) -> CheckResult:
        raise KeyError("bug")

    results = doctor.run_checks(healthy, [check_boom, check_devices])
    assert results[0].name == "boom" and results[0].verdict is Verdict.FAIL
    assert "KeyError" in results[0].summary and results[1].verdict is Verdict.OK


def _machine_has_rdma() -> bool:
    try:
        return any(Path("/sys/class/infiniband").iterdir())
    except OSError:
        return False


def test_cli_on_this_machine() -> None:
    """The real ``python -m rdmaio doctor`` here: without RDMA (outside the test host) it fails, naming
    what is missing and the test host; with a device, its exit status agrees with its verdicts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMAIO_")}
    run = subprocess.run(
        [sys.executable, "-m", "rdmaio", "doctor", "--json", "--timeout", "60"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    doc = json.loads(run.stdout)
    verdicts = {c["name"]: c["verdict"] for c in doc["checks"]}
    assert run.returncode == (0 if doc["ok"] else 1)
    assert doc["ok"] == ("fail" not in verdicts.values())
    if not _machine_has_rdma():
        assert run.returncode == 1
        assert verdicts["devices"] == "fail"
        devices = next(c for c in doc["checks"] if c["name"] == "devices")
        assert "no RDMA device on this machine" in devices["summary"]
        assert "rdmaio.testing.host" in devices["fix"]
        text = subprocess.run(
            [sys.executable, "-m", "rdmaio", "doctor"], capture_output=True, text=True, timeout=300, env=env
        )
        assert text.returncode == 1
        assert "FAIL  devices" in text.stdout and "no RDMA device here" in text.stdout
