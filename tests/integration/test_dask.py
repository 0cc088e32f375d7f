"""The ``rdma://`` comm backend of Dask distributed, over Soft-RoCE: comms, then real clusters.

The comm tests cover what distributed's own ``test_comms.py`` checks for a backend, mirrored here since
its ``check_*`` helpers are not shipped in its wheel: client/server with concurrent clients
(``check_client_server``), implicit and explicit close (``check_comm_closed_implicit``/``_explicit``),
connect failures and timeouts (``check_connect_timeout``), many listeners (``check_many_listeners``),
the ``deserialize`` flag on listeners and connectors (``check_deserialize``), a round trip of three
4 MiB frames written before the peer reads (``check_deserialize_roundtrip``), an ``EOFError`` while
deserialising (``check_deserialize_eoferror``), addresses and ``repr``; plus loading through the entry
point, the write queue (close flushes it, a peer that never reads cannot hang close) and hostile
peers that forge frame headers. They run on asyncio and uvloop (``arun``).

The cluster tests run ``LocalCluster(protocol="rdma", processes=True)`` with every process on asyncio, then
on uvloop (one cluster per loop, shared by the tests that use it) and a scheduler and two workers started
as separate ``dask`` CLI processes, the scheduler and one worker on asyncio and the other worker on
uvloop. distributed picks its event loop from the config ``distributed.admin.event-loop``, which its
worker processes inherit from the nanny and the CLI reads from ``DASK_DISTRIBUTED__ADMIN__EVENT_LOOP``.
Importing distributed, numpy and pandas is slow in the test host's VM, so the data are small and the
processes few.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask_tasks import loop_module, square_unless_victim
from distributed import Client, LocalCluster
from distributed.comm import connect, listen, parse_address, parse_host_port
from distributed.comm.core import Comm, CommClosedError
from distributed.protocol import Serialized, deserialize, serialize, to_serialize
from loops import Runner, arun

import rdmaio
import rdmaio.dask.comm
from rdmaio.dask import RDMABackend, RDMAComm

pytestmark = pytest.mark.timeout(900)


async def _echo(comm: Comm) -> None:
    """Listener handler: send every message back until the peer goes."""
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass


# --- comms ------------------------------------------------------------------------------------------


def test_entry_point_loads_in_a_fresh_process() -> None:
    """distributed finds the backend through the entry point; nothing imports rdmaio beforehand."""
    code = (
        "import sys\n"
        "from distributed.comm.registry import get_backend\n"
        "assert not any(m.startswith('rdmaio') for m in sys.modules), 'rdmaio imported early'\n"
        "backend = get_backend('rdma')\n"
        "print(type(backend).__module__, type(backend).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["rdmaio.dask.comm", "RDMABackend"]


def test_roundtrip_small_and_4mb_with_serialisation(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server_comms: list[Comm] = []

        async def handler(comm: Comm) -> None:
            server_comms.append(comm)
            await _echo(comm)

        async with listen(f"rdma://{rdma_addr}:0", handler) as listener:
            assert listener.contact_address.startswith(f"rdma://{rdma_addr}:")
            comm = await connect(listener.contact_address)
            assert isinstance(comm, RDMAComm)
            small = {"op": "ping", "values": [1, 2.5, "three", None], "nested": {"a": b"bytes"}}
            assert await comm.write(small) > 0
            got = await comm.read()
            assert got["op"] == "ping" and list(got["values"]) == [1, 2.5, "three", None]
            assert got["nested"] == {"a": b"bytes"}
            array = np.random.default_rng(0).random(512 * 1024)  # 4 MiB of float64
            written = await comm.write({"op": "data", "x": to_serialize(array)})
            assert written >= array.nbytes
            got = await comm.read()
            np.testing.assert_array_equal(got["x"], array)
            assert got["x"].flags.writeable  # received into a buffer of its own, not a bytes object
            for i in range(50):  # many small messages, in order
                await comm.write({"i": i})
            assert [(await comm.read())["i"] for _ in range(50)] == list(range(50))
            # addresses agree on both ends, and the handshake saw them
            (server_comm,) = server_comms
            assert comm.peer_address == listener.contact_address
            assert server_comm.peer_address == comm.local_address
            assert server_comm.local_address == listener.contact_address
            assert comm.remote_info["address"] == comm.peer_address
            assert comm.extra_info["device"] and comm.extra_info["qp_num"] > 0
            assert repr(comm).startswith("<RDMAComm ") and comm.peer_address in repr(comm)
            assert not comm.closed()
            await comm.close()
            assert comm.closed() and "(closed)" in repr(comm)

    arun(main())


def test_frames_are_cut_at_the_peers_max_message_size(arun: Runner[Any], rdma_addr: str) -> None:
    """A listener that accepts at most 1 MiB per message still gets 3 MiB frames: the client reads the
    limit from the handshake (``peer_max_message_size``) and cuts the frame into 1 MiB chunks."""

    async def main() -> None:
        options = "distributed.comm.rdma.options"
        with dask.config.set({options: {"max_message_size": 1 << 20}}):  # read when the listener starts
            async with listen(f"rdma://{rdma_addr}:0", _echo) as listener:
                with dask.config.set({options: {}}):  # default options here: 64 MiB accepted
                    comm = await connect(listener.contact_address)
                await _check(comm)

    async def _check(comm: Comm) -> None:
        assert isinstance(comm, RDMAComm)
        assert comm.extra_info["peer_max_message_size"] == 1 << 20
        array = np.arange(3 * (1 << 20) // 8, dtype="i8")  # 3 MiB, one frame
        await comm.write({"x": to_serialize(array)})
        np.testing.assert_array_equal((await comm.read())["x"], array)  # the echo: all of it arrived
        endpoint = comm.endpoint
        assert endpoint is not None and endpoint.statistics()["messages_sent"] >= 4  # header + 3 chunks
        await comm.close()

    arun(main())


def test_implicit_close_fails_the_peers_read(arun: Runner[Any], rdma_addr: str) -> None:
    """The server closes its end after one message: the client's read in flight fails."""

    async def main() -> None:
        async def handler(comm: Comm) -> None:
            await comm.read()
            await comm.close()

        async with listen(f"rdma://{rdma_addr}:0", handler) as listener:
            comm = await connect(listener.contact_address)
            reading = asyncio.ensure_future(comm.read())
            await comm.write({"op": "bye"})
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(reading, 30)
            assert comm.closed()
            with pytest.raises(CommClosedError):
                await comm.write({"op": "again"})

        # check_comm_closed_implicit: the server closes at once; a write then a read, or a read, fails
        async def closing_handler(comm: Comm) -> None:
            await comm.close()

        async with listen(f"rdma://{rdma_addr}:0", closing_handler) as listener:
            comm = await connect(listener.contact_address)
            with pytest.raises(CommClosedError):
                await comm.write({})
                await asyncio.wait_for(comm.read(), 60)
            comm = await connect(listener.contact_address)
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.read(), 60)

    arun(main())


def test_explicit_close_and_abort_with_reads_in_flight(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        server_errors: asyncio.Queue[BaseException] = asyncio.Queue()

        async def handler(comm: Comm) -> None:
            try:
                await comm.read()
            except CommClosedError as exc:
                await server_errors.put(exc)

        async with listen(f"rdma://{rdma_addr}:0", handler) as listener:
            for how in ("close", "abort"):
                comm = await connect(listener.contact_address)
                reading = asyncio.ensure_future(comm.read())
                await asyncio.sleep(0.05)
                if how == "close":
                    await comm.close()
                else:
                    comm.abort()
                with pytest.raises(CommClosedError):
                    await asyncio.wait_for(reading, 30)
                assert isinstance(await asyncio.wait_for(server_errors.get(), 30), CommClosedError)
                assert comm.closed()
                with pytest.raises(CommClosedError):
                    await comm.read()

        # check_comm_closed_explicit and check_repr/check_addresses, on a pair
        a, b = await _comm_pair(f"rdma://{rdma_addr}:0")
        assert a.peer_address == b.local_address and a.local_address == b.peer_address
        assert "closed" not in repr(a) and "closed" not in repr(b)
        a_read = asyncio.ensure_future(a.read())
        b_read = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.05)
        await asyncio.wait_for(a.close(), 60)
        assert "closed" in repr(a) and a.local_address in repr(a) and b.local_address in repr(a)
        for pending in (a_read, b_read):
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(pending, 60)
        for comm in (a, b):
            with pytest.raises(CommClosedError):
                await comm.read()
        for comm in (a, b):
            with pytest.raises(CommClosedError):
                await comm.write({})
        await b.close()
        assert "closed" in repr(b) and b.peer_address in repr(b)

    arun(main())


def test_connect_refused_and_timeout(arun: Runner[Any], rdma_addr: str) -> None:
    """Nobody listens: distributed retries the refused attempts, then raises an OSError at its timeout."""

    async def main() -> None:
        listener = listen(f"rdma://{rdma_addr}:0", _echo)
        await listener.start()
        address = listener.contact_address
        listener.stop()  # the port is known and nobody listens on it any more
        # one attempt: refused at once, as an OSError (CommClosedError) that distributed retries
        with pytest.raises(CommClosedError, match="cannot connect") as info:
            await RDMABackend().get_connector().connect(address.removeprefix("rdma://"))
        assert isinstance(info.value.__cause__, ConnectionRefusedError)
        # distributed's connect() retries until its timeout, then raises an OSError
        with pytest.raises(OSError, match="Timed out trying to connect"):
            await connect(address, timeout=1)
        with pytest.raises(OSError):  # check_connect_timeout's budget (its duration is not asserted)
            await connect(address, timeout=0.15)

    arun(main())


def test_many_listeners(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> None:
        listeners = [listen(f"rdma://{rdma_addr}:0", _echo) for _ in range(10)]
        await asyncio.gather(*(listener.start() for listener in listeners))
        try:
            addresses = {listener.contact_address for listener in listeners}
            assert len(addresses) == 10
            comms = await asyncio.gather(*(connect(address) for address in sorted(addresses)))
            for i, comm in enumerate(comms):
                await comm.write(i)
            assert [await comm.read() for comm in comms] == list(range(10))
            await asyncio.gather(*(comm.close() for comm in comms))
        finally:
            for listener in listeners:
                listener.stop()
        # check_many_listeners: 100 listeners (handler does nothing), each with its own addresses
        with dask.config.set({"distributed.comm.rdma.host": rdma_addr}):
            for address in (f"rdma://{rdma_addr}", "rdma://0.0.0.0", "rdma://"):
                many = [await listen(address, _ignore) for _ in range(100)]
                try:
                    assert len({listener.listen_address for listener in many}) == 100
                    assert len({listener.contact_address for listener in many}) == 100
                finally:
                    for listener in many:
                        listener.stop()

    arun(main())


def test_wildcard_and_loopback_listeners_advertise_the_rdma_address(
    arun: Runner[Any], rdma_addr: str
) -> None:
    async def main() -> None:
        with dask.config.set({"distributed.comm.rdma.host": rdma_addr}):
            for host in ("0.0.0.0", "127.0.0.1"):
                async with listen(f"rdma://{host}:0", _echo) as listener:
                    assert listener.listen_address.startswith(
                        f"rdma://{host if host != '127.0.0.1' else rdma_addr}:"
                    )
                    assert listener.contact_address.startswith(f"rdma://{rdma_addr}:")
                    comm = await connect(listener.contact_address)
                    await comm.write("hello")
                    assert await comm.read() == "hello"
                    await comm.close()

    arun(main())


async def _ignore(comm: Comm) -> None:
    """Listener handler that does nothing with the comm."""


async def _comm_pair(address: str, **kwargs: Any) -> tuple[Comm, Comm]:
    """A connected (client, server) pair of comms, after distributed's handshake (as get_comm_pair)."""
    accepted: asyncio.Queue[Comm] = asyncio.Queue()
    async with listen(address, accepted.put, **kwargs) as listener:
        client = await connect(listener.contact_address, **kwargs)
    return client, await asyncio.wait_for(accepted.get(), 60)


def test_client_server_with_concurrent_clients(arun: Runner[Any], rdma_addr: str) -> None:
    """check_client_server: two writes before a read, 1 then 20 concurrent clients, unknown connection
    arguments ignored, on a specific, a wildcard and an empty host."""

    async def check(address: str, listen_host: str) -> None:
        async def handler(comm: Comm) -> None:
            try:
                assert parse_address(comm.peer_address)[0] == "rdma"
                msg = await comm.read()
                assert msg["op"] == "ping"
                await comm.write({**msg, "op": "pong"})
                assert (await comm.read())["op"] == "foobar"
            finally:
                await comm.close()

        listener = await listen(address, handler, xxx="bar")
        try:
            scheme, loc = parse_address(listener.listen_address)
            assert scheme == "rdma"
            host, port = parse_host_port(loc)
            assert host == listen_host and 1023 < port < 65536
            contact = parse_host_port(parse_address(listener.contact_address)[1])
            assert contact == (rdma_addr, port)
            done: list[int] = []

            async def client(key: int, delay: float = 0) -> None:
                comm = await connect(listener.contact_address, xxx="foo")
                try:
                    assert comm.peer_address == listener.contact_address
                    await comm.write({"op": "ping", "data": key})
                    await comm.write({"op": "foobar"})
                    if delay:
                        await asyncio.sleep(delay)
                    assert await comm.read() == {"op": "pong", "data": key}
                    done.append(key)
                finally:
                    await comm.close()

            await client(1234)
            await asyncio.gather(*(client(i, 0.05) for i in range(20)))
            assert set(done) == {1234, *range(20)}
        finally:
            listener.stop()

    async def main() -> None:
        with dask.config.set({"distributed.comm.rdma.host": rdma_addr}):
            await check(f"rdma://{rdma_addr}", rdma_addr)
            await check("rdma://0.0.0.0", "0.0.0.0")
            await check("rdma://", "0.0.0.0")  # an empty host listens on every interface

    arun(main())


def test_deserialize_flag_of_listener_and_connector(arun: Runner[Any], rdma_addr: str) -> None:
    """check_deserialize: with ``deserialize=False`` the receiver gets ``Serialized`` objects (or the
    ``to_serialize`` wrapper), with True the values; small messages and 4 MiB bytestrings."""

    async def via_listener(flag: bool, msg: dict[str, Any]) -> dict[str, Any]:
        got: asyncio.Queue[Any] = asyncio.Queue()

        async def handler(comm: Comm) -> None:
            try:
                await got.put(await comm.read())
            except Exception as exc:
                await got.put(exc)
            finally:
                await comm.close()

        async with listen(f"rdma://{rdma_addr}:0", handler, deserialize=flag) as listener:
            comm = await connect(listener.contact_address)
        await comm.write(msg)
        out = await asyncio.wait_for(got.get(), 120)
        await comm.close()
        if isinstance(out, Exception):
            raise out
        assert isinstance(out, dict)
        return out

    async def via_connector(flag: bool, msg: dict[str, Any]) -> dict[str, Any]:
        done = asyncio.Event()

        async def handler(comm: Comm) -> None:
            try:
                await comm.write(msg)
                await done.wait()
            finally:
                await comm.close()

        async with listen(f"rdma://{rdma_addr}:0", handler) as listener:
            comm = await connect(listener.contact_address, deserialize=flag)
        try:
            out = await asyncio.wait_for(comm.read(), 120)
            done.set()
        finally:
            await comm.close()
        assert isinstance(out, dict)
        return out

    def check(out: dict[str, Any], flag: bool, value: Any, plain: Any) -> None:
        out = dict(out)
        to_ser, ser = out.pop("to_ser"), out.pop("ser")
        assert out == {"op": "update", "x": plain}
        if flag:
            if isinstance(value, bytes):  # bytes come back as a bytes-like frame
                assert bytes(ser) == value and [bytes(item) for item in to_ser] == [value]
            else:
                assert list(to_ser) == [value] and ser == value
            return
        assert isinstance(ser, Serialized) and deserialize(ser.header, ser.frames) == value
        (item,) = to_ser
        if isinstance(item, Serialized):
            assert deserialize(item.header, item.frames) == value
        else:
            assert item == to_serialize(value)

    async def main() -> None:
        big = os.urandom(1 << 20) * 4
        for value, plain in ((456, b"abc"), (big, big)):
            msg = {
                "op": "update",
                "x": plain,
                "to_ser": [to_serialize(value)],
                "ser": Serialized(*serialize(value)),
            }
            for flag in (False, True):
                for via in (via_listener, via_connector):
                    check(await via(flag, msg), flag, value, plain)

    arun(main())


def test_write_of_three_4mib_frames_does_not_wait_for_the_peers_read(
    arun: Runner[Any], rdma_addr: str
) -> None:
    """check_deserialize_roundtrip: a message of three 4 MiB frames is written before the peer reads.

    The frames go by rendezvous (``send()`` returns once the peer pulled them), and the receiving
    endpoint does not pull 12 MiB on its own, so a ``write()`` that waited for its frames to be sent
    would wait for the peer's ``read()``, which comes after it: the comm queues and returns."""

    async def main() -> None:
        data = os.urandom(1 << 20) * 4
        msg = {
            "op": "update",
            "x": data,
            "to_ser": [to_serialize(data)],
            "ser": Serialized(*serialize(data)),
        }
        for flag in (True, False):
            a, b = await _comm_pair(f"rdma://{rdma_addr}:0", deserialize=flag)
            written = await asyncio.wait_for(a.write(msg), 60)
            assert written > 3 * len(data)
            got = await asyncio.wait_for(b.read(), 120)
            await asyncio.wait_for(b.write(got), 120)
            got = await asyncio.wait_for(a.read(), 120)
            assert sorted(got) == sorted(msg)
            assert got["op"] == msg["op"] and got["x"] == data
            if flag:
                assert isinstance(got["to_ser"][0], (bytes, bytearray))
                assert isinstance(got["ser"], (bytes, bytearray))
            else:
                assert isinstance(got["to_ser"][0], (to_serialize, Serialized))
                assert isinstance(got["ser"], Serialized)
            assert isinstance(a, RDMAComm) and a.endpoint is not None
            assert a.endpoint.statistics()["rndv_sent"] >= 3  # the premise: the frames went by rendezvous
            await a.close()
            await b.close()

    arun(main())


class _RaisesEOFWhenUnpickled:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _raise_eof, ()


def _raise_eof() -> None:
    raise EOFError


def test_eoferror_while_deserialising_closes_the_comm(arun: Runner[Any], rdma_addr: str) -> None:
    """check_deserialize_eoferror: an EOFError raised by deserialisation closes the comm on both ends."""

    async def main() -> None:
        server_saw: asyncio.Queue[BaseException | None] = asyncio.Queue()

        async def handler(comm: Comm) -> None:
            await comm.write({"data": to_serialize(_RaisesEOFWhenUnpickled())})
            try:
                await comm.read()
            except CommClosedError as exc:
                await server_saw.put(exc)
            else:
                await server_saw.put(None)

        async with listen(f"rdma://{rdma_addr}:0", handler) as listener:
            comm = await connect(listener.contact_address, deserialize=True)
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.read(), 60)
            assert comm.closed()
            assert isinstance(await asyncio.wait_for(server_saw.get(), 60), CommClosedError)

    arun(main())


def test_close_sends_the_queue_and_never_hangs(arun: Runner[Any], rdma_addr: str) -> None:
    """close() right after write() still delivers the message; when the peer never reads, close() gives
    up after the endpoint's close_timeout without progress, aborting, instead of hanging."""

    async def main() -> None:
        data = os.urandom(1 << 20) * 4
        msg = {"x": to_serialize(data), "y": to_serialize(data), "z": to_serialize(data)}
        a, b = await _comm_pair(f"rdma://{rdma_addr}:0")
        await asyncio.wait_for(a.write(msg), 60)
        closing = asyncio.ensure_future(a.close())  # waits for the frames, which b pulls as it reads
        got = await asyncio.wait_for(b.read(), 120)
        await asyncio.wait_for(closing, 120)
        assert bytes(got["z"]) == data
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(b.read(), 60)
        # a peer that never reads: close() stops waiting once nothing moved for close_timeout
        with dask.config.set({"distributed.comm.rdma.options": {"close_timeout": 1.0}}):
            a, b = await _comm_pair(f"rdma://{rdma_addr}:0")
        for _ in range(3):
            await asyncio.wait_for(a.write(msg), 60)
        assert isinstance(a, RDMAComm) and a.write_queue_statistics()["messages"] >= 1
        with pytest.raises(CommClosedError, match="not sent"):
            await asyncio.wait_for(a.close(), 120)
        assert a.closed() and a.write_queue_statistics()["bytes"] == 0
        with pytest.raises(CommClosedError):
            for _ in range(4):  # whatever b had received before, the connection ends
                await asyncio.wait_for(b.read(), 120)

    arun(main())


# --- hostile peers: forged frame headers ------------------------------------------------------------


def _forged_header(*sizes: int) -> bytes:
    """A header message (rdmaio.dask.framing's format, version 1) declaring separate frames of these
    sizes; no data follows it."""
    return struct.pack(f"<B3xI{len(sizes)}Q", 1, len(sizes), *sizes)


@pytest.mark.parametrize(
    ("sizes", "config", "match", "cause"),
    [
        ((32 << 40,), {}, "max-frame-size", rdmaio.MessageTooLargeError),  # 32 TiB, under the format's 64
        ((16 << 30,), {}, "max-frame-size", rdmaio.MessageTooLargeError),
        (
            (1 << 20,) * 3,
            {"max-frame-size": "1MiB", "max-message-size": "2MiB"},
            "max-message-size",
            rdmaio.MessageTooLargeError,
        ),
        ((32 << 40,), {"max-frame-size": "64TiB", "max-message-size": "64TiB"}, "MemoryError", MemoryError),
    ],
    ids=["32TiB-frame", "16GiB-frame", "message-over-limit", "allocation-fails"],
)
def test_forged_headers_close_the_comm_before_allocating(
    arun: Runner[Any],
    rdma_addr: str,
    monkeypatch: pytest.MonkeyPatch,
    sizes: tuple[int, ...],
    config: dict[str, str],
    match: str,
    cause: type[BaseException],
) -> None:
    """A peer (an rdmaio endpoint sending a crafted header) declares frames it never sends: read()
    raises CommClosedError and closes the comm; a declaration over the limits allocates nothing, and an
    allocation that fails (MemoryError) is a closed comm too."""
    allocations: list[int] = []
    real_host_array = rdmaio.dask.comm.host_array

    def recording_host_array(n: int) -> memoryview:
        allocations.append(n)
        if n > 1 << 30:  # what numpy does in a small VM (and, past the address space, anywhere)
            raise MemoryError(f"Unable to allocate {n} bytes")
        return memoryview(real_host_array(n))

    monkeypatch.setattr(rdmaio.dask.comm, "host_array", recording_host_array)

    async def main() -> None:
        allocations.clear()
        server = await rdmaio.listen(rdma_addr, 0)
        try:
            host, port = server.addresses[0]
            keys = {f"distributed.comm.rdma.{key}": value for key, value in config.items()}
            with dask.config.set(keys):
                comm = await RDMABackend().get_connector().connect(f"{host}:{port}")
            peer = await asyncio.wait_for(server.accept(), 60)
            await peer.send(_forged_header(*sizes))
            with pytest.raises(CommClosedError, match=match) as info:
                await asyncio.wait_for(comm.read(), 60)
            assert isinstance(info.value.__cause__, cause)
            assert comm.closed() and comm.endpoint is None
            if cause is MemoryError:
                assert allocations == [sizes[0]]
            else:
                assert allocations == []  # rejected before any frame was allocated
            # the comm aborted its end: the hostile peer's connection ends (reset, or EOF)
            with contextlib.suppress(rdmaio.ConnectionResetError):
                assert await asyncio.wait_for(peer.recv(), 60) is None
            peer.abort()
        finally:
            server.close()

    arun(main())


# --- clusters ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def local_cluster(request: pytest.FixtureRequest) -> Iterator[tuple[str, Client]]:
    """``LocalCluster(protocol="rdma", n_workers=2, processes=True)``, every process on one loop.

    One cluster per loop for the module (pytest runs every test of one parameter before the next
    cluster starts): starting one costs minutes in the VM.
    """
    kind: str = request.param
    with (
        dask.config.set({"distributed.admin.event-loop": kind}),
        LocalCluster(
            protocol="rdma", n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=600)
        yield kind, client


def _scheduler_identity(client: Client) -> dict[str, Any]:
    """The scheduler's identity with every worker, asked now.

    Not ``client.scheduler_info()``: it refreshes the client's cached identity and returns the cache, which
    the client's periodic update (every 2 s, asking for no workers) may overwrite in between, so it can
    return ``workers == {}`` for a cluster with workers (seen in CI: the array test found 0 workers right
    after ``wait_for_workers(2)``, with no worker ever removed)."""
    info: dict[str, Any] = client.sync(client.scheduler.identity, n_workers=-1)
    return info


def _check_rdma_cluster(client: Client, loop_kind: str, n_workers: int) -> dict[str, Any]:
    info = _scheduler_identity(client)
    workers = info["workers"]
    assert info["address"].startswith("rdma://"), info["address"]
    assert len(workers) == n_workers and all(address.startswith("rdma://") for address in workers)
    assert client.run_on_scheduler(loop_module) == loop_kind
    return dict(workers)


def test_local_cluster_array_reduction(local_cluster: tuple[str, Client]) -> None:
    kind, client = local_cluster
    _check_rdma_cluster(client, kind, 2)
    assert set(client.run(loop_module).values()) == {kind}
    x = da.random.default_rng(42).random((1200, 1200), chunks=300)
    # the transpose pairs chunks held by different workers: worker-to-worker transfers over rdma://
    expr = (x + x.T).sum(axis=0) - x.mean(axis=1)
    base = x.compute(scheduler="sync")  # the same data, made locally
    np.testing.assert_allclose(expr.compute(), (base + base.T).sum(axis=0) - base.mean(axis=1))


def test_local_cluster_dataframe_shuffle(local_cluster: tuple[str, Client]) -> None:
    _, client = local_cluster
    rng = np.random.default_rng(7)
    df = pd.DataFrame({"k": rng.integers(0, 60, 30_000), "v": rng.random(30_000)})
    ddf = dd.from_pandas(df, npartitions=6)
    # A task-based shuffle: every output partition fetches a piece of every input partition, most of
    # them from the other worker. (The p2p method moves the same data through its own RPCs; it needs
    # pyarrow in every worker, which costs minutes to import in the VM: examples/dask_bench.py runs it.)
    shuffled = ddf.shuffle(on="k", npartitions=4, shuffle_method="tasks")
    keys_per_partition = client.compute(shuffled.map_partitions(lambda part: part["k"].drop_duplicates()))
    keys_per_partition = keys_per_partition.result()
    assert keys_per_partition.is_unique  # every key landed in exactly one partition
    assert set(keys_per_partition) == set(df["k"])
    out = shuffled.compute()

    # Compared with Python's sort: pandas' sort_index gave unsorted results under the VM's emulated CPU.
    def rows(frame: pd.DataFrame) -> list[tuple[int, float]]:
        return sorted(zip(frame["k"].tolist(), frame["v"].tolist(), strict=True))

    assert rows(out) == rows(df)
    sums = ddf.groupby("k")["v"].sum(split_out=2, shuffle_method="tasks").compute()
    assert sums.to_dict() == pytest.approx(df.groupby("k")["v"].sum().to_dict())


# Background wake-ups of the CLI processes, made rarer: distributed's own cluster tests
# (distributed.utils_test.config_for_cluster_tests) tick every 500 ms instead of 20 ms and turn the workers'
# statistical profiler off (a callback every 10 ms); the system monitor samples every 2 s instead of 0.5 s
# and the workers' memory monitor every 1 s instead of 0.1 s. Idle, a scheduler and two workers took 7.6 %
# of a CPU natively with the defaults and 1.3 % with these; the test host's one emulated CPU is 20-40 times
# slower, so with the defaults their idling alone could take all of it from the work under test. None of
# these takes part in noticing a lost worker (its comms closing) or in rerunning its tasks.
_CLI_CLUSTER_CONFIG = {
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "500ms",
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "2s",
    "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s",
}


def _start(args: list[str], loop_kind: str, log: Any) -> subprocess.Popen[bytes]:
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        **_CLI_CLUSTER_CONFIG,
        "DASK_DISTRIBUTED__ADMIN__EVENT_LOOP": loop_kind,
        "PYTHONPATH": path,
    }
    return subprocess.Popen([sys.executable, "-m", "dask", *args], env=env, stdout=log, stderr=log)


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of a live process (``/proc/PID/stat``), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Timeline:
    """The test's steps, written into the cluster's log between the processes' own (timestamped) lines,
    so that a slow or failed run shows where its time went."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._start = time.monotonic()

    def __call__(self, step: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
        elapsed = time.monotonic() - self._start
        self._log.write(f"{stamp} - test - +{elapsed:.1f} s: {step}\n".encode())
        self._log.flush()


# 480-834 s in passing CI runs of the whole module; alone in the test host 110 s, 97 of them until the
# three fresh interpreters have imported distributed and the scheduler listens
@pytest.mark.timeout(1800)
def test_cli_cluster_detects_a_killed_worker(tmp_path: Path) -> None:
    """``dask scheduler --protocol rdma`` and two ``dask worker --scheduler-file`` as separate processes:
    the scheduler and worker ``survivor`` on asyncio, worker ``victim`` on uvloop, no nannies. ``victim`` is
    SIGKILLed while it runs tasks; the scheduler learns it from the comms closing (there is no nanny to
    report it, and the heartbeat timeout is minutes: the removal's stimulus must be the comm's) and reruns
    the tasks on ``survivor``. The workers start with the scheduler (they wait for its file), so that the
    three interpreters' imports overlap."""
    scheduler_file = tmp_path / "scheduler.json"
    log = (tmp_path / "cluster.log").open("wb")
    timeline = _Timeline(log)
    timeline("starting the scheduler and the workers")
    procs = [_start(["scheduler", "--protocol", "rdma", "--scheduler-file", str(scheduler_file),
                     "--no-dashboard", "--port", "0"], "asyncio", log)]  # fmt: skip
    for name, kind in (("survivor", "asyncio"), ("victim", "uvloop")):
        procs.append(_start(["worker", "--scheduler-file", str(scheduler_file), "--name", name, "--nthreads",
                             "1", "--no-nanny", "--no-dashboard"], kind, log))  # fmt: skip
    victim = ""
    try:
        _wait_for(scheduler_file.exists, 600, "the scheduler file")
        with Client(scheduler_file=str(scheduler_file), timeout=600) as client:
            timeline("client connected")
            assert client.scheduler.address.startswith("rdma://")
            client.wait_for_workers(2, timeout=600)
            timeline("both workers registered")
            workers = _check_rdma_cluster(client, "asyncio", 2)
            by_name = {info["name"]: worker for worker, info in workers.items()}
            assert client.run(loop_module) == {by_name["survivor"]: "asyncio", by_name["victim"]: "uvloop"}
            victim = by_name["victim"]
            victim_pid = client.run(os.getpid, workers=[victim])[victim]
            futures = client.map(
                square_unless_victim, range(8), marker_dir=str(tmp_path), workers=[victim],
                allow_other_workers=True, pure=False,
            )  # fmt: skip
            started = lambda: any(tmp_path.glob("started-*")) or any(f.status == "error" for f in futures)  # noqa: E731
            _wait_for(started, 300, "a task running on the victim")
            assert not [f.exception() for f in futures if f.status == "error"]
            names = ("scheduler", "survivor", "victim")  # the order they were started in
            cpu = {name: _cpu_seconds(proc.pid) for name, proc in zip(names, procs, strict=True)}
            cpu["test"] = time.process_time()
            timeline(f"a task runs on the victim; killing it (CPU seconds so far: {cpu})")
            os.kill(victim_pid, signal.SIGKILL)
            assert client.gather(futures) == [i * i for i in range(8)]
            timeline("results gathered")
            gone = lambda: victim not in _scheduler_identity(client)["workers"]  # noqa: E731
            _wait_for(gone, 120, "the victim's removal")
            assert list(_scheduler_identity(client)["workers"]) == [by_name["survivor"]]
            cpu = {name: _cpu_seconds(proc.pid) for name, proc in zip(names[:2], procs, strict=False)}
            cpu["test"] = time.process_time()
            timeline(f"the victim is removed; closing (CPU seconds so far: {cpu})")
        timeline("client closed")
    finally:
        # The workers first, then the scheduler: a worker told to close by its closing scheduler while it
        # handles its own SIGTERM has been seen to stay alive (over TCP too), costing the wait below.
        for group in (procs[1:], procs[:1]):
            for proc in group:
                proc.terminate()
            for proc in group:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    timeline(f"process {proc.pid} still runs 60 s after SIGTERM; killing it")
                    proc.kill()
                    proc.wait()
        timeline("every process exited")
        log.close()
    text = (tmp_path / "cluster.log").read_text(errors="replace")
    # the scheduler's removal names its cause: the worker's stream closing (handle-worker-cleanup) or a
    # write to it failing (worker-send-comm-fail), not the heartbeat timeout (check-worker-ttl)
    removals = [line for line in text.splitlines() if "Remove worker" in line and victim in line]
    assert removals, text[-5000:]
    assert all("worker-cleanup" in line or "comm-fail" in line for line in removals), removals
