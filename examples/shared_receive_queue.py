"""Many connections on one shared receive queue: ``Options(shared_receive_queue=True)``.

A server and ``--clients`` connections in one process, every endpoint on the device's one shared receive queue
(SRQ) instead of a receive ring of its own. Each client sends ``--messages`` messages of mixed sizes and
checks the echo (SHA-256). The SRQ's credits are lent out of the receives it really holds, so a busy
connection borrows receives that idle ones give back (RECLAIM/RETURN frames), and no SEND ever meets an
empty queue (docs/protocol.md, "Shared receive queue and credits"). The script prints the windows the
connections ended with and how many credits their peers returned.

    python examples/shared_receive_queue.py 198.18.0.1 --clients 20
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random

import rdmaio

OPTIONS = rdmaio.Options(shared_receive_queue=True)


async def echo(ep: rdmaio.Endpoint) -> None:
    """Send every message back until the client closes."""
    while (msg := await ep.recv()) is not None:
        await ep.send(msg)


async def talk(ep: rdmaio.Endpoint, seed: int, messages: int) -> bool:
    """Send ``messages`` random messages (1 B to 20 KB) and read the echoes; True if they match."""
    rng = random.Random(seed)
    sent, received = hashlib.sha256(), hashlib.sha256()

    async def send_all() -> None:
        for _ in range(messages):
            data = rng.randbytes(rng.choice((1, 100, 3000, 20000)))
            sent.update(data)
            await ep.send(data)

    async def recv_all() -> None:
        for _ in range(messages):
            msg = await ep.recv()
            assert msg is not None, "the server closed early"
            received.update(msg)

    await asyncio.gather(send_all(), recv_all())
    return sent.digest() == received.digest()


async def main(host: str, clients: int, messages: int) -> None:
    server = await rdmaio.serve(echo, host, 0, options=OPTIONS)
    async with server:
        port = server.addresses[0][1]
        eps = await asyncio.gather(
            *(rdmaio.connect(host, port, options=OPTIONS, timeout=60) for _ in range(clients))
        )
        ok = await asyncio.gather(*(talk(ep, i, messages) for i, ep in enumerate(eps)))
        stats = [ep.statistics() for ep in eps]
        for ep in eps:
            await ep.aclose()
    if not all(ok):
        raise SystemExit(f"echo mismatch on {ok.count(False)} of {clients} connections")
    returned = sum(int(s.get("protocol_credits_returned_received", 0)) for s in stats)
    released = sum(int(s.get("protocol_released", 0)) for s in stats)
    print(
        f"{clients} connections x {messages} messages echoed over one shared receive queue, "
        f"SHA-256 ok on every connection"
    )
    print(
        f"credits the servers' side returned to the clients' pool (RETURN frames): {returned}; "
        f"receives the clients gave back to their pool: {released}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("host", nargs="?", default="198.18.0.1", help="address of the RDMA device")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--messages", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.host, args.clients, args.messages))
