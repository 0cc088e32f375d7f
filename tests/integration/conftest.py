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


# --- providers: what the device under test offers ---------------------------------------------------------
# The test host names its provider in RDMAIO_TEST_PROVIDER (rxe or siw); on a machine's own device the
# transport decides (an RNIC is iWARP). Tests of something a provider lacks carry a marker and are
# DESELECTED there (not skipped: a skip is a failure under the test host), so that the integration suite
# runs unchanged on siw:
#   @pytest.mark.requires_immediate       SEND/WRITE with immediate data at the verbs level (iWARP: none)
#   @pytest.mark.requires_atomics         RDMA atomics (siw: ATOMIC_NONE)
#   @pytest.mark.requires_memory_windows  memory windows (siw: max_mw 0)
#   @pytest.mark.provider("siw", ...)     only on these providers
#
# Run the suite on Soft-iWARP:
#   python -m rdmaio.testing.host --provider siw -- python -m pytest tests/integration

#: What each software provider lacks (the capabilities the markers above name).
PROVIDER_LACKS: dict[str, frozenset[str]] = {
    "rxe": frozenset(),
    "siw": frozenset({"immediate", "atomics", "memory_windows"}),
    "iwarp": frozenset({"immediate"}),  # a hardware iWARP device: atomics and windows vary, immediates never
}
_CAPABILITY_MARKERS = {
    "requires_immediate": "immediate",
    "requires_atomics": "atomics",
    "requires_memory_windows": "memory_windows",
}


def provider_under_test() -> str:
    """The provider under test: ``RDMAIO_TEST_PROVIDER``, else ``iwarp`` for an RNIC device, else ``rxe``."""
    named = os.environ.get("RDMAIO_TEST_PROVIDER")
    if named:
        return named
    device = os.environ.get("RDMAIO_TEST_DEVICE", "")
    try:
        node_type = (SYSFS_INFINIBAND / device / "node_type").read_text() if device else ""
    except OSError:
        node_type = ""
    return "iwarp" if "RNIC" in node_type else "rxe"


def pytest_configure(config: pytest.Config) -> None:
    """Register the provider markers."""
    for name, capability in _CAPABILITY_MARKERS.items():
        config.addinivalue_line(
            "markers", f"{name}: needs {capability.replace('_', ' ')} (deselected without)"
        )
    config.addinivalue_line(
        "markers", "provider(*names): runs only on these providers (deselected elsewhere)"
    )


def provider_applies(item: pytest.Item, provider: str) -> bool:
    """Whether a test's provider markers allow it on ``provider``."""
    lacks = PROVIDER_LACKS.get(provider, frozenset())
    for name, capability in _CAPABILITY_MARKERS.items():
        if capability in lacks and item.get_closest_marker(name) is not None:
            return False
    only = item.get_closest_marker("provider")
    return only is None or provider in only.args


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests that cannot apply on the provider under test."""
    provider = provider_under_test()
    kept = [item for item in items if provider_applies(item, provider)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def provider() -> str:
    """The provider under test (``rxe``, ``siw``, or ``iwarp`` for a machine's own iWARP device)."""
    return provider_under_test()
