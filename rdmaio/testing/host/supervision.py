"""Supervision: run the VM (or, on a machine with its own device, CMD itself) to its end or deadline.

The VM's output is streamed live and its tail kept for the failure message; the timeout and signals kill
the whole process group; CMD's exit status is read from the file the guest writes, and only its absence
means the VM failed. Run directories of killed test hosts are pruned.
"""

from __future__ import annotations

import codecs
import collections
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from rdmaio.testing.host.devices import LocalRdma
from rdmaio.testing.host.guest import harness_env
from rdmaio.testing.host.status import EXIT_HOST_FAILED, EXIT_TIMEOUT, log


class _Tail:
    """The last bytes written by the VM, for the failure message."""

    def __init__(self, limit: int = 16384) -> None:
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, data: bytes) -> None:
        with self._lock:
            self._chunks.append(data)
            self._size += len(data)
            while self._size - len(self._chunks[0]) > self._limit:
                self._size -= len(self._chunks.popleft())

    def lines(self, count: int) -> list[str]:
        with self._lock:
            text = b"".join(self._chunks).decode("utf-8", "replace")
        return text.splitlines()[-count:]


def _pump(src: BinaryIO, dst: TextIO, tail: _Tail) -> None:
    """Copy the VM's output to ``dst`` as it comes (bytes through to its buffer when it has one)."""
    fd = src.fileno()
    raw: BinaryIO | None = getattr(dst, "buffer", None)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        tail.add(data)
        try:
            if raw is not None:
                raw.write(data)
                raw.flush()
            else:
                dst.write(decoder.decode(data))
                dst.flush()
        except (OSError, ValueError):
            pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune_stale_runs(state: Path, max_age: float = 86400.0) -> None:
    """Remove run directories left by test hosts that were killed (their process gone for a day)."""
    now = time.time()
    for old in state.glob("run-*-*"):
        try:
            pid = int(old.name.split("-")[1])
            stale = now - old.stat().st_mtime > max_age and not _pid_alive(pid)
        except (ValueError, OSError):
            continue
        if stale:
            shutil.rmtree(old, ignore_errors=True)


def supervise_vm(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    workdir: Path,
    run_dir: Path,
    started: float,
    deadline: float,
) -> int:
    """Run the vng command ``argv`` to its end or ``deadline``; CMD's exit status, or a test host status."""
    tail = _Tail()
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, tail), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, tail), daemon=True),
    ]
    try:
        # Inside the try: SIGTERM raises SystemExit wherever the main thread is, and the VM must die
        # with us even if that happens while the output pumps are still being started.
        for t in pumps:
            t.start()
        vng_rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        for t in pumps:
            t.join(timeout=5)
        log(f"timeout: the run did not finish in time; VM killed after {time.monotonic() - started:.0f} s")
        return EXIT_TIMEOUT
    except BaseException:
        _kill_group(proc)
        raise
    for t in pumps:
        t.join(timeout=30)
    total = time.monotonic() - started
    ready = _read_text(run_dir / "ready")
    rc_text = _read_text(run_dir / "rc")
    if rc_text is None or not rc_text.isdigit():
        last = "\n".join(f"  | {line}" for line in tail.lines(40)) or "  (the VM printed nothing)"
        stage = "boot or set up RDMA" if ready is None else "finish (RDMA was ready; the command did not end)"
        log(
            f"error: the VM failed to {stage}: vng exit {vng_rc} after {total:.1f} s; "
            "the command's exit status is unknown (--verbose shows the kernel console). "
            f"Last output:\n{last}"
        )
        return EXIT_HOST_FAILED
    rc = int(rc_text)
    boot = f"VM boot + RDMA setup {float(ready):.1f} s of guest uptime, " if ready else ""
    log(f"total {total:.1f} s ({boot}command exit status {rc})")
    return rc


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def run_local(cmd: Sequence[str], local: LocalRdma, *, workdir: Path, deadline: float) -> int:
    """Run ``cmd`` on this machine's own device ``local`` and return its exit status."""
    env = {**os.environ, **harness_env("local", local.device, local.netdev, local.addr, None)}
    if "RDMAIO_TEST_ADDR" in os.environ:
        env["RDMAIO_TEST_ADDR"] = os.environ["RDMAIO_TEST_ADDR"]
    # Registration pins memory: lift the locked-memory limit as far as we may (inherited by CMD).
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        target = resource.RLIM_INFINITY if os.geteuid() == 0 else hard
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (target, target if os.geteuid() == 0 else hard))
    except (OSError, ValueError):
        pass
    started = time.monotonic()
    try:
        proc = subprocess.Popen(list(cmd), cwd=workdir, env=env, start_new_session=False)
    except OSError as exc:
        log(f"cannot run {cmd[0]}: {exc}")
        return 127
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log("timeout: the command did not finish in time")
        return EXIT_TIMEOUT
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    log(f"total {time.monotonic() - started:.1f} s (command exit status {rc})")
    return rc
