"""examples/anyio_echo.py, run as its users run it: separate processes, checked exit codes and output.

The RDMA cases need a device (the conftest's ``require_device``); the TCP cases run anywhere, which shows
the same program working over both transports.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "anyio_echo.py"


def host_args(transport: str, request: pytest.FixtureRequest) -> list[str]:
    if transport == "rdma":
        return ["--transport", "rdma", "--host", request.getfixturevalue("rdma_addr")]
    return ["--transport", "tcp", "--host", "127.0.0.1"]


def check_client_output(output: str) -> None:
    assert "client: 200 line round trips" in output, output
    assert "MiB echoed in" in output, output
    assert "client: ok" in output, output
    assert "MISMATCH" not in output, output


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_anyio_echo_in_one_process(transport: str, backend: str, request: pytest.FixtureRequest) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *host_args(transport, request), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    check_client_output(output)
    assert re.search(r"server: echoed 8390298 bytes", output), output  # 200 lines + 8 MiB
    assert "server: stopped" in output, output


@pytest.mark.parametrize(
    ("server_backend", "client_backend"),
    [("trio", "asyncio"), ("asyncio", "trio")],
    ids=["trio-asyncio", "asyncio-trio"],
)
@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_anyio_echo_server_and_client_processes(
    transport: str, server_backend: str, client_backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The server on one backend, the client on the other, in two processes; SIGTERM stops the server."""
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                *host_args(transport, request),
                "--backend",
                server_backend,
                "--role",
                "server",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not (match := re.search(r"listening on \S+ port (\d+)", log_path.read_text())):
            assert server.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        client = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                *host_args(transport, request),
                "--backend",
                client_backend,
                "--role",
                "client",
                "--port",
                match.group(1),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert client.returncode == 0, client.stdout + client.stderr
        check_client_output(client.stdout + client.stderr)
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0, log_path.read_text()
    output = log_path.read_text()
    assert "server: echoed 8390298 bytes" in output, output
    assert "server: stopped" in output, output
