"""Growing slot rings on a real device: idle connections pin little, busy ones grow."""

from __future__ import annotations

import hashlib
import json
import subprocess
from typing import Any

from loops import Runner, arun

import rdmaio

__all__ = ["arun"]

KiB = 1024


def registered_mr_bytes() -> int:
    """Sum of the lengths of every MR on the machine, from ``rdma -j resource show mr``."""
    out = subprocess.run(["rdma", "-j", "resource", "show", "mr"], check=True, capture_output=True, text=True)
    return sum(int(mr.get("mrlen", 0)) for mr in json.loads(out.stdout or "[]"))


async def sink(ep: rdmaio.Endpoint) -> None:
    """Read everything, then answer with the SHA-256 of what arrived and this side's statistics."""
    async with ep:
        digest = hashlib.sha256()
        while chunk := await ep.read(1 << 20):
            digest.update(chunk)
        stats = ep.statistics()
        await ep.send(digest.digest())
        await ep.send(json.dumps(stats).encode())


def test_an_idle_connection_pins_the_initial_receive_slots_only(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(sink, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            before = registered_mr_bytes()
            eps = [await rdmaio.connect(rdma_addr, port, timeout=20) for _ in range(8)]
            # 8 connections, two sides each, 4 receive slots of 64 KiB a side, no send slots yet.
            assert registered_mr_bytes() - before == 8 * 2 * 256 * KiB
            for ep in eps:
                assert ep.statistics()["registered_bytes"] == 256 * KiB
            for ep in eps:
                await ep.aclose()
            server.close_clients()

    arun(main())


def test_a_busy_connection_grows_its_rings_and_the_data_is_intact(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(sink, rdma_addr, 0)
        async with server, await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=20) as ep:
            data = bytes(range(256)) * (32 * KiB)  # 8 MiB
            for start in range(0, len(data), 256 * KiB):
                ep.write(data[start : start + 256 * KiB])
                await ep.drain()
            ep.write_eof()
            assert await ep.recv() == hashlib.sha256(data).digest()
            peer = json.loads((await ep.recv()) or b"{}")
            mine = ep.statistics()
            # The reader saw full windows and doubled its receive window; the writer's send ring doubled
            # when every slot was in flight. Neither went past its depth (32 slots of 64 KiB).
            assert peer["recv_ring_grown"] >= 1 and peer["protocol_recv_depth"] > 4
            assert peer["protocol_recv_depth"] <= 32
            assert mine["send_ring_grown"] >= 2
            assert 256 * KiB < mine["registered_bytes"] <= (32 + 32) * 64 * KiB
            # Two replies in one wake-up are not a full window: the writer's receive window stayed small.
            assert mine["protocol_recv_depth"] == 4

    arun(main())


def test_fixed_rings_when_initial_depth_is_recv_depth(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        fixed = {"initial_depth": 32}
        server = await rdmaio.serve(sink, rdma_addr, 0, options=fixed)
        async with (
            server,
            await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=20, options=fixed) as ep,
        ):
            assert ep.statistics()["registered_bytes"] == 32 * 64 * KiB
            assert ep.statistics()["protocol_recv_depth"] == 32
            ep.write(b"x" * 100)
            ep.write_eof()
            assert await ep.recv() == hashlib.sha256(b"x" * 100).digest()

    arun(main())
