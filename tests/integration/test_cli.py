"""The command-line tools on a real RDMA device (the test host): ``rdmaio doctor`` passes every check,
and ``rdmaio ping`` against ``rdmaio ping --server`` prints a line per round trip and ping's summary."""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from loops import Runner, arun  # arun is a fixture used by name

import rdmaio
from rdmaio.cli.checks import CHECKS, NEEDS_EXTENSION, CheckResult, Verdict
from rdmaio.cli.peer import (
    PROBE_PREFIX,
    READ_PROBE_SIZE,
    ProbeResponder,
    probe_request,
    run_peer_checks,
    serve_doctor_session,
)
from rdmaio.cli.startup import EXTENSION_FIX
from rdmaio.cli.system import System

REPO = Path(__file__).resolve().parents[2]
# Everything in the VM is 20-40x slower; these only bound a hang, they are not expectations.
START_TIMEOUT = 180.0
RUN_TIMEOUT = 300.0
PING_PORT = 7491
REPLY = re.compile(r"^256 bytes from (\S+) port 7491: seq=(\d+) time=(\d+\.\d{3}) ms$")
SUMMARY_RTT = re.compile(r"^rtt min/avg/max/p99 = (\d+\.\d{3})/(\d+\.\d{3})/(\d+\.\d{3})/(\d+\.\d{3}) ms$")


def rdmaio_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rdmaio", *args]


def test_doctor_passes_every_check() -> None:
    text = subprocess.run(rdmaio_cmd("doctor"), capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=REPO)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    checks = lines[1:-1]
    assert len(checks) == len(CHECKS), text.stdout
    assert all(line.startswith("ok    ") for line in checks), text.stdout
    assert lines[-1] == "doctor: no check failed: rdmaio connections can work on this machine"
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    assert any(line.startswith("ok    loopback") and f"{device} " in line for line in checks), text.stdout

    js = subprocess.run(
        rdmaio_cmd("doctor", "--json"), capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=REPO
    )
    assert js.returncode == 0, js.stdout + js.stderr
    doc = json.loads(js.stdout)
    assert doc["ok"] is True
    assert {c["name"]: c["verdict"] for c in doc["checks"]} == {c["name"]: "ok" for c in doc["checks"]}
    assert len(doc["checks"]) == len(CHECKS)


# --- doctor without rdmaio's compiled extension --------------------------------------------------------


def run_without_extension(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the interpreter on the package copy at ``root``.

    ``-S`` with the virtualenv's site-packages on ``PYTHONPATH``: the dependencies (cffi) are found, but not
    the editable install's import hook, which would otherwise find the checkout's own extension for the copy.
    """
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{sysconfig.get_paths()['purelib']}")
    return subprocess.run(
        [sys.executable, "-S", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=root, env=env
    )


def test_doctor_without_the_extension_on_a_device(tmp_path: Path) -> None:
    """On a machine whose RDMA works, doctor run from an installation whose compiled extension is missing
    names the extension and its fix, still passes every check that does not need the extension (the
    device, its GIDs, memlock ...), skips the three that do, and exits 1 without a traceback."""
    shutil.copytree(
        REPO / "rdmaio", tmp_path / "rdmaio", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    assert not list((tmp_path / "rdmaio").glob("_rdmaio_cffi*"))
    # The real failure mode: a program importing this copy fails on the missing extension.
    program = run_without_extension(tmp_path, "-c", "import rdmaio")
    assert program.returncode == 1
    assert "ModuleNotFoundError: No module named 'rdmaio._rdmaio_cffi'" in program.stderr, program.stderr

    done = run_without_extension(tmp_path, "-m", "rdmaio", "doctor")
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rdmaio 0.1.0 doctor (Python "), done.stdout
    checks = lines[1:-1]
    assert len(checks) == len(CHECKS), done.stdout  # no "no RDMA here" hint: the device is found
    by_name = {line.split()[1]: line for line in checks}
    missing = f"rdmaio's compiled extension is missing: no _rdmaio_cffi*.so in {tmp_path}/rdmaio"
    assert by_name["extension"] == f"FAIL  extension  {missing}  -> fix: {EXTENSION_FIX}", done.stdout
    for name in NEEDS_EXTENSION:
        assert by_name[name].startswith("skip  ") and by_name[name].endswith("(see extension)"), done.stdout
    passed = set(by_name) - NEEDS_EXTENSION - {"extension"}
    assert passed and all(by_name[name].startswith("ok    ") for name in passed), done.stdout
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    assert device in by_name["devices"], done.stdout
    assert lines[-1] == "doctor: 1 check(s) failed: extension", done.stdout

    js = run_without_extension(tmp_path, "-m", "rdmaio", "doctor", "--json")
    assert "Traceback" not in js.stderr, js.stderr
    assert js.returncode == 1, js.stdout + js.stderr
    doc = json.loads(js.stdout)
    assert doc["ok"] is False
    verdicts = {c["name"]: c["verdict"] for c in doc["checks"]}
    expected = (
        {name: "ok" for name in passed} | dict.fromkeys(NEEDS_EXTENSION, "skip") | {"extension": "fail"}
    )
    assert verdicts == expected


class Proc:
    """A running command whose output lines are read as they come."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen(
            rdmaio_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r} in {timeout} s; saw {self.seen}"
                ) from None
            if line is None:
                raise AssertionError(f"exited before {pattern!r}; saw {self.seen}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float = RUN_TIMEOUT) -> tuple[int, list[str]]:
        code = self.popen.wait(timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen.append(line)
        return code, self.seen

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


@pytest.fixture
def ping_server(rdma_addr: str) -> object:
    server = Proc("ping", "--server", rdma_addr, str(PING_PORT))
    try:
        server.wait_for(f"^rdmaio ping server listening on {re.escape(rdma_addr)} port {PING_PORT}$")
        yield server
        server.popen.send_signal(signal.SIGTERM)
        code, lines = server.finish()
        assert code == 0, lines
        assert lines[-1] == "rdmaio ping server stopped"
    finally:
        server.kill()


def check_summary(lines: list[str], addr: str, sent: int, received: int) -> None:
    assert lines[-3] == f"--- {addr} port {PING_PORT} rdmaio ping statistics ---", lines
    loss = round(100 * (sent - received) / sent)
    assert re.fullmatch(rf"{sent} sent, {received} received, {loss}% loss, time \d+ ms", lines[-2]), lines
    match = SUMMARY_RTT.match(lines[-1])
    assert match, lines
    lo, avg, hi, p99 = (float(x) for x in match.groups())
    assert 0 < lo <= avg <= hi and lo <= p99 <= hi


def test_ping_against_ping_server(ping_server: Proc, rdma_addr: str) -> None:
    client = Proc("ping", rdma_addr, str(PING_PORT), "-c", "4", "-s", "256", "-i", "0.2")
    try:
        code, lines = client.finish()
    finally:
        client.kill()
    assert code == 0, lines
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    assert lines[0] == f"PING {rdma_addr} port {PING_PORT} over {device}: 256 bytes per message"
    replies = [REPLY.match(line) for line in lines[1:5]]
    assert all(replies), lines
    assert [(m.group(1), int(m.group(2))) for m in replies if m] == [(rdma_addr, i) for i in range(1, 5)]
    check_summary(lines, rdma_addr, 4, 4)
    ping_server.wait_for(rf"^{re.escape(rdma_addr)} port \d+: closed after 4 messages$")


def test_ping_interrupted_prints_the_summary(ping_server: Proc, rdma_addr: str) -> None:
    client = Proc("ping", rdma_addr, str(PING_PORT), "-s", "256", "-i", "0.1")
    try:
        client.wait_for(r"seq=2 time=")
        client.popen.send_signal(signal.SIGINT)
        code, lines = client.finish()
    finally:
        client.kill()
    assert code == 0, lines
    sent = int(re.match(r"^(\d+) sent", lines[-2]).group(1))  # type: ignore[union-attr]
    assert sent >= 2
    check_summary(lines, rdma_addr, sent, sent)


def test_ping_without_server_is_refused(rdma_addr: str) -> None:
    client = Proc("ping", rdma_addr, str(PING_PORT + 1), "-c", "1")
    try:
        code, lines = client.finish()
    finally:
        client.kill()
    assert code == 2
    assert lines == [
        f"rdmaio ping: {rdma_addr} port {PING_PORT + 1}: connection refused: no rdmaio listener there "
        f"(start one with: python -m rdmaio ping --server {rdma_addr} {PING_PORT + 1})"
    ]


# --- doctor --peer ----------------------------------------------------------------------------------------

DOCTOR_PORT = 7493
PEER_CHECKS = ["extension", "route", "handshake", "gids", "mtu", "echo", "read", "throughput"]
MISSING_PEER = "198.18.0.77"  # in the test host's subnet, nobody there: ARP never answers
CHECK_LINE = re.compile(r"^(ok|WARN|FAIL|skip)\s+(\S+)\s+(.*)$")


def peer_address(rdma_addr: str) -> str:
    """The test host's second address when the first is the default: the pair's other end on one node."""
    return "198.18.0.2" if rdma_addr == "198.18.0.1" else rdma_addr


def doctor_lines(*args: str) -> tuple[int, list[str], dict[str, tuple[str, str]]]:
    done = subprocess.run(
        rdmaio_cmd("doctor", *args), capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=REPO
    )
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    checks = {m.group(2): (m.group(1), m.group(3)) for line in lines if (m := CHECK_LINE.match(line))}
    return done.returncode, lines, checks


def sysfs_gid(device: str, address: str) -> str:
    """The GID sysfs lists for an IPv4 address on port 1 of ``device``, as doctor writes it: ``::ffff:A``
    plus `` (index I, RoCE v2)``, I being its index in sysfs."""
    octets = [int(x) for x in address.split(".")]
    want = "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}".format(*octets)
    port = Path(f"/sys/class/infiniband/{device}/ports/1")
    index = next(
        name
        for name in sorted(os.listdir(port / "gids"), key=int)
        if (port / "gids" / name).read_text().strip() == want
        and (port / "gid_attrs/types" / name).read_text().strip() == "RoCE v2"
    )
    return f"::ffff:{address} (index {index}, RoCE v2)"


def iwarp_gid(device: str) -> str:
    """The one GID of an iWARP port (index 0, from the netdev's MAC), as doctor writes it (an IPv6
    address): iWARP has no GID per IP address."""
    entry = Path(f"/sys/class/infiniband/{device}/ports/1/gids/0").read_text().strip()
    return str(ipaddress.IPv6Address(entry))


def test_doctor_peer_passes_against_a_ping_server(rdma_addr: str, provider: str) -> None:
    server_addr = peer_address(rdma_addr)
    server = Proc("ping", "--server", server_addr, str(DOCTOR_PORT))
    try:
        server.wait_for(f"^rdmaio ping server listening on {re.escape(server_addr)} port {DOCTOR_PORT}$")
        code, lines, checks = doctor_lines("--peer", server_addr, str(DOCTOR_PORT), "--timeout", "60")
        server.wait_for(rf"^{re.escape(rdma_addr)} port \d+: closed after \d+ messages$")
    finally:
        server.kill()
    assert code == 0, lines
    assert list(checks) == PEER_CHECKS, lines
    assert {name: verdict for name, (verdict, _) in checks.items()} == dict.fromkeys(PEER_CHECKS, "ok"), lines
    assert lines[0].endswith(f", pair with {server_addr}:{DOCTOR_PORT})")
    assert (
        lines[-1]
        == f"doctor: no check failed: this host and {server_addr}:{DOCTOR_PORT} talk over RDMA through rdmaio"
    )
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    if provider == "rxe":
        # Each side's GID is the one sysfs lists for the address that side used (RoCE v2).
        here, peer = sysfs_gid(device, rdma_addr), sysfs_gid(device, server_addr)
        assert checks["gids"][1] == (
            f"here {device}/1 {rdma_addr} GID {here}; peer (rdmaio 0.1.0) {device}/1 {server_addr} GID {peer}"
        )
        transport = "RoCE v2"
    else:
        # iWARP: both addresses are on one device, whose port has one MAC-based GID, entry 0 (its type is
        # not a RoCE one, whatever the device names it)
        gid = re.escape(iwarp_gid(device))
        assert re.fullmatch(
            rf"here {device}/1 {re.escape(rdma_addr)} GID {gid} \(index 0, [^)]+\); "
            rf"peer \(rdmaio 0\.1\.0\) {device}/1 {re.escape(server_addr)} GID {gid} \(index 0, [^)]+\)",
            checks["gids"][1],
        ), checks["gids"]
        assert "RoCE" not in checks["gids"][1] and "None" not in checks["gids"][1]
        transport = "iWARP"
    assert re.fullmatch(
        rf"connected to {re.escape(server_addr)}:{DOCTOR_PORT} over {device} port 1, {transport} \(QP \d+\)",
        checks["handshake"][1],
    ), checks["handshake"]
    assert re.fullmatch(r"active MTU \d+ on both sides", checks["mtu"][1]), checks["mtu"]
    assert re.fullmatch(r"RDMA READ of 4096 bytes in \d+\.\d ms, data intact", checks["read"][1])
    assert re.search(r"\(\d+ messages of 64 KiB echoed in \d+\.\d\d s\)$", checks["throughput"][1])


def test_doctor_peer_wrong_port_says_to_start_a_server(rdma_addr: str) -> None:
    port = DOCTOR_PORT + 1  # nobody listens there
    code, lines, checks = doctor_lines("--peer", rdma_addr, str(port), "--timeout", "60")
    assert code == 1, lines
    assert checks["route"][0] == "ok", lines
    assert checks["handshake"] == (
        "FAIL",
        f"no rdmaio server is listening on {rdma_addr}:{port}  -> fix: start "
        f"`python -m rdmaio ping --server {rdma_addr} {port}` there (or give the port it listens on)",
    ), lines
    assert [checks[n][0] for n in PEER_CHECKS[3:]] == ["skip"] * 5, lines
    assert lines[-1] == "doctor: 1 check(s) failed: handshake"


def test_doctor_peer_missing_peer_names_route_and_arp() -> None:
    code, lines, checks = doctor_lines("--peer", MISSING_PEER, "--timeout", "5")
    assert code == 1, lines
    assert checks["route"][0] == "ok", lines  # the route exists (the subnet is on the device's netdev)
    verdict, text = checks["handshake"]
    assert verdict == "FAIL", lines
    assert re.match(rf"^{re.escape(MISSING_PEER)}:7471: (unreachable: |no answer within 5 s)", text), text
    assert (
        f"-> fix: check the route and ARP to {MISSING_PEER} (ip route get {MISSING_PEER}; ip neigh show "
        in text
    )
    assert [checks[n][0] for n in PEER_CHECKS[3:]] == ["skip"] * 5, lines


def test_peer_checks_and_probe_bound_on_each_loop(arun: Runner[Any], rdma_addr: str) -> None:
    """In one process on each loop: the pair checks pass against a server answering probes; that server
    holds at most one READ export per connection (a second ``read`` probe revokes the first key)."""
    responders: list[ProbeResponder] = []

    async def handler(ep: rdmaio.Endpoint) -> None:
        responder = ProbeResponder(ep)
        responders.append(responder)
        async with ep:
            while (msg := await ep.recv()) is not None:
                if not await responder.answer(msg):
                    await ep.send(msg)

    async def handed_over(ep: rdmaio.Endpoint) -> None:
        # As a server with a protocol of its own does: it reads the first message, sees a probe, hands over.
        first = await ep.recv()
        assert first is not None and first.startswith(PROBE_PREFIX)
        await serve_doctor_session(ep, first)

    async def main() -> None:
        other = await rdmaio.serve(handed_over, rdma_addr, 0)
        async with other:
            results = await run_peer_checks(rdma_addr, other.addresses[0][1], System(), 60.0, 0.2)
            assert [(r.name, r.verdict) for r in results] == [(n, Verdict.OK) for n in PEER_CHECKS[1:]], (
                results
            )
        server = await rdmaio.serve(handler, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            async with await rdmaio.connect(rdma_addr, port, timeout=60) as ep:
                keys = []
                for _ in range(3):
                    await ep.send(probe_request("read"))
                    answer = json.loads((await ep.recv() or b"")[len(PROBE_PREFIX) :])
                    keys.append(rdmaio.RemoteKey.from_bytes(bytes.fromhex(answer["key"])))
                    assert responders[-1].exported_bytes == READ_PROBE_SIZE  # never more than one export
                assert responders[-1].exports == 3
                assert len(await ep.rdma_read(keys[-1], 0, READ_PROBE_SIZE)) == READ_PROBE_SIZE
                with pytest.raises(rdmaio.RemoteKeyRevokedError):
                    await ep.rdma_read(keys[0], 0, 8)
                # Not a probe request: an unknown one is answered with an error; an oversized one is echoed.
                await ep.send(PROBE_PREFIX + b'{"ask": "more"}')
                assert json.loads((await ep.recv() or b"")[len(PROBE_PREFIX) :]) == {
                    "error": "unknown probe request 'more'"
                }
                big = PROBE_PREFIX + b" " * 600
                await ep.send(big)
                assert await ep.recv() == big

    arun(main())


def test_peer_checks_warn_against_a_server_without_probes(arun: Runner[Any], rdma_addr: str) -> None:
    """A plain echo server (an rdmaio older than the probe): echo and throughput pass, the rest warn."""

    async def echo(ep: rdmaio.Endpoint) -> None:
        async with ep:
            while (msg := await ep.recv()) is not None:
                await ep.send(msg)

    async def main() -> list[CheckResult]:
        server = await rdmaio.serve(echo, rdma_addr, 0)
        async with server:
            return await run_peer_checks(rdma_addr, server.addresses[0][1], System(), 60.0, 0.2)

    results = {r.name: r for r in arun(main())}
    verdicts = {name: r.verdict for name, r in results.items()}
    assert verdicts == {
        "route": Verdict.OK,
        "handshake": Verdict.OK,
        "echo": Verdict.OK,
        "gids": Verdict.WARN,
        "mtu": Verdict.WARN,
        "read": Verdict.WARN,
        "throughput": Verdict.OK,
    }
    assert "the server echoes doctor's probe instead of answering it" in results["read"].summary
    assert results["read"].fix == "run the same rdmaio version on both hosts"
