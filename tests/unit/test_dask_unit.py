"""Unit tests of rdmaio.dask without RDMA: framing, the comm and addressing over an in-memory endpoint.

``FakeEndpoint`` (:mod:`rdmaio.testing.fakes`) mimics the message half of :class:`rdmaio.Endpoint`, with its
documented semantics:
``send`` copies the data; ``recv`` returns the next message or ``None`` at EOF; ``recv_into`` copies what
fits of the next message and keeps the rest for the next read call; ``close`` sends EOF; ``abort`` makes
pending and later calls of both sides fail. With ``rendezvous_from`` set, a ``send`` of at least that
many bytes returns only once the peer has read the whole message, as a rendezvous send does when the
receiving endpoint does not pull unclaimed messages by itself.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import dask.config
import numpy as np
import pytest
import uvloop
from distributed.comm.core import CommClosedError
from hypothesis import given, settings
from hypothesis import strategies as st

import rdmaio
import rdmaio.dask.comm
from rdmaio.dask import addressing
from rdmaio.dask.comm import RDMABackend, RDMAComm, RDMAListener, chunk_size, frame_limits
from rdmaio.dask.config import load_defaults
from rdmaio.dask.framing import (
    INLINE_FRAME_LIMIT,
    FrameLimitError,
    FrameLimits,
    FramingError,
    decode_header,
    encode_header,
    read_frames,
    write_frames,
)
from rdmaio.testing.fakes import FakeEndpoint

T = TypeVar("T")


def endpoint_pair() -> tuple[FakeEndpoint, FakeEndpoint]:
    """Two connected fake endpoints with no message size limit; an endpoint's own abort fails its later
    calls with ``ConnectionAbortedError``."""
    return FakeEndpoint.pair(
        max_message_size=None, abort_error=lambda: rdmaio.ConnectionAbortedError("aborted")
    )


# --- framing -----------------------------------------------------------------------------------------


def _roundtrip(frames: list[bytes | memoryview], chunk: int) -> tuple[list[bytes], list[int]]:
    async def main() -> tuple[list[bytes], list[int]]:
        a, b = endpoint_pair()
        sent = await write_frames(a, frames, chunk)
        assert sent == sum(a.sent_sizes)
        got = await read_frames(b)
        assert got is not None
        assert not b.rx, "every message of the Dask message was consumed"
        return [bytes(f) for f in got], a.sent_sizes

    return asyncio.run(main())


def test_small_frames_ride_in_one_message() -> None:
    frames: list[bytes | memoryview] = [b"", b"header", b"x" * 1000]
    got, sizes = _roundtrip(frames, 1 << 20)
    assert got == [bytes(f) for f in frames]
    assert len(sizes) == 1


def test_large_frames_are_chunked_and_reassembled_exactly() -> None:
    big = bytes(range(256)) * 5000  # 1.28 MB
    frames: list[bytes | memoryview] = [b"meta", big, b"tail", memoryview(big)[7:300007]]
    got, sizes = _roundtrip(frames, 100_000)
    assert got == [bytes(f) for f in frames]
    # header (with the two small frames inline), then 13 + 3 chunks
    assert sizes[0] < INLINE_FRAME_LIMIT and len(sizes) == 1 + 13 + 3
    assert max(sizes[1:]) == 100_000


def test_non_byte_and_multidimensional_buffers() -> None:
    array = np.arange(60_000, dtype="f8").reshape(300, 200)
    empty = np.empty((0, 3))
    frames: list[bytes | memoryview] = [memoryview(array), memoryview(array.T.copy())[::2], memoryview(empty)]
    got, _ = _roundtrip(frames, 1 << 16)
    assert got[2] == b""
    assert got[0] == array.tobytes()
    assert got[1] == memoryview(array.T.copy())[::2].tobytes()


def test_inline_total_is_bounded() -> None:
    frames: list[bytes | memoryview] = [bytes([i]) * 60_000 for i in range(10)]
    header, separate = encode_header([memoryview(f) for f in frames])
    assert len(header) < 300_000
    assert len(separate) == 10 - 4  # 4 * 60 kB fit under the 256 KiB inline total


def test_receiver_does_not_depend_on_the_senders_chunking() -> None:
    async def main() -> None:
        a, b = endpoint_pair()
        big = np.random.default_rng(1).bytes(700_000)
        header, _ = encode_header([memoryview(b"m"), memoryview(big)])
        await a.send(header)
        # a peer that cuts the frame into unequal messages, across frame boundaries of recv_into
        for start, stop in ((0, 1), (1, 400_000), (400_000, 700_000)):
            await a.send(big[start:stop])
        got = await read_frames(b)
        assert got is not None and bytes(got[1]) == big

    asyncio.run(main())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.binary(max_size=3000) | st.integers(0, 300_000), max_size=8),
    st.integers(997, 200_000),
)
def test_roundtrip_property(spec: list[bytes | int], chunk: int) -> None:
    frames: list[bytes | memoryview] = [bytes([s % 251]) * s if isinstance(s, int) else s for s in spec]
    got, _ = _roundtrip(frames, chunk)
    assert got == [bytes(f) for f in frames]


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (b"\x01\x00", "too short"),
        (struct.pack("<B3xI", 2, 0), "version 2"),
        (struct.pack("<B3xI", 1, 1 << 21), "over the limit"),
        (struct.pack("<B3xI", 1, 2) + struct.pack("<Q", 5), "too short for 2 frames"),
        (struct.pack("<B3xIQ", 1, 1, (1 << 63) | 10) + b"abc", "past the end"),
        (struct.pack("<B3xIQ", 1, 1, 3) + b"abc", "stray bytes"),
        (struct.pack("<B3xIQ", 1, 1, 1 << 50), "frame size"),
    ],
)
def test_malformed_headers_are_rejected(message: bytes, match: str) -> None:
    with pytest.raises(FramingError, match=match):
        decode_header(message)


def test_end_of_stream_before_and_inside_a_message() -> None:
    async def main() -> None:
        a, b = endpoint_pair()
        header, _ = encode_header([memoryview(b"x" * 100_000)])
        await a.send(header)
        await a.send(b"x" * 1000)
        a.close()
        with pytest.raises(EOFError, match="1000 of 100000"):
            await read_frames(b)
        assert await read_frames(b) is None

    asyncio.run(main())


# --- the comm over the fake endpoint ----------------------------------------------------------------


async def _comm_pair() -> tuple[RDMAComm, RDMAComm, FakeEndpoint, FakeEndpoint]:
    a, b = endpoint_pair()
    ca = RDMAComm(a, "rdma://10.0.0.1:1", "rdma://10.0.0.2:2")  # type: ignore[arg-type]
    cb = RDMAComm(b, "rdma://10.0.0.2:2", "rdma://10.0.0.1:1")  # type: ignore[arg-type]
    return ca, cb, a, b


def test_comm_roundtrip_with_serialisation(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def main() -> None:
        ca, cb, _, _ = await _comm_pair()
        array = np.arange(600_000, dtype="i8")
        msg = {"op": "data", "x": array, "items": list(range(10))}
        from distributed.protocol import to_serialize

        written = await ca.write({**msg, "x": to_serialize(array)})
        assert written > array.nbytes
        got = await cb.read()
        assert got["op"] == "data" and list(got["items"]) == list(range(10))
        np.testing.assert_array_equal(got["x"], array)
        assert got["x"].flags.writeable
        assert ca.extra_info["device"] == "fake0"
        assert repr(ca) == "<RDMAComm  local=rdma://10.0.0.1:1 remote=rdma://10.0.0.2:2>"

    arun(main())


def test_comm_chunks_by_the_peers_max_message_size(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def main() -> None:
        a, b = endpoint_pair()
        a.extra["peer_max_message_size"] = 100_000  # below the default chunk size
        ca = RDMAComm(a, "rdma://10.0.0.1:1", "rdma://10.0.0.2:2")  # type: ignore[arg-type]
        cb = RDMAComm(b, "rdma://10.0.0.2:2", "rdma://10.0.0.1:1")  # type: ignore[arg-type]
        assert ca.extra_info["peer_max_message_size"] == 100_000
        payload = bytes(range(256)) * 1000
        await ca.write(payload)
        assert await cb.read() == payload
        assert max(a.sent_sizes) <= 100_000
        assert sum(size == 100_000 for size in a.sent_sizes) >= 2  # the frame was cut
        with dask.config.set({"distributed.comm.rdma.chunk-size": "64 kiB"}):
            assert chunk_size(100_000) == 65536
            assert chunk_size(None) == 65536
        assert chunk_size(100_000) == 100_000

    arun(main())


def test_comm_close_and_abort_fail_reads(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def main() -> None:
        ca, cb, _, _ = await _comm_pair()
        pending = asyncio.ensure_future(cb.read())
        await asyncio.sleep(0.01)
        await ca.close()
        with pytest.raises(CommClosedError, match="peer closed"):
            await pending
        assert ca.closed() and cb.closed()
        with pytest.raises(CommClosedError):
            await ca.write("x")
        ca2, cb2, _, _ = await _comm_pair()
        pending = asyncio.ensure_future(ca2.read())
        await asyncio.sleep(0.01)
        ca2.abort()
        with pytest.raises(CommClosedError, match="ConnectionAbortedError"):
            await pending
        with pytest.raises(CommClosedError, match="ConnectionResetError"):
            await cb2.read()

    arun(main())


def test_comm_cancelled_read_aborts(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def main() -> None:
        ca, cb, a, _ = await _comm_pair()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ca.read(), 0.05)
        assert ca.closed() and a.error is not None
        with pytest.raises(CommClosedError, match="ConnectionResetError"):
            await cb.read()

    arun(main())


def test_dropped_comm_aborts_its_endpoint(
    arun: Callable[[Coroutine[Any, Any, None]], None], caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        ca, cb, a, _ = await _comm_pair()
        del ca
        await asyncio.sleep(0)  # the finalizer schedules the abort on the loop
        assert a.error is not None
        assert "never closed" in caplog.text
        with pytest.raises(CommClosedError, match="ConnectionResetError"):
            await cb.read()

    arun(main())


def test_concurrent_writes_do_not_interleave(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def main() -> None:
        ca, cb, _, _ = await _comm_pair()
        from distributed.protocol import to_serialize

        payloads = [bytes([i]) * 300_000 for i in range(4)]
        await asyncio.gather(*(ca.write({"i": i, "b": to_serialize(p)}) for i, p in enumerate(payloads)))
        for _ in payloads:
            got = await cb.read()
            assert bytes(got["b"]) == payloads[got["i"]]

    arun(main())


# --- limits on what a peer may declare ----------------------------------------------------------------


def _forged_header(*sizes: int) -> bytes:
    """A header declaring separate frames of these sizes (what a hostile peer sends; no data follows)."""
    return struct.pack(f"<B3xI{len(sizes)}Q", 1, len(sizes), *sizes)


@pytest.mark.parametrize(
    ("header", "limits", "match"),
    [
        (_forged_header(32 << 40), FrameLimits(1 << 30, 16 << 30), "frame of 35184372088832 bytes"),
        (_forged_header(1 << 20, 1 << 20, 1 << 20), FrameLimits(1 << 20, 2 << 20), "message of 3145728"),
        (  # inline bytes count towards the message too
            struct.pack("<B3xI2Q", 1, 2, (1 << 63) | 4, 1 << 20) + b"abcd",
            FrameLimits(1 << 20, 1 << 20),
            "message of 1048580",
        ),
    ],
)
def test_limits_are_checked_before_anything_is_allocated(
    header: bytes, limits: FrameLimits, match: str
) -> None:
    async def main() -> None:
        a, b = endpoint_pair()
        await a.send(header)
        allocations: list[int] = []

        def allocate(n: int) -> memoryview:
            allocations.append(n)
            return memoryview(bytearray(n))

        with pytest.raises(FrameLimitError, match=match) as info:
            await read_frames(b, allocate, limits)
        assert allocations == []
        assert isinstance(info.value, rdmaio.MessageTooLargeError) and isinstance(info.value, ValueError)

    asyncio.run(main())


def test_limits_at_the_bound_are_accepted() -> None:
    async def main() -> None:
        a, b = endpoint_pair()
        frames = [b"x" * 100, bytes(range(256)) * 1024]  # 100 B inline + 256 KiB separate
        await write_frames(a, frames)
        got = await read_frames(b, None, FrameLimits(256 * 1024, 256 * 1024 + 100))
        assert got is not None and [bytes(f) for f in got] == frames

    asyncio.run(main())


def test_config_defaults_are_registered_and_user_settings_win() -> None:
    assert dask.config.get("distributed.comm.rdma.max-frame-size") == "1GiB"
    assert dask.config.get("distributed.comm.rdma.max-message-size") == "16GiB"
    assert dask.config.get("distributed.comm.rdma.write-queue-limit") == "256MiB"
    limits = frame_limits()
    assert (limits.max_frame_size, limits.max_message_size) == (1 << 30, 16 << 30)
    assert limits.frame_size_name == "distributed.comm.rdma.max-frame-size"
    with dask.config.set({"distributed.comm.rdma.max-frame-size": "4 MiB"}):
        load_defaults()  # registering again does not override what the user set
        assert frame_limits().max_frame_size == 4 << 20
    with (
        dask.config.set({"distributed.comm.rdma.max-message-size": 0}),
        pytest.raises(ValueError, match="max-message-size must be positive"),
    ):
        frame_limits()
    with (
        dask.config.set({"distributed.comm.rdma.write-queue-limit": "lots"}),
        pytest.raises(ValueError, match="write-queue-limit must be a byte size"),
    ):
        asyncio.run(_comm_pair())


async def _hostile_pair(**config: Any) -> tuple[RDMAComm, FakeEndpoint, FakeEndpoint]:
    a, b = endpoint_pair()
    with dask.config.set({f"distributed.comm.rdma.{key}": value for key, value in config.items()}):
        comm = RDMAComm(b, "rdma://10.0.0.2:2", "rdma://10.0.0.1:1")  # type: ignore[arg-type]
    return comm, a, b


@pytest.mark.parametrize(
    ("header", "config", "match"),
    [
        (_forged_header(32 << 40), {}, r"over distributed\.comm\.rdma\.max-frame-size"),
        (_forged_header(16 << 30), {}, r"over distributed\.comm\.rdma\.max-frame-size"),
        (_forged_header(3 << 20), {"max-frame-size": "2MiB"}, "max-frame-size"),
        (_forged_header(1 << 20, 1 << 20), {"max-message-size": "1MiB"}, "max-message-size"),
        (_forged_header(1 << 50), {}, "FramingError"),  # past the format's own bound
        (b"\x07\x00\x00\x00\x00\x00\x00\x00", {}, "version 7"),
    ],
)
def test_comm_read_turns_forged_headers_into_comm_closed(
    arun: Callable[[Coroutine[Any, Any, None]], None],
    monkeypatch: pytest.MonkeyPatch,
    header: bytes,
    config: dict[str, Any],
    match: str,
) -> None:
    allocations: list[int] = []
    monkeypatch.setattr(rdmaio.dask.comm, "host_array", lambda n: allocations.append(n) or bytearray(n))

    async def main() -> None:
        comm, hostile, _ = await _hostile_pair(**config)
        await hostile.send(header)
        with pytest.raises(CommClosedError, match=match) as info:
            await comm.read()
        assert isinstance(info.value.__cause__, FramingError)
        assert comm.closed() and comm.endpoint is None
        assert allocations == []
        with pytest.raises(rdmaio.ConnectionResetError):  # the hostile peer's connection is gone
            await hostile.recv()

    arun(main())


def test_comm_read_turns_a_failed_allocation_into_comm_closed(
    arun: Callable[[Coroutine[Any, Any, None]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(n: int) -> memoryview:
        raise MemoryError(f"Unable to allocate {n} bytes")

    monkeypatch.setattr(rdmaio.dask.comm, "host_array", refuse)

    async def main() -> None:
        comm, hostile, _ = await _hostile_pair(**{"max-frame-size": "64TiB", "max-message-size": "64TiB"})
        await hostile.send(_forged_header(32 << 40))
        with pytest.raises(CommClosedError, match="MemoryError") as info:
            await comm.read()
        assert isinstance(info.value.__cause__, MemoryError)
        assert comm.closed()

    arun(main())


# --- the write queue ------------------------------------------------------------------------------------


async def _rendezvous_pair(**config: Any) -> tuple[RDMAComm, RDMAComm, FakeEndpoint, FakeEndpoint]:
    """A comm pair whose large sends return only once the peer read them."""
    a, b = endpoint_pair()
    a.rendezvous_from = b.rendezvous_from = 256 * 1024
    with dask.config.set({f"distributed.comm.rdma.{key}": value for key, value in config.items()}):
        ca = RDMAComm(a, "rdma://10.0.0.1:1", "rdma://10.0.0.2:2")  # type: ignore[arg-type]
        cb = RDMAComm(b, "rdma://10.0.0.2:2", "rdma://10.0.0.1:1")  # type: ignore[arg-type]
    return ca, cb, a, b


def _three_4mib_frames() -> tuple[bytes, dict[str, Any]]:
    from distributed.protocol import to_serialize

    data = bytes(range(256)) * (1 << 14)  # 4 MiB
    return data, {"x": to_serialize(data), "y": to_serialize(data), "z": to_serialize(data)}


def test_write_returns_before_the_peer_reads(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    """A message of three 4 MiB frames, written before the peer reads (distributed's roundtrip check)."""

    async def main() -> None:
        ca, cb, a, _ = await _rendezvous_pair()
        data, msg = _three_4mib_frames()
        written = await asyncio.wait_for(ca.write(msg), 5)
        assert written > 3 * len(data)
        stats = ca.write_queue_statistics()
        assert stats["messages"] == 1 and stats["bytes"] == written
        got = await cb.read()
        assert [bytes(got[k]) for k in "xyz"] == [data] * 3
        await cb.write(got)  # and back, the same way
        got = await ca.read()
        assert [bytes(got[k]) for k in "xyz"] == [data] * 3
        assert ca.write_queue_statistics()["bytes"] == 0 and cb.write_queue_statistics()["bytes"] == 0
        assert sum(size >= 4 << 20 for size in a.sent_sizes) == 3

    arun(main())


def test_write_queue_limit_holds_back_a_writer_that_outpaces_its_peer(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def main() -> None:
        ca, cb, _, _ = await _rendezvous_pair(**{"write-queue-limit": "6MiB"})
        _, msg = _three_4mib_frames()
        await asyncio.wait_for(ca.write(msg), 5)  # over the limit alone: an empty queue takes it
        second = asyncio.ensure_future(ca.write({"n": 2}))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()  # 12 MiB queued: the next message waits for room
        stats = ca.write_queue_statistics()
        assert stats["messages"] == 1 and stats["limit"] == 6 << 20
        await cb.read()
        await asyncio.wait_for(second, 5)
        assert (await cb.read()) == {"n": 2}

    arun(main())


def test_cancelled_write_queues_nothing_and_keeps_the_comm(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def main() -> None:
        ca, cb, _, _ = await _rendezvous_pair(**{"write-queue-limit": "1MiB"})
        _, msg = _three_4mib_frames()
        await ca.write(msg)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ca.write({"lost": True}), 0.05)
        assert not ca.closed() and ca.write_queue_statistics()["messages"] == 1
        await cb.read()
        await ca.write({"n": 3})
        assert (await cb.read()) == {"n": 3}

    arun(main())


@pytest.mark.parametrize("surfaces_on", ["write", "close"])
def test_a_failed_background_send_surfaces_on_the_next_write_or_close(
    arun: Callable[[Coroutine[Any, Any, None]], None], surfaces_on: str
) -> None:
    async def main() -> None:
        ca, cb, a, _ = await _rendezvous_pair()
        _, msg = _three_4mib_frames()
        await ca.write(msg)
        cb.abort()  # the peer goes while the message waits for it
        for _ in range(20):
            await asyncio.sleep(0)
        assert ca.closed() and a.error is not None
        with pytest.raises(CommClosedError, match="not sent") as info:
            if surfaces_on == "write":
                await ca.write({"n": 1})
            else:
                await ca.close()
        assert isinstance(info.value.__cause__, rdmaio.ConnectionResetError)
        await ca.close()  # reported once
        with pytest.raises(CommClosedError, match="the comm is closed"):
            await ca.write({"n": 2})

    arun(main())


def test_close_sends_the_queue_first(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def main() -> None:
        ca, cb, _, _ = await _rendezvous_pair()
        data, msg = _three_4mib_frames()
        await ca.write(msg)
        await ca.write({"n": 1})
        closing = asyncio.ensure_future(ca.close())
        got = await cb.read()
        assert bytes(got["z"]) == data and (await cb.read()) == {"n": 1}
        await asyncio.wait_for(closing, 5)
        with pytest.raises(CommClosedError, match="peer closed"):
            await cb.read()

    arun(main())


def test_close_gives_up_on_a_peer_that_never_reads(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def main() -> None:
        ca, cb, a, _ = await _rendezvous_pair()
        a.options = rdmaio.Options(close_timeout=0.05)
        _, msg = _three_4mib_frames()
        await ca.write(msg)
        with pytest.raises(CommClosedError, match="not sent"):
            await asyncio.wait_for(ca.close(), 5)
        assert ca.closed() and a.error is not None
        assert ca.write_queue_statistics() == {
            "messages": 0,
            "bytes": 0,
            "limit": 256 << 20,
            "pieces_sent": 1,
        }
        with pytest.raises(CommClosedError):
            await cb.read()

    arun(main())


def test_abort_drops_the_queue_quietly(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def main() -> None:
        ca, _, a, _ = await _rendezvous_pair()
        _, msg = _three_4mib_frames()
        await ca.write(msg)
        ca.abort()
        await asyncio.sleep(0)
        assert ca.write_queue_statistics()["messages"] == 0 and a.error is not None
        await ca.close()  # the caller dropped the queue itself: nothing to report
        with pytest.raises(CommClosedError, match="the comm is closed"):
            await ca.write({"n": 1})

    arun(main())


def test_encryption_required_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not encrypted"):
        RDMAListener("10.0.0.1:0", lambda comm: asyncio.sleep(0), require_encryption=True)  # type: ignore[arg-type,return-value]


# --- addressing -------------------------------------------------------------------------------------


def _fake_sysfs(root: Path, gids: dict[str, list[str]], state: str | None = None) -> None:
    for device, entries in gids.items():
        gid_dir = root / device / "ports" / "1" / "gids"
        gid_dir.mkdir(parents=True)
        if state is not None:
            (gid_dir.parent / "state").write_text(state + "\n")
        for index, gid in enumerate(entries):
            (gid_dir / str(index)).write_text(gid + "\n")


def test_sysfs_addresses_and_rdma_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    # a DOWN port's address sorts last, even though its device comes first
    _fake_sysfs(tmp_path, {"mlx5_0": ["0000:0000:0000:0000:0000:ffff:0a00:0009"]}, state="1: DOWN")
    _fake_sysfs(
        tmp_path,
        {
            "rxe0": [
                "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                "0000:0000:0000:0000:0000:ffff:c612:0001",
                "0000:0000:0000:0000:0000:ffff:c612:0001",
                "0000:0000:0000:0000:0000:ffff:c612:0002",
                zero,
            ]
            + [zero] * 6,  # index 10 and 11 sort after 2, not before
            "rxe1": ["0000:0000:0000:0000:0000:ffff:0a00:0005"],
        },
        state="4: ACTIVE",
    )
    addresses = addressing.sysfs_ipv4_addresses(tmp_path)
    assert addresses == ["198.18.0.1", "198.18.0.2", "10.0.0.5", "10.0.0.9"]
    assert addressing.sysfs_ipv4_addresses(tmp_path / "missing") == []
    monkeypatch.setattr(addressing, "SYSFS_INFINIBAND", tmp_path)
    with dask.config.set({"distributed.comm.rdma.host": None}):
        assert addressing.rdma_host() == "198.18.0.1"
    with dask.config.set({"distributed.comm.rdma.host": "10.0.0.5"}):
        assert addressing.rdma_host() == "10.0.0.5"
    monkeypatch.setattr(addressing, "SYSFS_INFINIBAND", tmp_path / "missing")
    with pytest.raises(OSError, match=r"distributed\.comm\.rdma\.host"):
        addressing.rdma_host()


def test_iwarp_ports_take_the_address_of_the_interface_with_their_mac(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # siw (and iWARP NICs) fill the GID table with the port's MAC address, no IPv4 address: the RDMA host
    # is the address of the network interface with that MAC address (siw0 on dum0 in the test host).
    infiniband, net = tmp_path / "infiniband", tmp_path / "net"
    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    _fake_sysfs(infiniband, {"siw0": ["5254:0012:3456:0000:0000:0000:0000:0000", zero]}, state="4: ACTIVE")
    (infiniband / "siw0" / "node_type").write_text("4: RNIC\n")
    for netdev, mac in {
        "eth0": "52:54:00:aa:bb:cc",
        "dum0": "52:54:00:12:34:56",
        "dum1": "52:54:00:12:34:56",
    }.items():
        (net / netdev).mkdir(parents=True)
        (net / netdev / "address").write_text(mac + "\n")
    real_lookup = getattr(addressing, "interface_ipv4", None)
    addresses = {"eth0": "10.0.2.15", "dum0": "198.18.0.1", "dum1": None}
    monkeypatch.setattr(addressing, "interface_ipv4", addresses.get, raising=False)
    monkeypatch.setattr(addressing, "SYSFS_NET", net, raising=False)
    assert addressing.sysfs_ipv4_addresses(infiniband) == ["198.18.0.1"]
    monkeypatch.setattr(addressing, "SYSFS_INFINIBAND", infiniband)
    with dask.config.set({"distributed.comm.rdma.host": None}):
        assert addressing.rdma_host() == "198.18.0.1"
    # the same GID on a RoCE device (no RNIC node type) is a link-local GID, not a MAC: no address from it
    (infiniband / "siw0" / "node_type").write_text("1: CA\n")
    assert addressing.sysfs_ipv4_addresses(infiniband) == []
    assert real_lookup is not None and real_lookup("lo") == "127.0.0.1"  # the real lookup (an ioctl)


def test_backend_address_handling() -> None:
    backend = RDMABackend()
    assert backend.get_address_host("198.18.0.1:8786") == "198.18.0.1"
    assert backend.get_address_host_port("198.18.0.1:8786") == ("198.18.0.1", 8786)
    assert backend.resolve_address("localhost:80") == "127.0.0.1:80"
    assert addressing.is_loopback("127.0.0.2") and addressing.is_loopback("::1")
    assert not addressing.is_loopback("198.18.0.1")
    assert addressing.is_wildcard("") and addressing.is_wildcard("0.0.0.0")
    with dask.config.set({"distributed.comm.rdma.host": "198.18.0.1"}):
        assert backend.get_local_address_for("127.0.0.1:8786") == "198.18.0.1"


# --- python -m bench --only dask --------------------------------------------------------------------


def test_bench_dask_table_and_options() -> None:
    from bench import dask as dask_bench

    args = dask_bench.build_parser().parse_args(["--sizes", "1,64", "--loop", "uvloop", "--reps", "5"])
    assert args.sizes == [1, 64] and args.loops == ["uvloop"] and args.reps == 5
    assert args.protocols == ["tcp", "rdma"]
    results = {
        "tcp": {"transfer 1 MiB": 0.5, "shuffle 10 rows": 2.0},
        "rdma": {"transfer 1 MiB": 0.25, "shuffle 10 rows": 4.0},
    }
    table = dask_bench.render_table(results, "uvloop", args).splitlines()
    assert table[0] == "loop: uvloop, host: 198.18.0.1, median of 5"
    assert table[4] == "| transfer 1 MiB | 500.0 ms (2.0 MiB/s) | 250.0 ms (4.0 MiB/s) | 2.00x tcp's speed |"
    assert table[5] == "| shuffle 10 rows | 2000.0 ms | 4000.0 ms | 0.50x tcp's speed |"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--only", "dask,stream"], "runs alone"),
        (["--only", "dask", "--sizes", "64K"], "whole MiB"),
        (["--only", "dask", "--json", "x.json"], "table only"),
    ],
)
def test_bench_only_dask_rejects(argv: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.driver import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert error in capsys.readouterr().err


def test_bench_only_dask_passes_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import dask as dask_bench
    from bench.driver import main

    seen: list[list[str]] = []
    monkeypatch.setattr(dask_bench, "main", lambda argv: seen.append(list(argv)) or 0)
    assert main(["--only", "dask", "--sizes", "1M,16M", "--reps", "2", "--host", "198.18.0.2"]) == 0
    assert main(["--only", "dask", "--quick"]) == 0
    assert main(["--only", "dask", "--quick", "--sizes", "4M"]) == 0
    assert seen[0] == ["--host", "198.18.0.2", "--reps", "2", "--sizes", "1,16"]
    assert seen[1][-4:] == ["--sizes", "1,16", "--rows", "50000"] and seen[1][3] == "1"
    assert seen[2][-4:] == ["--sizes", "4", "--rows", "50000"]
