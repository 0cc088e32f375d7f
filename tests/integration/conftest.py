"""Fixtures and rules for the integration tests, which need an RDMA device.

Run them through the test host, which provides one (a VM with Soft-RoCE when this machine has none)::

    python -m rdmaio.testing.host -- python -m pytest tests/integration

Under the test host (``RDMAIO_REQUIRE_DEVICE=1``) and in CI (``CI`` set) a skipped test is an error: a
suite that silently skips everything must not pass. The junit report records the ``testhost`` property
(the value of ``RDMAIO_TESTHOST``) so that ``tools/check_integration_report.py`` can tell the tests really
ran inside the test host.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Generator
from pathlib import Path

import pytest

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
DEFAULT_ADDR = "198.18.0.1"
SKIP_PREFIX = "skipped under RDMAIO_REQUIRE_DEVICE"


def _skips_forbidden() -> bool:
    return os.environ.get("RDMAIO_REQUIRE_DEVICE") == "1" or bool(os.environ.get("CI"))


def _skip_reason(longrepr: object) -> str:
    # A skip's longrepr is (path, lineno, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Turn a skipped test into a failed one when skips are forbidden (xfail is left alone)."""
    report = yield
    if report.skipped and _skips_forbidden() and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"{SKIP_PREFIX}: {_skip_reason(report.longrepr)}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Likewise for a whole module skipped at collection (``pytest.skip(allow_module_level=True)``)."""
    report = yield
    if report.skipped and _skips_forbidden():
        report.outcome = "failed"
        report.longrepr = f"{SKIP_PREFIX}: {_skip_reason(report.longrepr)}"
    return report


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
