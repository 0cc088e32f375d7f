"""Echo server over RDMA: every message (or stream chunk) a client sends comes back.

    python examples/echo_server.py [HOST] [PORT] [--uvloop]

Runs until interrupted (Ctrl-C or SIGTERM), then closes every connection gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import rdmaio


async def echo(ep: rdmaio.Endpoint) -> None:
    """Send every message back until the client closes."""
    peer = ep.get_extra_info("peername")
    async with ep:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)
    stats = ep.statistics()
    print(
        f"{peer}: echoed {stats['messages_received']} messages, {stats['bytes_received']} bytes, "
        f"mean CQ batch {stats['mean_batch']:.1f}",
        flush=True,
    )


async def main(host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM."""
    server = await rdmaio.serve(echo, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"echo server listening on {server.addresses[0][0]} port {server.addresses[0][1]}", flush=True)
    async with server:
        await stop.wait()
    print("echo server stopped", flush=True)


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

        uvloop.run(main(args.host, args.port))
    else:
        asyncio.run(main(args.host, args.port))
