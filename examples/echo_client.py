"""Echo client over RDMA: sends messages of several sizes, checks each echo, prints round-trip times.

    python examples/echo_client.py [HOST] [PORT] [--uvloop]

Exits non-zero if an echo differs from what was sent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import rdmaio

SIZES = [0, 1, 64, 4096, 65536, 1 << 20, 4 << 20]


async def main(host: str, port: int) -> int:
    """Echo each size a few times; return a process exit code."""
    ep = await rdmaio.connect(host, port, timeout=10)
    async with ep:
        print(
            f"connected to {ep.get_extra_info('peername')} via {ep.get_extra_info('device')} "
            f"port {ep.get_extra_info('port')} (qp {ep.get_extra_info('qp_num')}, "
            f"mtu {ep.get_extra_info('mtu')})"
        )
        for size in SIZES:
            payload = os.urandom(size)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                await ep.send(payload)
                echoed = await ep.recv()
                times.append(time.perf_counter() - start)
                if echoed != payload:
                    print(f"MISMATCH at {size} bytes", file=sys.stderr)
                    return 1
            best = min(times) * 1e6
            print(f"{size:>9} B  ok  best round trip {best:9.0f} us")
        stats = ep.statistics()
        print(
            f"sent {stats['messages_sent']} messages / {stats['bytes_sent']} bytes; "
            f"{stats['wakeups']} loop wake-ups, mean CQ batch {stats['mean_batch']:.2f}"
        )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("host", nargs="?", default="198.18.0.1")
    parser.add_argument("port", nargs="?", type=int, default=7471)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        sys.exit(uvloop.run(main(args.host, args.port)))
    sys.exit(asyncio.run(main(args.host, args.port)))
