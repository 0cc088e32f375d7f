"""The rule the device suites share: where a suite must really run, a skipped test is a failed one.

Each suite's ``conftest.py`` says when skips are forbidden (under the test host, in CI, in the pair
topology) and takes its two hooks from :func:`skip_hooks`::

    pytest_runtest_makereport, pytest_make_collect_report = skip_hooks(forbidden, "skipped under ...")
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

__all__ = ["skip_hooks", "skip_reason"]


def skip_reason(longrepr: object) -> str:
    """The reason of a skip report (its ``longrepr`` is ``(path, lineno, "Skipped: reason")``)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def skip_hooks(forbidden: Callable[[], bool], prefix: str) -> tuple[Any, Any]:
    """pytest's ``pytest_runtest_makereport`` and ``pytest_make_collect_report`` hooks that turn a skipped
    test, or a module skipped at collection, into a failure while ``forbidden()`` is true (an xfail is
    left alone); the failure's text starts with ``prefix``."""

    def fail(report: pytest.TestReport | pytest.CollectReport) -> None:
        report.outcome = "failed"
        report.longrepr = f"{prefix}: {skip_reason(report.longrepr)}"

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.skipped and forbidden() and not hasattr(report, "wasxfail"):
            fail(report)
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        collector: pytest.Collector,
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        if report.skipped and forbidden():
            fail(report)
        return report

    return pytest_runtest_makereport, pytest_make_collect_report
