"""``python -m rdmaio doctor``: why RDMA does or does not work on this machine, one line per check.

Exit status 0 when no check failed (a connection can work: a loopback connect and echo through rdmaio
succeeded on every usable device), 1 otherwise, 2 for usage errors. ``--json`` prints the results as
one JSON document instead.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from rdmaio.cli.checks import (
    CHECKS,
    NEEDS_EXTENSION,
    CheckResult,
    Verdict,
    check_loopback,
    testhost_command,
)
from rdmaio.cli.system import System

__all__ = ["build_parser", "main", "rdmaio_version", "render_json", "render_text", "run_checks"]

_LABELS = {Verdict.OK: "ok", Verdict.WARN: "WARN", Verdict.FAIL: "FAIL", Verdict.SKIP: "skip"}


def run_checks(
    system: System, checks: Sequence[Callable[[System], CheckResult]] = CHECKS
) -> list[CheckResult]:
    """Run every check in order; a check that crashes is reported as failed, never raised."""
    results: list[CheckResult] = []
    for check in checks:
        target = getattr(check, "func", check)  # a functools.partial names its function
        name = getattr(target, "__name__", "check").removeprefix("check_")
        if name in NEEDS_EXTENSION and any(
            r.name == "extension" and r.verdict is Verdict.FAIL for r in results
        ):
            results.append(
                CheckResult(name, Verdict.SKIP, "rdmaio's extension does not load (see extension)")
            )
            continue
        try:
            results.append(check(system))
        except Exception as exc:  # a bug in one check must not hide the others' findings
            results.append(CheckResult(name, Verdict.FAIL, f"the check itself crashed: {exc!r}"))
    return results


def rdmaio_version() -> str:
    """rdmaio's version, also while the package is half imported (doctor run for a broken extension)."""
    version = getattr(sys.modules.get("rdmaio"), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("rdmaio")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _conclusion(results: Sequence[CheckResult]) -> str:
    failed = [r.name for r in results if r.verdict is Verdict.FAIL]
    if not failed:
        return "doctor: no check failed: rdmaio connections can work on this machine"
    text = f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}"
    if "devices" in failed:
        text += f"\ndoctor: no RDMA device here; to run on Soft-RoCE in the test host: {testhost_command()}"
    return text


def render_text(results: Sequence[CheckResult], out: TextIO) -> None:
    """One line per check: verdict, name, what was found, and the fix when there is one."""
    python, kernel = platform.python_version(), platform.release()
    print(f"rdmaio {rdmaio_version()} doctor (Python {python}, kernel {kernel})", file=out)
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        fix = f"  -> fix: {r.fix}" if r.fix else ""
        print(f"{_LABELS[r.verdict]:<4}  {r.name:<{width}}  {r.summary}{fix}", file=out)
    print(_conclusion(results), file=out)


def render_json(results: Sequence[CheckResult], out: TextIO) -> None:
    """The results as one JSON document: ``{"ok": bool, "checks": [...], ...}``."""
    doc: dict[str, Any] = {
        "ok": not any(r.verdict is Verdict.FAIL for r in results),
        "version": rdmaio_version(),
        "kernel": platform.release(),
        "checks": [r.to_json() for r in results],
    }
    json.dump(doc, out, indent=2)
    out.write("\n")


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``doctor``."""
    parser = argparse.ArgumentParser(
        prog="rdmaio doctor",
        description="Check what an RDMA connection needs on this machine; one line per check, with the fix.",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--timeout", type=float, default=20.0, metavar="SECONDS", help="loopback echo timeout (default 20)"
    )
    return parser


def main(argv: Sequence[str] | None = None, system: System | None = None) -> int:
    """Run doctor; returns the exit status (0 when no check failed)."""
    args = build_parser().parse_args(argv)
    checks = [
        functools.partial(check_loopback, timeout=args.timeout) if c is check_loopback else c for c in CHECKS
    ]
    results = run_checks(system or System(), checks)
    (render_json if args.json else render_text)(results, sys.stdout)
    return 1 if any(r.verdict is Verdict.FAIL for r in results) else 0
