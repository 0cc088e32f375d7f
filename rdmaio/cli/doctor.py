"""``python -m rdmaio doctor``: why RDMA does or does not work on this machine, one line per check.

Exit status 0 when no check failed (a connection can work: a loopback connect and echo through rdmaio
succeeded on every usable device), 1 otherwise, 2 for usage errors. ``--json`` prints the results as
one JSON document instead.

``--peer HOST [PORT]`` checks a pair of hosts instead, through ``rdmaio ping --server`` running on HOST
(:mod:`rdmaio.cli.peer`): route, handshake, echo, each side's GID, MTU match, an RDMA READ and a short
throughput sample.
"""

from __future__ import annotations

import argparse
import asyncio
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
    check_extension,
    check_loopback,
    testhost_command,
)
from rdmaio.cli.ping import DEFAULT_PORT
from rdmaio.cli.system import System

__all__ = [
    "build_parser",
    "main",
    "rdmaio_version",
    "render_json",
    "render_text",
    "run_checks",
    "run_pair_checks",
]

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


def _conclusion(results: Sequence[CheckResult], peer: str | None = None) -> str:
    failed = [r.name for r in results if r.verdict is Verdict.FAIL]
    if not failed:
        if peer is not None:
            return f"doctor: no check failed: this host and {peer} talk over RDMA through rdmaio"
        return "doctor: no check failed: rdmaio connections can work on this machine"
    text = f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}"
    if "devices" in failed:
        text += f"\ndoctor: no RDMA device here; to run on Soft-RoCE in the test host: {testhost_command()}"
    return text


def render_text(results: Sequence[CheckResult], out: TextIO, peer: str | None = None) -> None:
    """One line per check: verdict, name, what was found, and the fix when there is one.

    ``peer`` (``HOST:PORT``) when the checks were those of ``--peer``.
    """
    python, kernel = platform.python_version(), platform.release()
    target = f", pair with {peer}" if peer is not None else ""
    print(f"rdmaio {rdmaio_version()} doctor (Python {python}, kernel {kernel}{target})", file=out)
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        fix = f"  -> fix: {r.fix}" if r.fix else ""
        print(f"{_LABELS[r.verdict]:<4}  {r.name:<{width}}  {r.summary}{fix}", file=out)
    print(_conclusion(results, peer), file=out)


def render_json(results: Sequence[CheckResult], out: TextIO, peer: str | None = None) -> None:
    """The results as one JSON document: ``{"ok": bool, "checks": [...], ...}`` (and ``"peer"``)."""
    doc: dict[str, Any] = {
        "ok": not any(r.verdict is Verdict.FAIL for r in results),
        "version": rdmaio_version(),
        "kernel": platform.release(),
        "checks": [r.to_json() for r in results],
    }
    if peer is not None:
        doc["peer"] = peer
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
        "--timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="loopback echo timeout; with --peer, the connect and each answer's (default 20)",
    )
    parser.add_argument(
        "--peer",
        nargs="+",
        metavar=("HOST", "PORT"),
        help="check the pair of this host and HOST, where `rdmaio ping --server HOST [PORT]` runs "
        f"(PORT default {DEFAULT_PORT}): route, handshake, echo, GIDs, MTU, RDMA READ, throughput",
    )
    parser.add_argument(
        "--sample",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="with --peer, how long the throughput sample runs (default 0.5)",
    )
    return parser


def _peer_target(parser: argparse.ArgumentParser, values: Sequence[str]) -> tuple[str, int]:
    if len(values) > 2:
        parser.error("--peer takes HOST and an optional PORT")
    if len(values) == 1:
        return values[0], DEFAULT_PORT
    try:
        port = int(values[1])
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        parser.error(f"--peer: PORT must be a number between 1 and 65535, not {values[1]!r}")
    return values[0], port


def run_pair_checks(
    system: System, host: str, port: int, timeout: float, sample_seconds: float
) -> list[CheckResult]:
    """``--peer``: the extension first (the pair checks need it), then :func:`run_peer_checks`."""
    from rdmaio.cli.peer import AFTER_HANDSHAKE, run_peer_checks

    extension = run_checks(system, [check_extension])
    if extension[0].verdict is Verdict.FAIL:
        skipped = ("route", "handshake", *AFTER_HANDSHAKE)
        return extension + [
            CheckResult(name, Verdict.SKIP, "rdmaio's extension does not load (see extension)")
            for name in skipped
        ]
    return extension + asyncio.run(run_peer_checks(host, port, system, timeout, sample_seconds))


def main(argv: Sequence[str] | None = None, system: System | None = None) -> int:
    """Run doctor; returns the exit status (0 when no check failed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.sample <= 0:
        parser.error("--timeout and --sample must be positive")
    system = system or System()
    peer: str | None = None
    if args.peer:
        host, port = _peer_target(parser, args.peer)
        peer = f"{host}:{port}"
        results = run_pair_checks(system, host, port, args.timeout, args.sample)
    else:
        checks = [
            functools.partial(check_loopback, timeout=args.timeout) if c is check_loopback else c
            for c in CHECKS
        ]
        results = run_checks(system, checks)
    (render_json if args.json else render_text)(results, sys.stdout, peer)
    return 1 if any(r.verdict is Verdict.FAIL for r in results) else 0
