"""Peers in separate processes, for tests that kill them (SIGKILL) mid-transfer."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def peer_process(code: str, *args: str) -> subprocess.Popen[str]:
    """Start a separate Python process running ``code``; it prints a line starting READY when connected."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, text=True
    )


def wait_ready(proc: subprocess.Popen[str]) -> str:
    """Block until the peer prints its READY line; return that line."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return line
