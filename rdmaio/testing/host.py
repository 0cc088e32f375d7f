"""The test host: run a command where an RDMA device is available.

Usage::

    python -m rdmaio.testing.host [options] -- CMD [ARGS...]

If this machine already has a usable RDMA device (an ACTIVE ``rdma link`` whose netdev has an IPv4
address), CMD runs here directly. Otherwise a throwaway virtual machine is booted with virtme-ng on an
installed Debian kernel; it shares this machine's root file system read-only and the work directory
read-write, and sets up Soft-RoCE (``rdma_rxe``) as device ``rxe0`` on a dummy netdev ``dum0`` that holds
198.18.0.1/24 and 198.18.0.2/24. CMD then runs inside the VM, in the work directory, with its output
streamed live.

Environment given to CMD (both modes):

``RDMAIO_TESTHOST``
    ``1`` in the VM, ``local`` when CMD runs on this machine's own device.
``RDMAIO_TEST_ADDR`` / ``RDMAIO_TEST_ADDR2``
    an IPv4 address of the RDMA netdev (and a second one in the VM).
``RDMAIO_TEST_DEVICE`` / ``RDMAIO_TEST_NETDEV``
    the RDMA device and its netdev (``rxe0`` and ``dum0`` in the VM).
``RDMAIO_REQUIRE_DEVICE``
    ``1``: tests must not skip for want of a device.

The caller's variables named ``RDMAIO_*``, ``PYTEST_*``, ``CI``, ``PATH``, ``HOME``, ``LANG`` and
``PYTHONPATH`` are passed into the VM. In the VM the locked-memory limit is unlimited and the open files
limit is 65536.

Booting fast: under emulation (this module never uses KVM, which can hang guests) a stock virtme-ng boot
of a Debian kernel spends most of its time in udev's coldplug and in decompressing the kernel. Unless
``--stock-boot`` is given, the VM instead sees a minimal stand-in for ``systemd-udevd`` (it only makes the
``/dev/virtio-ports`` links virtme-ng needs) and masked ``udevadm`` and ``systemd-tmpfiles``, arranged in a
private mount namespace around vng (root only; nothing changes outside it), and it boots an uncompressed
copy of the kernel through its PVH entry (cached in ``~/.cache/rdmaio-testhost``). Either part falls back
to the stock behaviour when unavailable.

Exit status: CMD's own exit status; 2 when a prerequisite is missing and cannot be installed (or the
options are wrong); 3 when the VM failed to boot or to set up RDMA (CMD did not run); 124 when the
``--timeout`` expired. A CMD that itself exits 2 or 3 is reported as such: the VM writes CMD's status to a
file, and only its absence means the VM failed.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import importlib
import lzma
import os
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from rdmaio.cli.system import run_command
from rdmaio.testing import pair

__all__ = [
    "DEFAULT_CPUS",
    "DEFAULT_MEMORY",
    "DEFAULT_TIMEOUT",
    "EXIT_HOST_FAILED",
    "EXIT_PREFLIGHT",
    "EXIT_TIMEOUT",
    "GUEST_ADDR",
    "GUEST_ADDR2",
    "GUEST_DEVICE",
    "GUEST_NETDEV",
    "TOPOLOGIES",
    "LocalRdma",
    "PreflightError",
    "decompress_kernel",
    "filter_env",
    "find_kernel",
    "find_local_rdma",
    "guest_script",
    "have_local_rdma",
    "kernel_release",
    "main",
    "parse_rdma_links",
    "run",
    "rxe_module",
    "uncompressed_kernel",
    "vng_command",
]

EXIT_PREFLIGHT = 2
"""A prerequisite is missing and could not be installed, or the options are wrong."""
EXIT_HOST_FAILED = 3
"""The VM failed to boot or to set up RDMA: CMD did not run."""
EXIT_TIMEOUT = 124
"""The whole run took longer than ``--timeout``."""

GUEST_ADDR = "198.18.0.1"
GUEST_ADDR2 = "198.18.0.2"
GUEST_PREFIX_LEN = 24
GUEST_NETDEV = "dum0"
GUEST_DEVICE = "rxe0"

TOPOLOGIES = ("single", "pair")
"""``single``: one rxe device on a dummy netdev (the default, fastest); ``pair``: two rxe devices joined
by a veth pair (:mod:`rdmaio.testing.pair`), for fault injection on a real netdev."""

# One vCPU: under emulation on a busy 2-core machine a second vCPU made the boot about twice as slow
# (cross-CPU synchronisation while modules load) and the integration suite about 1.5 times as slow
# (measured: rxe ready after 12 s vs 25 s; 42 tests in 454 s vs 698 s). --cpus 2 remains.
DEFAULT_CPUS = 1
DEFAULT_MEMORY = "2G"
DEFAULT_TIMEOUT = 3600.0

BOOT_DIR = Path("/boot")
MODULES_DIR = Path("/lib/modules")
SYSFS_INFINIBAND = Path("/sys/class/infiniband")
STATE_DIRNAME = ".testhost"
QEMU_BINARY = "qemu-system-x86_64"
VIRTME_NG_REQUIREMENT = "virtme-ng>=1.30"

#: Debian packages the VM mode needs, with a file each one provides (checked on this machine, whose root
#: file system the VM shares). The kernel package is handled separately.
GUEST_PACKAGES: dict[str, tuple[str, ...]] = {
    "qemu-system-x86": (f"/usr/bin/{QEMU_BINARY}",),
    "kmod": ("/usr/bin/kmod", "/bin/kmod"),
    "iproute2": ("/usr/sbin/rdma", "/sbin/rdma", "/bin/rdma", "/usr/bin/rdma"),
    "udev": ("/usr/lib/systemd/systemd-udevd", "/lib/systemd/systemd-udevd"),
    "rdma-core": ("/usr/share/doc/rdma-core",),
    "ibverbs-providers": ("/usr/share/doc/ibverbs-providers",),
    "ibverbs-utils": ("/usr/bin/ibv_devinfo",),
    "rdmacm-utils": ("/usr/bin/rping",),
    "perftest": ("/usr/bin/ib_write_bw",),
    "binutils": ("/usr/bin/strings",),  # vng reads an uncompressed kernel's version with strings
    "file": ("/usr/bin/file",),  # ... and a compressed one's with file
}
KERNEL_PACKAGE = "linux-image-amd64"

#: Caller variables passed into the VM: these exact names, and names with these prefixes.
PASSTHROUGH_NAMES = frozenset({"CI", "PATH", "HOME", "LANG", "PYTHONPATH"})
PASSTHROUGH_PREFIXES = ("RDMAIO_", "PYTEST_")

_SHELL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Characters that would break vng's --rwdir=PATH syntax, QEMU's -fsdev option list or the kernel command line.
_BAD_PATH_CHARS = re.compile(r"[\s=,:\"'\\`$]")


class PreflightError(Exception):
    """Something the test host needs is missing, cannot be installed, or an option is wrong."""


def _log(message: str) -> None:
    print(f"testhost: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Kernel selection
# ---------------------------------------------------------------------------------------------------------


def _version_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """A natural sort key: ``6.10.0`` sorts after ``6.9.2``."""
    parts = re.findall(r"\d+|[^\d.\-+_~]+", text)
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in parts)


def kernel_release(kernel: Path) -> str:
    """The release (``uname -r``) of a kernel image.

    Read from the bzImage header when possible, else taken from a ``vmlinuz-RELEASE`` file name.
    """
    try:
        with kernel.open("rb") as f:
            header = f.read(0x400)
            if len(header) >= 0x210 and header[0x202:0x206] == b"HdrS":
                offset = int.from_bytes(header[0x20E:0x210], "little") + 0x200
                f.seek(offset)
                version = f.read(256).split(b"\0", 1)[0].decode("ascii", "replace")
                if version.strip():
                    return version.split()[0]
    except OSError:
        pass
    name = kernel.name
    for prefix in ("vmlinuz-", "vmlinux-", "bzImage-"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def rxe_module(release: str, modules_dir: Path = MODULES_DIR) -> Path | None:
    """The ``rdma_rxe`` module file for kernel ``release``, or None when it is not installed."""
    rxe_dir = modules_dir / release / "kernel" / "drivers" / "infiniband" / "sw" / "rxe"
    found = sorted(rxe_dir.glob("rdma_rxe.ko*")) if rxe_dir.is_dir() else []
    return found[0] if found else None


def find_kernel(boot_dir: Path = BOOT_DIR, modules_dir: Path = MODULES_DIR) -> Path:
    """The kernel image to boot: the newest ``vmlinuz-*`` in ``boot_dir``.

    Kernels whose ``rdma_rxe`` module is installed are preferred over newer ones without it.
    Raises :class:`PreflightError` when there is no kernel image at all.
    """
    images = [p for p in boot_dir.glob("vmlinuz-*") if p.is_file()]
    if not images:
        raise PreflightError(
            f"no kernel image {boot_dir}/vmlinuz-* found: install one "
            f"(apt-get install {KERNEL_PACKAGE}) or pass --kernel PATH"
        )
    images.sort(key=lambda p: _version_key(p.name[len("vmlinuz-") :]), reverse=True)
    with_rxe = [p for p in images if rxe_module(p.name[len("vmlinuz-") :], modules_dir) is not None]
    return (with_rxe or images)[0]


# ---------------------------------------------------------------------------------------------------------
# Local RDMA detection
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RdmaLink:
    """One line of ``rdma link show``."""

    device: str
    port: str
    state: str
    netdev: str | None


@dataclass(frozen=True)
class LocalRdma:
    """A usable RDMA device on this machine."""

    device: str
    netdev: str
    addr: str


def parse_rdma_links(text: str) -> list[RdmaLink]:
    """Parse the output of ``rdma link show``."""
    links: list[RdmaLink] = []
    for line in text.splitlines():
        tokens = line.split()
        if len(tokens) < 2 or tokens[0] != "link" or "/" not in tokens[1]:
            continue
        device, _, port = tokens[1].partition("/")
        fields: dict[str, str] = {}
        for i in range(2, len(tokens) - 1):
            fields.setdefault(tokens[i], tokens[i + 1])
        links.append(RdmaLink(device, port, fields.get("state", ""), fields.get("netdev")))
    return links


def _ipv4_addresses(netdev: str) -> list[str]:
    out = run_command(["ip", "-4", "-o", "addr", "show", "dev", netdev])
    return re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out or "")


def find_local_rdma(
    sysfs: Path = SYSFS_INFINIBAND,
    rdma_link_output: str | None = None,
    ipv4_of: Callable[[str], list[str]] | None = None,
) -> LocalRdma | None:
    """This machine's usable RDMA device, or None.

    Usable means: ``sysfs`` lists a device, and ``rdma link`` shows an ACTIVE port of it whose netdev has
    an IPv4 address. ``rdma_link_output`` and ``ipv4_of`` replace the ``rdma link`` and ``ip addr``
    commands (for tests).
    """
    try:
        devices = {p.name for p in sysfs.iterdir()}
    except OSError:
        return None
    if not devices:
        return None
    if rdma_link_output is None:
        rdma_link_output = run_command(["rdma", "link", "show"]) or ""
    lookup = ipv4_of if ipv4_of is not None else _ipv4_addresses
    for link in parse_rdma_links(rdma_link_output):
        if link.device in devices and link.state == "ACTIVE" and link.netdev:
            addrs = lookup(link.netdev)
            if addrs:
                return LocalRdma(link.device, link.netdev, addrs[0])
    return None


def have_local_rdma(
    sysfs: Path = SYSFS_INFINIBAND,
    rdma_link_output: str | None = None,
    ipv4_of: Callable[[str], list[str]] | None = None,
) -> bool:
    """Whether this machine has a usable RDMA device (see :func:`find_local_rdma`)."""
    return find_local_rdma(sysfs, rdma_link_output, ipv4_of) is not None


# ---------------------------------------------------------------------------------------------------------
# The guest script
# ---------------------------------------------------------------------------------------------------------


def filter_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables that are passed into the VM."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if _SHELL_NAME.match(name)
        and (name in PASSTHROUGH_NAMES or name.startswith(PASSTHROUGH_PREFIXES))
        and "\0" not in value
    }


def _harness_env(mode: str, device: str, netdev: str, addr: str, addr2: str | None) -> dict[str, str]:
    env = {
        "RDMAIO_TESTHOST": mode,
        "RDMAIO_TEST_ADDR": addr,
        "RDMAIO_TEST_DEVICE": device,
        "RDMAIO_TEST_NETDEV": netdev,
        "RDMAIO_REQUIRE_DEVICE": "1",
    }
    if addr2 is not None:
        env["RDMAIO_TEST_ADDR2"] = addr2
    return env


def _pair_env() -> dict[str, str]:
    a, b = pair.NODES
    return {
        "RDMAIO_TOPOLOGY": "pair",
        "RDMAIO_TEST_ADDR": a.addr,
        "RDMAIO_TEST_ADDR2": b.addr,
        "RDMAIO_TEST_ADDR6": a.addr6,
        "RDMAIO_TEST_ADDR6_2": b.addr6,
        "RDMAIO_TEST_DEVICE": a.device,
        "RDMAIO_TEST_DEVICE2": b.device,
        "RDMAIO_TEST_NETDEV": a.netdev,
        "RDMAIO_TEST_NETDEV2": b.netdev,
    }


def guest_script(
    cmd: Sequence[str], *, workdir: Path, run_dir: Path, env: Mapping[str, str], topology: str = "single"
) -> str:
    """The bash script the VM runs: set up ``rxe0`` (and ``rxe1`` with ``topology="pair"``), then run
    ``cmd`` in ``workdir``.

    ``env`` is exported (after filtering with :func:`filter_env`); the harness's own variables are set
    last and win. CMD's exit status is written to ``run_dir/rc``; ``run_dir/ready`` gets the guest
    uptime at which RDMA was ready. Under emulation every program started costs a good fraction of a
    second, so the script starts as few as it can (one modprobe, one ip, two rdma) and uses bash
    builtins for the rest.
    """
    if not cmd:
        raise ValueError("empty command")
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r} (one of {', '.join(TOPOLOGIES)})")
    q = shlex.quote
    exports = {
        **filter_env(env),
        **_harness_env("1", GUEST_DEVICE, GUEST_NETDEV, GUEST_ADDR, GUEST_ADDR2),
        **({"RDMAIO_TOPOLOGY": "single"} if topology == "single" else _pair_env()),
    }
    export_lines = "\n".join(f"export {name}={q(value)}" for name, value in exports.items())
    net, dev = GUEST_NETDEV, GUEST_DEVICE
    # dummy and crc32 would otherwise be loaded on demand by the kernel, one modprobe run each.
    modules = "rdma_rxe rdma_ucm ib_uverbs"
    if topology == "single":
        why = f"ip: cannot set up {net} with {GUEST_ADDR} and {GUEST_ADDR2}"
        netdev_setup = f"""ip -batch - <<'EOF_IP' || fail "{why}"
link add {net} type dummy
link set {net} up
addr add {GUEST_ADDR}/{GUEST_PREFIX_LEN} dev {net}
addr add {GUEST_ADDR2}/{GUEST_PREFIX_LEN} dev {net}
EOF_IP
rdma link add {dev} type rxe netdev {net} || fail "rdma link add {dev} type rxe netdev {net} failed"
"""
        devices = [dev]
        extra_modules = "dummy crc32_generic"
    else:
        netdev_setup = pair.setup_script()
        devices = [n.device for n in pair.NODES]
        extra_modules = "veth crc32_generic"
    wait_lines = "\n".join(
        f"""for ((i = 0; i < 100; i++)); do
    state=
    read -r state </sys/class/infiniband/{d}/ports/1/state 2>/dev/null
    [[ $state == *ACTIVE* ]] && break
    sleep 0.1
done
links=$(rdma link show {d}/1 2>&1)
[[ " $links " == *" state ACTIVE "* ]] || fail "{d} is not ACTIVE: $links"
"""
        for d in devices
    )
    ready = " and ".join(devices)
    return f"""#!/bin/bash
# Generated by rdmaio.testing.host for one run; removed when the run ends.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN_DIR={q(str(run_dir))}
uptime_s() {{ local rest; read -r REPLY rest </proc/uptime; }}
fail() {{ echo "testhost: guest setup failed: $*" >&2; exit {EXIT_HOST_FAILED}; }}

# Soft-RoCE on a dummy netdev (rxe on lo does not work with rdma_cm), or on a veth pair (topology pair).
modprobe -a {modules} {extra_modules} 2>/dev/null || modprobe -a {modules} ||
    fail "modprobe {modules} failed"
{netdev_setup.rstrip()}
{wait_lines.rstrip()}
[[ -e /dev/infiniband/uverbs0 && -e /dev/infiniband/rdma_cm ]] || fail "/dev/infiniband device nodes missing"
ulimit -l unlimited || fail "cannot raise the locked-memory limit"
ulimit -n 65536 || fail "cannot raise the open-files limit"
uptime_s
echo "$REPLY" >"$RUN_DIR/ready"
echo "testhost: {ready} ready at {GUEST_ADDR} after $REPLY s" >&2

{export_lines}
export PATH="${{PATH:+$PATH:}}/usr/local/sbin:/usr/sbin:/sbin"
cd {q(str(workdir))} || fail "cannot cd to {workdir}"
{shlex.join(cmd)} </dev/null
rc=$?
echo "$rc" >"$RUN_DIR/rc"
exit "$rc"
"""


# ---------------------------------------------------------------------------------------------------------
# Preflight and installation
# ---------------------------------------------------------------------------------------------------------


def _sbin_path() -> str:
    path = os.environ.get("PATH", "")
    extra = [d for d in ("/usr/local/sbin", "/usr/sbin", "/sbin") if d not in path.split(os.pathsep)]
    return os.pathsep.join([p for p in [path, *extra] if p])


def _bin_dir() -> Path:
    return Path(sys.executable).parent


def _vng_path() -> str:
    return os.pathsep.join([str(_bin_dir()), os.environ.get("PATH", "")])


def _find_vng() -> str | None:
    vng = shutil.which("vng", path=_vng_path())
    run = shutil.which("virtme-run", path=_vng_path())
    return vng if vng and run else None


def _dpkg_installed(package: str) -> bool | None:
    """True/False from dpkg, None when this is not a dpkg system."""
    if shutil.which("dpkg-query") is None:
        return None
    done = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return done.returncode == 0 and done.stdout.strip().endswith(" installed")


def _package_present(package: str, files: Sequence[str]) -> bool:
    installed = _dpkg_installed(package)
    if installed is not None:
        return installed
    return any(Path(f).exists() for f in files)


class _Installer:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.updated = False

    def apt(self, packages: Sequence[str], why: str) -> None:
        if not packages:
            return
        names = " ".join(packages)
        if not self.enabled:
            raise PreflightError(
                f"{why}: missing Debian packages {names} (apt-get install {names}; or --install)"
            )
        if shutil.which("apt-get") is None:
            raise PreflightError(f"{why}: missing packages {names}, and there is no apt-get to install them")
        if os.geteuid() != 0:
            raise PreflightError(
                f"{why}: missing packages {names}; installing them needs root (--install as root)"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if not self.updated:
            _log("apt-get update")
            done = subprocess.run(["apt-get", "update"], env=env, stdin=subprocess.DEVNULL, check=False)
            if done.returncode:
                raise PreflightError(f"apt-get update failed (exit {done.returncode})")
            self.updated = True
        _log(f"installing {names}")
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", *packages],
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if done.returncode:
            raise PreflightError(f"apt-get install {names} failed (exit {done.returncode})")

    def virtme_ng(self) -> None:
        if not self.enabled:
            raise PreflightError(
                f"virtme-ng (vng) not found: pip install '{VIRTME_NG_REQUIREMENT}' into {sys.prefix}; "
                "or --install"
            )
        _log(f"pip install {VIRTME_NG_REQUIREMENT} into {sys.prefix}")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", VIRTME_NG_REQUIREMENT],
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if done.returncode:
            raise PreflightError(f"pip install {VIRTME_NG_REQUIREMENT} failed (exit {done.returncode})")
        importlib.invalidate_caches()


@dataclass(frozen=True)
class _VmPlan:
    kernel: Path
    vng: str


def _check_workdir(workdir: Path) -> None:
    if not workdir.is_dir():
        raise PreflightError(f"work directory {workdir} does not exist")
    if _BAD_PATH_CHARS.search(str(workdir)):
        raise PreflightError(
            f"work directory {workdir} contains characters the VM cannot share (space , = : quotes \\ $)"
        )


def _preflight(kernel: Path | None, install: bool) -> _VmPlan:
    installer = _Installer(install)

    # Kernel: an explicit --kernel is never replaced by an installed one.
    if kernel is not None:
        if not kernel.is_file():
            raise PreflightError(f"kernel image {kernel} not found")
        if not os.access(kernel, os.R_OK):
            raise PreflightError(f"kernel image {kernel} is not readable (try running as root)")
    else:
        try:
            kernel = find_kernel()
        except PreflightError:
            installer.apt([KERNEL_PACKAGE], "no kernel image /boot/vmlinuz-*")
            kernel = find_kernel()
        if rxe_module(kernel_release(kernel)) is None and _dpkg_installed(KERNEL_PACKAGE) is False:
            installer.apt([KERNEL_PACKAGE], f"kernel {kernel} has no rdma_rxe module")
            kernel = find_kernel()
        if not os.access(kernel, os.R_OK):
            raise PreflightError(f"kernel image {kernel} is not readable (try running as root)")
    release = kernel_release(kernel)
    if rxe_module(release) is None:
        raise PreflightError(
            f"kernel {release} ({kernel}) has no rdma_rxe module "
            f"({MODULES_DIR}/{release}/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*); "
            f"boot a kernel that has it (Debian: {KERNEL_PACKAGE})"
        )

    missing = [pkg for pkg, files in GUEST_PACKAGES.items() if not _package_present(pkg, files)]
    if missing and install:
        installer.apt(missing, "the test host needs QEMU and the RDMA user space")
    elif missing:
        # Only what is checked below is essential; the rest (verbs providers, tools) is warned about.
        _log(f"warning: missing Debian packages {' '.join(missing)} (apt-get install them, or use --install)")
    if shutil.which(QEMU_BINARY) is None:
        raise PreflightError(f"QEMU ({QEMU_BINARY}) not found: apt-get install qemu-system-x86")
    for tool, pkg in (("modprobe", "kmod"), ("ip", "iproute2"), ("rdma", "iproute2")):
        if shutil.which(tool, path=_sbin_path()) is None:
            raise PreflightError(f"{tool} not found: apt-get install {pkg}")
    if not any(Path("/usr/lib").glob("*/libibverbs/librxe-rdmav*.so")) and not any(
        Path("/usr/lib64").glob("libibverbs/librxe-rdmav*.so")
    ):
        raise PreflightError("the rxe verbs provider (librxe) is missing: apt-get install ibverbs-providers")

    vng = _find_vng()
    if vng is None:
        installer.virtme_ng()
        vng = _find_vng()
        if vng is None:
            raise PreflightError(
                f"virtme-ng was installed, yet vng/virtme-run are not in {_bin_dir()} or PATH"
            )
    return _VmPlan(kernel, vng)


# ---------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------


def vng_command(
    vng: str, kernel: Path, *, workdir: Path, script: Path, cpus: int, memory: str, verbose: bool = False
) -> list[str]:
    """The ``vng`` command line that boots the VM and runs ``script`` in it."""
    return [
        vng,
        *(["--verbose"] if verbose else []),  # the kernel console, on stderr
        "--run",
        str(kernel),
        "--disable-kvm",  # /dev/kvm may exist yet hang the guest: emulation is slow but reliable
        "--force-9p",
        "--cpus",
        str(cpus),
        "--memory",
        memory,
        "--name",
        "rdmaio-testhost",
        "--rwdir",
        str(workdir),
        "--cwd",
        str(workdir),
        "--exec",
        f"bash {shlex.quote(str(script))}",
    ]


# Fast boot. Under emulation (no KVM) two things dominate a stock virtme-ng boot of a Debian kernel:
#  * udev's coldplug, which handles every emulated device and loads a module for most of them (KVM, SATA,
#    CD-ROM, watchdogs, input, crypto): 15-20 s. The test host needs none of it; virtme-ng needs only the
#    /dev/virtio-ports/NAME links that udev would make. So the VM gets a stand-in udevd that makes just
#    those links, and udevadm and systemd-tmpfiles (not needed either) are masked. This is done in a
#    private mount namespace around vng (so QEMU's view of the shared root changes, nothing else's);
#    it needs root and falls back to a stock boot when unavailable.
#  * the bzImage decompressing itself (xz) inside the guest: several seconds. The kernel is decompressed
#    once on this machine (cached) and booted as an ELF through its PVH entry point.

FAKE_UDEVD = """#!/bin/sh
# Stand-in for systemd-udevd in the rdmaio test host VM (see rdmaio/testing/host.py): make only the
# /dev/virtio-ports/NAME links that virtme-ng needs; skip udev's coldplug.
mkdir /dev/virtio-ports
cd /sys/class/virtio-ports || exit 0
for p in *; do
    read -r name <"$p/name" && [ -n "$name" ] && ln -s "../$p" "/dev/virtio-ports/$name"
done
exit 0
"""

_NS_SCRIPT = (
    'set -e; mount --bind "$1" /usr/lib/systemd; shift; '
    'while [ "$1" != -- ]; do mount --bind /dev/null "$1"; shift; done; shift; exec "$@"'
)


def _namespace_wrapper(run_dir: Path) -> list[str] | None:
    """A command prefix that runs vng with the fast-boot mounts, or None when that is not possible."""
    unshare = shutil.which("unshare", path=_sbin_path())
    if unshare is None or shutil.which("mount", path=_sbin_path()) is None:
        return None
    if os.geteuid() != 0 or not Path("/usr/lib/systemd").is_dir():
        return None
    sysd = run_dir / "systemd"
    sysd.mkdir(exist_ok=True)
    udevd = sysd / "systemd-udevd"
    udevd.write_text(FAKE_UDEVD)
    udevd.chmod(0o755)
    masked: set[str] = set()
    for name in ("udevadm", "systemd-tmpfiles"):
        for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
            candidate = Path(d) / name
            if candidate.is_file():
                masked.add(str(candidate.resolve()))
    prefix = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", _NS_SCRIPT, "testhost-ns"]
    prefix += [str(sysd), *sorted(masked), "--"]
    try:
        probe = subprocess.run(
            [*prefix, "true"], capture_output=True, stdin=subprocess.DEVNULL, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix if probe.returncode == 0 else None


_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZIP_MAGIC = b"\x1f\x8b"
_PT_NOTE = 4
_XEN_ELFNOTE_PHYS32_ENTRY = 18


def _has_pvh_entry(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF kernel has the Xen PVH entry note QEMU boots it through."""
    if len(elf) < 0x40 or elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return False
    phoff = int.from_bytes(elf[0x20:0x28], "little")
    phentsize = int.from_bytes(elf[0x36:0x38], "little")
    phnum = int.from_bytes(elf[0x38:0x3A], "little")
    for i in range(phnum):
        ph = phoff + i * phentsize
        if ph + 0x28 > len(elf) or int.from_bytes(elf[ph : ph + 4], "little") != _PT_NOTE:
            continue
        pos = int.from_bytes(elf[ph + 8 : ph + 16], "little")
        end = min(len(elf), pos + int.from_bytes(elf[ph + 32 : ph + 40], "little"))
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            pos += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
            if name == b"Xen" and ntype == _XEN_ELFNOTE_PHYS32_ENTRY:
                return True
    return False


def decompress_kernel(kernel: Path) -> bytes | None:
    """The ELF ``vmlinux`` inside a bzImage compressed with xz or gzip, or None."""
    try:
        data = kernel.read_bytes()
    except OSError:
        return None
    if len(data) < 0x250 or data[0x202:0x206] != b"HdrS":
        return None
    setup_sects = data[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", data, 0x248)
    start = (setup_sects + 1) * 512 + payload_offset
    payload = data[start : start + payload_length]
    try:
        if payload.startswith(_XZ_MAGIC):
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
        elif payload.startswith(_GZIP_MAGIC):
            elf = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
        else:
            return None
    except (lzma.LZMAError, zlib.error):
        return None
    return elf if elf.startswith(b"\x7fELF") else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rdmaio-testhost"


def uncompressed_kernel(kernel: Path, cache_dir: Path | None = None) -> Path | None:
    """A cached ELF copy of ``kernel`` that QEMU can boot directly (PVH), or None if there cannot be one.

    vng reads the kernel version of an ELF image with ``strings`` (binutils), so that must be present.
    """
    if shutil.which("strings") is None:
        return None
    cache_dir = cache_dir or _cache_dir()
    try:
        st = kernel.stat()
    except OSError:
        return None
    release = kernel_release(kernel)
    target = cache_dir / f"vmlinux-{release}-{st.st_size}-{st.st_mtime_ns}"
    if target.is_file():
        return target
    elf = decompress_kernel(kernel)
    if elf is None or not _has_pvh_entry(elf):
        return None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for old in cache_dir.glob(f"vmlinux-{release}-*"):
            old.unlink(missing_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(elf)
        os.replace(tmp, target)
    except OSError:
        return None
    return target


class _Tail:
    """The last bytes written by the VM, for the failure message."""

    def __init__(self, limit: int = 16384) -> None:
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, data: bytes) -> None:
        with self._lock:
            self._chunks.append(data)
            self._size += len(data)
            while self._size - len(self._chunks[0]) > self._limit:
                self._size -= len(self._chunks.popleft())

    def lines(self, count: int) -> list[str]:
        with self._lock:
            text = b"".join(self._chunks).decode("utf-8", "replace")
        return text.splitlines()[-count:]


def _pump(src: BinaryIO, dst: TextIO, tail: _Tail) -> None:
    """Copy the VM's output to ``dst`` as it comes (bytes through to its buffer when it has one)."""
    fd = src.fileno()
    raw: BinaryIO | None = getattr(dst, "buffer", None)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        tail.add(data)
        try:
            if raw is not None:
                raw.write(data)
                raw.flush()
            else:
                dst.write(decoder.decode(data))
                dst.flush()
        except (OSError, ValueError):
            pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_vm(
    cmd: Sequence[str],
    plan: _VmPlan,
    *,
    workdir: Path,
    cpus: int,
    memory: str,
    deadline: float,
    keep: bool,
    fast_boot: bool,
    verbose: bool,
    topology: str = "single",
) -> int:
    started = time.monotonic()
    state = workdir / STATE_DIRNAME
    state.mkdir(exist_ok=True)
    ignore = state / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    _prune_stale_runs(state)
    run_dir = state / f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    try:
        script = run_dir / "guest.sh"
        script.write_text(
            guest_script(cmd, workdir=workdir, run_dir=run_dir, env=os.environ, topology=topology)
        )
        prefix: list[str] = []
        kernel = plan.kernel
        how = "stock boot"
        if fast_boot:
            wrapper = _namespace_wrapper(run_dir)
            elf = uncompressed_kernel(plan.kernel)
            kernel = elf or kernel
            prefix = wrapper or []
            how = ", ".join(
                [
                    "minimal init" if wrapper else "full init (minimal init needs root and unshare)",
                    f"uncompressed kernel {elf}" if elf else "compressed kernel",
                ]
            )
        argv = prefix + vng_command(
            plan.vng, kernel, workdir=workdir, script=script, cpus=cpus, memory=memory
        )
        env = {**os.environ, "PATH": _vng_path()}
        plural = "s" if cpus > 1 else ""
        _log(f"booting VM: {plan.kernel}, {cpus} CPU{plural}, {memory} memory, emulated (no KVM), {how}")
        return _supervise_vm(
            argv, env=env, workdir=workdir, run_dir=run_dir, started=started, deadline=deadline
        )
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune_stale_runs(state: Path, max_age: float = 86400.0) -> None:
    """Remove run directories left by test hosts that were killed (their process gone for a day)."""
    now = time.time()
    for old in state.glob("run-*-*"):
        try:
            pid = int(old.name.split("-")[1])
            stale = now - old.stat().st_mtime > max_age and not _pid_alive(pid)
        except (ValueError, OSError):
            continue
        if stale:
            shutil.rmtree(old, ignore_errors=True)


def _supervise_vm(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    workdir: Path,
    run_dir: Path,
    started: float,
    deadline: float,
) -> int:
    tail = _Tail()
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, tail), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, tail), daemon=True),
    ]
    try:
        # Inside the try: SIGTERM raises SystemExit wherever the main thread is, and the VM must die
        # with us even if that happens while the output pumps are still being started.
        for t in pumps:
            t.start()
        vng_rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        for t in pumps:
            t.join(timeout=5)
        _log(f"timeout: the run did not finish in time; VM killed after {time.monotonic() - started:.0f} s")
        return EXIT_TIMEOUT
    except BaseException:
        _kill_group(proc)
        raise
    for t in pumps:
        t.join(timeout=30)
    total = time.monotonic() - started
    ready = _read_text(run_dir / "ready")
    rc_text = _read_text(run_dir / "rc")
    if rc_text is None or not rc_text.isdigit():
        last = "\n".join(f"  | {line}" for line in tail.lines(40)) or "  (the VM printed nothing)"
        stage = "boot or set up RDMA" if ready is None else "finish (RDMA was ready; the command did not end)"
        _log(
            f"error: the VM failed to {stage}: vng exit {vng_rc} after {total:.1f} s; "
            "the command's exit status is unknown (--verbose shows the kernel console). "
            f"Last output:\n{last}"
        )
        return EXIT_HOST_FAILED
    rc = int(rc_text)
    boot = f"VM boot + rxe setup {float(ready):.1f} s of guest uptime, " if ready else ""
    _log(f"total {total:.1f} s ({boot}command exit status {rc})")
    return rc


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _run_local(cmd: Sequence[str], local: LocalRdma, *, workdir: Path, deadline: float) -> int:
    env = {**os.environ, **_harness_env("local", local.device, local.netdev, local.addr, None)}
    if "RDMAIO_TEST_ADDR" in os.environ:
        env["RDMAIO_TEST_ADDR"] = os.environ["RDMAIO_TEST_ADDR"]
    # Registration pins memory: lift the locked-memory limit as far as we may (inherited by CMD).
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        target = resource.RLIM_INFINITY if os.geteuid() == 0 else hard
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (target, target if os.geteuid() == 0 else hard))
    except (OSError, ValueError):
        pass
    started = time.monotonic()
    try:
        proc = subprocess.Popen(list(cmd), cwd=workdir, env=env, start_new_session=False)
    except OSError as exc:
        _log(f"cannot run {cmd[0]}: {exc}")
        return 127
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _log("timeout: the command did not finish in time")
        return EXIT_TIMEOUT
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    _log(f"total {time.monotonic() - started:.1f} s (command exit status {rc})")
    return rc


def run(
    cmd: Sequence[str],
    *,
    force_vm: bool = False,
    install: bool | None = None,
    kernel: Path | None = None,
    cpus: int = DEFAULT_CPUS,
    memory: str = DEFAULT_MEMORY,
    timeout: float = DEFAULT_TIMEOUT,
    workdir: Path | None = None,
    keep: bool = False,
    fast_boot: bool = True,
    verbose: bool = False,
    topology: str = "single",
) -> int:
    """Run ``cmd`` on the test host and return its exit status.

    ``topology`` ``"pair"`` sets up two rxe devices joined by a veth pair (:mod:`rdmaio.testing.pair`)
    instead of one on a dummy netdev; it always uses the VM (it rewires the host's routing).

    Runs on this machine when it has a usable RDMA device (unless ``force_vm``), else in a VM. ``install``
    (default: whether we are root) lets missing Debian packages and virtme-ng be installed. ``fast_boot``
    False boots the VM the stock virtme-ng way (slower; see the module docstring); ``verbose`` shows
    the VM kernel's console. Returns
    :data:`EXIT_PREFLIGHT` or :data:`EXIT_HOST_FAILED` when CMD could not run, :data:`EXIT_TIMEOUT` when
    ``timeout`` seconds passed; messages go to stderr.
    """
    if not cmd:
        _log("no command given (usage: python -m rdmaio.testing.host [options] -- CMD [ARGS...])")
        return EXIT_PREFLIGHT
    deadline = time.monotonic() + timeout
    workdir = (workdir or Path.cwd()).resolve()
    if install is None:
        install = os.geteuid() == 0
    try:
        if cpus < 1:
            raise PreflightError("--cpus must be at least 1")
        if not re.fullmatch(r"\d+[KMGT]?", memory):
            raise PreflightError(f"--memory {memory!r} is not a size like 2G or 4096M")
        if not workdir.is_dir():
            raise PreflightError(f"work directory {workdir} does not exist")
        if topology not in TOPOLOGIES:
            raise PreflightError(f"--topology must be one of {', '.join(TOPOLOGIES)}")
        if topology == "pair":
            force_vm = True  # the pair rewires routing and adds devices: never on this machine
        local = None if force_vm else find_local_rdma()
        if local is not None:
            _log(
                f"mode: local (RDMA device {local.device} on {local.netdev}, {local.addr}); "
                "running the command directly"
            )
            return _run_local(cmd, local, workdir=workdir, deadline=deadline)
        reason = (
            "--topology pair"
            if topology == "pair"
            else "--force-vm"
            if force_vm
            else "no usable RDMA device on this machine"
        )
        _log(f"mode: VM with Soft-RoCE ({reason})")
        _check_workdir(workdir)
        plan = _preflight(kernel, install)
    except PreflightError as exc:
        _log(f"error: {exc}")
        return EXIT_PREFLIGHT
    return _run_vm(
        cmd,
        plan,
        workdir=workdir,
        cpus=cpus,
        memory=memory,
        deadline=deadline,
        keep=keep,
        fast_boot=fast_boot,
        verbose=verbose,
        topology=topology,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rdmaio.testing.host",
        usage="%(prog)s [options] -- CMD [ARGS...]",
        description=(
            "Run CMD where an RDMA device is available: on this machine if it has one, else in a "
            "throwaway VM with Soft-RoCE (rxe0 on dum0, 198.18.0.1)."
        ),
        epilog=(
            f"Exit status: CMD's; {EXIT_PREFLIGHT} = a prerequisite is missing; {EXIT_HOST_FAILED} = the VM "
            f"failed to boot or to set up RDMA; {EXIT_TIMEOUT} = --timeout expired."
        ),
    )
    parser.add_argument("--force-vm", action="store_true", help="use the VM even if this machine has RDMA")
    parser.add_argument(
        "--install",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apt-get/pip install what is missing (default: on when running as root)",
    )
    parser.add_argument("--kernel", type=Path, help="kernel image to boot (default: newest /boot/vmlinuz-*)")
    parser.add_argument("--cpus", type=int, default=DEFAULT_CPUS, help=f"VM CPUs (default {DEFAULT_CPUS})")
    parser.add_argument("--memory", default=DEFAULT_MEMORY, help=f"VM memory (default {DEFAULT_MEMORY})")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds for the whole run, boot included (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument("--workdir", type=Path, help="directory shared read-write with the VM (default: cwd)")
    parser.add_argument("--keep", action="store_true", help="keep the generated guest files in .testhost/")
    parser.add_argument("--verbose", action="store_true", help="show the VM kernel's console (on stderr)")
    parser.add_argument(
        "--stock-boot",
        action="store_true",
        help="boot with virtme-ng's full init (udev coldplug) and the compressed kernel: slower",
    )
    parser.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="single",
        help="single: rxe0 on a dummy netdev (default); pair: rxe0 and rxe1 joined by a veth pair, "
        "198.18.0.1 and 198.18.0.2, for fault injection (VM only)",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "--" in args_in:
        split = args_in.index("--")
        options, cmd = args_in[:split], args_in[split + 1 :]
        ns = parser.parse_args(options)
        if ns.cmd:
            parser.error(f"unexpected arguments before --: {' '.join(ns.cmd)}")
    else:
        ns = parser.parse_args(args_in)
        cmd = list(ns.cmd)

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through run(): the VM is killed, its files removed

    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run(
            cmd,
            force_vm=ns.force_vm,
            install=ns.install,
            kernel=ns.kernel,
            cpus=ns.cpus,
            memory=ns.memory,
            timeout=ns.timeout,
            workdir=ns.workdir,
            keep=ns.keep,
            fast_boot=not ns.stock_boot,
            verbose=ns.verbose,
            topology=ns.topology,
        )
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
