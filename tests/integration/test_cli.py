"""The command-line tools on a real RDMA device (the test host): ``rdmaio doctor`` passes every check,
and ``rdmaio ping`` against ``rdmaio ping --server`` prints a line per round trip and ping's summary."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rdmaio.cli.checks import CHECKS

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
