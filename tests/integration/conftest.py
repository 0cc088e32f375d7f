"""Fixtures and rules for the integration tests, which need an RDMA device.

Run them through the test host, which provides one (a VM with Soft-RoCE when this machine has none)::

    python -m rdmaio.testing.host -- python -m pytest tests/integration

Under the test host (``RDMAIO_REQUIRE_DEVICE=1``) and in CI (``CI`` set) a skipped test is an error: a
suite that silently skips everything must not pass. The junit report records the ``testhost`` property
(the value of ``RDMAIO_TESTHOST``) so that ``tools/check_integration_report.py`` can tell the tests really
ran inside the test host.
"""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Callable, Generator
from pathlib import Path

import pytest

from rdmaio.testing.skips import skip_hooks

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
DEFAULT_ADDR = "198.18.0.1"
SKIP_PREFIX = "skipped under RDMAIO_REQUIRE_DEVICE"


def _skips_forbidden() -> bool:
    return os.environ.get("RDMAIO_REQUIRE_DEVICE") == "1" or bool(os.environ.get("CI"))


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--framing=header``: run every test in the header framing (no immediate data), as on iWARP."""
    parser.addoption(
        "--framing",
        choices=("auto", "header"),
        default=None,
        help="the default of Options.framing for the whole run (and the peer processes it starts)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Apply ``--framing``: it becomes ``RDMAIO_FRAMING`` (Options.framing's default, read when an Options
    is made, here and in every process a test starts), and the package's default Options is made again."""
    framing = config.getoption("--framing")
    if framing is None:
        return
    os.environ["RDMAIO_FRAMING"] = framing
    import rdmaio.options

    rdmaio.options._DEFAULTS = rdmaio.options.Options()


# Under the test host or in CI a skipped test (or a module skipped at collection) is a failed one.
pytest_runtest_makereport, pytest_make_collect_report = skip_hooks(_skips_forbidden, SKIP_PREFIX)


@pytest.fixture(scope="session", autouse=True)
def _record_testhost(record_testsuite_property: Callable[[str, object], None]) -> None:
    """Record where the tests ran in the junit report (read by tools/check_integration_report.py)."""
    record_testsuite_property("testhost", os.environ.get("RDMAIO_TESTHOST", ""))
    record_testsuite_property("require_device", os.environ.get("RDMAIO_REQUIRE_DEVICE", ""))
    record_testsuite_property("kernel", platform.release())


@pytest.fixture(scope="session")
def rdma_addr() -> str:
    """The IPv4 address the RDMA device answers on (``RDMAIO_TEST_ADDR``, default 198.18.0.1)."""
    return os.environ.get("RDMAIO_TEST_ADDR", DEFAULT_ADDR)


@pytest.fixture(autouse=True)
def require_device(request: pytest.FixtureRequest) -> None:
    """Skip (a failure under the test host or in CI) when there is no RDMA device.

    A test parametrised with ``transport="tcp"`` (the TCP side of a TCP-vs-RDMA comparison) needs none.
    """
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("transport") == "tcp":
        return
    try:
        devices = sorted(p.name for p in SYSFS_INFINIBAND.iterdir())
    except OSError:
        devices = []
    if not devices:
        pytest.skip(
            f"no RDMA device in {SYSFS_INFINIBAND}; run through the test host: "
            "python -m rdmaio.testing.host -- python -m pytest tests/integration"
        )


@pytest.fixture(autouse=True)
def _collect_earlier_loops() -> None:
    """Collect what earlier tests left to the cyclic garbage collector before each test starts.

    A loop that ``asyncio.run`` closed releases its reactor's Domains (PD, shared CQ, pooled rings) when
    it is collected; a loop caught in a reference cycle waits for the collector, which could otherwise run
    in the middle of a later test and change the kernel's object counts between its "before" and "after"
    snapshots (the likely cause of what CI saw once: test_scale's baseline held one Domain more than
    its end state; test_scale now also counts only its own processes' objects)."""
    gc.collect()
