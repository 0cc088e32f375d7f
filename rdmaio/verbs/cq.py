"""Completions: :class:`CompletionChannel`, :class:`CompletionQueue` and :class:`CompletionBatch`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from rdmaio._ffi import ffi, lib
from rdmaio.errors import VerbsError
from rdmaio.verbs._base import _check, _check_ptr, _Resource
from rdmaio.verbs.device import DeviceContext
from rdmaio.verbs.wr import MAX_POLL

# --- completion channel, CQ ------------------------------------------------------------------------


class CompletionChannel(_Resource):
    """A completion channel whose non-blocking fd signals armed CQs."""

    _call_destroy = "ibv_destroy_comp_channel"

    def __init__(self, context: DeviceContext) -> None:
        super().__init__()
        self.context = context
        self._ptr = _check_ptr(lib.ibv_create_comp_channel(context._ptr), "ibv_create_comp_channel")
        self.fd: int = int(self._ptr.fd)
        os.set_blocking(self.fd, False)
        self._fired = ffi.new("struct ibv_cq *[]", 64)
        self._fired_max = 64
        self._events = ffi.new("unsigned int *")
        self._err = ffi.new("int *")

    def drain_events(self) -> tuple[list[int], bool, int]:
        """Read every pending event, ack them per CQ and re-arm each CQ that fired (one C call, GIL
        released). Return ``(handles, overflow, events)``: the :attr:`CompletionQueue.handle` of each CQ
        that fired (in the order of their first event), whether more CQs fired than could be listed (then
        poll every CQ), and how many events were read. A failed read or re-arm raises
        :class:`~rdmaio.errors.VerbsError` after everything read was acked (so poll every CQ then too)."""
        self._check_usable()
        n = lib.rdmaio_drain_channel(self._ptr, self._fired, self._fired_max, self._events, self._err)
        listed = min(n, self._fired_max)
        fired = self._fired
        handles = [int(ffi.cast("uintptr_t", fired[i])) for i in range(listed)]
        if self._err[0]:
            raise VerbsError.from_errno("ibv_get_cq_event/ibv_req_notify_cq", self._err[0])
        return handles, n > self._fired_max, int(self._events[0])

    def _destroy(self) -> None:
        lib.ibv_destroy_comp_channel(self._ptr)


class CompletionBatch:
    """Preallocated buffers of :meth:`CompletionQueue.poll_grouped`: ``records`` (the completions, grouped
    by dispatch key) and ``groups`` (``key``, ``start``, ``count`` of each run), ``size`` entries each."""

    def __init__(self, size: int) -> None:
        if not 1 <= size <= MAX_POLL:
            raise ValueError(f"a completion batch holds 1 to {MAX_POLL} records, not {size}")
        self.size = size
        self.records: Any = ffi.new("struct rdmaio_wc[]", size)
        self.groups: Any = ffi.new("struct rdmaio_wc_group[]", size)
        self._scratch = ffi.new("struct rdmaio_wc[]", size)
        self._ngroups = ffi.new("int *")
        self.ngroups = 0

    def copy_records(self, start: int, count: int) -> Any:
        """A copy of ``records[start:start + count]`` (a new ``struct rdmaio_wc[count]``)."""
        if not (start >= 0 and count >= 0 and start + count <= self.size):
            raise IndexError(f"records {start}..{start + count} of a batch of {self.size}")
        if not count:
            return []
        copy = ffi.new("struct rdmaio_wc[]", count)  # len(copy) == count
        ffi.memmove(copy, self.records + start, count * ffi.sizeof("struct rdmaio_wc"))
        return copy


class CompletionQueue(_Resource):
    """A CQ attached to a :class:`CompletionChannel`, armed at creation.

    Two ways to consume it. A channel serving this CQ alone: :meth:`drain` reads and acks the channel's
    events, re-arms and polls into a preallocated record array in one C call. A channel serving a pool of
    CQs (:mod:`rdmaio.completions`): :meth:`CompletionChannel.drain_events` acks and re-arms every CQ that
    fired, then :meth:`poll_grouped` polls each of them, grouping the completions by dispatch key.
    """

    _call_destroy = "ibv_destroy_cq"
    _close_rank = 3

    def __init__(
        self, context: DeviceContext, channel: CompletionChannel, cqe: int, *, batch: int = 256
    ) -> None:
        super().__init__(channel)
        self.channel = channel
        self._ptr = _check_ptr(
            lib.ibv_create_cq(context._ptr, cqe, ffi.NULL, channel._ptr, 0), "ibv_create_cq", f"cqe={cqe}"
        )
        self.cqe = int(self._ptr.cqe)
        self.handle = int(ffi.cast("uintptr_t", self._ptr))  # what AsyncEvent.obj names for CQ_ERR
        self.batch = batch
        self.records = ffi.new("struct rdmaio_wc[]", batch)
        self._events = ffi.new("unsigned int *")
        self.events_total = 0
        self.completions_total = 0
        self.drain_calls = 0
        _check(lib.rdmaio_req_notify(self._ptr), "ibv_req_notify_cq")

    def drain(self) -> int:
        """Drain channel events and completions; return how many records were filled in ``records``.

        A return equal to ``batch`` means more may be waiting: call again.
        """
        self._check_usable()
        n = lib.rdmaio_drain_cq(self.channel._ptr, self._ptr, self.records, self.batch, self._events)
        if n < 0:
            raise VerbsError.from_errno("ibv_get_cq_event/ibv_poll_cq", -n)
        self.drain_calls += 1
        self.events_total += self._events[0]
        self.completions_total += n
        return int(n)

    def poll_grouped(self, batch: CompletionBatch) -> int:
        """Poll up to ``batch.size`` completions into ``batch.records`` grouped by dispatch key (stable:
        CQ order kept within a key), the runs in ``batch.groups[0:batch.ngroups]``. Return the number of
        records; ``batch.size`` means more may be waiting. Does not read channel events (see
        :meth:`CompletionChannel.drain_events`)."""
        self._check_usable()
        n = lib.rdmaio_poll_grouped(
            self._ptr, batch._scratch, batch.records, batch.size, batch.groups, batch._ngroups
        )
        return self.took(batch, int(n))

    def took(self, batch: CompletionBatch, n: int) -> int:
        """Account for ``n`` records (or ``-errno``) that a C call polled from this CQ into ``batch`` (what
        :meth:`poll_grouped` does after its call). Returns ``n``; raises :class:`VerbsError` for a failed
        poll."""
        if n < 0:
            raise VerbsError.from_errno("ibv_poll_cq", -n)
        batch.ngroups = int(batch._ngroups[0])
        self.completions_total += n
        return n

    def iter_drain(self) -> Iterator[Any]:
        """Yield every completion record available now (re-draining while batches come back full)."""
        while True:
            n = self.drain()
            records = self.records
            for i in range(n):
                yield records[i]
            if n < self.batch:
                return

    def _destroy(self) -> None:
        lib.ibv_destroy_cq(self._ptr)
