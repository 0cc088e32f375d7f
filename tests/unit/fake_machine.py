"""Fake machines for the ``rdmaio doctor`` unit tests: a temporary root (``sys/``, ``proc/``, ``dev/``,
``etc/``, ``lib/modules/``) holding what a machine with rdma-core shows, and a :class:`System` reading it
with canned command output, so that each check runs against a machine the test describes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from rdmaio.cli.system import System
from rdmaio.verbs import DeviceInfo

RELEASE = "6.1.0-test"

LDCONFIG = (
    "42 libs found in cache `/etc/ld.so.cache'\n"
    "\tlibibverbs.so.1 (libc6,x86-64) => /usr/lib/libibverbs.so.1\n"
    "\tlibrdmacm.so.1 (libc6,x86-64) => /usr/lib/librdmacm.so.1\n"
)

DUM0_IPV4 = {
    ("ip", "-4", "-o", "addr", "show", "dev", "dum0"): "3: dum0    inet 198.18.0.1/24 scope global dum0\n"
}


def write(root: Path, path: str, text: str) -> None:
    """Write ``text`` to ``path`` (absolute, as on the machine) below ``root``, making its folders."""
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def rdma_core_root(root: Path, *, modules: str, drivers: Sequence[str]) -> Path:
    """What every fake machine has beside its devices: ``modules`` as ``/proc/modules``, ib_uverbs built
    in, rdma_rxe in the module index, the rdma_cm and uverbs device nodes, the provider drivers named in
    ``drivers``, rdma-core's two libraries and an unprivileged process."""
    write(root, "/proc/modules", modules)
    (root / "sys/module/ib_uverbs").mkdir(parents=True)  # built in: /sys/module only
    write(root, f"/lib/modules/{RELEASE}/modules.dep", "kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz:\n")
    write(root, "/dev/infiniband/rdma_cm", "")
    write(root, "/dev/infiniband/uverbs0", "")
    for driver in drivers:
        write(root, f"/etc/libibverbs.d/{driver}.driver", f"driver {driver}\n")
    for lib in ("libibverbs.so.1.14.44.0", "librdmacm.so.1.3.44.0"):
        write(root, f"/usr/lib/{lib}", "")
        (root / "usr/lib" / lib.split(".so")[0]).with_suffix(".so.1").symlink_to(lib)
    write(root, "/proc/self/status", "Name:\tpython\nCapEff:\t0000000000000000\n")
    return root


def fake_system(
    root: Path,
    outputs: Mapping[tuple[str, ...], str | None],
    devices: Callable[[], list[DeviceInfo]],
    **overrides: object,
) -> System:
    """A :class:`System` on ``root`` whose commands print ``outputs`` (None where a command is missing),
    whose devices are ``devices()``, with 8 GiB of locked memory, the extension importable, every device
    node accessible and a 2 ms loopback; ``overrides`` replace any of those fields."""
    canned = dict(outputs)

    def run(args: Sequence[str]) -> str | None:
        return canned.get(tuple(args))

    fields: dict[str, object] = {
        "root": root,
        "run": run,
        "release": RELEASE,
        "memlock": lambda: (8 << 30, 8 << 30),
        "list_devices": devices,
        "import_extension": lambda: None,
        "access": lambda path: True,
        "loopback": lambda addr, timeout: 0.002,
    }
    fields.update(overrides)
    return System(**fields)  # type: ignore[arg-type]
