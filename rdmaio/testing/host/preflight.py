"""Preflight and packages: check what the VM mode needs on this machine, installing what is missing when
allowed (Debian packages with apt-get, virtme-ng with pip), and plan the VM (which kernel, which vng).

The VM shares this machine's root file system, so every tool the guest uses must be installed here.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rdmaio.testing.host import siw
from rdmaio.testing.host.kernel import KERNEL_PACKAGE, MODULES_DIR, find_kernel, kernel_release, rxe_module
from rdmaio.testing.host.status import PreflightError, log

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


# Characters that would break vng's --rwdir=PATH syntax, QEMU's -fsdev option list or the kernel command line.
_BAD_PATH_CHARS = re.compile(r"[\s=,:\"'\\`$]")


def sbin_path() -> str:
    """PATH with the sbin directories added (modprobe, ip, rdma, unshare live there)."""
    path = os.environ.get("PATH", "")
    extra = [d for d in ("/usr/local/sbin", "/usr/sbin", "/sbin") if d not in path.split(os.pathsep)]
    return os.pathsep.join([p for p in [path, *extra] if p])


def _bin_dir() -> Path:
    return Path(sys.executable).parent


def vng_path() -> str:
    """PATH with this Python's bin directory first (where pip installs vng)."""
    return os.pathsep.join([str(_bin_dir()), os.environ.get("PATH", "")])


def _find_vng() -> str | None:
    vng = shutil.which("vng", path=vng_path())
    run = shutil.which("virtme-run", path=vng_path())
    return vng if vng and run else None


def _dpkg_installed(package: str) -> bool | None:
    """True/False from dpkg, None when this is not a dpkg system."""
    if shutil.which("dpkg-query") is None:
        return None
    return siw.dpkg_version(package) is not None


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
            log("apt-get update")
            done = subprocess.run(["apt-get", "update"], env=env, stdin=subprocess.DEVNULL, check=False)
            if done.returncode:
                raise PreflightError(f"apt-get update failed (exit {done.returncode})")
            self.updated = True
        log(f"installing {names}")
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
        log(f"pip install {VIRTME_NG_REQUIREMENT} into {sys.prefix}")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", VIRTME_NG_REQUIREMENT],
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if done.returncode:
            raise PreflightError(f"pip install {VIRTME_NG_REQUIREMENT} failed (exit {done.returncode})")
        importlib.invalidate_caches()


@dataclass(frozen=True)
class VmPlan:
    """What preflight found for the VM: the kernel image to boot and the vng executable (and, for Soft-iWARP,
    the ``siw.ko`` built for that kernel)."""

    kernel: Path
    vng: str
    siw_module: Path | None = None


def check_workdir(workdir: Path) -> None:
    """Refuse a work directory the VM cannot share (missing, or with characters vng/QEMU cannot pass)."""
    if not workdir.is_dir():
        raise PreflightError(f"work directory {workdir} does not exist")
    if _BAD_PATH_CHARS.search(str(workdir)):
        raise PreflightError(
            f"work directory {workdir} contains characters the VM cannot share (space , = : quotes \\ $)"
        )


def plan_vm(kernel: Path | None, install: bool, provider: str = "rxe") -> VmPlan:
    """Check (and, with ``install``, install) what the VM needs; the plan, or :class:`PreflightError`.

    ``provider="siw"`` also installs the kernel's headers and source packages when missing and builds
    ``siw.ko`` for the kernel (once per machine, see :mod:`rdmaio.testing.host.siw`).
    """
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
    if provider == "rxe" and rxe_module(release) is None:
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
        log(f"warning: missing Debian packages {' '.join(missing)} (apt-get install them, or use --install)")
    if shutil.which(QEMU_BINARY) is None:
        raise PreflightError(f"QEMU ({QEMU_BINARY}) not found: apt-get install qemu-system-x86")
    for tool, pkg in (("modprobe", "kmod"), ("ip", "iproute2"), ("rdma", "iproute2")):
        if shutil.which(tool, path=sbin_path()) is None:
            raise PreflightError(f"{tool} not found: apt-get install {pkg}")
    library = f"lib{provider}-rdmav*.so"
    if not any(Path("/usr/lib").glob(f"*/libibverbs/{library}")) and not any(
        Path("/usr/lib64").glob(f"libibverbs/{library}")
    ):
        raise PreflightError(
            f"the {provider} verbs provider (lib{provider}) is missing: apt-get install ibverbs-providers"
        )
    siw_module = None
    if provider == "siw":
        missing_src = siw.missing_packages(release)
        if missing_src and install:
            installer.apt(missing_src, f"building siw.ko for kernel {release}")
        siw_module = siw.ensure_module(release)

    vng = _find_vng()
    if vng is None:
        installer.virtme_ng()
        vng = _find_vng()
        if vng is None:
            raise PreflightError(
                f"virtme-ng was installed, yet vng/virtme-run are not in {_bin_dir()} or PATH"
            )
    return VmPlan(kernel, vng, siw_module)
