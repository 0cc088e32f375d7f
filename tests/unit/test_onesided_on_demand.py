"""A connection's one-sided engine is built on its first use: a connection that never uses one-sided RDMA
builds none, yet reports, folds and tears down as one with an unused engine; the first call of either
side, the peer's first control message, and a call after the close all find an engine that behaves as one
built at setup."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from rdmaio import errors
from rdmaio.core import metrics
from rdmaio.core.onesided import UNUSED_STATISTICS
from rdmaio.core.onesided.exporter import Exporter
from rdmaio.testing.nullpair import null_pair

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def test_an_unused_connection_builds_no_engine_and_reports_an_unused_ones_statistics(arun: Run) -> None:
    async def main() -> None:
        a, b, _device = null_pair()
        await a.send(b"ping")
        assert await b.recv() == b"ping"
        assert a._conn._onesided is None and b._conn._onesided is None
        unbuilt = a.statistics()
        assert a._conn._onesided is None  # statistics() builds nothing
        # An engine that exists but never did anything reports the same one-sided counters.
        assert b._conn.onesided.statistics() == UNUSED_STATISTICS
        built = b.statistics()
        assert {k: unbuilt[k] for k in UNUSED_STATISTICS} == {k: built[k] for k in UNUSED_STATISTICS}
        a.close()
        b.close()
        await a.wait_closed()
        await b.wait_closed()
        assert a._conn._onesided is None  # teardown builds nothing either
        assert b._conn.onesided.closed  # ... and closes the one that exists

    arun(main())


def test_the_first_call_and_the_peers_first_control_message_build_the_engines(arun: Run) -> None:
    async def main() -> None:
        a, b, _device = null_pair()
        memory = bytearray(64)
        memory[:5] = b"hello"
        key = b.export(memory, access="rw", scope="domain")  # the exporter's first use builds its engine
        assert b._conn._onesided is not None and a._conn._onesided is None
        assert await a.rdma_read(key, 0, 5) == b"hello"  # the importer's first call builds its own
        assert a._conn._onesided is not None
        await a.rdma_write(key, 8, b"world")
        assert memory[8:13] == b"world"
        a.close()
        b.close()
        await a.wait_closed()
        await b.wait_closed()

    arun(main())


def test_a_control_message_to_a_connection_without_an_engine_builds_it(
    arun: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver hands the peer's control message or write notice to the connection's stand-in, which
    builds the engine, puts it in its own place and hands it the message (its answer comes back)."""
    seen: list[tuple[int, int, int, bytes, int]] = []

    def on_recv(self: Exporter, opcode: int, imm: int, length: int, view: memoryview, slot: int) -> bool:
        seen.append((opcode, imm, length, bytes(view), slot))
        return False  # held

    monkeypatch.setattr(Exporter, "on_recv", on_recv)

    async def main() -> None:
        a, b, _device = null_pair()
        conn = a._conn
        assert conn._onesided is None
        stand_in = conn.receiver.onesided
        assert stand_in is not None
        assert stand_in.on_recv(1, 2, 3, memoryview(b"abc"), 4) is False
        assert conn._onesided is not None
        assert conn.receiver.onesided is conn._onesided  # the stand-in is out of the way
        assert seen == [(1, 2, 3, b"abc", 4)]
        a.close()
        b.close()
        await a.wait_closed()
        await b.wait_closed()
        assert conn._onesided.closed

    arun(main())


def test_a_first_call_after_the_close_finds_a_closed_engine(arun: Run) -> None:
    async def main() -> None:
        a, b, _device = null_pair()
        key = b.export(bytearray(64), access="rw", scope="domain")
        a.close()
        await a.wait_closed()
        assert a._conn._onesided is None
        with pytest.raises(errors.RdmaError):
            await a.rdma_read(key, 0, 5)
        assert a._conn.onesided.closed
        b.close()
        await b.wait_closed()

    arun(main())


def _onesided_reads() -> int:
    counters, _gauges = metrics.connection_totals()
    return sum(bucket.get("onesided_reads", 0) for bucket in counters.values())


def test_the_process_metrics_fold_used_and_unused_connections(arun: Run) -> None:
    async def main() -> None:
        start = _onesided_reads()
        a, b, _device = null_pair()  # never uses one-sided RDMA
        a.close()
        b.close()
        await a.wait_closed()
        await b.wait_closed()
        assert a._conn._onesided is None and b._conn._onesided is None
        assert _onesided_reads() == start
        a, b, _device = null_pair()
        key = b.export(bytearray(64), access="r", scope="domain")
        assert await a.rdma_read(key, 0, 8) == bytes(8)
        assert _onesided_reads() == start + 1  # live
        a.close()
        b.close()
        await a.wait_closed()
        await b.wait_closed()
        assert _onesided_reads() == start + 1  # folded

    arun(main())
