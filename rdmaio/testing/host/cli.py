"""The command line: ``python -m rdmaio.testing.host [options] -- CMD [ARGS...]`` (see the package
docstring)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from rdmaio.testing.host.guest import PROVIDERS, TOPOLOGIES
from rdmaio.testing.host.launcher import DEFAULT_TIMEOUT, run
from rdmaio.testing.host.status import EXIT_HOST_FAILED, EXIT_PREFLIGHT, EXIT_TIMEOUT, log
from rdmaio.testing.host.vm import DEFAULT_CPUS, DEFAULT_MEMORY


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
    parser.add_argument(
        "--provider",
        choices=PROVIDERS,
        default="rxe",
        help="rxe: Soft-RoCE (default); siw: Soft-iWARP (siw0, and siw1 with --topology pair; siw.ko is "
        "built for the VM's kernel on the first run, which needs the kernel's headers and source packages; "
        "VM only)",
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
            provider=ns.provider,
        )
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
