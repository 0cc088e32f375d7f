"""Unit tests of ``rdmaio doctor --peer`` (rdmaio/cli/peer.py) without a device: the route check against
fake ``ip`` output and a fake sysfs, each side's GID from sysfs, the GID and MTU comparisons, the line and
fix for each way a connect fails, the command-line parsing, and the server's probe responder against a
fake endpoint. The checks against a live server run in the test host (tests/integration/test_cli.py)."""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import rdmaio
from rdmaio.cli import doctor
from rdmaio.cli.checks import Verdict
from rdmaio.cli.peer import (
    MAX_PROBE_REQUEST,
    PROBE_PREFIX,
    PeerReport,
    ProbeResponder,
    check_gids,
    check_mtu_match,
    check_route,
    connect_failure,
    gid_of_address,
    local_path,
    parse_route,
    probe_request,
)
from rdmaio.cli.system import System

GID_1 = "0000:0000:0000:0000:0000:ffff:c612:0001"  # ::ffff:198.18.0.1
GID_LINK_LOCAL = "fe80:0000:0000:0000:b4f2:1cff:fe11:2233"


def write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def machine(root: Path, outputs: dict[tuple[str, ...], str], v1_too: bool = False) -> System:
    """rxe0 port 1 on dum0 with GIDs: 0 link-local, 1 (and 2 as RoCE v1 when asked) for 198.18.0.1."""
    port = "/sys/class/infiniband/rxe0/ports/1"
    write(root, f"{port}/state", "4: ACTIVE\n")
    write(root, f"{port}/link_layer", "Ethernet\n")
    table = [(GID_LINK_LOCAL, "RoCE v2"), (GID_1, "RoCE v2")] + ([(GID_1, "IB/RoCE v1")] if v1_too else [])
    for i, (gid, kind) in enumerate(table):
        write(root, f"{port}/gids/{i}", gid + "\n")
        write(root, f"{port}/gid_attrs/types/{i}", kind + "\n")
        write(root, f"{port}/gid_attrs/ndevs/{i}", "dum0\n")

    def run(args: Sequence[str]) -> str | None:
        return outputs.get(tuple(args))

    return System(root=root, run=run)


IP_VERSION = {("ip", "-V"): "ip utility, iproute2-6.1.0\n"}


def test_parse_route() -> None:
    assert parse_route("198.18.0.2 dev dum0 src 198.18.0.1 uid 0 \\    cache") == {
        "type": "unicast",
        "dev": "dum0",
        "src": "198.18.0.1",
    }
    assert parse_route("10.1.2.3 via 192.0.2.1 dev eth0 src 192.0.2.2 uid 0") == {
        "type": "unicast",
        "via": "192.0.2.1",
        "dev": "eth0",
        "src": "192.0.2.2",
    }
    assert parse_route("local 198.18.0.2 dev lo src 198.18.0.2 uid 0")["type"] == "local"


def test_route_to_a_peer_on_the_rdma_netdev(tmp_path: Path) -> None:
    system = machine(
        tmp_path,
        {
            **IP_VERSION,
            ("ip", "-4", "-o", "route", "get", "198.18.0.9"): "198.18.0.9 dev dum0 src 198.18.0.1\n",
        },
    )
    result = check_route(system, "198.18.0.9")
    assert result.verdict is Verdict.OK
    assert result.summary == "198.18.0.9 dev dum0 src 198.18.0.1: RDMA port rxe0/1"


def test_route_to_an_own_address_names_its_netdev(tmp_path: Path) -> None:
    system = machine(
        tmp_path,
        {
            **IP_VERSION,
            ("ip", "-4", "-o", "route", "get", "198.18.0.2"): "local 198.18.0.2 dev lo src 198.18.0.2\n",
            ("ip", "-4", "-o", "addr", "show"): "1: lo    inet 127.0.0.1/8 scope host lo\n"
            "3: dum0    inet 198.18.0.1/24 scope global dum0\n"
            "3: dum0    inet 198.18.0.2/24 scope global secondary dum0\n",
        },
    )
    result = check_route(system, "198.18.0.2")
    assert result.verdict is Verdict.OK
    assert result.summary == "198.18.0.2 is an address of this machine (dum0): RDMA port rxe0/1"


def test_route_through_a_netdev_without_rdma_fails_with_the_fix(tmp_path: Path) -> None:
    system = machine(
        tmp_path,
        {
            **IP_VERSION,
            ("ip", "-4", "-o", "route", "get", "10.0.0.5"): "10.0.0.5 via 192.0.2.1 dev eth0 src 192.0.2.2\n",
        },
    )
    result = check_route(system, "10.0.0.5")
    assert result.verdict is Verdict.FAIL
    assert result.summary.startswith("10.0.0.5 via 192.0.2.1 dev eth0 src 192.0.2.2: no RDMA device on eth0")
    assert result.fix is not None and "peer's RDMA interface address" in result.fix


def test_no_route_and_no_ip_tool(tmp_path: Path) -> None:
    result = check_route(machine(tmp_path, IP_VERSION), "203.0.113.9")
    assert (result.verdict, result.summary) == (Verdict.FAIL, "no IPv4 route to 203.0.113.9")
    assert result.fix is not None and "ip route" in result.fix
    assert check_route(machine(tmp_path, {}), "203.0.113.9").verdict is Verdict.WARN


def test_gid_of_address_prefers_roce_v2(tmp_path: Path) -> None:
    system = machine(tmp_path, {}, v1_too=True)
    assert gid_of_address(system, "rxe0", 1, "198.18.0.1") == (1, GID_1, "RoCE v2")
    assert gid_of_address(system, "rxe0", 1, "198.18.0.7") is None
    assert gid_of_address(system, "rxe9", 1, "198.18.0.1") is None
    assert gid_of_address(system, "rxe0", 1, "not-an-address") is None


class FakeKey:
    """Stands for a RemoteKey: only its wire form is used."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __bytes__(self) -> bytes:
        return self.number.to_bytes(32, "big")


class FakeEndpoint:
    """The endpoint calls the probe responder and local_path make, recorded."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra = extra
        self.sent: list[bytes] = []
        self.exported: list[bytearray] = []
        self.revoked: list[object] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    async def send(self, data: bytes) -> None:
        self.sent.append(bytes(data))

    def export(self, buffer: bytearray, access: str = "rw") -> FakeKey:
        assert access == "r"
        self.exported.append(buffer)
        return FakeKey(len(self.exported))

    async def revoke(self, key: object) -> None:
        self.revoked.append(key)


EXTRA = {"device": "rxe0", "port": 1, "sockname": ("198.18.0.1", 7471), "mtu": 1024, "qp_num": 17}


def test_local_path_from_extra_info_and_sysfs(tmp_path: Path) -> None:
    path = local_path(FakeEndpoint(EXTRA), machine(tmp_path, {}))  # type: ignore[arg-type]
    assert path == {
        "device": "rxe0",
        "port": 1,
        "address": "198.18.0.1",
        "transport": None,
        "active_mtu": 1024,
        "path_mtu": None,
        "gid": "::ffff:198.18.0.1",
        "gid_index": 1,
        "gid_type": "RoCE v2",
        "remote_gid": None,
    }


def test_local_path_prefers_the_path_record(tmp_path: Path) -> None:
    class Record:
        device = "mlx5_0"
        port = 1
        local_gid = "fe80::1"
        gid_index = 3
        gid_type = "RoCE v2"
        active_mtu = 4096
        transport = "RoCE v2"

    ep = FakeEndpoint({**EXTRA, "rdma": Record()})
    path = local_path(ep, machine(tmp_path, {}))  # type: ignore[arg-type]
    assert (path["device"], path["gid"], path["gid_index"], path["active_mtu"]) == (
        "mlx5_0",
        "fe80::1",
        3,
        4096,
    )
    assert path["transport"] == "RoCE v2"


def side(gid_type: str = "RoCE v2", mtu: int = 1024) -> dict[str, Any]:
    return {
        "device": "rxe0",
        "port": 1,
        "address": "198.18.0.1",
        "active_mtu": mtu,
        "gid": GID_1,
        "gid_index": 1,
        "gid_type": gid_type,
    }


def test_gids_and_mtu_comparisons() -> None:
    ok = check_gids(side(), PeerReport("0.1.0", side(), True))
    assert ok.verdict is Verdict.OK
    assert ok.summary == (
        f"here rxe0/1 198.18.0.1 GID {GID_1} (index 1, RoCE v2); peer (rdmaio 0.1.0) rxe0/1 198.18.0.1 GID "
        f"{GID_1} (index 1, RoCE v2)"
    )
    mixed = check_gids(side(), PeerReport("0.1.0", side("IB/RoCE v1"), True))
    assert mixed.verdict is Verdict.FAIL and "different RoCE versions" in mixed.summary
    addressed_elsewhere = check_gids(
        {**side(), "remote_gid": "::ffff:10.0.0.9"}, PeerReport("0.1.0", side(), True)
    )
    assert addressed_elsewhere.verdict is Verdict.WARN
    assert "queue pair addresses GID ::ffff:10.0.0.9" in addressed_elsewhere.summary
    consistent = check_gids({**side(), "remote_gid": "::ffff:198.18.0.1"}, PeerReport("0.1.0", side(), True))
    assert consistent.verdict is Verdict.OK
    unknown = check_gids(side(), PeerReport(None, None, False))
    assert unknown.verdict is Verdict.WARN and "echoes doctor's probe" in unknown.summary

    assert (
        check_mtu_match(side(), PeerReport("0.1.0", side(), True)).summary == "active MTU 1024 on both sides"
    )
    differ = check_mtu_match(side(mtu=4096), PeerReport("0.1.0", side(mtu=1024), True))
    assert differ.verdict is Verdict.WARN
    assert differ.summary == "active MTU here 4096, peer 1024: the connection uses 1024"
    assert differ.fix is not None and "mtu" in differ.fix
    assert check_mtu_match(side(), PeerReport(None, None, False)).verdict is Verdict.WARN


@pytest.mark.parametrize(
    ("exc", "summary", "fix_part"),
    [
        (
            rdmaio.ConnectionRefusedError("rejected"),
            "no rdmaio server is listening on 198.18.0.2:7000",
            "start `python -m rdmaio ping --server 198.18.0.2 7000` there",
        ),
        (
            rdmaio.UnreachableError("RDMA_CM_EVENT_ADDR_ERROR"),
            "198.18.0.2:7000: unreachable: RDMA_CM_EVENT_ADDR_ERROR",
            "check the route and ARP to 198.18.0.2 (ip route get 198.18.0.2; ip neigh show 198.18.0.2)",
        ),
        (
            rdmaio.TimeoutError("connect timed out"),
            "198.18.0.2:7000: no answer within 5 s (connect timed out)",
            "UDP port 4791",
        ),
        (
            rdmaio.VerbsError("rdma_create_event_channel() [ENODEV]", errno=errno.ENODEV),
            "no usable RDMA device on this host: ",
            "python -m rdmaio doctor (without --peer)",
        ),
        (
            rdmaio.HandshakeError("bad version"),
            "198.18.0.2:7000: the rdmaio handshake failed: bad version",
            "the same rdmaio version on both hosts",
        ),
    ],
)
def test_connect_failures_say_what_to_fix(exc: BaseException, summary: str, fix_part: str) -> None:
    result = connect_failure(exc, "198.18.0.2", 7000, 5.0)
    assert result.name == "handshake" and result.verdict is Verdict.FAIL
    assert result.summary.startswith(summary), result.summary
    assert result.fix is not None and fix_part in result.fix, result.fix


def test_probe_responder_answers_info_and_read_and_echoes_the_rest(tmp_path: Path) -> None:
    ep = FakeEndpoint(EXTRA)
    responder = ProbeResponder(ep, machine(tmp_path, {}))  # type: ignore[arg-type]

    async def main() -> None:
        assert await responder.answer(b"RPNG\x00\x00\x00\x00\x00\x00\x00\x01") is False
        assert await responder.answer(PROBE_PREFIX + b" " * MAX_PROBE_REQUEST) is False  # too long
        assert await responder.answer(probe_request("info")) is True
        for _ in range(3):
            assert await responder.answer(probe_request("read")) is True
        assert await responder.answer(PROBE_PREFIX + b"{not json") is True

    asyncio.run(main())
    answers = [json.loads(m[len(PROBE_PREFIX) :]) for m in ep.sent]
    assert answers[0]["version"] == rdmaio.__version__
    assert answers[0]["path"]["gid"] == "::ffff:198.18.0.1" and answers[0]["path"]["active_mtu"] == 1024
    assert [a["length"] for a in answers[1:4]] == [4096] * 3
    # One export at a time: each new read probe revoked the previous key first.
    assert len(ep.exported) == 3 and len(ep.revoked) == 2 and responder.exported_bytes == 4096
    assert answers[4] == {"error": "unknown probe request None"}


def test_peer_argument_parsing(capsys: pytest.CaptureFixture[str]) -> None:
    parser = doctor.build_parser()
    assert doctor._peer_target(parser, ["198.18.0.2"]) == ("198.18.0.2", 7471)
    assert doctor._peer_target(parser, ["198.18.0.2", "7000"]) == ("198.18.0.2", 7000)
    for bad in (["h", "x"], ["h", "0"], ["h", "1", "2"]):
        with pytest.raises(SystemExit) as stop:
            doctor._peer_target(parser, bad)
        assert stop.value.code == 2
    assert "--peer" in capsys.readouterr().err


def test_peer_mode_renders_a_conclusion(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rdmaio.cli.checks import CheckResult

    results = [CheckResult("route", Verdict.OK, "fine"), CheckResult("handshake", Verdict.OK, "fine")]
    monkeypatch.setattr(doctor, "run_pair_checks", lambda *args: results)
    assert doctor.main(["--peer", "198.18.0.2", "7000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(", pair with 198.18.0.2:7000)")
    assert out[-1] == "doctor: no check failed: this host and 198.18.0.2:7000 talk over RDMA through rdmaio"
    results.append(CheckResult("echo", Verdict.FAIL, "broken", "fix it"))
    assert doctor.main(["--peer", "198.18.0.2", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["peer"] == "198.18.0.2:7471" and doc["ok"] is False
