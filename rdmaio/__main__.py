"""``python -m rdmaio COMMAND`` or ``rdmaio COMMAND``: ``bench``, ``devices``, ``doctor``, ``ping``,
``perf``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m rdmaio COMMAND [ARGS...]

commands:
  bench     moved out of the package: from a checkout, tools/dev bench ARGS (see docs/benchmarks.md)
  devices   list the RDMA devices and their ports
  doctor    check what RDMA needs on this machine, with the fix for each problem (--json)
  ping      round-trip times to an rdmaio ping server (python -m rdmaio ping --help)
  perf      throughput and latency between two hosts (python -m rdmaio perf --help)
"""


BENCH_MOVED = """rdmaio bench: the benchmark harness is not part of the installed package.
From a checkout of rdmaio (https://github.com/rdmaio/rdmaio), run it in the test host with
    tools/dev bench ARGS          e.g. tools/dev bench --quick
or, where an RDMA device exists, python -m bench ARGS from the checkout (docs/benchmarks.md).
"""
"""What ``rdmaio bench`` prints: the benchmark harness lives in the repository, not in the package."""


def devices() -> int:
    """Print every RDMA device with its ports; exit status 1 when there is none."""
    from rdmaio.errors import RdmaError
    from rdmaio.verbs import list_devices

    try:
        found = list_devices()
    except RdmaError as exc:
        print(f"no RDMA device: {exc}", file=sys.stderr)
        return 1
    for dev in found:
        print(
            f"{dev.name}  fw {dev.fw_ver}  max_qp {dev.max_qp}  max_qp_wr {dev.max_qp_wr}"
            f"  max_mr_size {dev.max_mr_size}"
        )
        for port in dev.ports:
            print(
                f"  port {port.number}: {port.state}  {port.link_layer}"
                f"  mtu {port.active_mtu} (max {port.max_mtu})  max_msg_size {port.max_msg_size}"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "bench":
        # The harness left the package (it is not in the wheel): say where it is, run nothing.
        print(BENCH_MOVED, file=sys.stderr, end="")
        return 2
    if command == "doctor":
        from rdmaio.cli.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "ping":
        from rdmaio.cli.ping import main as ping_main

        return ping_main(rest)
    if command == "perf":
        from rdmaio.cli.perf import main as perf_main

        return perf_main(rest)
    if command == "devices":
        if rest:
            print("usage: python -m rdmaio devices", file=sys.stderr)
            return 2
        return devices()
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
