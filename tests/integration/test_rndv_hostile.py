"""Rendezvous against hostile peers, in the test host: a peer's announcements stay within the receive
buffer's limit (stream reads pull only what they need; announcements hold their slots past the limit), and
a receiver that never answers holds neither the sender's buffer past ``rndv_timeout`` nor more than its
connection's share of the device's rendezvous budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import trio
from hostile import (
    CTL_DONE,
    export_region,
    forge_rndv_many,
    never_answer_rndv,
    record_rndv_answers,
)
from loops import Runner, arun  # arun is a fixture used by name
from traffic import endpoint_pair

import rdmaio
from rdmaio.protocol.rxbuffer import PLACEHOLDER_CHARGE

MiB = 1 << 20
OPTIONS: dict[str, Any] = {"rndv_threshold": 64 * 1024, "max_message_size": 80 * MiB}
PATTERN = bytes(range(256)) * 4096  # 1 MiB


def pair(
    addr: str, server_options: dict[str, Any] | None = None, **options: Any
) -> AbstractAsyncContextManager[tuple[rdmaio.Endpoint, rdmaio.Endpoint]]:
    """(server side, client side) of one connection with this module's options (and ``options``)."""
    return endpoint_pair(addr, {**OPTIONS, **options}, server_options)


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:  # noqa: ASYNC109
    """Wait (polling) until ``condition()`` holds; fail after ``timeout`` seconds (a bound, not a timing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


async def until_stable(value: Callable[[], int], what: str, quiet: float = 1.0) -> int:
    """Wait until ``value()`` stopped changing for ``quiet`` seconds (at most 60 s); return it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    last, since = value(), loop.time()
    while loop.time() - since < quiet:
        assert loop.time() < deadline, f"never settled: {what}"
        await asyncio.sleep(0.05)
        now = value()
        if now != last:
            last, since = now, loop.time()
    return last


def quiet_for(ep: rdmaio.Endpoint) -> Callable[[], bool]:
    """A condition: the automatic pull has nothing more to do within the limit (it deferred a message, or
    every announced message was pulled) and no pull is running."""

    def check() -> bool:
        stats = ep.statistics()
        rxbuf = ep._conn.rxbuf
        rndv = ep._conn.rndv
        assert rndv is not None
        return rndv._owned_inflight == 0 and (stats.get("rndv_deferred", 0) > 0 or rxbuf.pending == 0)

    return check


# --- a stream read pulls what it needs, not everything announced -


def test_readexactly_pulls_only_what_it_needs(arun: Runner[Any], rdma_addr: str) -> None:
    """The attacker announces 24 messages of 1 MiB, all of them one 1 MiB region it exported; the victim
    reads one byte. The victim pulls the first message (the read needs it) and, in the background, only as
    much as its 4 MiB receive limit allows: never the 24 MiB announced."""
    limit = 4 * MiB

    async def main() -> None:
        async with pair(rdma_addr, server_options={"recv_buffer_limit": limit}) as (victim, attacker):
            answers = record_rndv_answers(attacker)
            region = export_region(attacker, PATTERN)
            try:
                forge_rndv_many(attacker, region, 24, MiB)
                await until(lambda: victim.statistics().get("rndv_announced", 0) >= 3, "announcements")
                assert await asyncio.wait_for(victim.readexactly(1), 60) == PATTERN[:1]
                await until(quiet_for(victim), "the automatic pull settles")
                stats = victim.statistics()
                rxbuf = victim._conn.rxbuf
                # The read's message plus what the automatic pull may take under the limit.
                assert stats["rndv_received"] <= limit // MiB + 1, stats
                assert rxbuf.buffered <= limit + MiB, (rxbuf.buffered, stats)
                # The rest is still announced, not pulled: the read gets it when it needs it.
                assert (
                    await asyncio.wait_for(victim.readexactly(3 * MiB), 60) == (PATTERN * 4)[1 : 3 * MiB + 1]
                )
                await until(
                    lambda: answers.count(CTL_DONE) == victim.statistics()["rndv_received"], "the answers"
                )
            finally:
                attacker.abort()
                region.close()

    arun(main())


def test_line_server_that_reads_nothing_stays_within_its_limit(arun: Runner[Any], rdma_addr: str) -> None:
    """An asyncio-streams line server (start_server) whose handler reads nothing: its reader task must not
    pull everything a peer announces (24 x 1 MiB of one exported region)."""
    limit = 4 * MiB

    async def main() -> None:
        transports: asyncio.Queue[Any] = asyncio.Queue()
        done = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await transports.put((reader, writer))
            await done.wait()

        server = await rdmaio.start_server(
            handler, rdma_addr, 0, options={**OPTIONS, "recv_buffer_limit": limit}
        )
        async with server:
            port = server.sockets[0].getsockname()[1]
            attacker = await rdmaio.connect(rdma_addr, port, timeout=30, options=OPTIONS)
            reader, writer = await asyncio.wait_for(transports.get(), 30)
            victim: rdmaio.Endpoint = writer.transport.get_extra_info("endpoint")
            record_rndv_answers(attacker)
            region = export_region(attacker, PATTERN)
            try:
                forge_rndv_many(attacker, region, 24, MiB)
                await until(lambda: victim.statistics().get("rndv_received", 0) >= 1, "a pull")
                await until(quiet_for(victim), "the pulls settle")
                await asyncio.sleep(0.5)  # the reader task had its chance to ask for more
                await until(quiet_for(victim), "the pulls settle again")
                stats = victim.statistics()
                # The reader task's read needs one message at a time and stops once asyncio's reader is
                # paused (its buffer above 2 * limit); the automatic pull stays within the limit.
                assert stats["rndv_received"] <= limit // MiB + 2, stats
                assert victim._conn.rxbuf.buffered <= limit + MiB, stats
                assert len(reader._buffer) <= 2 * MiB  # type: ignore[attr-defined]
            finally:
                done.set()
                attacker.abort()
                writer.transport.abort()
                region.close()

    arun(main())


# --- announcements hold their slots past the limit -------------


def test_announcement_flood_is_held_back_and_released_by_reading(arun: Runner[Any], rdma_addr: str) -> None:
    """The attacker queues 300 announcements of 64 KiB at a victim that reads nothing (limit 256 KiB): the
    announced bytes count against the limit, their slots are held, the attacker runs out of credits with
    most of them still queued on its side. Then the victim reads, which releases the slots: every message
    arrives, whole and in order."""
    limit = 256 * 1024
    count, length = 300, 64 * 1024

    async def main() -> None:
        async with pair(rdma_addr, server_options={"recv_buffer_limit": limit}) as (victim, attacker):
            answers = record_rndv_answers(attacker)
            region = export_region(attacker, PATTERN)
            try:
                forge_rndv_many(attacker, region, count, length)
                announced = await until_stable(
                    lambda: int(victim.statistics().get("rndv_announced", 0)), "the announcements"
                )
                await until(quiet_for(victim), "the automatic pull settles")
                stats = victim.statistics()
                recv_depth = victim._conn.options.recv_depth
                rxbuf = victim._conn.rxbuf
                # Within the limit, plus the frames the attacker held credits for when holding started.
                bound = limit // (length + PLACEHOLDER_CHARGE) + 1 + recv_depth
                assert announced <= bound, (stats, bound)
                assert stats["recv_held_slots"] > 0, stats
                assert rxbuf.pending + stats["rndv_received"] == stats["rndv_announced"]
                assert rxbuf.committed <= limit + (1 + recv_depth) * (length + PLACEHOLDER_CHARGE)
                assert len(attacker._conn.sender.queue.txq) >= count - bound  # the rest waits for credits
                for i in range(count):
                    got = await asyncio.wait_for(victim.recv(), 60)
                    assert got == PATTERN[:length], i
                await until(lambda: answers.count(CTL_DONE) == count, "every answer")
            finally:
                attacker.abort()
                region.close()

    arun(main())


# --- a receiver that never answers --------------------------


@pytest.mark.parametrize(
    ("budget", "windows"),
    [
        (None, "auto"),
        (2 * MiB, "auto"),
        # Every connection with a protection domain and a registration cache of its own, as on a device
        # without memory windows (siw, where "auto" is this already): the budget is still the device's.
        pytest.param(None, "off", marks=pytest.mark.provider("rxe")),
    ],
    ids=["default-share", "explicit-budget", "default-share-own-pd"],
)
def test_silent_receivers_hold_neither_the_budget_nor_the_buffers(
    arun: Runner[Any], rdma_addr: str, budget: int | None, windows: str
) -> None:
    """Four receivers record our descriptors and never answer (not even a CANCEL). Each connection keeps at
    most its share of the device's rendezvous budget pinned (its other sends are copied), so a 512 KiB send
    to an honest peer still goes zero-copy; at ``rndv_timeout`` the stuck sends are cancelled, the silent
    connections failed, and the sends raise RendezvousTimeoutError with their regions released.

    The default share is half of what the other connections leave free of the device's 16 MiB, so four
    connections holding six 1 MiB sends each pin at most 8 + 4 + 2 + 1 MiB; an explicit budget of 2 MiB
    pins two sends each and copies the other four. The budget is the device's also where each connection
    registers in a protection domain and a cache of its own (a device without memory windows, siw); there
    each connection used to get a whole budget of its own, so four silent peers held all 24 sends."""
    max_pinned = 32 * MiB  # the device's send budget is 16 MiB
    sends_each = 6
    # The deadline leaves the honest send time to run first in a slow VM (it would go zero-copy after the
    # deadline anyway; the assertions do not depend on the order).
    options = {
        **OPTIONS,
        "max_pinned": max_pinned,
        "rndv_timeout": 20.0,
        "close_timeout": 2.0,
        "rndv_send_budget": budget,
        "memory_windows": windows,
    }
    payload = bytearray(PATTERN)
    honest_payload = bytes(PATTERN[: 512 * 1024])  # within what four full shares leave (1 MiB)

    async def main() -> None:
        accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
        done = asyncio.Event()

        async def handler(ep: rdmaio.Endpoint) -> None:
            await accepted.put(ep)
            await done.wait()

        server = await rdmaio.serve(handler, rdma_addr, 0, options=options)
        async with server:
            port = server.addresses[0][1]
            victims, silents = [], []
            for _ in range(4):
                victims.append(await rdmaio.connect(rdma_addr, port, timeout=30, options=options))
                silents.append(never_answer_rndv(await asyncio.wait_for(accepted.get(), 30)))
            honest_client = await rdmaio.connect(rdma_addr, port, timeout=30, options=options)
            honest_server = await asyncio.wait_for(accepted.get(), 30)
            cache = honest_client._conn.transport.domain.registrations
            assert cache.max_pinned == max_pinned
            try:
                stuck = [asyncio.ensure_future(ep.send(payload)) for ep in victims for _ in range(sends_each)]

                def all_decided() -> bool:
                    per_conn = [ep.statistics() for ep in victims]
                    decided = sum(s["rndv_sending"] + s.get("rndv_fallback_eager", 0) for s in per_conn)
                    return decided == len(stuck)

                await until(all_decided, "every send went zero-copy or fell back")
                # The silent receivers do hold sends, counted in the Domain's cache (the device's budget).
                pinned_each = [ep.statistics()["rndv_send_pinned"] for ep in victims]
                assert cache.reserved >= 4 * MiB, (cache.statistics(), pinned_each)

                # An honest connection still gets a zero-copy send.
                received = asyncio.ensure_future(honest_server.recv())
                await asyncio.wait_for(honest_client.send(honest_payload), 60)
                assert await asyncio.wait_for(received, 60) == honest_payload
                honest = honest_client.statistics()
                assert honest.get("rndv_sent", 0) == 1 and honest.get("rndv_fallback_eager", 0) == 0, honest
                held = [ep.statistics() for ep in victims]  # because each silent one holds its share only
                pinned = [stats["rndv_send_pinned"] for stats in held]
                assert sum(stats["rndv_sending"] for stats in held) * MiB == sum(pinned), held
                if budget is None:
                    # Each send fitted in half of what the others left: never the whole device budget.
                    assert sum(pinned) <= max_pinned // 2 - 2 * MiB and max(pinned) <= max_pinned // 4, pinned
                    assert sum(stats.get("rndv_fallback_eager", 0) for stats in held) >= 1, held
                else:
                    for stats in held:
                        assert stats["rndv_send_pinned"] == budget, stats
                        assert stats["rndv_sending"] == 2 and stats["rndv_fallback_eager"] == 4, stats

                # The deadline: every stuck send fails, typed; the silent peers could not keep the buffers.
                results = await asyncio.wait_for(asyncio.gather(*stuck, return_exceptions=True), 120)
                errors = [r for r in results if isinstance(r, BaseException)]
                stuck_sends = sum(stats["rndv_sending"] for stats in held)
                assert len(errors) == stuck_sends and all(r is None for r in results if r not in errors), (
                    results
                )
                assert all(isinstance(e, rdmaio.RendezvousTimeoutError) for e in errors), errors
                assert all(isinstance(e, TimeoutError) and isinstance(e, rdmaio.RdmaError) for e in errors)
                assert all(silent.cancels for silent in silents)  # each was asked, none answered
                for ep in victims:
                    assert ep.statistics()["rndv_timeouts"] >= 1
                    assert ep._conn.torn_down  # failed: its queue pair, the peer's way in, is gone
                    assert ep._conn.rndv is not None and ep._conn.rndv.send_pinned == 0
                # Only the honest pair's pooled bounce buffers stay reserved (no send region is left): in
                # the Domain's cache, and in the caches of connections with a protection domain of their own.
                bounces = [b for ep in (honest_client, honest_server) for b in ep._conn.rndv._bounces]
                endpoints = (*victims, honest_client, honest_server)
                caches = {id(c): c for c in (cache, *(ep._conn.rndv._cache for ep in endpoints))}
                reserved = sum(c.reserved for c in caches.values())
                assert reserved == sum(len(b.buf) for b in bounces), [c.statistics() for c in caches.values()]
            finally:
                done.set()
                for ep in (*victims, honest_client, honest_server):
                    ep.abort()

    arun(main())


def test_deadline_withdraws_from_a_slow_honest_receiver(arun: Runner[Any], rdma_addr: str) -> None:
    """An honest receiver that reads nothing for longer than rndv_timeout (its limit defers the pull): the
    send is withdrawn (the receiver answers the CANCEL), raises RendezvousTimeoutError, and the connection
    stays usable; the buffer is not registered any more."""

    async def main() -> None:
        async with pair(
            rdma_addr,
            server_options={"recv_buffer_limit": 64 * 1024},
            rndv_threshold=512 * 1024,
            rndv_timeout=3.0,
        ) as (served, client):
            cache = client._conn.transport.domain.registrations
            first = bytes(200 * 1024)  # eager (below the threshold): fills the receiver's limit
            await client.send(first)
            await until(lambda: served._conn.rxbuf.unread == len(first), "the eager message")
            before = cache.reserved
            try:
                await asyncio.wait_for(client.send(bytearray(PATTERN)), 60)
            except rdmaio.RendezvousTimeoutError as exc:
                assert "withdrawn" in str(exc), exc
            else:
                raise AssertionError("the send did not time out")
            assert cache.reserved == before and client._conn.rndv is not None
            assert client._conn.rndv.send_pinned == 0
            assert served.statistics()["rndv_withdrawn_by_peer"] == 1
            assert await served.recv() == first
            await client.send(b"still usable")
            assert await asyncio.wait_for(served.recv(), 60) == b"still usable"
            assert not client._conn.torn_down

    arun(main())


def test_deadline_on_trio(rdma_addr: str) -> None:
    """The deadline on the trio backend (its timer and shielded wait differ from asyncio's): the send to a
    receiver that defers the pull is withdrawn and raises RendezvousTimeoutError; the connection stays."""

    async def main() -> None:
        with trio.fail_after(120):
            ready: list[rdmaio.Endpoint] = []
            accepted = trio.Event()
            options = {**OPTIONS, "rndv_threshold": 512 * 1024, "rndv_timeout": 3.0}

            async def handler(ep: rdmaio.Endpoint) -> None:
                ready.append(ep)
                accepted.set()
                await ep.wait_closed()

            server = await rdmaio.serve(
                handler, rdma_addr, 0, options={**options, "recv_buffer_limit": 65536}
            )
            async with server:
                client = await rdmaio.connect(rdma_addr, server.addresses[0][1], timeout=30, options=options)
                await accepted.wait()
                served = ready[0]
                first = bytes(200 * 1024)
                await client.send(first)
                while served._conn.rxbuf.unread < len(first):  # noqa: ASYNC110 (polling a counter)
                    await trio.sleep(0.05)
                with pytest.raises(rdmaio.RendezvousTimeoutError, match="withdrawn"):
                    await client.send(bytearray(PATTERN))
                assert client._conn.rndv is not None and client._conn.rndv.send_pinned == 0
                assert await served.recv() == first
                await client.send(b"still usable")
                assert await served.recv() == b"still usable"
                client.abort()

    trio.run(main)
