#!/usr/bin/env python3
"""Micro-benchmark of the sans-IO protocol's per-frame cost (no RDMA, no event loop).

Usage::

    .venv/bin/python tools/bench_protocol.py                        # the working tree's rdmaio.protocol
    .venv/bin/python tools/bench_protocol.py --module /tmp/old_protocol.py   # any other version of it

    git show HEAD:rdmaio/protocol.py > /tmp/protocol_head.py
    .venv/bin/python tools/bench_protocol.py --module /tmp/protocol_head.py  # "before" figure

Scenarios (each timed with :mod:`timeit`, best of ``--repeat``, reported in nanoseconds):

``ping``
    Two sessions A and B. Per data frame: ``A.can_send_data()``, ``A.take_data_frame(last=True, n)``,
    ``B.on_frame(imm, n)``, ``B.on_recv_reposted(1)``, ``B.credit_frame_due()`` and, when due, a CREDIT frame
    from B to A (``take_credit_frame``/``on_frame``/``on_recv_reposted``). This is the Session work the
    endpoint does for every small message; the figure is ns per data frame, CREDIT frames amortised in.
``batch``
    Only if the module has batching: per frame, ``pack_batch_into`` of ``--batch`` messages into a slot,
    ``take_batch_frame``, ``on_frame`` and ``on_batch`` (which unpacks), and the reposts and CREDIT frames as
    above. Reported per frame and per message.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def load_protocol(path: str | None) -> ModuleType:
    """Import ``rdmaio.protocol`` or, with ``path``, that file as a stand-alone module named ``_bench_proto``.

    A stand-alone copy (e.g. ``git show HEAD:rdmaio/protocol.py``) still imports ``rdmaio.errors`` from
    this checkout, so its exceptions are the usual ones.
    """
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if path is None:
        import rdmaio.protocol

        return rdmaio.protocol
    spec = importlib.util.spec_from_file_location("_bench_proto", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


def _pair(proto: ModuleType, depth: int, slot: int, *, batching: bool = False) -> tuple[Any, Any]:
    kwargs: dict[str, int] = {}
    if batching:
        kwargs["features"] = proto.FEATURE_BATCH
    hs = proto.Handshake(depth, slot, 1 << 20, **kwargs)
    return proto.Session(hs, hs), proto.Session(hs, hs)


def ping_runner(proto: ModuleType, depth: int, size: int) -> Callable[[int], None]:
    """Return ``run(frames)`` that sends ``frames`` one-fragment messages of ``size`` bytes from A to B."""
    a, b = _pair(proto, depth, max(size, proto.MIN_SLOT_SIZE))
    data_end = proto.FrameKind.DATA_END

    def run(frames: int) -> None:
        a_can_send = a.can_send_data
        a_take = a.take_data_frame
        a_on_frame = a.on_frame
        a_repost = a.on_recv_reposted
        b_on_frame = b.on_frame
        b_repost = b.on_recv_reposted
        b_due = b.credit_frame_due
        b_take_credit = b.take_credit_frame
        for _ in range(frames):
            if not a_can_send():
                raise AssertionError("sender stalled: the credit loop is broken")
            if b_on_frame(a_take(True, size), size) != data_end:
                raise AssertionError("wrong frame kind")
            b_repost(1)
            if b_due():
                a_on_frame(b_take_credit(), 0)
                a_repost(1)

    return run


def batch_runner(proto: ModuleType, depth: int, size: int, per_batch: int) -> Callable[[int], None]:
    """Return ``run(frames)`` sending ``frames`` DATA_BATCH frames of ``per_batch`` messages from A to B."""
    record = proto.batch_record_size(size)
    slot = max(record * per_batch, proto.MIN_SLOT_SIZE)
    a, b = _pair(proto, depth, slot, batching=True)
    if not (a.batching and b.batching):
        raise AssertionError("batching was not negotiated")
    buf = memoryview(bytearray(slot))
    messages = [bytes([i % 256]) * size for i in range(per_batch)]
    data_batch = proto.FrameKind.DATA_BATCH
    pack = proto.pack_batch_into

    def run(frames: int) -> None:
        a_take = a.take_batch_frame
        a_on_frame = a.on_frame
        a_repost = a.on_recv_reposted
        b_on_frame = b.on_frame
        b_on_batch = b.on_batch
        b_repost = b.on_recv_reposted
        b_due = b.credit_frame_due
        b_take_credit = b.take_credit_frame
        for _ in range(frames):
            n = pack(buf, 0, messages)
            if b_on_frame(a_take(n, per_batch), n) != data_batch:
                raise AssertionError("wrong frame kind")
            if len(b_on_batch(buf[:n])) != per_batch:
                raise AssertionError("lost messages")
            b_repost(1)
            if b_due():
                a_on_frame(b_take_credit(), 0)
                a_repost(1)

    return run


def best_ns(run: Callable[[int], None], frames: int, repeat: int) -> float:
    """Best time per frame over ``repeat`` runs of ``frames`` frames, in nanoseconds."""
    run(min(frames, 1000))  # warm up (specialising interpreter, caches)
    times = timeit.repeat(lambda: run(frames), number=1, repeat=repeat)
    return min(times) / frames * 1e9


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios and print one line per scenario."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--module", help="path of a protocol.py to benchmark instead of rdmaio.protocol")
    parser.add_argument("--frames", type=int, default=200_000, help="frames per timed run (200000)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs; the best is reported (7)")
    parser.add_argument("--depth", type=int, default=64, help="recv_depth of both sides (64)")
    parser.add_argument("--size", type=int, default=64, help="message size in bytes (64)")
    parser.add_argument("--batch", type=int, default=16, help="messages per DATA_BATCH frame (16)")
    args = parser.parse_args(argv)

    proto = load_protocol(args.module)
    origin = args.module or "rdmaio.protocol"
    print(
        f"{origin}: {args.frames} frames x {args.repeat} runs, depth {args.depth}, {args.size}-byte messages"
    )
    ns = best_ns(ping_runner(proto, args.depth, args.size), args.frames, args.repeat)
    print(f"ping:  {ns:7.1f} ns per data frame")
    if hasattr(proto, "pack_batch_into"):
        frames = max(1, args.frames // args.batch)
        ns = best_ns(batch_runner(proto, args.depth, args.size, args.batch), frames, args.repeat)
        print(
            f"batch: {ns:7.1f} ns per DATA_BATCH frame of {args.batch} messages, "
            f"{ns / args.batch:.1f} ns per message (pack + take + on_frame + on_batch)"
        )
    else:
        print("batch: not supported by this module")
    return 0


if __name__ == "__main__":
    sys.exit(main())
