"""What CMD gets: the environment of the harness, and the script the VM runs (set up RDMA, then run CMD).

The guest script sets up Soft-RoCE (``rxe0`` on the dummy netdev ``dum0`` holding 198.18.0.1/24 and
198.18.0.2/24, or two rxe devices on a veth pair with ``topology="pair"``, see :mod:`rdmaio.testing.pair`),
exports the caller's passed-through variables and the harness's own, runs CMD in the work directory and
writes its exit status where the supervisor reads it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from rdmaio.testing import pair
from rdmaio.testing.host import siw
from rdmaio.testing.host.status import EXIT_HOST_FAILED

GUEST_ADDR = "198.18.0.1"
GUEST_ADDR2 = "198.18.0.2"
GUEST_PREFIX_LEN = 24
GUEST_NETDEV = "dum0"
GUEST_DEVICE = "rxe0"

PROVIDERS = ("rxe", "siw")
"""``rxe``: Soft-RoCE (the default; RoCE v2 semantics); ``siw``: Soft-iWARP (iWARP semantics: no immediate
data, no atomics, no memory windows; its ``siw.ko`` is built for the VM's kernel, see
:mod:`rdmaio.testing.host.siw`). Only one provider's device is set up on a netdev: with rxe and siw on the
same netdev, rdma_cm picks rxe."""

SIW_MODULE_NAME = "siw.ko"
"""The name under which the cached ``siw.ko`` is copied into the run directory for the guest to load."""


def guest_device(provider: str = "rxe") -> str:
    """The device the VM sets up for ``provider`` on its dummy netdev (``rxe0`` or ``siw0``)."""
    return f"{provider}0"


TOPOLOGIES = ("single", "pair")
"""``single``: one rxe device on a dummy netdev (the default, fastest); ``pair``: two rxe devices joined
by a veth pair (:mod:`rdmaio.testing.pair`), for fault injection on a real netdev."""


#: Caller variables passed into the VM: these exact names, and names with these prefixes.
PASSTHROUGH_NAMES = frozenset({"CI", "PATH", "HOME", "LANG", "PYTHONPATH"})
PASSTHROUGH_PREFIXES = ("RDMAIO_", "PYTEST_")

_SHELL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def filter_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables that are passed into the VM."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if _SHELL_NAME.match(name)
        and (name in PASSTHROUGH_NAMES or name.startswith(PASSTHROUGH_PREFIXES))
        and "\0" not in value
    }


def harness_env(
    mode: str, device: str, netdev: str, addr: str, addr2: str | None, provider: str | None = None
) -> dict[str, str]:
    """The variables the harness gives CMD (``mode`` is ``1`` in the VM, ``local`` on this machine;
    ``provider`` is the software provider the VM set up, unknown for a local device)."""
    env = {
        "RDMAIO_TESTHOST": mode,
        "RDMAIO_TEST_ADDR": addr,
        "RDMAIO_TEST_DEVICE": device,
        "RDMAIO_TEST_NETDEV": netdev,
        "RDMAIO_REQUIRE_DEVICE": "1",
    }
    if addr2 is not None:
        env["RDMAIO_TEST_ADDR2"] = addr2
    if provider is not None:
        env["RDMAIO_TEST_PROVIDER"] = provider
    return env


def _pair_env(provider: str = "rxe") -> dict[str, str]:
    a, b = pair.nodes(provider)
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
    cmd: Sequence[str],
    *,
    workdir: Path,
    run_dir: Path,
    env: Mapping[str, str],
    topology: str = "single",
    provider: str = "rxe",
) -> str:
    """The bash script the VM runs: set up ``rxe0`` (and ``rxe1`` with ``topology="pair"``), then run
    ``cmd`` in ``workdir``.

    With ``provider="siw"`` the devices are ``siw0`` (and ``siw1``) instead, and no rxe device exists:
    the script loads siw's dependencies with modprobe (the guest shares this machine's ``/lib/modules``)
    and ``insmod``-s ``run_dir/siw.ko`` (copied there by the caller, see :data:`SIW_MODULE_NAME`).

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
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r} (one of {', '.join(PROVIDERS)})")
    q = shlex.quote
    exports = {
        **filter_env(env),
        **harness_env("1", guest_device(provider), GUEST_NETDEV, GUEST_ADDR, GUEST_ADDR2, provider),
        **({"RDMAIO_TOPOLOGY": "single"} if topology == "single" else _pair_env(provider)),
    }
    export_lines = "\n".join(f"export {name}={q(value)}" for name, value in exports.items())
    net, dev = GUEST_NETDEV, guest_device(provider)
    # dummy and crc32 would otherwise be loaded on demand by the kernel, one modprobe run each.
    if provider == "rxe":
        modules = "rdma_rxe rdma_ucm ib_uverbs"
        load_provider = ""
    else:
        modules = f"{' '.join(siw.GUEST_DEPENDENCIES)} rdma_ucm ib_uverbs"
        ko = q(str(run_dir / SIW_MODULE_NAME))
        load_provider = f'insmod {ko} || fail "insmod {SIW_MODULE_NAME} failed (built for another kernel?)"\n'
    if topology == "single":
        why = f"ip: cannot set up {net} with {GUEST_ADDR} and {GUEST_ADDR2}"
        netdev_setup = f"""ip -batch - <<'EOF_IP' || fail "{why}"
link add {net} type dummy
link set {net} up
addr add {GUEST_ADDR}/{GUEST_PREFIX_LEN} dev {net}
addr add {GUEST_ADDR2}/{GUEST_PREFIX_LEN} dev {net}
EOF_IP
rdma link add {dev} type {provider} netdev {net} || fail "rdma link add {dev} type {provider} netdev {net}"
"""
        devices = [dev]
        extra_modules = "dummy crc32_generic"
    else:
        netdev_setup = pair.setup_script(provider)
        devices = [n.device for n in pair.nodes(provider)]
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

# Soft-RoCE (or Soft-iWARP) on a dummy netdev (rxe on lo does not work with rdma_cm), or on a veth pair
# (topology pair).
modprobe -a {modules} {extra_modules} 2>/dev/null || modprobe -a {modules} ||
    fail "modprobe {modules} failed"
{load_provider}{netdev_setup.rstrip()}
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
