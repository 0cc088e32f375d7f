"""The per-device Domain and the per-loop event channel, on a real device."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import uvloop
from loops import Runner, arun
from rdma_state import open_fds, rdma_resources

import rdmaio
from rdmaio.core.onesided.caps import cached_caps
from rdmaio.core.reactor import Reactor

__all__ = ["arun"]


async def echo(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


def test_connections_share_the_device_pd_and_the_event_channel(
    arun: Runner[Any], rdma_addr: str, provider: str
) -> None:
    """Connections on one loop and device share its Domain and completion channel; where the device has
    memory windows they share its PD too. Without windows (siw: ``max_mw`` 0) each connection has a PD of
    its own (an export is then its region's own rkey, reaching that connection only: docs/providers.md),
    which goes with the connection."""

    async def main() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0)
        async with server:
            port = server.addresses[0][1]
            first = await rdmaio.connect(rdma_addr, port, timeout=20)
            second = await rdmaio.connect(rdma_addr, port, timeout=20)
            domain = first._conn.transport.domain
            windows = cached_caps(domain.device).max_mw > 0
            if provider in ("rxe", "siw"):
                assert windows is (provider == "rxe"), provider
            for _ in range(600):  # bounds a hang: the server's ends are established after the clients'
                if len(server._clients) == 2:
                    break
                await asyncio.sleep(0.05)
            ends = (first, second, *server._clients)
            assert len(ends) == 4
            assert {ep._conn.transport.domain for ep in ends} == {domain}
            pds = [ep._conn.transport.pd for ep in ends]
            if windows:
                assert all(pd is domain.pd for pd in pds)
            else:
                assert len({id(pd) for pd in pds}) == len(pds) and domain.pd not in pds
            channel_fd = Reactor.current().channel.fd
            mine = [os.getpid()]  # this process's objects only (an earlier test's peer may still exit)
            pd_count = rdma_resources(mine)["pd"]
            await first.aclose()
            await second.aclose()
            server.close_clients()
            # No cm id of ours is left but the listener's; a new connection reuses the channel and the PD.
            async with await rdmaio.connect(rdma_addr, port, timeout=20) as third:
                await third.send(b"x")
                assert await third.recv() == b"x"
                assert Reactor.current().channel.fd == channel_fd
                assert third._conn.transport.domain is domain
                if windows:
                    assert rdma_resources(mine)["pd"] == pd_count
                else:
                    for _ in range(600):  # bounds a hang: the server's ends are torn down after
                        if all(pd.closed for pd in pds) and len(server._clients) == 1:
                            break
                        await asyncio.sleep(0.05)
                    # the four ends' own PDs went with them; the third connection's two ends have theirs
                    assert all(pd.closed for pd in pds)
                    assert rdma_resources(mine)["pd"] == pd_count - 2

    arun(main())


def test_loop_end_releases_the_domain_and_the_channel(rdma_addr: str) -> None:
    """asyncio.run() cycles on asyncio and uvloop leave no fd and no PD behind once the loops are gone."""

    async def cycle() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0)
        async with server, await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=20) as ep:
            await ep.send(b"ping")
            assert await ep.recv() == b"ping"

    # Warm-up on both loops: librdmacm opens the device once per process and keeps it, and the first
    # uvloop loop of a process makes libuv's process-wide signal lock pipe (two fds, never closed; a
    # run that created no uvloop loop before this test saw them as 19 fds against 17).
    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(cycle())
    gc.collect()
    fds, resources = open_fds(), rdma_resources()
    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        for _ in range(3):
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(cycle())
    gc.collect()
    assert open_fds() == fds
    assert rdma_resources() == resources


def test_registration_cache_registers_once_and_respects_its_bound(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server = await rdmaio.serve(echo, rdma_addr, 0)
        async with server, await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=20) as ep:
            cache = ep._conn.transport.domain.registrations
            cache.max_pinned = 3 << 20
            mrs = rdma_resources()["mr"]
            buf = bytearray(1 << 20)
            first = cache.get(buf)
            second = cache.get(buf)
            assert first.lkey == second.lkey and rdma_resources()["mr"] == mrs + 1
            first.release()
            second.release()
            others = [bytearray(1 << 20) for _ in range(4)]
            for other in others:
                cache.get(other).release()
            assert cache.pinned <= cache.max_pinned
            assert rdma_resources()["mr"] == mrs + cache.statistics()["entries"] <= mrs + 3
            cache.close()
            assert rdma_resources()["mr"] == mrs

    arun(main())
