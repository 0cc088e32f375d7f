"""A small one-sided key-value store: clients put and get without involving the server's CPU.

The server exports one table (``SLOTS`` slots of 128 bytes plus a counter word) and sends each client its
key; after that it only waits. Clients find a key's slot by hashing (linear probing) and

* ``put``: take the slot's lock with ``compare_swap``, make its version odd with ``fetch_add``, write the
  entry with ``rdma_write``, make the version even again, release the lock; count the put with
  ``fetch_add`` on the table's counter;
* ``get``: ``rdma_read`` the slot, then its version again (a seqlock): an odd or changed version means a
  writer was busy, so read again;
* ``get_many``: the same for many keys at once, in batches: one ``rdma_read_many`` of their home slots,
  one of their versions, then one ``fetch_add_many`` on the hit counters of the slots found (a cache's
  popularity count); a key that is not in its home slot, or was being written, falls back to ``get``.

Slot layout (little-endian): lock u64, version u64, key length u32, value length u32, key (32 bytes),
value (72 bytes). Usage: ``python examples/onesided_kv.py [HOST] [--clients N] [--uvloop]``; it runs the
server and the clients in one process, over RDMA (the test host: 198.18.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import zlib

import rdmaio

SLOTS = 64
SLOT = 128
HEADER = struct.Struct("<QQII")  # lock, version, key length, value length
KEY_MAX, VALUE_MAX = 32, 72
COUNTER = SLOTS * SLOT  # offset of the u64 count of puts
HITS = COUNTER + 8  # SLOTS u64 hit counters, one per slot (bumped by get_many)


class Client:
    """A client of the table behind ``key`` on connection ``ep``; ``me`` (> 0) is its lock owner id."""

    def __init__(self, ep: rdmaio.Endpoint, key: rdmaio.RemoteKey, me: int) -> None:
        self.ep, self.key, self.me = ep, key, me
        self.hits = 0  # lookups get_many answered from one batch (and counted in the table)

    def _slots(self, name: bytes) -> list[int]:
        start = zlib.crc32(name) % SLOTS
        return [(start + i) % SLOTS * SLOT for i in range(SLOTS)]

    async def put(self, name: bytes, value: bytes) -> None:
        """Store ``value`` under ``name`` (at most 32 and 72 bytes)."""
        if len(name) > KEY_MAX or len(value) > VALUE_MAX or not name:
            raise ValueError("key 1..32 bytes, value at most 72 bytes")
        ep, key = self.ep, self.key
        for slot in self._slots(name):
            while await ep.compare_swap(key, slot, 0, self.me) != 0:  # noqa: ASYNC110 (a spin lock)
                await asyncio.sleep(0)
            try:
                _, _, klen, _ = HEADER.unpack(await ep.rdma_read(key, slot, HEADER.size))
                stored = await ep.rdma_read(key, slot + HEADER.size, klen) if klen else b""
                if klen and stored != name:
                    continue  # taken by another key: probe the next slot
                await ep.fetch_add(key, slot + 8, 1)  # version odd: readers retry
                entry = struct.pack("<II", len(name), len(value)) + name.ljust(KEY_MAX, b"\0") + value
                await ep.rdma_write(key, slot + 16, entry)
                await ep.fetch_add(key, slot + 8, 1)  # version even: entry consistent
                await ep.fetch_add(key, COUNTER, 1)
                return
            finally:
                assert await ep.compare_swap(key, slot, self.me, 0) == self.me
        raise RuntimeError("table full")

    async def get(self, name: bytes) -> bytes | None:
        """The value stored under ``name``, or None; the server's CPU takes no part."""
        ep, key = self.ep, self.key
        for slot in self._slots(name):
            while True:
                raw = await ep.rdma_read(key, slot, SLOT)
                _, version, klen, vlen = HEADER.unpack_from(raw)
                again = struct.unpack("<Q", await ep.rdma_read(key, slot + 8, 8))[0]
                if version % 2 == 0 and version == again:
                    break  # no writer touched the slot between the two reads
                await asyncio.sleep(0)
            if klen == 0:
                return None
            if raw[HEADER.size : HEADER.size + klen] == name:
                start = HEADER.size + KEY_MAX
                return raw[start : start + vlen]
        return None

    async def get_many(self, names: list[bytes]) -> list[bytes | None]:
        """The values stored under ``names`` (None where absent), read in batches."""
        ep, key = self.ep, self.key
        homes = [self._slots(name)[0] for name in names]
        raws = await ep.rdma_read_many(key, [(slot, SLOT) for slot in homes])
        versions = await ep.rdma_read_many(key, [(slot + 8, 8) for slot in homes])
        values: list[bytes | None] = []
        found: list[int] = []
        for name, slot, raw, again in zip(names, homes, raws, versions, strict=True):
            _, version, klen, vlen = HEADER.unpack_from(raw)
            consistent = version % 2 == 0 and version == struct.unpack("<Q", again)[0]
            if not consistent or (klen and raw[HEADER.size : HEADER.size + klen] != name):
                values.append(await self.get(name))  # being written, or probed past its home slot
            elif klen == 0:
                values.append(None)
            else:
                start = HEADER.size + KEY_MAX
                values.append(raw[start : start + vlen])
                found.append(HITS + slot // SLOT * 8)
        if found:
            await ep.fetch_add_many(key, found)  # one chain of atomics for all the hits
            self.hits += len(found)
        return values

    async def puts(self) -> int:
        """The table's count of puts (an RDMA READ of the counter word)."""
        return int.from_bytes(await self.ep.rdma_read(self.key, COUNTER, 8), "little")


async def main(host: str, clients: int) -> int:
    table = bytearray(SLOTS * SLOT + 8 + 8 * SLOTS)
    served = 0

    async def handler(ep: rdmaio.Endpoint) -> None:
        nonlocal served
        async with ep:
            key = ep.export(table, access="rwa")
            await ep.send(bytes(key))
            assert await ep.recv() == b"bye"  # the only message after the key: no requests to serve
            await ep.revoke(key)
            served += 1

    server = await rdmaio.serve(handler, host, 0)
    barrier = asyncio.Barrier(clients)
    async with server:
        port = server.addresses[0][1]

        async def client(n: int) -> tuple[int, int, int]:
            async with await rdmaio.connect(host, port, timeout=60) as ep:
                c = Client(ep, rdmaio.RemoteKey.from_bytes(await ep.recv()), n + 1)
                for i in range(10):
                    await c.put(b"key-%d-%d" % (n, i), b"value %d of client %d" % (i, n))
                for i in range(5):
                    await c.put(b"shared", b"client %d round %d" % (n, i))
                await barrier.wait()  # every client's puts are done before anyone checks
                bad = 0
                for m in range(clients):
                    for i in range(10):
                        if await c.get(b"key-%d-%d" % (m, i)) != b"value %d of client %d" % (i, m):
                            bad += 1
                shared = await c.get(b"shared")
                if shared is None or not shared.startswith(b"client ") or b" round 4" not in shared:
                    bad += 1
                if await c.get(b"missing") is not None:
                    bad += 1
                names = [b"key-%d-%d" % (m, i) for m in range(clients) for i in range(10)]
                expected = [b"value %d of client %d" % (i, m) for m in range(clients) for i in range(10)]
                bad += sum(got != want for got, want in zip(await c.get_many(names), expected, strict=True))
                count = await c.puts()
                await ep.send(b"bye")
                return bad, count, c.hits

        results = await asyncio.gather(*(client(n) for n in range(clients)))
    bad = sum(r[0] for r in results)
    total = int.from_bytes(table[COUNTER:HITS], "little")
    expected = clients * 15
    hits = sum(struct.unpack_from(f"<{SLOTS}Q", table, HITS))
    batched = sum(r[2] for r in results)
    print(f"{clients} clients, {total} puts (expected {expected}), {bad} bad reads, server served {served}")
    print(f"get_many: {batched} lookups answered from batches, {hits} hits counted by fetch_add_many")
    ok = bad == 0 and total == expected and served == clients and hits == batched > 0
    print("onesided kv: ok" if ok else "onesided kv: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host", nargs="?", default="198.18.0.1")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        sys.exit(uvloop.run(main(args.host, args.clients)))
    sys.exit(asyncio.run(main(args.host, args.clients)))
