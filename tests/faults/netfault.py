"""Fault injection on the test host's pair topology: netem, link state, RDMA devices, peer processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import rdmaio
from rdmaio.testing.pair import routing_commands


@dataclass(frozen=True)
class Node:
    """One end of the pair as the test host describes it in the environment."""

    device: str
    netdev: str
    addr: str
    addr6: str


@dataclass(frozen=True)
class Pair:
    """Node A (``a``) and node B (``b``)."""

    a: Node
    b: Node

    @classmethod
    def from_env(cls) -> Pair:
        """Read ``RDMAIO_TEST_*`` as set by ``python -m rdmaio.testing.host --topology pair``."""
        env = os.environ
        return cls(
            Node(
                env["RDMAIO_TEST_DEVICE"],
                env["RDMAIO_TEST_NETDEV"],
                env["RDMAIO_TEST_ADDR"],
                env["RDMAIO_TEST_ADDR6"],
            ),
            Node(
                env["RDMAIO_TEST_DEVICE2"],
                env["RDMAIO_TEST_NETDEV2"],
                env["RDMAIO_TEST_ADDR2"],
                env["RDMAIO_TEST_ADDR6_2"],
            ),
        )

    @property
    def nodes(self) -> tuple[Node, Node]:
        """Both nodes."""
        return (self.a, self.b)


def sh(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a command of the test host (ip, tc, rdma), its output captured."""
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def netem(pair: Pair, spec: str) -> None:
    """Apply ``tc qdisc ... netem SPEC`` to the egress of both veths (so both directions see it)."""
    for node in pair.nodes:
        sh("tc", "qdisc", "replace", "dev", node.netdev, "root", "netem", *spec.split())


def clear_netem(pair: Pair) -> None:
    """Remove netem from both veths."""
    for node in pair.nodes:
        sh("tc", "qdisc", "del", "dev", node.netdev, "root", check=False)


def partition(pair: Pair) -> None:
    """Cut the wire both ways (100 % loss) while the links stay up: a partition, not a port event."""
    netem(pair, "loss 100%")


def heal(pair: Pair) -> None:
    """End a partition."""
    clear_netem(pair)


def set_link(netdev: str, up: bool) -> None:
    """``ip link set NETDEV up|down``; after ``up``, the pair's routing is applied again (a link going
    down flushed its routes, and coming up put its address back into the ``local`` table)."""
    sh("ip", "link", "set", netdev, "up" if up else "down")
    if up:
        reroute()


def reroute() -> None:
    """Re-apply the pair topology's routing (:func:`rdmaio.testing.pair.routing_commands`)."""
    script = "\n".join(routing_commands()) + "\n"
    subprocess.run(["ip", "-force", "-batch", "-"], input=script, text=True, capture_output=True, timeout=60)


def rdma_devices() -> set[str]:
    """Names of the RDMA devices present."""
    try:
        return set(os.listdir("/sys/class/infiniband"))
    except OSError:
        return set()


def provider() -> str:
    """The software provider of the pair's devices (``RDMAIO_TEST_PROVIDER``; rxe unless the test host
    says otherwise)."""
    return os.environ.get("RDMAIO_TEST_PROVIDER", "rxe")


def restore(pair: Pair) -> None:
    """Undo what a test may have done: netem off, links up, deleted devices added again (of the provider
    under test, ``RDMAIO_TEST_PROVIDER``: rxe or siw)."""
    clear_netem(pair)
    for node in pair.nodes:
        set_link(node.netdev, True)
    present = rdma_devices()
    for node in pair.nodes:
        if node.device not in present:
            sh("rdma", "link", "add", node.device, "type", provider(), "netdev", node.netdev)
    for node in pair.nodes:
        state = f"/sys/class/infiniband/{node.device}/ports/1/state"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    break
            time.sleep(0.1)


async def connected(
    pair: Pair, port: int, options: rdmaio.Options | None = None, greeting: bytes = b"hello"
) -> rdmaio.Endpoint:
    """Connect from node A to the echo server on node B (port ``port``) and echo ``greeting`` once."""
    ep = await rdmaio.connect(pair.b.addr, port, local_addr=(pair.a.addr, 0), options=options, timeout=30)
    await ep.send(greeting)
    assert await ep.recv() == greeting
    return ep


def peer(code: str, *args: str) -> subprocess.Popen[str]:
    """Start a Python process running ``code`` (it prints a line starting READY when it is set up)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, text=True
    )


def wait_ready(proc: subprocess.Popen[str]) -> str:
    """Block until the peer prints its READY line; return that line."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"peer did not start: {line!r} (exit status {proc.poll()})"
    return line


ECHO_SERVER = """
    import asyncio, json, sys, rdmaio
    async def handler(ep):
        try:
            while (msg := await ep.recv()) is not None:
                await ep.send(msg)
        except ConnectionError:
            pass
    async def main():
        options = {"keepalive_interval": None, **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")}
        server = await rdmaio.serve(handler, sys.argv[1], 0, options=options)
        print("READY", server.addresses[0][1], flush=True)
        await server.serve_forever()
    asyncio.run(main())
"""
"""An echo server (keepalive off: only the side under test probes) for ``peer(ECHO_SERVER, addr)``;
``peer(ECHO_SERVER, addr, json.dumps(options))`` adds Options fields."""


SINK_SERVER = """
    import asyncio, hashlib, json, sys, rdmaio
    async def handler(ep):
        digest = hashlib.sha256()
        total = 0
        while chunk := await ep.read(1 << 20):
            digest.update(chunk)
            total += len(chunk)
        await ep.send(digest.digest() + total.to_bytes(8, "big"))
        await ep.aclose()
    async def main():
        options = {"keepalive_interval": None, **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")}
        server = await rdmaio.serve(handler, sys.argv[1], 0, options=options)
        print("READY", server.addresses[0][1], flush=True)
        await server.serve_forever()
    asyncio.run(main())
"""
"""A server that reads a stream to EOF and answers with its SHA-256 and length."""
