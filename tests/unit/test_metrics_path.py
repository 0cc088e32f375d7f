"""The path record (``ep.get_extra_info("rdma")``, :class:`rdmaio.PathInfo`) on the null device: its fields,
that it is read from the device once, the streams and anyio equivalents, ``rdmaio ping -v``, and the
handshake field that carries the peer's version (compatible both ways)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import rdmaio
from rdmaio.cli import ping
from rdmaio.cli.ping import PingConfig
from rdmaio.core.negotiation import local_handshake
from rdmaio.path import PathInfo, format_gid
from rdmaio.protocol import FEATURE_BATCH, FEATURE_GROW, Handshake
from rdmaio.protocol.handshake import _BODY_V1, _HEADER, FLAG_SOFTWARE, HANDSHAKE_MAGIC, MAX_SOFTWARE
from rdmaio.testing.fakes import FakeCMId
from rdmaio.testing.nullpair import null_connect
from rdmaio.verbs.path import transport_name

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def test_the_path_record_names_the_device_transport_gids_mtu_and_negotiation(arun: Run) -> None:
    async def main() -> tuple[PathInfo, PathInfo]:
        client, server, _device = await null_connect()
        try:
            return client.get_extra_info("rdma"), server.get_extra_info("rdma")
        finally:
            await client.aclose()
            await server.wait_closed()

    client, server = arun(main())
    assert isinstance(client, PathInfo) and isinstance(server, PathInfo)
    assert (client.device, client.port, client.transport, client.link_layer) == (
        "fake0",
        1,
        "RoCE v2",
        "Ethernet",
    )
    # the fake id's GIDs: the IPv4-mapped forms of its addresses, as a RoCE v2 GID of an IPv4 address
    assert client.local_gid == "::ffff:198.18.0.1" and client.remote_gid == "::ffff:198.18.0.2"
    assert (client.gid_type, client.gid_index) == ("RoCE v2", 1)
    assert (client.active_mtu, client.path_mtu) == (4096, 4096)
    options = rdmaio.Options()
    # the null connection's options: 8 receive slots each side, no rendezvous, no SRQ
    assert (client.credit_window, client.recv_depth, client.rndv_threshold, client.srq) == (8, 8, 0, False)
    assert client.features == ("batch", "grow", "onesided")  # rendezvous off in the null options
    assert client.peer_version == server.peer_version == rdmaio.__version__
    assert client.qp_num == 10 and server.qp_num == 11
    assert options.rndv_threshold > 0  # (rendezvous is on by default; the null pair turns it off)
    with pytest.raises(dataclasses.FrozenInstanceError):
        client.device = "other"  # type: ignore[misc]
    record = client.as_dict()
    assert json.loads(json.dumps(record)) == record
    assert record["features"] == ["batch", "grow", "onesided"] and record["transport"] == "RoCE v2"
    lines = client.describe().splitlines()
    assert lines[0] == "path: fake0 port 1, RoCE v2 over Ethernet, MTU 4096, qp 10"
    assert lines[1] == "  GID[1] ::ffff:198.18.0.1 -> ::ffff:198.18.0.2, RoCE v2"
    assert lines[2] == "  credits 8, receive depth 8, inline 0 B, no rendezvous, SRQ off"
    assert lines[3] == f"  features: batch, grow, onesided; peer rdmaio {rdmaio.__version__}"


def test_the_path_is_read_once_on_first_request_never_at_setup(arun: Run) -> None:
    async def main() -> tuple[int, int, bool]:
        client, server, _device = await null_connect()
        cm_id: FakeCMId = client._conn._cm_id
        before = cm_id.path_queries  # connection setup made no query
        first = client.get_extra_info("rdma")
        again = client.get_extra_info("rdma")
        await client.aclose()
        await server.wait_closed()
        after_close = client.get_extra_info("rdma")  # still the record read before the close
        return before, cm_id.path_queries, first is again is after_close

    before, queries, same = arun(main())
    assert (before, queries, same) == (0, 1, True)


def test_a_connection_closed_before_the_first_request_gives_the_default(arun: Run) -> None:
    async def main() -> tuple[object, object]:
        client, server, _device = await null_connect()
        await client.aclose()
        await server.wait_closed()
        client._conn._cm_id.close()  # as the reactor's release destroys a real id
        return client.get_extra_info("rdma"), client.get_extra_info("rdma", "gone")

    assert arun(main()) == (None, "gone")


def test_transport_names() -> None:
    assert transport_name("InfiniBand", False, "IB") == "InfiniBand"
    assert transport_name("Ethernet", False, "RoCE v2") == "RoCE v2"
    assert transport_name("Ethernet", False, "RoCE v1") == "RoCE v1"
    assert transport_name("Ethernet", True, "") == "iWARP"
    assert format_gid(bytes.fromhex("fe80000000000000505400fffe123456")) == "fe80::5054:ff:fe12:3456"
    assert format_gid(bytes(10) + b"\xff\xff" + bytes([198, 18, 0, 2])) == "::ffff:198.18.0.2"


def test_the_streams_and_anyio_equivalents_give_the_same_record(arun: Run) -> None:
    from rdmaio.anyio import RdmaAttribute, RdmaByteStream
    from rdmaio.streams import RdmaTransport

    async def main() -> tuple[PathInfo, Any, Any]:
        client, server, _device = await null_connect()
        record = client.get_extra_info("rdma")
        client._conn.extra["mtu"] = 4096  # the anyio stream reads the MTU; the null device has no port
        stream = RdmaByteStream.from_endpoint(client)
        through_anyio = stream.extra(RdmaAttribute.path)
        transport = RdmaTransport(asyncio.get_running_loop(), server, asyncio.Protocol())
        through_streams = transport.get_extra_info("rdma")
        await client.aclose()
        await server.wait_closed()
        return record, through_anyio, (through_streams, server.get_extra_info("rdma"))

    record, through_anyio, (through_streams, server_record) = arun(main())
    assert through_anyio is record
    assert through_streams is server_record and isinstance(server_record, PathInfo)


def test_ping_v_prints_the_path_record(monkeypatch: pytest.MonkeyPatch, arun: Run) -> None:
    async def main() -> str:
        client, server, _device = await null_connect()

        async def echo() -> None:
            while (message := await server.recv()) is not None:
                await server.send(message)
            await server.aclose()

        async def connect(host: str, port: int, **kwargs: Any) -> rdmaio.Endpoint:
            return client

        monkeypatch.setattr(rdmaio, "connect", connect)
        task = asyncio.ensure_future(echo())
        out, err = io.StringIO(), io.StringIO()
        config = PingConfig("198.18.0.2", 7471, count=2, interval=0.001, verbose=True)
        assert await ping.run_client(config, out, err) == 0
        await task
        return out.getvalue()

    text = arun(main())
    lines = text.splitlines()
    assert lines[0].startswith("PING 198.18.0.2 port 7471 over fake0")
    assert lines[1] == "path: fake0 port 1, RoCE v2 over Ethernet, MTU 4096, qp 10"
    assert lines[4] == f"  features: batch, grow, onesided; peer rdmaio {rdmaio.__version__}"
    assert ping.build_parser().parse_args(["h", "-v"]).verbose


# --- the handshake field that carries the peer's version ---------------------------------------------------


def test_the_handshake_carries_the_version_and_stays_within_the_private_data_limit() -> None:
    hs = local_handshake(rdmaio.Options())
    assert hs.software == rdmaio.__version__
    data = hs.encode()
    assert len(data) <= 56
    assert data[5] & FLAG_SOFTWARE
    assert Handshake.decode(data) == hs
    longest = Handshake(16, 64, 1, features=FEATURE_BATCH | FEATURE_GROW, initial_depth=4, software="9" * 40)
    encoded = longest.encode()
    assert len(encoded) <= 56
    assert Handshake.decode(encoded).software == "9" * MAX_SOFTWARE  # cut, not refused


def test_a_handshake_without_the_version_reads_as_none_and_an_older_reader_ignores_it() -> None:
    older = Handshake(16, 256, 4096, features=FEATURE_BATCH)  # what a peer without the field sends
    assert Handshake.decode(older.encode()).software == ""
    # an older reader knows neither the flag nor the field: it reads the fields it knows, as before
    newer = dataclasses.replace(older, software="0.2.0").encode()
    magic, _version, flags, body_len = _HEADER.unpack_from(newer)
    assert magic == HANDSHAKE_MAGIC and flags & ~FLAG_SOFTWARE == FEATURE_BATCH
    assert _BODY_V1.unpack_from(newer, _HEADER.size) == (16, 256, 4096)
    assert body_len == _BODY_V1.size + 1 + len("0.2.0")


@pytest.mark.parametrize(
    "field",
    [b"\x05abc", b"\x03a\x00c", b"\x03a\xffc", bytes([MAX_SOFTWARE + 1]) + b"1" * (MAX_SOFTWARE + 1), b""],
    ids=["longer-than-the-body", "control-byte", "non-ascii", "too-long", "empty"],
)
def test_a_hostile_version_field_is_dropped_not_fatal(field: bytes) -> None:
    body = _BODY_V1.pack(16, 256, 4096) + field
    data = _HEADER.pack(HANDSHAKE_MAGIC, 1, FLAG_SOFTWARE, len(body)) + body
    decoded = Handshake.decode(data)
    assert decoded.software == "" and (decoded.recv_depth, decoded.slot_size) == (16, 256)


def test_the_c_query_refuses_an_id_without_a_device_and_fills_every_field() -> None:
    """``rdmaio_query_path`` through cffi: a NULL id (or output) is -EINVAL, never a crash, and the output
    is initialised (unknown index and type -1, the rest 0) before anything is read."""
    import errno

    from rdmaio._ffi import ffi, lib

    out = ffi.new("struct rdmaio_path *")
    out.sgid_index = 99
    out.path_mtu = 5
    assert lib.rdmaio_query_path(ffi.NULL, out) == -errno.EINVAL
    assert (out.sgid_index, out.gid_type, out.path_mtu, out.port_num) == (-1, -1, 0, 0)
    assert bytes(ffi.buffer(out.sgid)) == bytes(16) == bytes(ffi.buffer(out.dgid))
    assert lib.rdmaio_query_path(ffi.NULL, ffi.NULL) == -errno.EINVAL
    # an id whose device is not resolved yet (verbs NULL): the same
    raw_id = ffi.new("struct rdma_cm_id *")
    assert lib.rdmaio_query_path(raw_id, out) == -errno.EINVAL
