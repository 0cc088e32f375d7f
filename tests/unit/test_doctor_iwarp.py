"""Unit tests of ``rdmaio doctor`` on transports other than RoCE: the transport of each port, the GID check
per transport (iWARP GIDs are MAC-based: RoCE's IPv4 GID check must not fail there), and the device's
features (immediate data, atomics, memory windows, scatter entries) -- on fake machines."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
from fake_machine import DUM0_IPV4, LDCONFIG, fake_system, rdma_core_root, write

import rdmaio
from rdmaio.cli import doctor
from rdmaio.cli.checks import CHECKS, Verdict, check_features, check_gids, check_loopback
from rdmaio.cli.peer import check_route, connect_failure, describe_side, local_path
from rdmaio.cli.system import LoopbackTime, System, parse_devinfo, transport_of
from rdmaio.verbs import DeviceInfo, PortInfo

SIW_GID = "c2ff:ea7a:94db:0000:0000:0000:0000:0000"  # what siw0 showed in the test host: from the MAC
RXE_GID_V4 = "0000:0000:0000:0000:0000:ffff:c612:0001"

# `ibv_devinfo -v` of siw0 and rxe0 in the test host (trimmed to what is parsed and a few neighbours).
DEVINFO_SIW = """hca_id:\tsiw0
\ttransport:\t\t\tiWARP (1)
\tfw_ver:\t\t\t\t0.0.0
\tmax_qp:\t\t\t\t102400
\tmax_sge:\t\t\t6
\tmax_sge_rd:\t\t\t1
\tatomic_cap:\t\t\tATOMIC_NONE (0)
\tmax_mw:\t\t\t\t0
\tmax_srq_sge:\t\t\t6
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t1024 (3)
"""
DEVINFO_RXE = """hca_id:\trxe0
\ttransport:\t\t\tInfiniBand (0)
\tmax_sge:\t\t\t32
\tmax_sge_rd:\t\t\t32
\tatomic_cap:\t\t\tATOMIC_HCA (1)
\tmax_mw:\t\t\t\t524287
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
"""


def siw_root(root: Path) -> Path:
    """A machine with siw0 on dum0 (198.18.0.1), as the test host sets it up with --provider siw."""
    write(root, "/sys/class/infiniband/siw0/node_type", "4: RNIC\n")
    port = "/sys/class/infiniband/siw0/ports/1"
    write(root, f"{port}/state", "4: ACTIVE\n")
    write(root, f"{port}/link_layer", "Ethernet\n")
    write(root, f"{port}/gids/0", SIW_GID + "\n")  # iWARP: no gid_attrs types/ndevs to read
    modules = "siw 188416 0 - Live 0x0\nrdma_ucm 32768 0 - Live 0x0\n"
    return rdma_core_root(root, modules=modules, drivers=("siw",))


def siw_system(
    root: Path, *, addresses: bool = True, devinfo: str | None = DEVINFO_SIW, **overrides: object
) -> System:
    """The machine of ``siw_root`` with siw0 as its one device; ``addresses=False`` leaves dum0 without an
    IPv4 address, ``devinfo`` is what ``ibv_devinfo -v`` prints."""
    outputs = {
        ("ldconfig", "-p"): LDCONFIG,
        ("rdma", "system"): "netns shared copy-on-fork on\n",
        ("rdma", "link", "show"): "link siw0/1 state ACTIVE physical_state LINK_UP netdev dum0 \n",
        ("ibv_devinfo", "-v"): devinfo,
        **(DUM0_IPV4 if addresses else {}),
    }
    port = PortInfo(1, "ACTIVE", True, 1024, 1024, "Ethernet", 1, 0xFFFFFFFF)
    info = DeviceInfo("siw0", "0.0.0", 102400, 32768, 102400, 3276800, 1024000, 1 << 63, 6, (port,))
    return fake_system(root, outputs, lambda: [info], **overrides)


@pytest.fixture
def siw(tmp_path: Path) -> System:
    return siw_system(siw_root(tmp_path))


def test_iwarp_port_is_recognised_with_its_netdev_from_rdma_link(siw: System) -> None:
    (device,) = siw.sysfs_devices()
    assert device.node_type == "RNIC"
    (port,) = device.ports
    assert port.transport == "iWARP"
    assert port.netdev == "dum0"  # from `rdma link`: an iWARP GID names no netdev
    assert port.roce_v2_ipv4() == []


def test_gids_on_iwarp_pass_without_roce_gids_and_show_no_roce_fix(siw: System) -> None:
    """Before: ``FAIL gids: siw0/1: netdev -, RoCE v2 IPv4 none`` with the ``ip addr add`` fix, on a
    siw0 whose netdev had its address."""
    result = check_gids(siw)
    assert result.verdict is Verdict.OK, result
    assert result.summary == "siw0/1: iWARP, 1 MAC-based GIDs, netdev dum0, IPv4 198.18.0.1"
    assert result.fix is None
    assert "RoCE" not in result.summary


def test_gids_on_iwarp_without_an_ipv4_address_fail_with_the_address_fix(tmp_path: Path) -> None:
    system = siw_system(siw_root(tmp_path), addresses=False)
    result = check_gids(system)
    assert result.verdict is Verdict.FAIL
    assert "siw0/1: iWARP, 1 MAC-based GIDs, netdev dum0, IPv4 none" in result.summary
    assert "RoCE v2" not in result.summary
    assert result.fix == "sudo ip addr add ADDR/PREFIX dev NETDEV (the netdev of siw0/1)"


def test_features_of_siw_say_what_iwarp_lacks(siw: System) -> None:
    result = check_features(siw)
    assert result.verdict is Verdict.OK
    assert result.summary == (
        "siw0: iWARP, immediate data none, atomics none (ATOMIC_NONE), memory windows none, "
        "READ scatter entries 1, send scatter entries 6"
    )
    assert result.data["siw0"] == {
        "transport": "iWARP",
        "immediate_data": False,
        "atomics": False,
        "atomic_cap": "ATOMIC_NONE",
        "max_mw": 0,
        "max_sge_rd": 1,
        "max_sge": 6,
    }


def test_features_of_rxe(tmp_path: Path) -> None:
    root = tmp_path
    port = "/sys/class/infiniband/rxe0/ports/1"
    write(root, "/sys/class/infiniband/rxe0/node_type", "1: CA\n")
    write(root, f"{port}/state", "4: ACTIVE\n")
    write(root, f"{port}/link_layer", "Ethernet\n")
    for i, kind in enumerate(("IB/RoCE v1", "RoCE v2")):
        write(root, f"{port}/gids/{i}", RXE_GID_V4 + "\n")
        write(root, f"{port}/gid_attrs/types/{i}", kind + "\n")
        write(root, f"{port}/gid_attrs/ndevs/{i}", "dum0\n")
    system = siw_system(root, devinfo=DEVINFO_RXE)
    result = check_features(system)
    assert result.summary == (
        "rxe0: RoCE v1/v2, immediate data yes, atomics yes (ATOMIC_HCA), memory windows 524287, "
        "READ scatter entries 32, send scatter entries 32"
    )
    assert check_gids(system).summary == "rxe0/1: netdev dum0, RoCE v2 IPv4 198.18.0.1"


def test_features_without_ibv_devinfo_still_show_transport_and_immediates(tmp_path: Path) -> None:
    system = siw_system(siw_root(tmp_path), devinfo=None)
    result = check_features(system)
    assert result.verdict is Verdict.OK
    assert result.summary.startswith("siw0: iWARP, immediate data none (atomics, memory windows")
    assert "ibverbs-utils" in result.summary


def test_whole_doctor_passes_on_siw(siw: System, capsys: pytest.CaptureFixture[str]) -> None:
    results = doctor.run_checks(siw)
    assert [r.verdict for r in results] == [Verdict.OK] * len(CHECKS), results
    assert doctor.main([], system=siw) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "RoCE v2 IPv4" not in out


def test_loopback_reports_the_connections_inline_size(siw: System) -> None:
    def loopback(addr: str, timeout: float) -> float:
        took = LoopbackTime(0.003)
        took.max_inline = 64
        return took

    siw.loopback = loopback
    assert check_loopback(siw).summary == "siw0 198.18.0.1: connect+echo ok (3.0 ms, max inline 64 B)"


@pytest.mark.parametrize(
    ("node_type", "link_layer", "gid_types", "expected"),
    [
        ("RNIC", "Ethernet", (), "iWARP"),
        ("CA", "InfiniBand", (), "InfiniBand"),
        ("CA", "Ethernet", ("RoCE v2",), "RoCE v2"),
        ("CA", "Ethernet", ("IB/RoCE v1",), "RoCE v1"),
        ("CA", "Ethernet", ("IB/RoCE v1", "RoCE v2"), "RoCE v1/v2"),
        ("CA", "Ethernet", (), "RoCE"),
        ("", "unknown", (), "unknown"),
    ],
)
def test_transport_of(node_type: str, link_layer: str, gid_types: tuple[str, ...], expected: str) -> None:
    assert transport_of(node_type, link_layer, gid_types) == expected


def test_parse_devinfo_of_two_devices() -> None:
    caps = parse_devinfo(DEVINFO_SIW + DEVINFO_RXE)
    assert sorted(caps) == ["rxe0", "siw0"]
    assert caps["siw0"].transport == "iWARP" and not caps["siw0"].immediate_data
    assert not caps["siw0"].atomics and caps["siw0"].max_mw == 0 and caps["siw0"].max_sge_rd == 1
    assert caps["rxe0"].atomics and caps["rxe0"].max_mw == 524287 and caps["rxe0"].immediate_data
    assert parse_devinfo("") == {}


# --- doctor --peer on iWARP -------------------------------------------------------------------------------


def test_peer_route_finds_the_iwarp_port_on_the_routes_netdev(siw: System) -> None:
    """Before: ``FAIL route: 198.18.0.2 dev dum0 ...: no RDMA device on dum0`` (the port was looked for
    among the GIDs' netdevs, which an iWARP GID does not name; ``rdma link`` does)."""
    canned = siw.run
    route = {("ip", "-V"): "ip utility, iproute2-6.1.0\n"} | {
        ("ip", "-4", "-o", "route", "get", "198.18.0.9"): "198.18.0.9 dev dum0 src 198.18.0.1\n"
    }
    system = dataclasses.replace(siw, run=lambda args: route.get(tuple(args)) or canned(args))
    result = check_route(system, "198.18.0.9")
    assert result.verdict is Verdict.OK, result
    assert result.summary == "198.18.0.9 dev dum0 src 198.18.0.1: RDMA port siw0/1"


def test_peer_path_keeps_gid_index_zero_of_an_iwarp_record(siw: System) -> None:
    """An iWARP port's one GID is entry 0: the record's index 0 is an entry, not "unknown". Before: the
    index was dropped, no RoCE GID of the address was found in sysfs, and doctor said ``index None``."""

    class Record:
        device = "siw0"
        port = 1
        transport = "iWARP"
        local_gid = "c2ff:ea7a:94db::"
        remote_gid = "c2ff:ea7a:94db::"
        gid_index = 0
        gid_type = "IB"  # IBV_GID_TYPE_IB: not a RoCE entry
        active_mtu = 1024
        path_mtu = 1024

    class Endpoint:
        def get_extra_info(self, name: str) -> object:
            extra = {"rdma": Record(), "sockname": ("198.18.0.1", 40000), "device": "siw0", "port": 1}
            return extra.get(name)

    path = local_path(Endpoint(), siw)  # type: ignore[arg-type]
    assert (path["gid"], path["gid_index"], path["gid_type"]) == ("c2ff:ea7a:94db::", 0, "IB")
    assert describe_side(path) == "siw0/1 198.18.0.1 GID c2ff:ea7a:94db:: (index 0, IB)"


def test_peer_connect_failure_on_iwarp_names_tcp_not_roces_udp_port() -> None:
    """iWARP connects over TCP to the server's port: the firewall hint names that port, not RoCE v2's UDP
    port 4791 (which the hint named on every transport before)."""
    result = connect_failure(rdmaio.TimeoutError("connect timed out"), "198.18.0.2", 7000, 5.0, "iWARP")
    assert result.fix is not None and "TCP port 7000 (iWARP runs over TCP)" in result.fix, result.fix
    assert "4791" not in result.fix
    roce = connect_failure(rdmaio.TimeoutError("connect timed out"), "198.18.0.2", 7000, 5.0, "RoCE v2")
    assert roce.fix is not None and "UDP port 4791 (RoCE v2)" in roce.fix
