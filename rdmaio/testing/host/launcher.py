"""The test host's entry point as a function: :func:`run` picks this machine's device or a VM, checks the
prerequisites, and runs CMD there.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from rdmaio.testing.host.devices import find_local_rdma
from rdmaio.testing.host.guest import PROVIDERS, TOPOLOGIES
from rdmaio.testing.host.preflight import check_workdir, plan_vm
from rdmaio.testing.host.status import EXIT_PREFLIGHT, PreflightError, log
from rdmaio.testing.host.supervision import run_local
from rdmaio.testing.host.vm import DEFAULT_CPUS, DEFAULT_MEMORY, run_vm

DEFAULT_TIMEOUT = 3600.0


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
    provider: str = "rxe",
) -> int:
    """Run ``cmd`` on the test host and return its exit status.

    ``provider`` ``"siw"`` sets up Soft-iWARP (``siw0``, and ``siw1`` in the pair) instead of Soft-RoCE;
    it always uses the VM, and builds ``siw.ko`` for the VM's kernel on its first run on a machine.

    ``topology`` ``"pair"`` sets up two rxe devices joined by a veth pair (:mod:`rdmaio.testing.pair`)
    instead of one on a dummy netdev; it always uses the VM (it rewires the host's routing).

    Runs on this machine when it has a usable RDMA device (unless ``force_vm``), else in a VM. ``install``
    (default: whether we are root) lets missing Debian packages and virtme-ng be installed. ``fast_boot``
    False boots the VM the stock virtme-ng way (slower; see the package docstring); ``verbose`` shows
    the VM kernel's console. Returns
    :data:`EXIT_PREFLIGHT` or :data:`EXIT_HOST_FAILED` when CMD could not run, :data:`EXIT_TIMEOUT` when
    ``timeout`` seconds passed; messages go to stderr.
    """
    if not cmd:
        log("no command given (usage: python -m rdmaio.testing.host [options] -- CMD [ARGS...])")
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
        if provider not in PROVIDERS:
            raise PreflightError(f"--provider must be one of {', '.join(PROVIDERS)}")
        if topology == "pair" or provider != "rxe":
            force_vm = True  # the pair rewires routing and adds devices, siw loads a module: never here
        local = None if force_vm else find_local_rdma()
        if local is not None:
            log(
                f"mode: local (RDMA device {local.device} on {local.netdev}, {local.addr}); "
                "running the command directly"
            )
            return run_local(cmd, local, workdir=workdir, deadline=deadline)
        reason = (
            "--topology pair"
            if topology == "pair"
            else f"--provider {provider}"
            if provider != "rxe"
            else "--force-vm"
            if force_vm
            else "no usable RDMA device on this machine"
        )
        log(f"mode: VM with {'Soft-iWARP' if provider == 'siw' else 'Soft-RoCE'} ({reason})")
        check_workdir(workdir)
        plan = plan_vm(kernel, install, provider)
    except PreflightError as exc:
        log(f"error: {exc}")
        return EXIT_PREFLIGHT
    return run_vm(
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
        provider=provider,
    )
