"""The shared CQ of a Domain. Many connections on one loop share ONE completion channel fd and a
pool of CQs; completions are dispatched by (qp_num << 24) | tag; a closed connection's late completions
are dropped, never delivered to a new connection."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import random
import threading
import time
from typing import Any

import traffic
from loops import Runner, arun
from rdma_state import open_fds, rdma_resources

import rdmaio
from rdmaio.core.reactor import Reactor

__all__ = ["arun"]

# Small rings: 100 endpoints in one process of a 2 GiB VM.
OPTIONS = rdmaio.Options(slot_size=8192, recv_depth=16, send_depth=16, signal_interval=4)
CONNECTIONS = 50
MESSAGES = 40


async def echo(ep: rdmaio.Endpoint) -> None:
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)


async def exchange(ep: rdmaio.Endpoint, seed: int) -> tuple[str, str]:
    return await traffic.exchange(ep, seed, MESSAGES)


def test_connections_share_one_channel_fd_and_traffic_on_all_is_correct(
    arun: Runner[Any], rdma_addr: str
) -> None:
    async def main() -> dict[str, int]:
        server = await rdmaio.serve(echo, rdma_addr, 0, options=OPTIONS)
        async with server:
            port = server.addresses[0][1]
            # Warm-up: the domain, its completion channel and first CQ exist from here on (they live as long
            # as the loop), so the baseline below includes them.
            async with await rdmaio.connect(rdma_addr, port, options=OPTIONS, timeout=30) as ep:
                await ep.send(b"warm")
                assert await ep.recv() == b"warm"
                domain = ep._conn.transport.domain
            await asyncio.sleep(0)
            server.close_clients()
            for _ in range(200):
                if not server._clients:
                    break
                await asyncio.sleep(0.05)
            dispatcher = domain.completions
            assert dispatcher.fd is not None
            gc.collect()
            base_fds, base = open_fds(), rdma_resources()
            # New pooled CQs of 200 entries hold 5 endpoints (40 entries each), and the first CQ is filled
            # up (a reservation without a QP): the pool grows to many CQs, all on the one channel.
            first = dispatcher._pool[0]
            filler = dispatcher.reserve(first.capacity - first.reserved)
            assert filler.cq is first.cq
            dispatcher.cq_capacity = 200
            clients = [
                await rdmaio.connect(rdma_addr, port, options=OPTIONS, timeout=30) for _ in range(CONNECTIONS)
            ]
            for _ in range(200):
                if len(server._clients) == CONNECTIONS:
                    break
                await asyncio.sleep(0.05)
            endpoints = [*clients, *server._clients]
            assert len(endpoints) == 2 * CONNECTIONS
            assert {e._conn.transport.completions for e in endpoints} == {dispatcher}
            cqs = dispatcher.cqs
            assert len(cqs) >= 2 * CONNECTIONS * 40 // 200
            assert {e._conn.transport.cq for e in endpoints} <= set(cqs)
            # one channel fd for every connection: no fd per connection
            assert open_fds() == base_fds
            now = rdma_resources()
            assert now["cq"] == base["cq"] + len(cqs) - 1
            assert now["qp"] == base["qp"] + 2 * CONNECTIONS

            before = dispatcher.statistics()
            results = await asyncio.wait_for(
                asyncio.gather(*(exchange(ep, seed) for seed, ep in enumerate(clients))), 300
            )
            after = dispatcher.statistics()
            for sent, received in results:
                assert sent == received
            stats = {
                k: after[k] - before[k] for k in ("wakeups", "events", "completions", "dispatched", "polls")
            }
            stats["cqs"] = len(cqs)
            print(f"\nshared CQ, {CONNECTIONS} busy connections (both ends on one loop): {stats}")
            assert stats["completions"] > 0
            # One wake-up serves several connections: fewer wake-ups than handler calls.
            assert stats["wakeups"] < stats["dispatched"]

            for ep in clients:
                await ep.aclose()
            for _ in range(400):
                if not server._clients:
                    break
                await asyncio.sleep(0.05)
            assert not server._clients
            filler.release()
            gc.collect()
            assert open_fds() == base_fds
            end = rdma_resources()
            assert end["qp"] == base["qp"] and end["cm_id"] == base["cm_id"]
            assert end["cq"] == base["cq"] and len(dispatcher.cqs) == 1  # only the first CQ stays
            assert dispatcher.statistics()["connections"] == 0
            return stats

    arun(main())


def _serve_in_thread(addr: str, burst: int, size: int) -> tuple[int, threading.Event, list[Any]]:
    """A server on its own loop in a thread (its own domain): to each connection it sends ``burst``
    messages of ``size`` bytes at once, then echoes. Returns (port, stop event, errors)."""
    ready = threading.Event()
    stop = threading.Event()
    box: list[Any] = []

    async def handler(ep: rdmaio.Endpoint) -> None:
        async with ep:
            try:
                for i in range(burst):
                    await ep.send(bytes([i % 256]) * size)
                while (msg := await ep.recv()) is not None:
                    await ep.send(msg)
            except rdmaio.RdmaError:
                pass  # the client aborted the first connection on purpose

    async def run() -> None:
        server = await rdmaio.serve(handler, addr, 0, options=OPTIONS)
        async with server:
            box.append(server.addresses[0][1])
            ready.set()
            while not stop.is_set():  # noqa: ASYNC110 - set by another thread
                await asyncio.sleep(0.05)

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by the test
            box.append(exc)
            ready.set()

    threading.Thread(target=target, daemon=True).start()
    assert ready.wait(60)
    assert isinstance(box[0], int), box
    return box.pop(0), stop, box


def test_late_completions_of_a_closed_connection_do_not_reach_a_new_one(rdma_addr: str) -> None:
    port, stop, errors = _serve_in_thread(rdma_addr, burst=16, size=6000)

    async def main() -> None:
        reactor = Reactor.current()
        first = await rdmaio.connect(rdma_addr, port, options=OPTIONS, timeout=30)
        dispatcher = first._conn.transport.completions
        assert await first.recv() is not None  # the burst is flowing
        # Block the loop (the server thread keeps running): more of the burst lands in the shared CQ,
        # unpolled. Then close the connection at once, with its completions still in the CQ.
        time.sleep(1.0)  # noqa: ASYNC251 - blocking the loop on purpose
        first_qp, first_tag = first._conn.qp.qp_num, first._conn.transport.tag
        fd = dispatcher.fd
        assert fd is not None
        reactor.unwatch(fd)  # nothing polls the CQ until the new connection exists
        try:
            dropped = dispatcher.dropped
            first.abort()
            second = await rdmaio.connect(rdma_addr, port, options=OPTIONS, timeout=30)
        finally:
            reactor.watch(fd, dispatcher._on_readable)
        assert second._conn.transport.tag != first_tag
        assert second._conn.transport.cq is first._conn.transport.cq  # same shared CQ
        dispatcher.poll_now()
        # The first connection's late completions (received frames, flushed receives) were dropped.
        assert dispatcher.dropped > dropped
        # The new connection sees its own burst and echoes, and nothing of the first one's.
        for i in range(16):
            assert await second.recv() == bytes([i % 256]) * 6000
        data = os.urandom(20000)
        await second.send(data)
        assert await second.recv() == data
        print(
            f"\nfirst qp {first_qp} tag {first_tag}; second qp {second._conn.qp.qp_num} "
            f"tag {second._conn.transport.tag}; dropped {dispatcher.dropped - dropped}"
        )
        await second.aclose()

    try:
        asyncio.run(main())
    finally:
        stop.set()
    assert not errors, errors
