"""Batches of one-sided requests: ``fetch_add_many`` and ``rdma_read_many``, over the operation engine.

A batch is checked as a whole before anything is posted, then goes out in waves: a wave is ONE op of the
:class:`~rdmaio.core.onesided.operations.OperationEngine` that stands for up to ``max_ops`` work requests
(it takes that many op slots, so the send queue never overflows), has one piece of staging memory for all
of its results, and is posted as one chain of which only the last request is signalled
(``rdmaio_post_batch``). RC executes a send queue in order, so that one completion means the whole wave is
done: one completion, one dispatch and one wake-up for the wave instead of one per request; a request that
fails completes with its own error (the wave's wr_id), which fails the wave. The waves of one call follow
each other; calls from several tasks overlap.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from itertools import accumulate

from rdmaio.core.onesided.keys import ACCESS_ATOMIC, ACCESS_READ, RemoteKey
from rdmaio.core.onesided.operations import (
    STAGING_SLOT,
    U64,
    WR_FADD,
    WR_READ,
    OperationEngine,
    crosses_page,
    to_page_end,
)
from rdmaio.errors import MessageTooLargeError, RemoteAccessError

__all__ = ["BatchCalls"]


class BatchCalls:
    """The batch calls of one connection's one-sided engine, posted through ``operations`` (its public
    methods only; they are bound once here, as the single calls find theirs on their own object)."""

    def __init__(self, operations: OperationEngine) -> None:
        self._operations = operations
        self._check_key = operations.check_key
        self._raise_if_failed = operations.raise_if_failed
        self._wave = operations.wave

    async def fetch_add_many(
        self, key: RemoteKey, offsets: Iterable[int], add: int | Iterable[int] = 1
    ) -> list[int]:
        """Atomic fetch-and-add on many u64s of one key; see ``Endpoint.fetch_add_many``."""
        if not self._operations.atomics or not getattr(key, "exporter_atomics", True):
            self._operations.check_atomics_possible(key, "fetch_add_many")  # raises
        where = _ints(offsets, "offsets")
        if isinstance(add, int):
            adds = [add] * len(where)
        else:
            adds = _ints(add, "add")
            if len(adds) != len(where):
                raise ValueError(f"{len(adds)} values to add for {len(where)} offsets")
        if not where:
            self._raise_if_failed()
            return []
        if min(adds) < -(1 << 63) or max(adds) > U64:
            raise ValueError("every add must be an int in -2**63..2**64-1")
        self._check_key(key, min(where), 8, ACCESS_ATOMIC)
        self._check_key(key, max(where), 8, ACCESS_ATOMIC)
        base = key.addr
        for offset in where:
            if (base + offset) & 7:
                raise RemoteAccessError(
                    f"atomic at offset {offset} of {key!r} is not 8-byte aligned (remote address "
                    f"{base + offset:#x})"
                )
        remote = array("Q", [base + offset for offset in where])
        operands = array("Q", [value & U64 for value in adds])
        results: list[int] = []
        step = self._operations.max_ops
        for i in range(0, len(where), step):
            wave = remote[i : i + step]
            data = await self._wave(key, WR_FADD, 8 * len(wave), wave, compare_add=operands[i : i + step])
            # The NIC stores each original value as a u64 in this host's byte order.
            results.extend(struct.unpack_from(f"={len(wave)}Q", data))
        return results

    async def read_many(self, key: RemoteKey, ranges: Iterable[tuple[int, int]]) -> list[bytes]:
        """RDMA READs of many ranges of one key; see ``Endpoint.rdma_read_many``."""
        wanted: list[tuple[int, int]] = []
        for item in ranges:
            offset, length = item
            self._check_key(key, offset, length, ACCESS_READ)
            if length > STAGING_SLOT:
                raise MessageTooLargeError(
                    f"rdma_read_many() reads at most {STAGING_SLOT} bytes per range; use rdma_read() for "
                    f"the range of {length} bytes"
                )
            wanted.append((offset, length))
        self._raise_if_failed()
        results: list[bytes] = [b""] * len(wanted)
        # The READs to post, each (range index, offset, length): one per non-empty range (zero-length ranges
        # post nothing), two for a range siw would return wrong (see operations.INLINE_READ_MAX), one per
        # page, whose parts land one after the other and are joined in order.
        reads: list[tuple[int, int, int]] = []
        split = self._operations.split_page_crossing_reads
        for i, (offset, length) in enumerate(wanted):
            if not length:
                continue
            if split and crosses_page(key.addr + offset, length):
                first = to_page_end(key.addr + offset)
                reads.append((i, offset, first))
                reads.append((i, offset + first, length - first))
            else:
                reads.append((i, offset, length))
        done = 0
        while done < len(reads):
            wave = _next_wave(reads, done, self._operations.max_ops)
            done += len(wave)
            lengths = array("I", [length for _, _, length in wave])
            starts = array("Q", [0, *accumulate(lengths)][:-1])
            total = starts[-1] + lengths[-1]
            remote = array("Q", [key.addr + offset for _, offset, _ in wave])
            data = await self._wave(key, WR_READ, total, remote, length=lengths, local_offset=starts)
            for (i, _, length), start in zip(wave, starts, strict=True):
                results[i] += data[start : start + length]  # b"" + part is part itself
        return results


def _ints(values: Iterable[int], name: str) -> list[int]:
    items = list(values)
    for value in items:
        if not isinstance(value, int):
            raise TypeError(f"{name} must be ints, not {type(value).__name__}")
    return items


def _next_wave(reads: list[tuple[int, int, int]], first: int, max_ops: int) -> list[tuple[int, int, int]]:
    """The next READs of ``reads`` from ``first`` on that fit one wave: at most ``max_ops`` requests and one
    staging slot."""
    wave: list[tuple[int, int, int]] = []
    total = 0
    for read in reads[first : first + max_ops]:
        length = read[2]
        if wave and total + length > STAGING_SLOT:
            break
        wave.append(read)
        total += length
    return wave
