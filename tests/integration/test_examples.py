"""The examples, run as their users run them: separate processes, checked exit codes and output."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("loop_flag", [[], ["--uvloop"]], ids=["asyncio", "uvloop"])
def test_echo_server_and_client(rdma_addr: str, loop_flag: list[str], tmp_path: Path) -> None:
    port = "7471" if not loop_flag else "7472"
    log = (tmp_path / "server.log").open("w+")
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "echo_server.py"), rdma_addr, port, *loop_flag],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while "listening" not in (tmp_path / "server.log").read_text():
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "echo server did not start"
            time.sleep(0.1)
        client = run_example(str(EXAMPLES / "echo_client.py"), rdma_addr, port, *loop_flag)
        assert client.returncode == 0, client.stdout + client.stderr
        assert client.stdout.count(" ok ") == 7, client.stdout  # every size echoed intact
        assert "MISMATCH" not in client.stdout + client.stderr
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
    output = (tmp_path / "server.log").read_text()
    assert "echoed 35 messages" in output, output  # 7 sizes x 5 round trips
    assert "echo server stopped" in output


@pytest.mark.parametrize("loop_flag", [[], ["--uvloop"]], ids=["asyncio", "uvloop"])
def test_streams_echo_example_over_rdma(rdma_addr: str, loop_flag: list[str]) -> None:
    result = run_example(
        str(EXAMPLES / "streams_echo.py"), "--transport", "rdma", "--host", rdma_addr, *loop_flag
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("loop_flag", [[], ["--uvloop"]], ids=["asyncio", "uvloop"])
def test_onesided_kv_example(rdma_addr: str, loop_flag: list[str], provider: str) -> None:
    """One-sided KV store: puts with compare_swap/fetch_add/rdma_write, gets with rdma_read, and
    batched gets with rdma_read_many counting hits with fetch_add_many. Without atomics (siw) the server
    exports the table read-only and applies the puts and hit counts the clients send it; gets stay
    one-sided."""
    result = run_example(str(EXAMPLES / "onesided_kv.py"), rdma_addr, "--clients", "4", *loop_flag)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 clients, 60 puts (expected 60), 0 bad reads, server served 4" in result.stdout, result.stdout
    assert "onesided kv: ok" in result.stdout
    assert "lookups answered from batches" in result.stdout
    if provider == "rxe":
        assert "hits counted by fetch_add_many" in result.stdout and "no atomics" not in result.stdout
    else:
        assert "no atomics: " in result.stdout and "hits counted by the server" in result.stdout, (
            result.stdout
        )


@pytest.mark.parametrize("loop_flag", [[], ["--uvloop"]], ids=["asyncio", "uvloop"])
def test_key_scope_example(rdma_addr: str, loop_flag: list[str], provider: str) -> None:
    """A key exported to client A is refused by the NIC when client B uses it on its own connection; A's
    memory stays intact and A keeps access. (On iWARP the refusal is a TERMINATE that ends B's connection:
    B's READ after its unacknowledged WRITE fails with a ConnectionError.)"""
    result = run_example(str(EXAMPLES / "key_scope.py"), rdma_addr, *loop_flag)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    if provider == "rxe":
        assert "B with A's key: refused by the NIC (RemoteAccessRefusedError" in out, out
    else:
        assert "B with A's key: refused by the NIC (" in out, out
    assert "A reads its buffer again: b'only-for-client-A'" in out, out
    assert "server: client-A's buffer after everything: b'only-for-client-A'" in out, out


@pytest.mark.parametrize("loop_flag", [[], ["--uvloop"]], ids=["asyncio", "uvloop"])
def test_zerocopy_transfer_example(rdma_addr: str, loop_flag: list[str]) -> None:
    """Zero-copy: large messages go by rendezvous into the receiver's buffer, digests match."""
    result = run_example(
        str(EXAMPLES / "zerocopy_transfer.py"), rdma_addr, "--sizes", "64K,1M,4M", *loop_flag
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("sha256 ok") == 3 and "MISMATCH" not in out, out
    assert "65536 bytes  eager (copied)" in out, out
    assert "sender: 2 sent by rendezvous; receiver: 2 received by rendezvous, 2 of them straight" in out, out
    assert "zerocopy transfer: ok" in out


def test_shared_receive_queue_example(rdma_addr: str) -> None:
    """Shared receive queue: 10 connections' echoes over one SRQ per device, digests match."""
    result = run_example(
        str(EXAMPLES / "shared_receive_queue.py"), rdma_addr, "--clients", "10", "--messages", "60"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 connections x 60 messages echoed over one shared receive queue, SHA-256 ok" in result.stdout


@pytest.mark.parametrize("framing", ["auto", "header"])
@pytest.mark.parametrize("loop_flag", [[], ["--uvloop"]], ids=["asyncio", "uvloop"])
def test_capabilities_example(rdma_addr: str, loop_flag: list[str], framing: str, provider: str) -> None:
    """The framing and path a connection uses, an echo, RDMA WRITE and READ on an export, a batch of small
    READs across a page boundary (siw's page-crossing bug worked around), and fetch_add:
    done where both devices have atomics, refused up front (FeatureNotSupportedError) where they do not."""
    result = run_example(str(EXAMPLES / "capabilities.py"), rdma_addr, "--framing", framing, *loop_flag)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    header = framing == "header" or provider != "rxe"  # siw and other iWARP devices: no immediate data
    assert (
        f"client: framing {'header' if header else 'immediate'} (immediate data: {'no' if header else 'yes'})"
        in out
    )
    assert "client: echoed b'hello over RDMA'" in out, out
    assert "client: RDMA READ gives back b'written by RDMA WRITE'" in out, out
    assert "client: rdma_read_many of 5 small ranges, 4 across a page boundary: all right" in out, out
    assert "server: the buffer now starts with b'written by RDMA WRITE'" in out, out
    if provider == "rxe":
        assert "client: fetch_add returned 0 (both devices have atomics)" in out, out
    else:
        assert (
            "server: no atomics here" in out and "client: fetch_add refused before anything was sent" in out
        )
