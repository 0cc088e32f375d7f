"""Impaired links (tc netem on both veths): loss, delay with jitter, reordering, duplication.

For each impairment a byte stream (SHA-256 checked at the receiver) and a message echo (every message
compared): data intact, nothing hangs, throughput printed and recorded. The stream is 8 MiB in CI's
bounded run (the issue asks for 256 MiB: ``RDMAIO_FAULT_STREAM_MIB=256`` with ``-m long`` sets it; in
the emulated VM that takes far longer than CI's budget).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections.abc import Callable

import pytest
from netfault import ECHO_SERVER, SINK_SERVER, Pair, netem, peer, wait_ready

import rdmaio

STREAM_MIB = int(os.environ.get("RDMAIO_FAULT_STREAM_MIB", "8"))
IMPAIRMENTS = {
    "none": "",  # the baseline the others compare with (VM times only mean something as ratios)
    "loss1": "loss 1%",
    "loss10": "loss 10%",
    "delay5ms": "delay 5ms 1ms distribution normal",
    "reorder": "delay 5ms reorder 25% 50%",
    "duplicate": "duplicate 5%",
}
BOUNDED = {"none", "loss1", "delay5ms", "reorder", "duplicate"}  # loss10 is slow in the VM: long run only
CASES = [
    pytest.param(name, id=name, marks=() if name in BOUNDED else pytest.mark.long) for name in IMPAIRMENTS
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impairment", CASES)
def test_stream_intact_under(
    impairment: str, pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    size = STREAM_MIB << 20
    proc = peer(SINK_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> float:
            ep = await rdmaio.connect(pair.b.addr, port, local_addr=(pair.a.addr, 0), timeout=30)
            rng = random.Random(impairment)
            digest = hashlib.sha256()
            if IMPAIRMENTS[impairment]:
                netem(pair, IMPAIRMENTS[impairment])
            started = time.monotonic()
            sent = 0
            while sent < size:
                chunk = rng.randbytes(min(1 << 20, size - sent))
                digest.update(chunk)
                ep.write(chunk)
                await ep.drain()
                sent += len(chunk)
            ep.write_eof()
            answer = await ep.recv()
            elapsed = time.monotonic() - started
            assert answer is not None and len(answer) == 40
            assert int.from_bytes(answer[32:], "big") == size
            assert answer[:32] == digest.digest(), "stream corrupted"
            await ep.aclose()
            return elapsed

        elapsed = asyncio.run(asyncio.wait_for(main(), 540))
    finally:
        proc.kill()
        proc.wait()
    rate = size / elapsed / 1e6
    print(
        f"{IMPAIRMENTS[impairment] or 'no impairment'}: {STREAM_MIB} MiB stream intact "
        f"in {elapsed:.1f} s ({rate:.2f} MB/s)"
    )
    record_property("stream_MBps", round(rate, 3))
    record_property("stream_s", round(elapsed, 2))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impairment", CASES)
def test_message_echo_intact_under(
    impairment: str, pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> tuple[int, float]:
            ep = await rdmaio.connect(pair.b.addr, port, local_addr=(pair.a.addr, 0), timeout=30)
            rng = random.Random(impairment)
            if IMPAIRMENTS[impairment]:
                netem(pair, IMPAIRMENTS[impairment])
            started = time.monotonic()
            total = 0
            for i in range(200):
                message = rng.randbytes(rng.choice((0, 1, 100, 4096, 65536, 200_000)))
                await ep.send(message)
                echoed = await ep.recv()
                assert echoed == message, f"message {i} of {len(message)} bytes differs"
                total += 2 * len(message)
            elapsed = time.monotonic() - started
            await ep.aclose()
            return total, elapsed

        total, elapsed = asyncio.run(asyncio.wait_for(main(), 540))
    finally:
        proc.kill()
        proc.wait()
    print(
        f"{IMPAIRMENTS[impairment] or 'no impairment'}: 200 messages echoed intact in {elapsed:.1f} s "
        f"({total / elapsed / 1e6:.2f} MB/s)"
    )
    record_property("echo_s", round(elapsed, 2))
    record_property("echo_MBps", round(total / elapsed / 1e6, 3))
