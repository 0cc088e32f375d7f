"""Fixtures of the fault suite, which needs the test host's two-node topology.

Run it through the test host with ``--topology pair`` (tools/dev test does)::

    python -m rdmaio.testing.host --topology pair -- python -m pytest tests/faults

There, node A is rxe0 on veth0 (198.18.0.1) and node B is rxe1 on veth1 (198.18.0.2), and every packet
between them crosses the veth pair, where the tests inject loss, delay, partitions and link failures
(:mod:`rdmaio.testing.pair`). Outside that topology every test here skips; under it (``RDMAIO_TOPOLOGY=pair``)
a skip is turned into a failure, and tools/check_integration_report.py refuses a report with skips, so a
CI run where the fault suite did not really run cannot pass.
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
from collections.abc import Callable, Coroutine, Generator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))  # rdma_state

from netfault import Pair, restore

from rdmaio.testing.skips import skip_hooks

T = TypeVar("T")
SKIP_PREFIX = "skipped under RDMAIO_TOPOLOGY=pair"


def _in_pair() -> bool:
    return os.environ.get("RDMAIO_TOPOLOGY") == "pair"


# In the pair topology a skipped test (or module) is a failed one: the fault suite must really run there.
pytest_runtest_makereport, pytest_make_collect_report = skip_hooks(_in_pair, SKIP_PREFIX)


@pytest.fixture(scope="session", autouse=True)
def _record_testhost(record_testsuite_property: Callable[[str, object], None]) -> None:
    """Record where the suite ran in the junit report (read by tools/check_integration_report.py)."""
    record_testsuite_property("testhost", os.environ.get("RDMAIO_TESTHOST", ""))
    record_testsuite_property("topology", os.environ.get("RDMAIO_TOPOLOGY", ""))
    record_testsuite_property("kernel", platform.release())


@pytest.fixture(scope="session")
def pair() -> Pair:
    """The two nodes (skips, a failure under the pair topology, when the test host is not in it)."""
    if not _in_pair():
        pytest.skip(
            "needs the test host's pair topology: "
            "python -m rdmaio.testing.host --topology pair -- python -m pytest tests/faults"
        )
    return Pair.from_env()


@pytest.fixture(autouse=True)
def _restore_network(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test: no netem, both links up, both rxe devices present (a test may break them)."""
    yield
    if _in_pair():
        restore(Pair.from_env())


LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(params=["asyncio", pytest.param("uvloop", marks=pytest.mark.long)])
def arun(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    """``arun(coro)`` runs ``coro`` on a fresh asyncio or uvloop loop (uvloop is in the long run only:
    the loop does not change what a fault does, and CI time is bounded)."""

    def run(coro: Coroutine[Any, Any, T]) -> T:
        with asyncio.Runner(loop_factory=LOOP_FACTORIES[request.param]) as runner:
            return runner.run(coro)

    return run
