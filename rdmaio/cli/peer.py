"""``rdmaio doctor --peer HOST [PORT]``: check a pair of hosts through a live rdmaio server on the other one.

The peer runs ``python -m rdmaio ping --server HOST [PORT]``. Doctor checks, in order, one line each: the
route this side takes to HOST (and the RDMA device behind it), the rdma_cm connect and rdmaio handshake, the
GID each side chose (this side's from the connection's path record, the peer's from its answer to doctor's
probe), that both sides' active MTUs match, an echo, a one-sided RDMA READ of memory the peer exports for
it, and a short throughput sample (echoed 64 KiB messages). Every failure says what to fix.

The probe is an ordinary message starting with :data:`PROBE_PREFIX` followed by a small JSON request; a
ping server answers it (:class:`ProbeResponder`) instead of echoing it. An older server that predates the
probe echoes it back unchanged, which doctor recognises and reports as a warning.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import ipaddress
import json
import re
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rdmaio.cli.checks import CheckResult, Verdict
from rdmaio.cli.system import System

if TYPE_CHECKING:  # importing rdmaio loads the extension, which doctor checks before this runs
    import rdmaio

__all__ = [
    "PROBE_PREFIX",
    "READ_PROBE_SIZE",
    "SAMPLE_MESSAGE_SIZE",
    "PeerReport",
    "ProbeResponder",
    "check_route",
    "local_path",
    "parse_route",
    "probe_request",
    "run_peer_checks",
    "serve_doctor_session",
]

PROBE_PREFIX = b"\x00rdmaio-doctor/1 "
"""How a doctor probe starts (a NUL byte first: no text and no ping message starts like this)."""
MAX_PROBE_REQUEST = 512
"""A longer message is never a probe: the server echoes it like any other."""
READ_PROBE_SIZE = 4096
"""Bytes the server exports for the READ check (fixed: a client cannot make it export more)."""
SAMPLE_MESSAGE_SIZE = 64 * 1024
SAMPLE_WINDOW = 4
"""Messages of the throughput sample in flight at once."""
ECHO_PAYLOAD = b"rdmaio doctor echo " + bytes(range(45))


def probe_request(ask: str) -> bytes:
    """The message that asks the server for ``ask`` (``info`` or ``read``)."""
    return PROBE_PREFIX + json.dumps({"ask": ask}).encode()


def _read_pattern(size: int) -> bytes:
    return bytes((i * 31 + 7) & 0xFF for i in range(size))


# --- the path of one connection, as each side sees it -------------------------------------------------


def gid_of_address(system: System, device: str, port: int, address: str) -> tuple[int, str, str] | None:
    """(index, GID, type) of the RoCE GID that carries IPv4 ``address`` on ``device``/``port`` (sysfs)."""
    octets = [int(x) for x in address.split(".")] if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", address) else []
    if len(octets) != 4:
        return None
    want = "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}".format(*octets)
    base = f"/sys/class/infiniband/{device}/ports/{port}"
    try:
        indexes = sorted(int(p.name) for p in system.path(f"{base}/gids").iterdir() if p.name.isdigit())
    except OSError:
        return None
    found = None
    for i in indexes:
        if (system.read(f"{base}/gids/{i}") or "").strip() != want:
            continue
        gid_type = (system.read(f"{base}/gid_attrs/types/{i}") or "").strip()
        entry = (i, want, gid_type or "unknown")
        if gid_type.lower() == "roce v2":
            return entry  # rdma_cm prefers RoCE v2 for an IPv4 address when both exist
        found = found or entry
    return found


def local_path(ep: rdmaio.Endpoint, system: System) -> dict[str, Any]:
    """What carries ``ep`` on this side: device, port, address, transport, the local GID (index, type),
    the GID its queue pair sends to, the port's active MTU and the queue pair's path MTU.

    Read from the connection's path record (``get_extra_info("rdma")``, :class:`rdmaio.PathInfo`); what
    it does not know (an unknown GID index or type) comes from the endpoint's ``sockname`` and the GID
    table in sysfs. GIDs are written as IPv6 addresses (``::ffff:198.18.0.1``), as ``ibv_devinfo`` does.
    """
    record = ep.get_extra_info("rdma")
    sockname = ep.get_extra_info("sockname")
    address = sockname[0] if isinstance(sockname, tuple) else None
    path: dict[str, Any] = {
        "device": ep.get_extra_info("device"),
        "port": ep.get_extra_info("port"),
        "address": address,
        "transport": None,
        "gid": None,
        "gid_index": None,
        "gid_type": None,
        "remote_gid": None,
        "active_mtu": None,
        "path_mtu": None,
    }
    if record is not None:
        for field_name, attr in (
            ("device", "device"),
            ("port", "port"),
            ("transport", "transport"),
            ("gid", "local_gid"),
            ("gid_index", "gid_index"),
            ("gid_type", "gid_type"),
            ("remote_gid", "remote_gid"),
            ("active_mtu", "active_mtu"),
            ("path_mtu", "path_mtu"),
        ):
            value = getattr(record, attr, None)
            # The record's "unknown": -1, and 0 but for the GID index (0 is an entry: an iWARP port's one)
            if value in (None, "", -1) or (value == 0 and field_name != "gid_index"):
                continue
            path[field_name] = value if isinstance(value, int | bool) else str(value)
    else:
        path["active_mtu"] = ep.get_extra_info("mtu")
    if (path["gid_index"] is None or not path["gid_type"]) and path["device"] and path["port"] and address:
        entry = gid_of_address(system, str(path["device"]), int(path["port"]), address)
        if entry is not None and (path["gid"] is None or same_gid(path["gid"], entry[1])):
            path["gid_index"], gid, path["gid_type"] = entry
            path["gid"] = path["gid"] or compress_gid(gid)
    return path


def compress_gid(gid: str) -> str:
    """A GID in sysfs's form (8 groups of 4 hex digits) as an IPv6 address, as :class:`rdmaio.PathInfo`
    writes it (``::ffff:198.18.0.1``); returned unchanged when it is not one."""
    try:
        address = ipaddress.IPv6Address(gid)
    except ValueError:
        return gid
    mapped = address.ipv4_mapped
    return f"::ffff:{mapped}" if mapped is not None else str(address)


def same_gid(a: object, b: object) -> bool:
    """Whether two GIDs (any IPv6 spelling) are the same."""
    return compress_gid(str(a)) == compress_gid(str(b))


def describe_side(path: dict[str, Any]) -> str:
    """``rxe0/1 198.18.0.1 GID ::ffff:... (index 1, RoCE v2)``, with what is known."""
    where = f"{path.get('device') or '?'}/{path.get('port') or '?'} {path.get('address') or '?'}"
    if not path.get("gid"):
        return f"{where}, GID unknown"
    return f"{where} GID {path['gid']} (index {path.get('gid_index')}, {path.get('gid_type')})"


# --- the server's side of the probe ---------------------------------------------------------------------


class ProbeResponder:
    """Answers doctor's probes on one server connection (``rdmaio ping --server`` uses it).

    ``info`` answers with this side's path (:func:`local_path`) and rdmaio's version; ``read`` exports
    :data:`READ_PROBE_SIZE` bytes of a known pattern for RDMA READ through this connection only and
    answers with the key and the pattern's SHA-256. At most one such export exists per connection: a new
    ``read`` revokes the previous one first, so a client cannot make the server register more than
    :data:`READ_PROBE_SIZE` bytes per connection this way. The export ends with the connection.
    """

    def __init__(self, ep: rdmaio.Endpoint, system: System | None = None) -> None:
        self._ep = ep
        self._system = system or System()
        self._key: rdmaio.RemoteKey | None = None
        self.exports = 0
        """How many ``read`` probes were answered with a key (for tests)."""

    @property
    def exported_bytes(self) -> int:
        """Bytes currently exported for the READ probe (0 or :data:`READ_PROBE_SIZE`)."""
        return READ_PROBE_SIZE if self._key is not None else 0

    async def answer(self, message: bytes) -> bool:
        """Answer ``message`` if it is a probe (True); False for any other message (echo it)."""
        if not message.startswith(PROBE_PREFIX) or len(message) > MAX_PROBE_REQUEST:
            return False
        try:
            request = json.loads(message[len(PROBE_PREFIX) :])
            ask = request.get("ask") if isinstance(request, dict) else None
        except ValueError:
            ask = None
        reply: dict[str, Any]
        if ask == "info":
            from rdmaio import __version__

            reply = {"version": __version__, "path": local_path(self._ep, self._system)}
        elif ask == "read":
            reply = await self._export()
        else:
            reply = {"error": f"unknown probe request {ask!r}"}
        await self._ep.send(PROBE_PREFIX + json.dumps(reply).encode())
        return True

    async def _export(self) -> dict[str, Any]:
        import rdmaio

        if self._key is not None:
            key, self._key = self._key, None
            await self._ep.revoke(key)
        pattern = bytearray(_read_pattern(READ_PROBE_SIZE))
        try:
            self._key = self._ep.export(pattern, access="r")
        except (rdmaio.RdmaError, OSError) as exc:
            return {"error": f"cannot export memory: {type(exc).__name__}: {exc}"}
        self.exports += 1
        return {
            "key": bytes(self._key).hex(),
            "length": READ_PROBE_SIZE,
            "sha256": hashlib.sha256(pattern).hexdigest(),
        }


async def serve_doctor_session(ep: rdmaio.Endpoint, first: bytes | None = None) -> int:
    """Serve one connection for ``doctor --peer``: answer its probes, echo every other message, until the
    peer closes; returns the number of messages handled.

    For a server with its own protocol (``rdmaio perf --server``): when a connection's first message
    starts with :data:`PROBE_PREFIX`, hand the connection and that message (``first``) over to this.
    """
    responder = ProbeResponder(ep)
    count = 0
    async with ep:
        message = first if first is not None else await ep.recv()
        while message is not None:
            if not await responder.answer(message):
                await ep.send(message)
            count += 1
            message = await ep.recv()
    return count


# --- the client's checks ----------------------------------------------------------------------------------


def parse_route(output: str) -> dict[str, str]:
    """The fields of one ``ip -4 -o route get ADDR`` line: ``type`` (``local`` for an own address,
    else ``unicast``), ``dev``, ``src`` and ``via`` when present."""
    tokens = output.split()
    route: dict[str, str] = {"type": "local" if tokens[:1] == ["local"] else "unicast"}
    for name in ("dev", "src", "via"):
        if name in tokens[:-1]:
            route[name] = tokens[tokens.index(name) + 1]
    return route


def _rdma_ports_on(system: System, netdev: str) -> list[str]:
    """``device/port`` of every RDMA port on ``netdev``: whose GIDs sit on it (RoCE), or that ``rdma link``
    puts on it (iWARP, whose GIDs name no netdev)."""
    return [
        f"{p.device}/{p.number}"
        for d in system.sysfs_devices()
        for p in d.ports
        if p.link_netdev == netdev or any(ndev == netdev for _gid, _type, ndev in p.gids)
    ]


def _netdev_of_address(system: System, address: str) -> str | None:
    out = system.run(["ip", "-4", "-o", "addr", "show"]) or ""
    for line in out.splitlines():
        match = re.match(r"^\d+:\s+(\S+)\s+inet\s+(\d+\.\d+\.\d+\.\d+)/", line)
        if match and match.group(2) == address:
            return match.group(1)
    return None


def check_route(system: System, host: str) -> CheckResult:
    """The route this machine takes to ``host`` and the RDMA port on that route's interface."""
    if system.run(["ip", "-V"]) is None:
        return CheckResult(
            "route", Verdict.WARN, "cannot run 'ip' to look up the route", "apt-get install iproute2"
        )
    out = system.run(["ip", "-4", "-o", "route", "get", host])
    if not out:
        return CheckResult(
            "route",
            Verdict.FAIL,
            f"no IPv4 route to {host}",
            f"check the address, then 'ip route' (add one: ip route add {host}/32 dev NETDEV) and that this "
            "machine's RDMA interface has an address in the peer's subnet",
        )
    route = parse_route(out.splitlines()[0])
    netdev = route.get("dev")
    if route["type"] == "local":
        netdev = _netdev_of_address(system, host) or netdev
        where = f"{host} is an address of this machine ({netdev})"
    else:
        via = f" via {route['via']}" if "via" in route else ""
        where = f"{host}{via} dev {netdev} src {route.get('src', '?')}"
    ports = _rdma_ports_on(system, netdev) if netdev else []
    data = {"route": route, "netdev": netdev, "rdma_ports": ports}
    if not ports:
        return CheckResult(
            "route",
            Verdict.FAIL,
            f"{where}: no RDMA device on {netdev} (rdma_cm would not find one for this route)",
            f"give the RDMA port's interface an address in {host}'s subnet (rdma link; ip addr), or connect "
            "to the peer's RDMA interface address instead",
            data,
        )
    return CheckResult("route", Verdict.OK, f"{where}: RDMA port {', '.join(ports)}", data=data)


def _route_transport(system: System, route: CheckResult) -> str | None:
    """The transport of the RDMA port the route check found (the first), or None."""
    ports = (route.data or {}).get("rdma_ports") or []
    if not ports:
        return None
    for device in system.sysfs_devices():
        for p in device.ports:
            if f"{p.device}/{p.number}" == ports[0]:
                return p.transport
    return None


def connect_failure(
    exc: BaseException, host: str, port: int, timeout: float, transport: str | None = None
) -> CheckResult:
    """The ``handshake`` line for a connect that failed, with what to do about it. ``transport``: the
    route's RDMA port's (``iWARP`` connects over TCP to ``port``; else RoCE v2's UDP port 4791)."""
    import rdmaio

    target = f"{host}:{port}"
    server = f"python -m rdmaio ping --server {shlex.quote(host)} {port}"
    if isinstance(exc, rdmaio.ConnectionRefusedError):
        return CheckResult(
            "handshake",
            Verdict.FAIL,
            f"no rdmaio server is listening on {target}",
            f"start `{server}` there (or give the port it listens on)",
        )
    firewall = f"TCP port {port} (iWARP runs over TCP)" if transport == "iWARP" else "UDP port 4791 (RoCE v2)"
    reach = (
        f"check the route and ARP to {host} (ip route get {host}; ip neigh show {host}), that {host} is the "
        f"address of the peer's RDMA interface and that it is up, and that no firewall drops {firewall}"
    )
    if isinstance(exc, TimeoutError):
        return CheckResult(
            "handshake", Verdict.FAIL, f"{target}: no answer within {timeout:g} s ({exc})", reach
        )
    if isinstance(exc, rdmaio.UnreachableError | rdmaio.AddressError):
        return CheckResult("handshake", Verdict.FAIL, f"{target}: unreachable: {exc}", reach)
    if isinstance(exc, rdmaio.DeviceError) or getattr(exc, "errno", None) == errno.ENODEV:
        return CheckResult(
            "handshake",
            Verdict.FAIL,
            f"no usable RDMA device on this host: {exc}",
            "python -m rdmaio doctor (without --peer) says why and how to fix it",
        )
    if isinstance(exc, rdmaio.HandshakeError):
        return CheckResult(
            "handshake",
            Verdict.FAIL,
            f"{target}: the rdmaio handshake failed: {exc}",
            "the same rdmaio version on both hosts, and an rdmaio server there (not another RDMA program)",
        )
    return CheckResult(
        "handshake",
        Verdict.FAIL,
        f"{target}: {type(exc).__name__}: {exc}",
        f"python -m rdmaio doctor on both hosts; then `{server}` there and "
        f"`python -m rdmaio ping {host} {port}` here",
    )


@dataclass
class PeerReport:
    """What the peer said about itself in answer to the ``info`` probe (None: it did not answer)."""

    version: str | None
    path: dict[str, Any] | None
    answered: bool


async def _ask(ep: rdmaio.Endpoint, ask: str, wait_seconds: float) -> dict[str, Any] | None:
    """Send a probe; the parsed answer, or None when the server echoed it (it predates the probe)."""
    request = probe_request(ask)
    await ep.send(request)
    reply = await asyncio.wait_for(ep.recv(), wait_seconds)
    if reply is None:
        raise ConnectionResetError("the server closed the connection")
    if reply == request or not reply.startswith(PROBE_PREFIX):
        return None
    answer = json.loads(reply[len(PROBE_PREFIX) :])
    if not isinstance(answer, dict):
        raise ValueError(f"the server's probe answer is not an object: {answer!r}")
    return answer


OLD_SERVER = (
    "the server echoes doctor's probe instead of answering it (an rdmaio older than this doctor, or not "
    "`rdmaio ping --server`)"
)
UPGRADE = "run the same rdmaio version on both hosts"


def check_gids(local: dict[str, Any], peer: PeerReport) -> CheckResult:
    """The GID each side chose; both RoCE GIDs must be of the same type (v1 does not talk to v2)."""
    mine = describe_side(local)
    data = {"local": local, "peer": peer.path}
    if peer.path is None:
        return CheckResult(
            "gids", Verdict.WARN, f"here {mine}; the peer's unknown: {OLD_SERVER}", UPGRADE, data
        )
    theirs = describe_side(peer.path)
    text = f"here {mine}; peer (rdmaio {peer.version}) {theirs}"
    addressed, used = local.get("remote_gid"), peer.path.get("gid")
    if addressed and used and not same_gid(addressed, used):
        return CheckResult(
            "gids",
            Verdict.WARN,
            f"{text}: this side's queue pair addresses GID {addressed}, not the one the peer says it uses",
            "a NAT or proxy between the hosts, or several addresses on the peer's RDMA interface: connect to "
            "the address whose GID the peer uses",
            data,
        )
    # sysfs names them "RoCE v2" and "IB/RoCE v1"; a v1 GID cannot reach a v2 one.
    kinds = {str(p.get("gid_type") or "").lower() for p in (local, peer.path)}
    versions = {"v2" if "v2" in k else "v1" for k in kinds if "roce" in k}
    if len(versions) > 1:
        return CheckResult(
            "gids",
            Verdict.FAIL,
            f"{text}: the two sides use different RoCE versions",
            "give both hosts' RDMA interfaces IPv4 addresses with RoCE v2 GIDs (rdma_cm picks the GID of the "
            "address; check /sys/class/infiniband/DEV/ports/1/gid_attrs/types)",
            data,
        )
    return CheckResult("gids", Verdict.OK, text, data=data)


def check_mtu_match(local: dict[str, Any], peer: PeerReport) -> CheckResult:
    """Both sides' active MTU; different MTUs work (the path uses the smaller) but waste the larger."""
    mine = local.get("active_mtu")
    if peer.path is None:
        return CheckResult("mtu", Verdict.WARN, f"here {mine}; the peer's unknown: {OLD_SERVER}", UPGRADE)
    theirs = peer.path.get("active_mtu")
    if not isinstance(mine, int) or not isinstance(theirs, int):
        return CheckResult("mtu", Verdict.WARN, f"active MTU here {mine}, peer {theirs}: not both known")
    if mine != theirs:
        return CheckResult(
            "mtu",
            Verdict.WARN,
            f"active MTU here {mine}, peer {theirs}: the connection uses {min(mine, theirs)}",
            "set both RDMA interfaces' netdev MTU alike (ip link set dev NETDEV mtu 1500, or 9000 on both)",
        )
    return CheckResult("mtu", Verdict.OK, f"active MTU {mine} on both sides")


async def check_echo(ep: rdmaio.Endpoint, wait_seconds: float) -> CheckResult:
    """One message there and back, compared byte for byte."""
    start = time.perf_counter()
    await ep.send(ECHO_PAYLOAD)
    reply = await asyncio.wait_for(ep.recv(), wait_seconds)
    elapsed = time.perf_counter() - start
    if reply != ECHO_PAYLOAD:
        return CheckResult(
            "echo",
            Verdict.FAIL,
            f"the echo came back different ({len(reply or b'')} bytes)",
            "the server there is not an echo server: run `python -m rdmaio ping --server HOST PORT` there",
        )
    return CheckResult("echo", Verdict.OK, f"{len(ECHO_PAYLOAD)} bytes echoed in {elapsed * 1000:.1f} ms")


async def check_read(ep: rdmaio.Endpoint, wait_seconds: float) -> CheckResult:
    """An RDMA READ of memory the peer exported for it, checked against the SHA-256 the peer sent."""
    import rdmaio

    answer = await _ask(ep, "read", wait_seconds)
    if answer is None:
        return CheckResult("read", Verdict.WARN, f"not checked: {OLD_SERVER}", UPGRADE)
    if "error" in answer:
        return CheckResult(
            "read",
            Verdict.FAIL,
            f"the peer cannot export memory for RDMA READ: {answer['error']}",
            "python -m rdmaio doctor on the peer (its features check lists what its device offers for "
            "one-sided RDMA)",
        )
    key = rdmaio.RemoteKey.from_bytes(bytes.fromhex(str(answer["key"])))
    length = int(answer["length"])
    start = time.perf_counter()
    data = await asyncio.wait_for(ep.rdma_read(key, 0, length), wait_seconds)
    elapsed = time.perf_counter() - start
    if hashlib.sha256(data).hexdigest() != answer.get("sha256"):
        return CheckResult(
            "read",
            Verdict.FAIL,
            f"RDMA READ of {length} bytes returned other data than the peer exported",
            "report it with both hosts' `python -m rdmaio doctor --json`",
        )
    return CheckResult(
        "read", Verdict.OK, f"RDMA READ of {length} bytes in {elapsed * 1000:.1f} ms, data intact"
    )


async def check_throughput(ep: rdmaio.Endpoint, seconds: float, wait_seconds: float) -> CheckResult:
    """Echoed :data:`SAMPLE_MESSAGE_SIZE` messages for ``seconds``, :data:`SAMPLE_WINDOW` in flight."""
    payload = bytes(SAMPLE_MESSAGE_SIZE)
    sent = received = 0
    start = time.perf_counter()
    deadline = start + seconds
    while sent < SAMPLE_WINDOW:
        await ep.send(payload)
        sent += 1
    while received < sent:
        reply = await asyncio.wait_for(ep.recv(), wait_seconds)
        if reply is None:
            raise ConnectionResetError("the server closed the connection")
        if len(reply) != SAMPLE_MESSAGE_SIZE:
            return CheckResult(
                "throughput",
                Verdict.FAIL,
                f"an echoed {SAMPLE_MESSAGE_SIZE}-byte message came back {len(reply)}",
            )
        received += 1
        if time.perf_counter() < deadline:
            await ep.send(payload)
            sent += 1
    elapsed = time.perf_counter() - start
    rate = received * SAMPLE_MESSAGE_SIZE / elapsed / (1 << 20)
    return CheckResult(
        "throughput",
        Verdict.OK,
        f"{rate:.1f} MiB/s each way ({received} messages of {SAMPLE_MESSAGE_SIZE // 1024} KiB echoed in "
        f"{elapsed:.2f} s)",
        data={"messages": received, "bytes": received * SAMPLE_MESSAGE_SIZE, "seconds": elapsed},
    )


def _skip(name: str, why: str) -> CheckResult:
    return CheckResult(name, Verdict.SKIP, why)


AFTER_HANDSHAKE = ("gids", "mtu", "echo", "read", "throughput")


async def run_peer_checks(
    host: str, port: int, system: System, wait_seconds: float = 20.0, sample_seconds: float = 0.5
) -> list[CheckResult]:
    """Every check of ``doctor --peer``, in order; a failed step skips the checks that need it."""
    import rdmaio

    results = [check_route(system, host)]
    try:
        ep = await rdmaio.connect(host, port, timeout=wait_seconds)
    except (OSError, rdmaio.RdmaError) as exc:
        results.append(connect_failure(exc, host, port, wait_seconds, _route_transport(system, results[0])))
        return results + [_skip(n, "no connection (see handshake)") for n in AFTER_HANDSHAKE]
    local = local_path(ep, system)
    transport = f", {local['transport']}" if local["transport"] else ""
    results.append(
        CheckResult(
            "handshake",
            Verdict.OK,
            f"connected to {host}:{port} over {local['device']} port {local['port']}{transport} "
            f"(QP {ep.get_extra_info('qp_num')})",
            data={"path": local},
        )
    )
    peer = PeerReport(None, None, False)

    async def gids() -> CheckResult:
        answer = await _ask(ep, "info", wait_seconds)
        if answer is not None:
            path = answer.get("path")
            peer.version = str(answer.get("version"))
            peer.path = path if isinstance(path, dict) else None
            peer.answered = True
        return check_gids(local, peer)

    async def mtu() -> CheckResult:
        return check_mtu_match(local, peer)

    steps: list[tuple[str, Callable[[], Awaitable[CheckResult]]]] = [
        # The info probe first: a server that multiplexes (rdmaio perf --server) recognises doctor by it.
        ("gids", gids),
        ("mtu", mtu),
        ("echo", lambda: check_echo(ep, wait_seconds)),
        ("read", lambda: check_read(ep, wait_seconds)),
        ("throughput", lambda: check_throughput(ep, sample_seconds, wait_seconds)),
    ]
    broken: str | None = None
    async with ep:
        for name, step in steps:
            if broken is not None:
                results.append(_skip(name, f"the connection is gone (see {broken})"))
                continue
            try:
                results.append(await step())
            except TimeoutError:
                results.append(
                    CheckResult(
                        name,
                        Verdict.FAIL,
                        f"no answer from {host}:{port} within {wait_seconds:g} s",
                        "the server there is busy or stuck: restart it; check both sides with doctor",
                    )
                )
                broken = name
            except (OSError, rdmaio.RdmaError, ValueError) as exc:
                results.append(
                    CheckResult(
                        name,
                        Verdict.FAIL,
                        f"{type(exc).__name__}: {exc}",
                        "python -m rdmaio doctor on both hosts; the server's output says more",
                    )
                )
                broken = name
    return results
