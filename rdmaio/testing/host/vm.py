"""The VM command: the ``vng`` command line that boots the throwaway VM, the fast-boot mount namespace
around it, and one VM run (its run directory, guest script and kernel), handed to supervision.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from rdmaio.testing.host.guest import SIW_MODULE_NAME, guest_script
from rdmaio.testing.host.kernel import uncompressed_kernel
from rdmaio.testing.host.preflight import VmPlan, sbin_path, vng_path
from rdmaio.testing.host.status import log
from rdmaio.testing.host.supervision import prune_stale_runs, supervise_vm

# One vCPU: under emulation on a busy 2-core machine a second vCPU made the boot about twice as slow
# (cross-CPU synchronisation while modules load) and the integration suite about 1.5 times as slow
# (measured: rxe ready after 12 s vs 25 s; 42 tests in 454 s vs 698 s). --cpus 2 remains.
DEFAULT_CPUS = 1
DEFAULT_MEMORY = "2G"

STATE_DIRNAME = ".testhost"
"""The directory, in the work directory, that holds each run's guest script and status files."""


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
#    once on this machine (cached) and booted as an ELF through its PVH entry point (see kernel.py).

FAKE_UDEVD = """#!/bin/sh
# Stand-in for systemd-udevd in the rdmaio test host VM (see rdmaio/testing/host/vm.py): make only the
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
    unshare = shutil.which("unshare", path=sbin_path())
    if unshare is None or shutil.which("mount", path=sbin_path()) is None:
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


def run_vm(
    cmd: Sequence[str],
    plan: VmPlan,
    *,
    workdir: Path,
    cpus: int,
    memory: str,
    deadline: float,
    keep: bool,
    fast_boot: bool,
    verbose: bool,
    topology: str = "single",
    provider: str = "rxe",
) -> int:
    """Boot the VM, run ``cmd`` in it and return its exit status (or a status of :mod:`.status`).

    With ``provider="siw"`` the plan's built ``siw.ko`` is copied into the run directory, the one place
    of this machine's that the guest surely sees (it hides ``/root`` and ``/tmp``, where a cache may be).
    """
    started = time.monotonic()
    state = workdir / STATE_DIRNAME
    state.mkdir(exist_ok=True)
    ignore = state / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    prune_stale_runs(state)
    run_dir = state / f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    try:
        if provider == "siw":
            if plan.siw_module is None:
                raise ValueError("provider siw needs a plan with a built siw.ko")
            shutil.copyfile(plan.siw_module, run_dir / SIW_MODULE_NAME)
        script = run_dir / "guest.sh"
        script.write_text(
            guest_script(
                cmd, workdir=workdir, run_dir=run_dir, env=os.environ, topology=topology, provider=provider
            )
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
        env = {**os.environ, "PATH": vng_path()}
        plural = "s" if cpus > 1 else ""
        log(
            f"booting VM: {plan.kernel}, {cpus} CPU{plural}, {memory} memory, emulated (no KVM), {how}, "
            f"provider {provider}"
        )
        return supervise_vm(
            argv, env=env, workdir=workdir, run_dir=run_dir, started=started, deadline=deadline
        )
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
