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
``RDMAIO_TEST_PROVIDER``
    in the VM, the provider it set up: ``rxe`` (the default), or ``siw`` with ``--provider siw``
    (Soft-iWARP: ``siw0`` instead of ``rxe0``, and ``siw1`` in the pair; see
    :mod:`~rdmaio.testing.host.siw`).

The caller's variables named ``RDMAIO_*``, ``PYTEST_*``, ``CI``, ``PATH``, ``HOME``, ``LANG`` and
``PYTHONPATH`` are passed into the VM. In the VM the locked-memory limit is unlimited and the open files
limit is 65536.

Booting fast: under emulation (the test host never uses KVM, which can hang guests) a stock virtme-ng boot
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

Modules, one job each:

* :mod:`~rdmaio.testing.host.launcher` -- :func:`run`: this machine's device or a VM, then run CMD.
* :mod:`~rdmaio.testing.host.devices` -- device detection: a usable RDMA device on this machine.
* :mod:`~rdmaio.testing.host.preflight` -- preflight and packages: what the VM needs, installed if allowed.
* :mod:`~rdmaio.testing.host.kernel` -- kernel preparation: the kernel to boot and its uncompressed copy.
* :mod:`~rdmaio.testing.host.siw` -- Soft-iWARP: ``siw.ko`` built for the VM's kernel and cached.
* :mod:`~rdmaio.testing.host.guest` -- the environment CMD gets and the script the VM runs.
* :mod:`~rdmaio.testing.host.vm` -- the VM command: the ``vng`` command line and the fast-boot namespace.
* :mod:`~rdmaio.testing.host.supervision` -- supervision: output, deadline, signals, exit status.
* :mod:`~rdmaio.testing.host.status` -- the test host's exit statuses, its error and its messages.
* :mod:`~rdmaio.testing.host.cli` (run by ``__main__``) -- the command line.
"""

from __future__ import annotations

from rdmaio.testing.host.cli import main
from rdmaio.testing.host.devices import LocalRdma, find_local_rdma, have_local_rdma, parse_rdma_links
from rdmaio.testing.host.guest import (
    GUEST_ADDR,
    GUEST_ADDR2,
    GUEST_DEVICE,
    GUEST_NETDEV,
    TOPOLOGIES,
    filter_env,
    guest_script,
)
from rdmaio.testing.host.kernel import (
    decompress_kernel,
    find_kernel,
    kernel_release,
    rxe_module,
    uncompressed_kernel,
)
from rdmaio.testing.host.launcher import DEFAULT_TIMEOUT, run
from rdmaio.testing.host.status import EXIT_HOST_FAILED, EXIT_PREFLIGHT, EXIT_TIMEOUT, PreflightError
from rdmaio.testing.host.vm import DEFAULT_CPUS, DEFAULT_MEMORY, vng_command

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
