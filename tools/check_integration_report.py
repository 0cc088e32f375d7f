#!/usr/bin/env python3
"""Check that the integration tests really ran, inside the test host, and all passed.

Usage: tools/check_integration_report.py [reports/integration.xml]

Reads the junit XML that pytest wrote (``--junitxml``) and exits 1 with a message unless: at least one test
ran, none was skipped (an xfail counts as skipped: junit records it so), none failed or errored, and the
report's ``testhost`` property (recorded by tests/integration/conftest.py from ``RDMAIO_TESTHOST``) shows
the tests ran inside the test host (``1``: its VM; ``local``: this machine's own RDMA device).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_REPORT = Path("reports/integration.xml")
TESTHOST_VALUES = {"1": "the test host VM", "local": "the test host (this machine's RDMA device)"}


@dataclass
class Summary:
    """What one junit report says."""

    tests: int = 0
    passed: int = 0
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)


def _name(case: ET.Element) -> str:
    classname = case.get("classname", "")
    name = case.get("name", "?")
    return f"{classname}::{name}" if classname else name


def _first_line(element: ET.Element) -> str:
    text = element.get("message") or (element.text or "")
    return text.strip().splitlines()[0][:200] if text.strip() else ""


def summarize(root: ET.Element) -> Summary:
    """Count the test cases of a junit report by their outcome."""
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    summary = Summary()
    for suite in suites:
        for prop in suite.iter("property"):
            summary.properties.setdefault(prop.get("name", ""), prop.get("value", ""))
        for case in suite.iter("testcase"):
            summary.tests += 1
            label = _name(case)
            outcome = "passed"
            for child in case:
                detail = _first_line(child)
                entry = f"{label}: {detail}" if detail else label
                if child.tag == "failure":
                    summary.failures.append(entry)
                    outcome = "failed"
                elif child.tag == "error":
                    summary.errors.append(entry)
                    outcome = "failed"
                elif child.tag == "skipped":
                    summary.skipped.append(entry)
                    outcome = "skipped"
            if outcome == "passed":
                summary.passed += 1
    return summary


def _listing(entries: list[str], limit: int = 5) -> str:
    shown = "\n".join(f"    {entry}" for entry in entries[:limit])
    more = f"\n    ... and {len(entries) - limit} more" if len(entries) > limit else ""
    return f"\n{shown}{more}"


def check(summary: Summary) -> list[str]:
    """The reasons the report is not acceptable (empty when it is)."""
    problems: list[str] = []
    if summary.tests == 0:
        problems.append("no test ran (0 test cases in the report)")
    if summary.failures:
        problems.append(f"{len(summary.failures)} test(s) failed:" + _listing(summary.failures))
    if summary.errors:
        problems.append(f"{len(summary.errors)} test(s) errored:" + _listing(summary.errors))
    if summary.skipped:
        problems.append(f"{len(summary.skipped)} test(s) skipped:" + _listing(summary.skipped))
    testhost = summary.properties.get("testhost")
    if testhost is None:
        problems.append(
            "the report has no 'testhost' property: tests/integration/conftest.py did not record it "
            "(or no test ran)"
        )
    elif testhost not in TESTHOST_VALUES:
        problems.append(
            f"the tests did not run inside the test host (testhost={testhost!r}; run them through "
            "python -m rdmaio.testing.host)"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    """Check the report named in ``argv`` (default reports/integration.xml); return the exit status."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DEFAULT_REPORT
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        print(f"integration report: FAILED: {path} does not exist (the integration tests did not run)")
        return 1
    except (ET.ParseError, OSError) as exc:
        print(f"integration report: FAILED: cannot read {path}: {exc}")
        return 1
    summary = summarize(root)
    where = TESTHOST_VALUES.get(summary.properties.get("testhost", ""), "unknown")
    kernel = summary.properties.get("kernel", "?")
    print(
        f"integration report {path}: {summary.tests} tests: {summary.passed} passed, "
        f"{len(summary.failures)} failed, {len(summary.errors)} errors, {len(summary.skipped)} skipped; "
        f"ran in: {where}, kernel {kernel}"
    )
    problems = check(summary)
    for problem in problems:
        print(f"integration report: FAILED: {problem}")
    if problems:
        return 1
    print("integration report: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
