"""IPv6 end to end across the veth pair, and host names from an /etc/hosts entry that exists only
inside the test host (bind-mounted in a private mount namespace of one client process)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from netfault import ECHO_SERVER, Pair, peer, wait_ready

import rdmaio


def _tx_packets(netdev: str) -> int:
    return int(Path(f"/sys/class/net/{netdev}/statistics/tx_packets").read_text())


@pytest.mark.timeout(180)
def test_ipv6_echo_crosses_the_veth(pair: Pair) -> None:
    proc = peer(ECHO_SERVER, pair.b.addr6)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> None:
            before = _tx_packets(pair.a.netdev)
            ep = await rdmaio.connect(pair.b.addr6, port, local_addr=(pair.a.addr6, 0), timeout=30)
            assert ep.get_extra_info("peername")[0] == pair.b.addr6
            assert ep.get_extra_info("sockname")[0] == pair.a.addr6
            assert ep.get_extra_info("device") == pair.a.device
            for size in (0, 1, 4096, 65537, 300_000):
                payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
                await ep.send(payload)
                assert await ep.recv() == payload
            await ep.aclose()
            sent = _tx_packets(pair.a.netdev) - before
            # 370 KiB each way at most 4 KiB per packet: well over 100 packets left through the veth
            assert sent >= 100, sent

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


CLIENT = """
    import asyncio, sys, rdmaio
    async def main():
        ep = await rdmaio.connect(sys.argv[1], int(sys.argv[2]), local_addr=(sys.argv[3], 0), timeout=30)
        await ep.send(b"by name")
        assert await ep.recv() == b"by name"
        print("OK", ep.get_extra_info("peername")[0], flush=True)
        await ep.aclose()
    asyncio.run(main())
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["ipv4", pytest.param("ipv6", marks=pytest.mark.long)])
def test_host_names_from_etc_hosts_inside_the_test_host(pair: Pair, tmp_path: Path, family: str) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "127.0.0.1 localhost\n"
        f"{pair.a.addr} node-a\n{pair.b.addr} node-b\n"
        f"{pair.a.addr6} node-a6\n{pair.b.addr6} node-b6\n"
    )
    server_addr, name, local = (
        (pair.b.addr, "node-b", "node-a") if family == "ipv4" else (pair.b.addr6, "node-b6", "node-a6")
    )
    proc = peer(ECHO_SERVER, server_addr)
    try:
        port = wait_ready(proc).split()[1]
        # The test host shares this machine's root file system read-only: the entry lives in a private
        # mount namespace of the client only, never in any real /etc/hosts.
        script = (
            f"mount --bind {hosts} /etc/hosts && exec {sys.executable} -c "
            f"{_quote(textwrap.dedent(CLIENT))} {name} {port} {local}"
        )
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        proc.kill()
        proc.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OK", server_addr]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
