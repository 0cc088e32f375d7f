"""Soft-iWARP for the VM: ``siw.ko`` built out of tree for exactly the kernel the VM boots, once per machine.

Debian's kernels are built without ``CONFIG_RDMA_SIW``. The module is built from the driver's directory of
Debian's kernel source package (``linux-source-X.Y``, the same package version as the booted kernel image;
only ``drivers/infiniband/sw/siw`` is extracted from its tarball) against the matching headers package
(``linux-headers-RELEASE``)::

    make -C /usr/src/linux-headers-RELEASE M=DIR CONFIG_RDMA_SIW=m modules

The result is cached beside the uncompressed kernel (``~/.cache/rdmaio-testhost``), named after the kernel
release and the source package's version, so it is built once per machine; a lock file serialises two test
hosts that start at once (the second waits, then finds the module built). The module is unsigned: loading
it taints the guest kernel, which does not matter in a throwaway VM. The guest hides ``/root`` and
``/tmp`` behind its own mounts, so the module is copied into the run directory (in the work directory,
which the guest shares) and ``insmod``-ed from there.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from rdmaio.testing.host.kernel import MODULES_DIR, cache_dir
from rdmaio.testing.host.status import PreflightError, log

SRC_DIR = Path("/usr/src")
SIW_SUBDIR = "drivers/infiniband/sw/siw"
MODULE_NAME = "siw.ko"
#: What ``siw.ko`` needs loaded first (``modinfo``: ``depends: ib_core,libcrc32c``); libcrc32c asks the
#: crypto API for crc32c, whose generic implementation is named so that no modprobe runs on demand.
GUEST_DEPENDENCIES = ("ib_core", "crc32c_generic", "libcrc32c")
BUILD_TIMEOUT = 900.0


def series(release: str) -> str:
    """The kernel series of a release: ``6.1`` for ``6.1.0-56-amd64``."""
    match = re.match(r"(\d+)\.(\d+)", release)
    if match is None:
        raise PreflightError(f"cannot tell the kernel series of release {release!r}")
    return f"{match.group(1)}.{match.group(2)}"


def headers_package(release: str) -> str:
    """The Debian package with the build tree of kernel ``release``."""
    return f"linux-headers-{release}"


def source_package(release: str) -> str:
    """The Debian package with the source tarball of kernel ``release``'s series."""
    return f"linux-source-{series(release)}"


def image_package(release: str) -> str:
    """The Debian package of kernel image ``release``."""
    return f"linux-image-{release}"


def headers_dir(release: str, src_dir: Path = SRC_DIR) -> Path:
    """Where :func:`headers_package` puts the build tree."""
    return src_dir / f"linux-headers-{release}"


def source_tarball(release: str, src_dir: Path = SRC_DIR) -> Path | None:
    """The kernel source tarball of ``release``'s series, or None when it is not installed."""
    for suffix in ("tar.xz", "tar.bz2", "tar.gz", "tar"):
        path = src_dir / f"{source_package(release)}.{suffix}"
        if path.is_file():
            return path
    return None


def dpkg_version(package: str) -> str | None:
    """The installed version of a Debian package, or None (not installed, or not a dpkg system)."""
    if shutil.which("dpkg-query") is None:
        return None
    done = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}\t${Version}", package],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    status, _, version = done.stdout.partition("\t")
    if done.returncode or not status.endswith(" installed") or not version:
        return None
    return version.strip()


def wanted_packages(release: str) -> list[str]:
    """The apt-get arguments that install what the build needs, the source pinned to the image's version
    (the same package version is the same source the image was built from)."""
    image_version = dpkg_version(image_package(release))
    source = source_package(release)
    return [headers_package(release), f"{source}={image_version}" if image_version else source]


def missing_packages(release: str, src_dir: Path = SRC_DIR) -> list[str]:
    """The apt-get arguments for what is missing to build ``siw.ko`` for ``release`` (empty: nothing)."""
    missing: list[str] = []
    headers, source = wanted_packages(release)
    if not (headers_dir(release, src_dir) / "Makefile").is_file():
        missing.append(headers)
    tarball = source_tarball(release, src_dir)
    image_version = dpkg_version(image_package(release))
    source_version = dpkg_version(source_package(release))
    if tarball is None or (image_version and source_version and image_version != source_version):
        missing.append(source)
    return missing


def cache_key(release: str, src_dir: Path = SRC_DIR) -> str:
    """What identifies one build: the kernel release and the source it was built from (the package version,
    else the tarball's size and modification time)."""
    version = dpkg_version(source_package(release))
    if version is None:
        tarball = source_tarball(release, src_dir)
        if tarball is None:
            version = "unknown"
        else:
            st = tarball.stat()
            version = f"{st.st_size}-{st.st_mtime_ns}"
    return re.sub(r"[^A-Za-z0-9.+~_-]", "_", f"{release}-{version}")


def cached_module(release: str, cache: Path | None = None, src_dir: Path = SRC_DIR) -> Path:
    """Where the module built for ``release`` is (or will be) cached."""
    return (cache or cache_dir()) / f"siw-{cache_key(release, src_dir)}.ko"


def build_commands(release: str, tarball: Path, build_dir: Path, src_dir: Path = SRC_DIR) -> list[list[str]]:
    """The commands that extract the driver's directory into ``build_dir`` and build ``siw.ko`` there."""
    top = source_package(release)
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    return [
        ["tar", "-xf", str(tarball), "-C", str(build_dir), "--wildcards", f"{top}/{SIW_SUBDIR}/*"],
        [
            "make",
            "-C",
            str(headers_dir(release, src_dir)),
            f"M={build_dir / top / SIW_SUBDIR}",
            "CONFIG_RDMA_SIW=m",
            f"-j{jobs}",
            "modules",
        ],
    ]


def _run(argv: list[str], what: str, deadline: float) -> None:
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=max(1.0, deadline - time.monotonic()),
        check=False,
    )
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise PreflightError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n{tail}")


def build_module(release: str, target: Path, src_dir: Path = SRC_DIR) -> None:
    """Extract the driver's sources, build ``siw.ko`` and move it (debug info stripped) to ``target``."""
    tarball = source_tarball(release, src_dir)
    if tarball is None:
        raise PreflightError(f"kernel source {source_package(release)} not installed in {src_dir}")
    deadline = time.monotonic() + BUILD_TIMEOUT
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rdmaio-siw-") as tmp:
        build_dir = Path(tmp)
        extract, make = build_commands(release, tarball, build_dir, src_dir)
        log(f"building {MODULE_NAME} for {release}: extracting {SIW_SUBDIR} from {tarball}")
        try:
            _run(extract, "extracting the siw sources", deadline)
            extracted = time.monotonic()
            log(f"building {MODULE_NAME}: make (extracted in {extracted - started:.1f} s)")
            _run(make, f"building {MODULE_NAME}", deadline)
        except subprocess.TimeoutExpired as exc:
            raise PreflightError(f"building {MODULE_NAME} took longer than {BUILD_TIMEOUT:.0f} s") from exc
        built = build_dir / source_package(release) / SIW_SUBDIR / MODULE_NAME
        if not built.is_file():
            raise PreflightError(f"the build made no {MODULE_NAME} ({built})")
        # A smaller module reads and loads faster in the emulated guest; the debug info is never used there.
        if shutil.which("strip") is not None:
            subprocess.run(
                ["strip", "--strip-debug", str(built)],
                capture_output=True,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_target = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(built, tmp_target)
        os.replace(tmp_target, target)
    log(f"built {target} in {time.monotonic() - started:.1f} s (extract {extracted - started:.1f} s)")


def ensure_module(release: str, cache: Path | None = None, src_dir: Path = SRC_DIR) -> Path:
    """The cached ``siw.ko`` for kernel ``release``, built first if it is not cached yet.

    Raises :class:`PreflightError` (with what to install) when the packages are missing or the build
    fails. Holds a lock while building so that two test hosts starting at once build it once.
    """
    if (MODULES_DIR / release / "kernel" / SIW_SUBDIR).is_dir():
        log(f"note: kernel {release} ships siw; the out-of-tree build is used all the same")
    missing = missing_packages(release, src_dir)
    if missing:
        raise PreflightError(
            f"building {MODULE_NAME} for kernel {release} needs {' '.join(missing)} "
            f"(apt-get install {' '.join(missing)}; or --install as root)"
        )
    target = cached_module(release, cache, src_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".siw-{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # built by the test host that held the lock
            return target
        build_module(release, target, src_dir)
        for old in target.parent.glob(f"siw-{release}-*.ko"):
            if old != target:
                old.unlink(missing_ok=True)
    return target
