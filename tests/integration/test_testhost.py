"""The environment the test host guarantees to the integration tests.

In the VM (``RDMAIO_TESTHOST=1``) that is: Soft-RoCE device rxe0 (siw0 with ``--provider siw``), ACTIVE,
on netdev dum0 holding 198.18.0.1 and 198.18.0.2, unlimited locked memory and 65536 open files. On a
machine with its own RDMA device (``RDMAIO_TESTHOST=local``) the device, netdev and address are the ones
the test host found.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
from pathlib import Path

IN_VM = os.environ.get("RDMAIO_TESTHOST") == "1"
DEVICE = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
NETDEV = os.environ.get("RDMAIO_TEST_NETDEV", "dum0")


def run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout


def ipv4_addresses(netdev: str) -> list[str]:
    return re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", run("ip", "-4", "-o", "addr", "show", "dev", netdev))


def test_runs_under_the_test_host() -> None:
    assert os.environ.get("RDMAIO_TESTHOST") in {"1", "local"}
    assert os.environ.get("RDMAIO_REQUIRE_DEVICE") == "1"


def test_device_is_in_sysfs() -> None:
    devices = sorted(p.name for p in Path("/sys/class/infiniband").iterdir())
    assert DEVICE in devices
    if IN_VM:
        provider = os.environ.get("RDMAIO_TEST_PROVIDER", "rxe")
        assert f"{provider}0" == DEVICE  # rxe0, or siw0 (--provider siw)
        assert (Path("/sys/class/infiniband") / DEVICE / "ports" / "1" / "state").read_text().strip() == (
            "4: ACTIVE"
        )


def test_ibv_devinfo_reports_port_active() -> None:
    out = run("ibv_devinfo", "-d", DEVICE)
    assert re.search(r"^\s*state:\s+PORT_ACTIVE\b", out, re.MULTILINE), out
    if IN_VM:
        # RoCE reports the IB transport; Soft-iWARP (--provider siw) iWARP
        transport = "iWARP" if os.environ.get("RDMAIO_TEST_PROVIDER") == "siw" else "InfiniBand"
        assert re.search(rf"^\s*transport:\s+{transport}\b", out, re.MULTILINE), out
        assert re.search(r"^\s*link_layer:\s+Ethernet", out, re.MULTILINE), out


def test_rdma_link_is_active_on_the_netdev() -> None:
    out = run("rdma", "link", "show")
    line = next((ln for ln in out.splitlines() if ln.startswith(f"link {DEVICE}/")), "")
    assert " state ACTIVE " in f"{line} ", out
    assert f" netdev {NETDEV}" in line, out


def test_memlock_is_unlimited() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert soft == resource.RLIM_INFINITY
    assert hard == resource.RLIM_INFINITY


def test_open_files_limit() -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= (65536 if IN_VM else 1024)


def test_test_address_is_on_the_netdev(rdma_addr: str) -> None:
    assert rdma_addr == os.environ["RDMAIO_TEST_ADDR"]
    addrs = ipv4_addresses(NETDEV)
    assert rdma_addr in addrs
    if IN_VM:
        assert rdma_addr == "198.18.0.1"
        assert "198.18.0.2" in addrs
        assert os.environ.get("RDMAIO_TEST_ADDR2") == "198.18.0.2"


def test_verbs_device_nodes_exist() -> None:
    nodes = {p.name for p in Path("/dev/infiniband").iterdir()}
    assert "rdma_cm" in nodes
    assert any(n.startswith("uverbs") for n in nodes)
