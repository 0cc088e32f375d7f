"""An anyio echo server and client; ``--transport`` picks TCP or RDMA, ``--backend`` the async library.

    python examples/anyio_echo.py --transport tcp --backend trio          # server + client in one process
    python examples/anyio_echo.py --transport rdma --host 198.18.0.1 --backend asyncio
    python examples/anyio_echo.py --transport rdma --role server --port 7490 --backend trio
    python examples/anyio_echo.py --transport rdma --role client --port 7490   # the two halves apart

This is ordinary anyio code: a ``Listener`` serving handlers in a task group, ``ByteStream.send`` /
``receive`` / ``send_eof``, ``BufferedByteStream.receive_until`` / ``receive_exactly``, ``EndOfStream``.
The only lines that differ between TCP and RDMA are the four marked ``# <- transport`` in ``listen()``
and ``connect()``: ``anyio.create_tcp_listener`` / ``connect_tcp`` or ``rdmaio.anyio.create_listener`` /
``connect``. Exits non-zero if an echo differs from what was sent.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from typing import Any

import anyio
from anyio.abc import ByteStream, Listener, SocketAttribute
from anyio.streams.buffered import BufferedByteStream

import rdmaio.anyio

BULK = 8 << 20  # bytes streamed through the echo in the bulk phase


async def listen(transport: str, host: str, port: int) -> Listener[Any]:
    """Listen on ``host``:``port``."""
    if transport == "rdma":
        return await rdmaio.anyio.create_listener(host, port)  # <- transport
    return await anyio.create_tcp_listener(local_host=host, local_port=port)  # <- transport


async def connect(transport: str, host: str, port: int) -> ByteStream:
    """Connect to ``host``:``port``."""
    if transport == "rdma":
        return await rdmaio.anyio.connect(host, port)  # <- transport
    return await anyio.connect_tcp(host, port)  # <- transport


async def handle_echo(stream: ByteStream) -> None:
    """Send back every byte until the client half-closes, then close."""
    peer = stream.extra(SocketAttribute.remote_address, None)
    total = 0
    async with stream:
        async for chunk in stream:
            await stream.send(chunk)
            total += len(chunk)
    print(f"server: echoed {total} bytes to {peer}", flush=True)


async def client(transport: str, host: str, port: int) -> int:
    """Line round trips, then a bulk transfer; return a process exit code."""
    stream = BufferedByteStream(await connect(transport, host, port))
    print(f"client: connected to {stream.extra(SocketAttribute.remote_address)} over {transport}")
    async with stream:
        # 1. line round trips
        times = []
        for i in range(200):
            line = b"line %d\n" % i
            start_time = time.perf_counter()
            await stream.send(line)
            echoed = await stream.receive_until(b"\n", 1024) + b"\n"
            times.append(time.perf_counter() - start_time)
            if echoed != line:
                print(f"client: MISMATCH: sent {line!r}, got {echoed!r}", file=sys.stderr)
                return 1
        times.sort()
        print(f"client: 200 line round trips, median {times[100] * 1e6:.0f} us, best {times[0] * 1e6:.0f} us")

        # 2. bulk: send while reading the echo back; send_eof() ends the server's loop
        payload = os.urandom(1 << 20)

        async def send_all() -> None:
            for _ in range(BULK // len(payload)):
                await stream.send(payload)
            await stream.send_eof()

        start_time = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(send_all)
            received = await stream.receive_exactly(BULK)
        elapsed = time.perf_counter() - start_time
        if hashlib.sha256(received).digest() != hashlib.sha256(payload * (BULK // len(payload))).digest():
            print("client: MISMATCH in the bulk echo", file=sys.stderr)
            return 1
        rate = 2 * BULK / elapsed / 1e6
        print(f"client: {BULK >> 20} MiB echoed in {elapsed:.2f} s ({rate:.0f} MB/s both ways)")
        try:
            await stream.receive()
        except anyio.EndOfStream:  # the server closes after our EOF
            pass
        else:
            print("client: expected the end of the stream", file=sys.stderr)
            return 1
    print("client: ok")
    return 0


async def main(args: argparse.Namespace) -> int:
    """Run the chosen role(s); return a process exit code."""
    if args.role == "client":
        return await client(args.transport, args.host, args.port)
    listener = await listen(args.transport, args.host, args.port)
    port = listener.extra(SocketAttribute.local_port)
    print(f"server: listening on {args.host} port {port} over {args.transport}", flush=True)
    status = 0
    async with listener, anyio.create_task_group() as handlers, anyio.create_task_group() as acceptor:
        acceptor.start_soon(listener.serve, handle_echo, handlers)
        if args.role == "server":
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _signal in signals:
                    break
        else:
            status = await client(args.transport, args.host, port)
        acceptor.cancel_scope.cancel()  # stop accepting; the handlers finish their connections
    print("server: stopped", flush=True)
    return status


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--role", choices=["both", "server", "client"], default="both")
    parser.add_argument("--transport", choices=["tcp", "rdma"], default="tcp")
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    parser.add_argument("--host", help="default: 127.0.0.1 for tcp, $RDMAIO_TEST_ADDR or 198.18.0.1 for rdma")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (server and both)")
    args = parser.parse_args()
    if args.host is None:
        args.host = (
            "127.0.0.1" if args.transport == "tcp" else os.environ.get("RDMAIO_TEST_ADDR", "198.18.0.1")
        )
    if args.role == "client" and not args.port:
        parser.error("client needs --port")
    backend = "trio" if args.backend == "trio" else "asyncio"
    options = {"use_uvloop": True} if args.backend == "uvloop" else {}
    sys.exit(anyio.run(main, args, backend=backend, backend_options=options))
