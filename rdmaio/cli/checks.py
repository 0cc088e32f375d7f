"""The checks of ``rdmaio doctor``: each a function of a :class:`~rdmaio.cli.system.System` that returns
one :class:`CheckResult` (a verdict, one line of explanation, and the fix when it is not ``ok``)."""

from __future__ import annotations

import contextlib
import enum
import resource
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdmaio.cli.startup import EXTENSION_FIX, describe_extension_error
from rdmaio.cli.system import PortState, System
from rdmaio.options import Options

__all__ = [
    "CHECKS",
    "NEEDS_EXTENSION",
    "CheckResult",
    "Verdict",
    "check_dev_nodes",
    "check_devices",
    "check_driver",
    "check_extension",
    "check_features",
    "check_gids",
    "check_libraries",
    "check_loopback",
    "check_memlock",
    "check_module",
    "check_mtu",
    "check_netns",
    "check_providers",
    "check_verbs",
    "testhost_command",
]

#: Kernel drivers of RDMA devices: Soft-RoCE and soft-iWARP, then the vendors' (``ls drivers/infiniband/hw``).
DRIVER_MODULES = (
    "rdma_rxe",
    "siw",
    "mlx5_ib",
    "mlx4_ib",
    "irdma",
    "bnxt_re",
    "efa",
    "erdma",
    "hns_roce_hw_v2",
    "qedr",
    "iw_cxgb4",
    "mana_ib",
    "ionic_rdma",
    "vmw_pvrdma",
    "ocrdma",
    "hfi1",
    "ib_qib",
    "usnic_verbs",
)
RDMA_LIBRARIES = {"libibverbs.so.1": "libibverbs1", "librdmacm.so.1": "librdmacm1"}
GOOD_MTU = 1024
SUDO = "sudo "


class Verdict(enum.StrEnum):
    """The outcome of one check."""

    OK = "ok"
    WARN = "warn"
    """Works, but not as well as it could (the fix says how)."""
    FAIL = "fail"
    """A connection cannot work until this is fixed."""
    SKIP = "skip"
    """Not checked, because an earlier check failed (the reason says which)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check, as one line of text (``summary``) plus the fix."""

    name: str
    verdict: Verdict
    summary: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    """Machine-readable details for ``--json``."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "name": self.name,
            "verdict": str(self.verdict),
            "summary": self.summary,
            "fix": self.fix,
            "data": self.data,
        }


def testhost_command() -> str:
    """How to run doctor in the test host from this interpreter."""
    py = shlex.quote(sys.executable)
    return f"{py} -m rdmaio.testing.host -- {py} -m rdmaio doctor"


def check_extension(system: System) -> CheckResult:
    """rdmaio's compiled cffi extension loads (it links libibverbs and librdmacm)."""
    try:
        system.import_extension()
    except ImportError as exc:
        return CheckResult("extension", Verdict.FAIL, describe_extension_error(exc), EXTENSION_FIX)
    return CheckResult("extension", Verdict.OK, "rdmaio's cffi extension loads")


def _library_paths(system: System) -> dict[str, str]:
    paths: dict[str, str] = {}
    for line in (system.run(["ldconfig", "-p"]) or "").splitlines():
        name, sep, path = line.strip().partition(" => ")
        soname = name.split(" ", 1)[0]
        if sep and soname in RDMA_LIBRARIES:
            paths.setdefault(soname, path.strip())
    return paths


def check_libraries(system: System) -> CheckResult:
    """The rdma-core user libraries (libibverbs, librdmacm) are installed; report their versions."""
    paths = _library_paths(system)
    missing = [soname for soname in RDMA_LIBRARIES if soname not in paths]
    if missing:
        packages = " ".join(RDMA_LIBRARIES[m] for m in missing)
        return CheckResult(
            "libraries",
            Verdict.FAIL,
            f"{', '.join(missing)} not found by ldconfig",
            f"{SUDO}apt-get install {packages} (rdma-core; dnf install rdma-core on Fedora/RHEL)",
        )
    versions = {}
    for soname, path in paths.items():
        real = system.path(path).resolve().name  # libibverbs.so.1.14.44.0: its third number is rdma-core's
        versions[soname.split(".so")[0]] = real.partition(".so.")[2] or "unknown"
    text = ", ".join(f"{lib} {v}" for lib, v in versions.items())
    releases = {v.split(".")[2] for v in versions.values() if v.count(".") >= 2}
    if len(releases) == 1:
        text += f" (rdma-core {releases.pop()})"
    return CheckResult("libraries", Verdict.OK, text, data={"versions": versions})


def check_providers(system: System) -> CheckResult:
    """User-space drivers (verbs providers) are installed: ``/etc/libibverbs.d/*.driver``."""
    try:
        names = sorted(p.stem for p in system.path("/etc/libibverbs.d").glob("*.driver"))
    except OSError:
        names = []
    if not names:
        return CheckResult(
            "providers",
            Verdict.FAIL,
            "no verbs provider in /etc/libibverbs.d (ibv_get_device_list will find no device)",
            f"{SUDO}apt-get install ibverbs-providers",
        )
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    text = f"{len(names)} verbs providers: {shown}"
    return CheckResult("providers", Verdict.OK, text, data={"providers": names})


def _module_state(system: System, name: str) -> tuple[bool, bool]:
    """(loaded, installed) for a kernel module; a built-in module counts as both."""
    modules = system.read("/proc/modules") or ""
    loaded = any(line.split(" ", 1)[0] == name for line in modules.splitlines())
    loaded = loaded or system.path(f"/sys/module/{name}").is_dir()
    index = "".join(
        system.read(f"/lib/modules/{system.release}/{f}") or "" for f in ("modules.dep", "modules.builtin")
    )
    installed = loaded or f"/{name}.ko" in index
    return loaded, installed


def check_module(name: str, purpose: str) -> Callable[[System], CheckResult]:
    """A check that kernel module ``name`` is loaded (``purpose`` says what it provides)."""

    def check(system: System) -> CheckResult:
        loaded, installed = _module_state(system, name)
        if loaded:
            return CheckResult(name, Verdict.OK, f"{name} loaded ({purpose})")
        if installed:
            return CheckResult(name, Verdict.FAIL, f"{name} not loaded ({purpose})", f"{SUDO}modprobe {name}")
        return CheckResult(
            name,
            Verdict.FAIL,
            f"{name} not loaded and not installed for kernel {system.release} ({purpose})",
            f"install the kernel's modules (apt-get install linux-image-amd64), or use the test host: "
            f"{testhost_command()}",
        )

    check.__name__ = f"check_{name}"
    check.__doc__ = f"Kernel module {name} is loaded ({purpose})."
    return check


def check_driver(system: System) -> CheckResult:
    """A kernel driver of an RDMA device is loaded: ``rdma_rxe`` (Soft-RoCE), ``siw`` or a vendor's."""
    states = {name: _module_state(system, name) for name in DRIVER_MODULES}
    loaded = [name for name, (is_loaded, _) in states.items() if is_loaded]
    if loaded:
        text = f"RDMA driver loaded: {', '.join(loaded)}"
        return CheckResult("driver", Verdict.OK, text, data={"loaded": loaded})
    if states["rdma_rxe"][1]:
        return CheckResult(
            "driver",
            Verdict.FAIL,
            "no RDMA driver loaded (rdma_rxe, Soft-RoCE, is installed)",
            f"{SUDO}modprobe rdma_rxe && {SUDO}rdma link add rxe0 type rxe netdev ETH "
            "(ETH: a network interface with an IPv4 address)",
        )
    return CheckResult(
        "driver",
        Verdict.FAIL,
        f"no RDMA driver loaded and none installed for kernel {system.release}",
        f"install your NIC's driver or the kernel's rdma_rxe, or use the test host: {testhost_command()}",
    )


def check_dev_nodes(system: System) -> CheckResult:
    """``/dev/infiniband/rdma_cm`` and ``uverbs*`` exist and this user may open them read-write."""
    base = system.path("/dev/infiniband")
    try:
        nodes = sorted(p for p in base.iterdir() if p.name == "rdma_cm" or p.name.startswith("uverbs"))
    except OSError:
        nodes = []
    names = [p.name for p in nodes]
    if "rdma_cm" not in names or not any(n.startswith("uverbs") for n in names):
        need = [n for n in ("rdma_cm", "uverbs*") if not any(x.startswith(n.rstrip("*")) for x in names)]
        return CheckResult(
            "dev-nodes",
            Verdict.FAIL,
            f"/dev/infiniband lacks {' and '.join(need)} (present: {', '.join(names) or 'nothing'})",
            f"{SUDO}modprobe ib_uverbs rdma_ucm (with a device driver loaded); in a container, pass "
            "--device /dev/infiniband",
        )
    denied = [p.name for p in nodes if not system.access(p)]
    if denied:
        return CheckResult(
            "dev-nodes",
            Verdict.FAIL,
            f"no read-write access to /dev/infiniband/{{{','.join(denied)}}}",
            f"{SUDO}chmod 666 /dev/infiniband/rdma_cm /dev/infiniband/uverbs* (or install rdma-core's udev "
            "rules, which do that)",
        )
    return CheckResult("dev-nodes", Verdict.OK, f"/dev/infiniband: {', '.join(names)} (read-write)")


def _no_device(name: str) -> CheckResult:
    return CheckResult(name, Verdict.SKIP, "no RDMA device (see devices)")


def check_devices(system: System) -> CheckResult:
    """There is an RDMA device with an ACTIVE port (``/sys/class/infiniband``)."""
    devices = system.sysfs_devices()
    if not devices:
        return CheckResult(
            "devices",
            Verdict.FAIL,
            "no RDMA device on this machine (/sys/class/infiniband is empty or missing)",
            f"add Soft-RoCE ({SUDO}rdma link add rxe0 type rxe netdev ETH) or run in the test host: "
            f"{testhost_command()}",
        )
    ports = [p for d in devices for p in d.ports]
    text = ", ".join(f"{p.device}/{p.number} {p.state} {p.link_layer}" for p in ports)
    data = {"ports": [{"device": p.device, "port": p.number, "state": p.state} for p in ports]}
    if not any(p.state == "ACTIVE" for p in ports):
        return CheckResult(
            "devices",
            Verdict.FAIL,
            f"no ACTIVE port: {text or 'no ports'}",
            "bring the port's network interface up (ip link set dev ETH up) and check the cable/switch",
            data,
        )
    return CheckResult("devices", Verdict.OK, text, data=data)


def check_verbs(system: System) -> CheckResult:
    """libibverbs can open every device (its provider is installed and matches the kernel driver)."""
    if not system.sysfs_devices():
        return _no_device("verbs")
    try:
        infos = system.list_devices()
    except OSError as exc:
        return CheckResult(
            "verbs",
            Verdict.FAIL,
            f"libibverbs cannot open the devices: {exc}",
            f"{SUDO}apt-get install ibverbs-providers (the device's user-space driver)",
        )
    text = ", ".join(f"{d.name} (fw {d.fw_ver or '-'}, max_qp {d.max_qp})" for d in infos)
    return CheckResult("verbs", Verdict.OK, f"opened {text}", data={"devices": [d.name for d in infos]})


def _active_ports(system: System) -> list[PortState]:
    return [p for d in system.sysfs_devices() for p in d.ports if p.state == "ACTIVE"]


def check_gids(system: System) -> CheckResult:
    """Each ACTIVE port has GIDs; a RoCE port has a RoCE v2 GID for an IPv4 address of its netdev; an iWARP
    port (whose GIDs are MAC-based, RoCE's checks do not apply) has an IPv4 address on its netdev."""
    ports = _active_ports(system)
    if not ports:
        return _no_device("gids")
    parts, bad = [], []
    for port in ports:
        where = f"{port.device}/{port.number}"
        if port.transport == "iWARP":
            addrs = system.ipv4_addresses(port.netdev) if port.netdev else []
            parts.append(
                f"{where}: iWARP, {len(port.gids)} MAC-based GIDs, netdev {port.netdev or '-'}, "
                f"IPv4 {', '.join(addrs) or 'none'}"
            )
            if not addrs:
                bad.append(where)
            continue
        if port.link_layer != "Ethernet":
            parts.append(f"{where}: {len(port.gids)} GIDs")
            if not port.gids:
                bad.append(where)
            continue
        addrs = port.roce_v2_ipv4()
        parts.append(f"{where}: netdev {port.netdev or '-'}, RoCE v2 IPv4 {', '.join(addrs) or 'none'}")
        if not addrs:
            bad.append(where)
    text = "; ".join(parts)
    if bad:
        return CheckResult(
            "gids",
            Verdict.FAIL,
            f"{text} — rdma_cm over IPv4 needs an IPv4 address on the port's netdev",
            f"{SUDO}ip addr add ADDR/PREFIX dev NETDEV (the netdev of {', '.join(bad)})",
        )
    return CheckResult("gids", Verdict.OK, text)


def check_features(system: System) -> CheckResult:
    """What each device offers that changes what rdmaio does on it: transport, immediate data, atomics,
    memory windows, scatter entries of a READ and of a send (``ibv_devinfo -v``)."""
    devices = system.sysfs_devices()
    if not devices:
        return _no_device("features")
    caps = system.device_caps()
    parts: list[str] = []
    data: dict[str, Any] = {}
    for device in devices:
        transport = ", ".join(sorted({p.transport for p in device.ports})) or "unknown"
        immediate = "iWARP" not in transport
        entry: dict[str, Any] = {"transport": transport, "immediate_data": immediate}
        found = caps.get(device.name)
        if found is None:
            parts.append(f"{device.name}: {transport}, immediate data {'yes' if immediate else 'none'}")
        else:
            entry.update(
                atomics=found.atomics,
                atomic_cap=found.atomic_cap,
                max_mw=found.max_mw,
                max_sge_rd=found.max_sge_rd,
                max_sge=found.max_sge,
            )
            parts.append(
                f"{device.name}: {transport}, immediate data {'yes' if immediate else 'none'}, "
                f"atomics {'yes' if found.atomics else 'none'} ({found.atomic_cap or '?'}), "
                f"memory windows {found.max_mw or 'none'}, READ scatter entries {found.max_sge_rd}, "
                f"send scatter entries {found.max_sge}"
            )
        data[device.name] = entry
    text = "; ".join(parts)
    if not caps:
        text += (
            " (atomics, memory windows and scatter entries: ibv_devinfo -v, from ibverbs-utils, gave none)"
        )
    return CheckResult("features", Verdict.OK, text, data=data)


def check_mtu(system: System) -> CheckResult:
    """The active MTU of each ACTIVE port (RoCE derives it from the netdev's MTU)."""
    if not system.sysfs_devices():
        return _no_device("mtu")
    try:
        infos = system.list_devices()
    except OSError:
        return CheckResult("mtu", Verdict.SKIP, "libibverbs cannot open the devices (see verbs)")
    ports = [(d.name, p) for d in infos for p in d.ports if p.active]
    if not ports:
        return CheckResult("mtu", Verdict.SKIP, "no ACTIVE port (see devices)")
    text = ", ".join(f"{name}/{p.number} {p.active_mtu} (max {p.max_mtu})" for name, p in ports)
    small = [f"{name}/{p.number}" for name, p in ports if p.active_mtu < GOOD_MTU]
    if small:
        return CheckResult(
            "mtu",
            Verdict.WARN,
            f"active MTU {text}: below {GOOD_MTU}, every message is cut into many packets",
            f"{SUDO}ip link set dev NETDEV mtu 1500 (or 9000 with jumbo frames) for {', '.join(small)}",
        )
    return CheckResult("mtu", Verdict.OK, f"active MTU {text}")


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def check_memlock(system: System) -> CheckResult:
    """``RLIMIT_MEMLOCK`` allows the memory default :class:`~rdmaio.Options` register per connection."""
    opts = Options()
    per_conn = (opts.recv_depth + opts.send_depth) * opts.slot_size
    soft, hard = system.memlock()
    need = f"default Options register up to {_format_bytes(per_conn)} per connection"
    data = {"soft": soft, "hard": hard, "per_connection": per_conn}
    if soft == resource.RLIM_INFINITY:
        return CheckResult("memlock", Verdict.OK, f"ulimit -l unlimited ({need})", data=data)
    if system.has_cap_ipc_lock():
        text = f"ulimit -l {soft // 1024} KiB, not enforced: CAP_IPC_LOCK ({need})"
        return CheckResult("memlock", Verdict.OK, text, data=data)
    fits = soft // per_conn
    raise_to = "unlimited" if hard == resource.RLIM_INFINITY else str(hard // 1024)
    fix = (
        f"ulimit -l {raise_to} (this shell, up to the hard limit); for good: '* - memlock unlimited' in "
        "/etc/security/limits.conf, LimitMEMLOCK=infinity for a systemd unit, --ulimit memlock=-1 for docker"
    )
    text = f"ulimit -l {soft // 1024} KiB: room for {fits} connection(s); {need}"
    # A loopback (client and server in one process) needs two.
    if fits < 2:
        return CheckResult("memlock", Verdict.FAIL, text, fix, data)
    if fits < 16:
        return CheckResult("memlock", Verdict.WARN, text, fix, data)
    return CheckResult("memlock", Verdict.OK, text, data=data)


def check_netns(system: System) -> CheckResult:
    """The RDMA subsystem's network-namespace mode (``rdma system``): shared or exclusive."""
    out = system.run(["rdma", "system"])
    devices = system.sysfs_devices()
    if out is None:
        if not devices:
            return _no_device("netns")
        return CheckResult(
            "netns", Verdict.WARN, "cannot run 'rdma system'", f"{SUDO}apt-get install iproute2"
        )
    tokens = out.split()
    mode = tokens[tokens.index("netns") + 1] if "netns" in tokens[:-1] else "unknown"
    if mode == "shared":
        return CheckResult("netns", Verdict.OK, "netns shared: every network namespace sees the devices")
    if mode == "exclusive" and devices:
        return CheckResult("netns", Verdict.OK, "netns exclusive: this namespace sees its devices")
    return CheckResult(
        "netns",
        Verdict.WARN,
        f"netns {mode}: devices are visible only in the namespace they were moved to",
        f"{SUDO}rdma dev set DEV netns NS, or {SUDO}rdma system set netns shared",
    )


def _port_addresses(system: System, port: PortState) -> list[str]:
    addrs = port.roce_v2_ipv4()
    netdevs = [port.netdev] if port.netdev else []
    with contextlib.suppress(OSError):  # IPoIB: the netdev sits under the device's PCI function
        netdevs += [p.name for p in system.path(f"/sys/class/infiniband/{port.device}/device/net").iterdir()]
    for netdev in netdevs:
        addrs += [a for a in system.ipv4_addresses(netdev) if a not in addrs]
    return addrs


def check_loopback(system: System, timeout: float = 20.0) -> CheckResult:
    """A connect and echo through rdmaio on each device with an ACTIVE port and an IPv4 address."""
    targets: dict[str, str] = {}
    for port in _active_ports(system):
        addrs = _port_addresses(system, port)
        if addrs and port.device not in targets:
            targets[port.device] = addrs[0]
    if not targets:
        if not _active_ports(system):
            return _no_device("loopback")
        return CheckResult("loopback", Verdict.SKIP, "no ACTIVE port with an IPv4 address (see gids)")
    parts, failed = [], []
    for device, addr in targets.items():
        try:
            seconds = system.loopback(addr, timeout)
        except TimeoutError:
            failed.append(f"{device} {addr}: no echo within {timeout:g} s")
        except Exception as exc:  # any failure is the finding here: report it, do not crash
            failed.append(f"{device} {addr}: {type(exc).__name__}: {exc}")
        else:
            inline = getattr(seconds, "max_inline", None)
            extra = f", max inline {inline} B" if inline is not None else ""
            parts.append(f"{device} {addr}: connect+echo ok ({seconds * 1000:.1f} ms{extra})")
    data = {"targets": targets}
    if failed:
        return CheckResult(
            "loopback",
            Verdict.FAIL,
            "; ".join(failed + parts),
            "run the checks above first; then python -m rdmaio ping --server ADDR and python -m rdmaio ping "
            "ADDR show the error in full",
            data,
        )
    return CheckResult("loopback", Verdict.OK, "; ".join(parts), data=data)


#: The checks that load rdmaio's compiled extension: skipped when the ``extension`` check failed.
NEEDS_EXTENSION: frozenset[str] = frozenset({"verbs", "mtu", "loopback"})

#: Every check, in the order doctor runs and prints them.
CHECKS: tuple[Callable[[System], CheckResult], ...] = (
    check_libraries,
    check_providers,
    check_extension,
    check_module("ib_uverbs", "verbs device files"),
    check_module("rdma_ucm", "rdma_cm from user space"),
    check_driver,
    check_dev_nodes,
    check_devices,
    check_verbs,
    check_gids,
    check_features,
    check_mtu,
    check_memlock,
    check_netns,
    check_loopback,
)
