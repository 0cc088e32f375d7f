"""An asyncio-streams echo server and client; ``--transport`` picks TCP or RDMA.

    python examples/streams_echo.py --transport tcp                    # server + client in one process
    python examples/streams_echo.py --transport rdma --host 198.18.0.1
    python examples/streams_echo.py --transport rdma server --port 7480   # or run the two halves apart
    python examples/streams_echo.py --transport rdma client --port 7480

This is ordinary asyncio-streams code (StreamReader/StreamWriter, readline, readexactly, drain,
write_eof, wait_closed). The only lines that differ between TCP and RDMA are the two marked
``# <- transport``: ``asyncio.start_server``/``open_connection`` or ``rdmaio.streams``'s. Exits non-zero
if an echo differs from what was sent.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import sys
import time

import rdmaio.streams

BULK = 8 << 20  # bytes streamed through the echo in the bulk phase


async def handle_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send back every byte until the client half-closes, then close."""
    peer = writer.get_extra_info("peername")
    total = 0
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
        total += len(data)
    writer.close()
    await writer.wait_closed()
    print(f"server: echoed {total} bytes to {peer}", flush=True)


async def start(transport: str, host: str, port: int) -> asyncio.AbstractServer:
    """Listen on ``host``:``port``."""
    if transport == "rdma":
        return await rdmaio.streams.start_server(handle_echo, host, port)  # <- transport
    return await asyncio.start_server(handle_echo, host, port)  # <- transport


async def client(transport: str, host: str, port: int) -> int:
    """Line round trips, then a bulk transfer; return a process exit code."""
    if transport == "rdma":
        reader, writer = await rdmaio.streams.open_connection(host, port)  # <- transport
    else:
        reader, writer = await asyncio.open_connection(host, port)  # <- transport
    print(f"client: connected to {writer.get_extra_info('peername')} over {transport}")

    # 1. line round trips
    times = []
    for i in range(200):
        line = b"line %d\n" % i
        start_time = time.perf_counter()
        writer.write(line)
        await writer.drain()
        echoed = await reader.readline()
        times.append(time.perf_counter() - start_time)
        if echoed != line:
            print(f"client: MISMATCH: sent {line!r}, got {echoed!r}", file=sys.stderr)
            return 1
    times.sort()
    print(f"client: 200 line round trips, median {times[100] * 1e6:.0f} us, best {times[0] * 1e6:.0f} us")

    # 2. bulk: write while reading the echo back; write_eof() ends the server's read loop
    payload = os.urandom(1 << 20)

    async def send_all() -> None:
        for _ in range(BULK // len(payload)):
            writer.write(payload)
            await writer.drain()
        writer.write_eof()

    start_time = time.perf_counter()
    sender = asyncio.create_task(send_all())
    received = await reader.readexactly(BULK)
    await sender
    elapsed = time.perf_counter() - start_time
    if hashlib.sha256(received).digest() != hashlib.sha256(payload * (BULK // len(payload))).digest():
        print("client: MISMATCH in the bulk echo", file=sys.stderr)
        return 1
    print(
        f"client: {BULK >> 20} MiB echoed in {elapsed:.2f} s ({2 * BULK / elapsed / 1e6:.0f} MB/s both ways)"
    )
    if await reader.read() != b"":  # the server closes after our EOF
        print("client: expected EOF", file=sys.stderr)
        return 1
    writer.close()
    await writer.wait_closed()
    print("client: ok")
    return 0


async def main(args: argparse.Namespace) -> int:
    """Run the chosen role(s); return a process exit code."""
    if args.role == "client":
        return await client(args.transport, args.host, args.port)
    server = await start(args.transport, args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    print(f"server: listening on {args.host} port {port} over {args.transport}", flush=True)
    async with server:
        if args.role == "server":
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            return 0
        return await client(args.transport, args.host, port)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", nargs="?", choices=["both", "server", "client"], default="both")
    parser.add_argument("--transport", choices=["tcp", "rdma"], default="tcp")
    parser.add_argument("--host", help="default: 127.0.0.1 for tcp, $RDMAIO_TEST_ADDR or 198.18.0.1 for rdma")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (server and both)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.host is None:
        args.host = (
            "127.0.0.1" if args.transport == "tcp" else os.environ.get("RDMAIO_TEST_ADDR", "198.18.0.1")
        )
    if args.role == "client" and not args.port:
        parser.error("client needs --port")
    if args.uvloop:
        import uvloop

        sys.exit(uvloop.run(main(args)))
    sys.exit(asyncio.run(main(args)))
