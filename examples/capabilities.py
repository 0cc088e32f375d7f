"""What a connection uses of its two devices: the framing, the path, and the one-sided operations they offer.

The server exports a buffer to its client, with atomics where its device has them: ``export(access="rwa")``
raises ``rdmaio.FeatureNotSupportedError`` on a device without them (Soft-iWARP, other iWARP devices), and
the server exports ``"rw"`` instead. The client prints the connection's framing (SEND with immediate data,
or the header framing where either device has no immediate data or either side asks for it) and its path
record, echoes a message, writes and reads the buffer with RDMA, reads a batch of small ranges across its
page boundary with ``rdma_read_many`` (Soft-iWARP returns wrong bytes for a READ of up to 32 bytes across a
page; rdmaio splits such a READ there), and tries an atomic ``fetch_add``: it works
where both devices have atomics and raises ``FeatureNotSupportedError``, before anything is sent, where
either lacks them. Usage: ``python examples/capabilities.py [HOST] [--uvloop] [--framing auto|header]`` (the
test host: 198.18.0.1; ``python -m rdmaio.testing.host --provider siw -- ...`` runs it on Soft-iWARP).
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import sys

import rdmaio

PORT = 7482
WRITTEN = b"written by RDMA WRITE"
PAGE = mmap.PAGESIZE
PATTERN_FROM = 64  # the buffer's first 64 bytes are written and added to; a known pattern follows
# small ranges across the page boundary of the (page-aligned) exported buffer, and one inside a page
SMALL_RANGES = [(PAGE - 4, 8), (PAGE - 1, 2), (PAGE - 13, 32), (PAGE - 30, 31), (100, 16)]


def pattern(length: int) -> bytes:
    """The bytes the server puts at ``PATTERN_FROM`` onwards."""
    return bytes((7 * i + 3) % 251 for i in range(length))


async def serve_one(ep: rdmaio.Endpoint) -> None:
    """Echo the client's greeting, export a buffer to it (atomics where this device has them), then wait
    for the client to finish."""
    greeting = await ep.recv()
    assert greeting is not None
    await ep.send(greeting)
    buffer = mmap.mmap(-1, 2 * PAGE)  # page-aligned: offset PAGE is a page boundary of the exporter's memory
    buffer[PATTERN_FROM:] = pattern(2 * PAGE - PATTERN_FROM)
    try:
        key = ep.export(buffer, access="rwa")
    except rdmaio.FeatureNotSupportedError as exc:
        print(f"server: no atomics here ({exc}); exporting read/write only")
        key = ep.export(buffer, access="rw")
    await ep.send(bytes(key))
    await ep.recv()  # the client's goodbye
    print(f"server: the buffer now starts with {bytes(buffer[: len(WRITTEN)])!r}")
    await ep.aclose()


async def main(host: str, framing: str) -> int:
    server = await rdmaio.serve(serve_one, host, PORT)
    async with server:
        ep = await rdmaio.connect(host, PORT, timeout=10, options={"framing": framing})
        async with ep:
            framing_used = ep.get_extra_info("framing")  # "immediate" or "header"
            immediate = framing_used == "immediate"
            print(f"client: framing {framing_used} (immediate data: {'yes' if immediate else 'no'})")
            print(ep.get_extra_info("rdma").describe())
            await ep.send(b"hello over RDMA")
            print(f"client: echoed {await ep.recv()!r}")
            key = rdmaio.RemoteKey.from_bytes(await ep.recv())
            await ep.rdma_write(key, 0, WRITTEN)
            read = await ep.rdma_read(key, 0, len(WRITTEN))
            print(f"client: RDMA READ gives back {read!r}")
            whole = bytes(PATTERN_FROM) + pattern(2 * PAGE - PATTERN_FROM)
            small = await ep.rdma_read_many(key, SMALL_RANGES)
            small_ok = small == [whole[o : o + n] for o, n in SMALL_RANGES]
            print(
                f"client: rdma_read_many of {len(SMALL_RANGES)} small ranges, {len(SMALL_RANGES) - 1} across "
                f"a page boundary: {'all right' if small_ok else 'WRONG BYTES'}"
            )
            try:
                old = await ep.fetch_add(key, 56, 1)
            except rdmaio.FeatureNotSupportedError as exc:
                print(f"client: fetch_add refused before anything was sent: {exc}")
            else:
                print(f"client: fetch_add returned {old} (both devices have atomics)")
            await ep.send(b"bye")
            return 0 if read == WRITTEN and small_ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host", nargs="?", default="198.18.0.1")
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--framing", choices=("auto", "header"), default="auto")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        sys.exit(uvloop.run(main(args.host, args.framing)))
    sys.exit(asyncio.run(main(args.host, args.framing)))
