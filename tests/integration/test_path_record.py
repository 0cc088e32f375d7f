"""The path record (``ep.get_extra_info("rdma")``) on a real device, checked against what the system tools
and sysfs say: ``ibv_devinfo -v`` (link layer, active MTU, transport), ``rdma link`` (the device and port
are up), ``/sys/class/infiniband/<dev>/ports/<n>/gids/<i>`` and ``gid_attrs/types/<i>`` (the GID and its
type at the index the record names). Both ends of one connection, on asyncio and uvloop; the asyncio
streams and anyio equivalents; and ``rdmaio ping -v``."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import re
import subprocess
from pathlib import Path
from typing import Any

import anyio
from loops import Runner, arun  # arun is a fixture used by name

import rdmaio
from rdmaio.anyio import RdmaAttribute
from rdmaio.cli import ping
from rdmaio.path import PathInfo

SYSFS = Path("/sys/class/infiniband")
MTU_LINE = re.compile(r"^\s*active_mtu:\s*(\d+) \(\d+\)$", re.MULTILINE)
LINK_LAYER_LINE = re.compile(r"^\s*link_layer:\s*(\S+)$", re.MULTILINE)
TRANSPORT_LINE = re.compile(r"^\s*transport:\s*(\S+) \(\d+\)$", re.MULTILINE)


def tool(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout


def sysfs_gid(device: str, port: int, index: int, transport: str) -> tuple[ipaddress.IPv6Address, str]:
    """The GID at ``index`` of the port's table and its type, as the kernel shows them. The record must name
    a real entry on every transport (an index of -1 is no entry: it fails here, never reads ``gids/-1``).
    On iWARP the entry is also checked to be what an iWARP device uses: its netdev's MAC (``rdma link``
    names the netdev, sysfs its address) followed by ten zero bytes."""
    base = SYSFS / device / "ports" / str(port)
    assert 0 <= index < len(list((base / "gids").iterdir())), (index, device, port)
    gid = ipaddress.IPv6Address((base / "gids" / str(index)).read_text().strip())
    gid_type = (base / "gid_attrs" / "types" / str(index)).read_text().strip()
    if transport == "iWARP":
        link = tool("rdma", "link", "show", f"{device}/{port}")
        netdev = re.search(r"\bnetdev (\S+)", link)
        assert netdev is not None, link
        mac = bytes.fromhex(
            (Path("/sys/class/net") / netdev[1] / "address").read_text().strip().replace(":", "")
        )
        assert gid.packed == mac + bytes(10), (str(gid), mac.hex(":"))
    return gid, gid_type


def check_against_the_system(path: PathInfo) -> None:
    """Every device-derived field of ``path`` against the tools' and sysfs' view of the same device."""
    assert (SYSFS / path.device).is_dir(), sorted(p.name for p in SYSFS.iterdir())
    link = tool("rdma", "link", "show", f"{path.device}/{path.port}")
    assert re.search(rf"^link {re.escape(path.device)}/{path.port} state ACTIVE", link, re.MULTILINE), link
    info = tool("ibv_devinfo", "-v", "-d", path.device, "-i", str(path.port))
    assert MTU_LINE.findall(info) == [str(path.active_mtu)], info
    assert LINK_LAYER_LINE.findall(info) == [path.link_layer], info
    transport = TRANSPORT_LINE.findall(info)
    if path.link_layer == "Ethernet" and transport == ["InfiniBand"]:  # RoCE: an IB transport on Ethernet
        assert path.transport in ("RoCE v1", "RoCE v2")
        expected_type = "RoCE v2" if path.transport == "RoCE v2" else "IB/RoCE v1"
    else:
        assert path.transport == ("iWARP" if transport == ["iWARP"] else "InfiniBand"), info
        expected_type = "IB/RoCE v1"
    assert 0 < path.path_mtu <= path.active_mtu
    # the local GID is the one at gid_index, of the type the record names (sysfs names v1 "IB/RoCE v1")
    gid, gid_type = sysfs_gid(path.device, path.port, path.gid_index, path.transport)
    assert ipaddress.IPv6Address(path.local_gid) == gid
    assert gid_type == expected_type, (gid_type, path)


async def connected_pair(host: str) -> tuple[rdmaio.StreamServer, rdmaio.Endpoint, rdmaio.Endpoint]:
    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
    server = await rdmaio.serve(accepted.put, host, 0)
    port = server.addresses[0][1]
    client = await rdmaio.connect(host, port)
    return server, client, await asyncio.wait_for(accepted.get(), 120)


def test_the_path_record_matches_the_device(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> tuple[PathInfo, PathInfo, PathInfo, int]:
        server, client, accepted = await connected_pair(rdma_addr)
        try:
            ours, theirs = client.get_extra_info("rdma"), accepted.get_extra_info("rdma")
            await client.send(b"x" * 100)  # the connection carries data as the record says
            assert await accepted.recv() == b"x" * 100
            return ours, theirs, client.get_extra_info("rdma"), client.get_extra_info("mtu")
        finally:
            await client.aclose()
            await accepted.aclose()
            server.close()
            await server.wait_closed()

    ours, theirs, again, mtu = arun(main())
    print(ours.describe())  # shown with -rP: what the docs' examples are taken from
    assert again is ours  # read once, kept
    for path in (ours, theirs):
        check_against_the_system(path)
        assert path.peer_version == rdmaio.__version__
        assert {"batch", "grow", "onesided", "rndv"} <= set(path.features)
        assert path.rndv_threshold == rdmaio.Options().rndv_threshold
        assert path.srq is False
        assert path.credit_window == path.recv_depth == rdmaio.Options().recv_depth
    assert mtu == ours.active_mtu  # the older "mtu" key agrees
    # one connection seen from both ends: each side's remote GID is the other's local one
    assert ipaddress.IPv6Address(ours.remote_gid) == ipaddress.IPv6Address(theirs.local_gid)
    assert ipaddress.IPv6Address(theirs.remote_gid) == ipaddress.IPv6Address(ours.local_gid)
    assert ours.path_mtu == theirs.path_mtu
    assert (
        ours.describe().splitlines()[0].startswith(f"path: {ours.device} port {ours.port}, {ours.transport}")
    )


def test_streams_and_anyio_give_the_same_record(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> tuple[PathInfo, None]:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readline())
            await writer.drain()
            writer.close()

        server = await rdmaio.start_server(handler, rdma_addr, 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await rdmaio.open_connection(rdma_addr, port)
        # asked while the connection is open (the server closes it after one line)
        through_streams = writer.get_extra_info("rdma")
        writer.write(b"hello\n")
        assert await reader.readline() == b"hello\n"
        endpoint_record = writer.get_extra_info("endpoint").get_extra_info("rdma")
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
        assert through_streams is endpoint_record
        return through_streams, None

    through_streams, _ = arun(main())
    check_against_the_system(through_streams)

    async def with_anyio() -> PathInfo:
        async def serve_one(stream: Any) -> None:
            async with stream:
                await stream.send(await stream.receive())

        listener = await rdmaio.anyio.create_listener(rdma_addr, 0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve_one)
            async with await rdmaio.anyio.connect(rdma_addr, port) as stream:
                await stream.send(b"ping")
                assert await stream.receive() == b"ping"
                path: PathInfo = stream.extra(RdmaAttribute.path)
                assert path is stream.extra(RdmaAttribute.endpoint).get_extra_info("rdma")
            tg.cancel_scope.cancel()
        await listener.aclose()
        return path

    check_against_the_system(anyio.run(with_anyio))


def test_ping_v_prints_the_path(arun: Runner[Any], rdma_addr: str) -> None:
    async def main() -> tuple[int, str, PathInfo]:
        records: list[PathInfo] = []

        async def echo(ep: rdmaio.Endpoint) -> None:
            records.append(ep.get_extra_info("rdma"))
            async with ep:
                while (message := await ep.recv()) is not None:
                    await ep.send(message)

        server = await rdmaio.serve(echo, rdma_addr, 0)
        port = server.addresses[0][1]
        out, err = io.StringIO(), io.StringIO()
        config = ping.PingConfig(rdma_addr, port, count=2, interval=0.01, timeout=60, verbose=True)
        code = await ping.run_client(config, out, err)
        server.close()
        await server.wait_closed()
        return code, out.getvalue() + err.getvalue(), records[0]

    code, text, server_side = arun(main())
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0].startswith(f"PING {rdma_addr} port ")
    assert re.fullmatch(
        r"path: \S+ port \d+, (RoCE v[12]|InfiniBand|iWARP) over \S+, MTU \d+.*, qp \d+", lines[1]
    )
    gid_line = lines[2]
    # the client's GIDs: its remote GID is the server side's local one
    assert f"-> {server_side.local_gid}, " in gid_line, (gid_line, server_side)
    assert lines[4] == f"  features: {', '.join(server_side.features)}; peer rdmaio {rdmaio.__version__}"
