"""The kernel the VM boots: finding an installed one that has ``rdma_rxe``, and preparing a fast-booting copy.

A Debian kernel is a compressed bzImage; decompressing it inside an emulated guest takes several seconds,
so :func:`uncompressed_kernel` decompresses it once on this machine (cached in
``~/.cache/rdmaio-testhost``) into the ELF ``vmlinux`` that QEMU boots directly through its PVH entry.
"""

from __future__ import annotations

import lzma
import os
import re
import shutil
import struct
import zlib
from pathlib import Path

from rdmaio.testing.host.status import PreflightError

BOOT_DIR = Path("/boot")
MODULES_DIR = Path("/lib/modules")
KERNEL_PACKAGE = "linux-image-amd64"


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


_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZIP_MAGIC = b"\x1f\x8b"
_PT_NOTE = 4
_XEN_ELFNOTE_PHYS32_ENTRY = 18


def has_pvh_entry(elf: bytes) -> bool:
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


def cache_dir() -> Path:
    """The test host's cache directory (``$XDG_CACHE_HOME/rdmaio-testhost``, default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rdmaio-testhost"


_cache_dir = cache_dir  # uncompressed_kernel's parameter shadows the name


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
    if elf is None or not has_pvh_entry(elf):
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
