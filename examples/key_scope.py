"""A remote key works only on the connection it was exported on.

The server exports one private buffer to each client and sends it the key. Client B then forges a
request with client A's key (in a real attack it would guess the address; rkeys are near-sequential) and
tries to read and overwrite A's memory through its own connection. The server's NIC refuses it: B gets
``rdmaio.RemoteAccessRefusedError`` (its connection is gone, as with any remote access error) and A's data
is untouched; A keeps reading its buffer. On iWARP (Soft-iWARP: no memory windows, so each connection has a
protection domain of its own) the refusal ends B's connection without an answer to the WRITE: B's next
operation fails with a ``ConnectionError``. Usage: ``python examples/key_scope.py [HOST] [--uvloop]`` (the
test host: 198.18.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import rdmaio

PORT = 7476


async def main(host: str) -> int:
    async def handler(ep: rdmaio.Endpoint) -> None:
        name = await ep.recv()
        assert name is not None
        buffer = bytearray(b"only-for-" + name)  # this connection's private memory
        key = ep.export(buffer, access="rw")
        await ep.send(bytes(key))
        # B's connection ends with an error: its queue pair went to the error state with the refused request.
        with contextlib.suppress(ConnectionError):
            await ep.recv()  # until the client goes
        await ep.aclose()
        print(f"server: {name.decode()}'s buffer after everything: {bytes(buffer)!r}")

    server = await rdmaio.serve(handler, host, PORT)
    async with server:
        a = await rdmaio.connect(host, PORT, timeout=10)
        b = await rdmaio.connect(host, PORT, timeout=10)
        await a.send(b"client-A")
        key_a = rdmaio.RemoteKey.from_bytes(await a.recv())
        await b.send(b"client-B")
        rdmaio.RemoteKey.from_bytes(await b.recv())  # B's own key: not used here
        print(f"A reads its buffer: {await a.rdma_read(key_a, 0, key_a.length)!r}")
        try:
            await b.rdma_write(key_a, 0, b"written-by-B")
            data = await b.rdma_read(key_a, 0, key_a.length)
        except rdmaio.RemoteAccessRefusedError as exc:
            print(f"B with A's key: refused by the NIC ({type(exc).__name__}: {exc})")
        except ConnectionError as exc:
            # iWARP: an RDMA WRITE completes once it is sent, unacknowledged, and the NIC's refusal is a
            # TERMINATE message that ends B's connection: the READ after the WRITE fails with it.
            print(f"B with A's key: refused by the NIC ({type(exc).__name__}: {exc}); B's connection ended")
        else:
            print(f"B with A's key: read {data!r}: the key is NOT scoped to its connection")
            return 1
        again = await a.rdma_read(key_a, 0, key_a.length)
        print(f"A reads its buffer again: {again!r}")
        await a.send(b"bye")
        await a.aclose()
        await b.aclose()
        return 0 if again == b"only-for-client-A" else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host", nargs="?", default="198.18.0.1")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        sys.exit(uvloop.run(main(args.host)))
    sys.exit(asyncio.run(main(args.host)))
