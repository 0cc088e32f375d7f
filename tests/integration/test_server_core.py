"""The server core (StreamServer) in the test host: several listeners, start_serving=False."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from loops import Runner, arun

import rdmaio


async def _echo_once(host: str, port: int, payload: bytes) -> bytes | None:
    async with await rdmaio.connect(host, port, timeout=20) as ep:
        await ep.send(payload)
        return await ep.recv()


def test_start_serving_false_holds_connections_then_serves_them_in_order(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """serve(start_serving=False, backlog=2): two connections are established and wait, the third is
    refused, and start_serving() hands the waiting ones to the handler in arrival order."""

    async def main() -> None:
        seen: list[bytes | None] = []

        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                message = await ep.recv()
                seen.append(message)
                await ep.send(b"ok " + (message or b""))

        server = await rdmaio.serve(handler, rdma_addr, 0, backlog=2, start_serving=False)
        async with server:
            assert server.listening and not server.is_serving()
            port = server.addresses[0][1]
            clients = [await rdmaio.connect(rdma_addr, port, timeout=20) for _ in range(2)]
            with pytest.raises(rdmaio.ConnectionRefusedError):
                await rdmaio.connect(rdma_addr, port, timeout=20)
            for i, ep in enumerate(clients):
                await ep.send(b"%d" % i)
            await asyncio.sleep(0.5)
            assert seen == [], "a handler ran before start_serving()"
            assert server.statistics()["unaccepted"] == 2
            await server.start_serving()
            assert server.is_serving()
            replies = [await asyncio.wait_for(ep.recv(), 30) for ep in clients]
            assert replies == [b"ok 0", b"ok 1"] and seen == [b"0", b"1"]
            for ep in clients:
                await ep.aclose()
            # Serving now: a new connection goes straight to the handler.
            assert await _echo_once(rdma_addr, port, b"2") == b"ok 2"
        assert not server.listening and not server.is_serving()

    arun(main())


def test_one_server_listens_on_several_hosts(arun: Runner[Any], rdma_addr: str) -> None:
    """serve(handler, [host, host], 0): one listener per host (port 0: each its own port), one backlog,
    one handler, one close."""

    async def main() -> None:
        async def handler(ep: rdmaio.Endpoint) -> None:
            async with ep:
                while (message := await ep.recv()) is not None:
                    await ep.send(message)

        server = await rdmaio.serve(handler, [rdma_addr, rdma_addr], 0)
        async with server:
            assert len(server.addresses) == 2
            ports = [port for _host, port in server.addresses]
            assert len(set(ports)) == 2
            for port in ports:
                assert await _echo_once(rdma_addr, port, b"x%d" % port) == b"x%d" % port
            assert server.statistics()["accepted"] == 2
        for port in ports:
            with pytest.raises(rdmaio.ConnectionRefusedError):
                await rdmaio.connect(rdma_addr, port, timeout=20)

    arun(main())
