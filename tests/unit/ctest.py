"""Compiling and running the small C test programs of the unit tests against rdmaio's C sources.

Each program is a ``main`` that drives functions of ``rdmaio/_ffi/*.c`` (with fake verbs functions where
it needs them) and prints what the test asserts. They are compiled with warnings as errors, so a C change
that makes a test program (or the code under test) warn fails the tests.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

FFI_DIR = Path(__file__).resolve().parents[2] / "rdmaio" / "_ffi"
"""rdmaio's C sources and headers (the compiled extension's)."""

CFLAGS = ("-std=gnu11", "-Wall", "-Wextra", "-Werror")
"""What every test program is compiled with (callers may add flags, e.g. the sanitizers)."""

RUN_TIMEOUT = 120.0
"""Seconds a test program may run: a bound on a hang, not an expectation."""


def compile_c(
    work: Path, name: str, program: str | Path, ffi_sources: Sequence[str], extra_flags: Sequence[str] = ()
) -> Path:
    """Compile ``program`` (C source text, or a path to a ``.c`` file) with ``ffi_sources`` (file names in
    rdmaio/_ffi) into ``work/name``; returns the binary. A compiler error fails the test with its output."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is needed to build the C test programs (tools/dev setup installs it)")
    if isinstance(program, Path):
        main = program
    else:
        main = work / f"{name}.c"
        main.write_text(program)
    binary = work / name
    done = subprocess.run(
        [
            gcc,
            *CFLAGS,
            *extra_flags,
            "-I",
            str(FFI_DIR),
            str(main),
            *(str(FFI_DIR / source) for source in ffi_sources),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"the C test program {name} does not compile:\n{done.stderr}")
    return binary


def build_and_run(work: Path, name: str, program: str | Path, ffi_sources: Sequence[str]) -> str:
    """Compile ``program`` with ``ffi_sources`` (see :func:`compile_c`), run it, return what it printed; a
    non-zero exit status fails the test with the program's output."""
    binary = compile_c(work, name, program, ffi_sources)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if run.returncode != 0:
        pytest.fail(
            f"the C test program {name} exited with status {run.returncode}:\n{run.stdout}{run.stderr}"
        )
    return run.stdout
