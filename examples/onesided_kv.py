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

Atomics need both devices to have them (RoCE, InfiniBand). Where they do not (iWARP: Soft-iWARP, Intel E810
in iWARP mode, Chelsio), ``export(access="rwa")`` raises ``rdmaio.FeatureNotSupportedError`` and the server
exports the table read-only instead: the key says so (no ``"a"`` in ``key.access``), and the clients then
send their puts and their hit counts to the server as messages (the server applies them with the same
seqlock), while every get stays a one-sided READ.

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


PUT, HITS_MSG, BYE = b"P", b"H", b"bye"  # the messages of a client without atomics (and its goodbye)


def slots_of(name: bytes) -> list[int]:
    """The offsets of the slots ``name`` may live in, in probing order."""
    start = zlib.crc32(name) % SLOTS
    return [(start + i) % SLOTS * SLOT for i in range(SLOTS)]


def local_put(table: bytearray, name: bytes, value: bytes) -> None:
    """A put done by the server's CPU (for clients without atomics): the same seqlock as a remote put, so
    that the clients' one-sided gets never return a half-written entry. One event loop applies the puts
    one at a time: no lock word is needed among them."""
    for slot in slots_of(name):
        _, version, klen, _ = HEADER.unpack_from(table, slot)
        if klen and bytes(table[slot + HEADER.size : slot + HEADER.size + klen]) != name:
            continue  # taken by another key: probe the next slot
        struct.pack_into("<Q", table, slot + 8, version + 1)  # version odd: readers retry
        entry = struct.pack("<II", len(name), len(value)) + name.ljust(KEY_MAX, b"\0") + value
        table[slot + 16 : slot + 16 + len(entry)] = entry
        struct.pack_into("<Q", table, slot + 8, version + 2)  # version even: entry consistent
        struct.pack_into("<Q", table, COUNTER, struct.unpack_from("<Q", table, COUNTER)[0] + 1)
        return
    raise RuntimeError("table full")


class Client:
    """A client of the table behind ``key`` on connection ``ep``; ``me`` (> 0) is its lock owner id.
    Without atomics on the key (``"a"`` not in ``key.access``) puts and hit counts go to the server."""

    def __init__(self, ep: rdmaio.Endpoint, key: rdmaio.RemoteKey, me: int) -> None:
        self.ep, self.key, self.me = ep, key, me
        self.hits = 0  # lookups get_many answered from one batch (and counted in the table)
        self.atomics = "a" in key.access

    def _slots(self, name: bytes) -> list[int]:
        return slots_of(name)

    async def put(self, name: bytes, value: bytes) -> None:
        """Store ``value`` under ``name`` (at most 32 and 72 bytes)."""
        if len(name) > KEY_MAX or len(value) > VALUE_MAX or not name:
            raise ValueError("key 1..32 bytes, value at most 72 bytes")
        ep, key = self.ep, self.key
        if not self.atomics:
            await ep.send(PUT + bytes([len(name)]) + name + value)
            assert await ep.recv() == b"ok"  # applied: a get after this sees it
            return
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
        if found and self.atomics:
            await ep.fetch_add_many(key, found)  # one chain of atomics for all the hits
            self.hits += len(found)
        elif found:
            await ep.send(HITS_MSG + struct.pack(f"<{len(found)}I", *found))  # the server counts them
            assert await ep.recv() == b"ok"
            self.hits += len(found)
        return values

    async def puts(self) -> int:
        """The table's count of puts (an RDMA READ of the counter word)."""
        return int.from_bytes(await self.ep.rdma_read(self.key, COUNTER, 8), "little")


async def main(host: str, clients: int) -> int:
    table = bytearray(SLOTS * SLOT + 8 + 8 * SLOTS)
    served = 0
    without_atomics = ""  # why the server exported without atomics (empty: it did not)

    async def handler(ep: rdmaio.Endpoint) -> None:
        nonlocal served, without_atomics
        async with ep:
            try:
                key = ep.export(table, access="rwa")
            except rdmaio.FeatureNotSupportedError as exc:
                without_atomics = str(exc)
                key = ep.export(table, access="r")  # puts and hit counts come as messages
            await ep.send(bytes(key))
            # With atomics "bye" is the only message after the key: no requests to serve.
            while (request := await ep.recv()) != BYE:
                assert request is not None and "a" not in key.access
                if request[:1] == PUT:
                    size = request[1]
                    local_put(table, bytes(request[2 : 2 + size]), bytes(request[2 + size :]))
                else:
                    for offset in struct.unpack(f"<{(len(request) - 1) // 4}I", request[1:]):
                        struct.pack_into("<Q", table, offset, struct.unpack_from("<Q", table, offset)[0] + 1)
                await ep.send(b"ok")
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
                await ep.send(BYE)
                return bad, count, c.hits

        results = await asyncio.gather(*(client(n) for n in range(clients)))
    bad = sum(r[0] for r in results)
    total = int.from_bytes(table[COUNTER:HITS], "little")
    expected = clients * 15
    hits = sum(struct.unpack_from(f"<{SLOTS}Q", table, HITS))
    batched = sum(r[2] for r in results)
    if without_atomics:
        print(f"no atomics: {without_atomics}")
        print("puts and hit counts went to the server as messages; every get was a one-sided READ")
    print(f"{clients} clients, {total} puts (expected {expected}), {bad} bad reads, server served {served}")
    counted_by = "the server" if without_atomics else "fetch_add_many"
    print(f"get_many: {batched} lookups answered from batches, {hits} hits counted by {counted_by}")
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
