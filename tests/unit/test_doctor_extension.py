"""``rdmaio doctor`` when rdmaio's own compiled extension is missing or broken: it runs, reports the
extension with the fix, skips the checks that need it and exits 1, without a traceback; the other commands
say in one line that the extension does not load; ``import rdmaio`` in a program still raises at once.

Each case runs the command line in a subprocess on a copy of the package (in a temporary directory) whose
extension was removed or replaced by garbage. The interpreter runs with ``-S`` and the virtualenv's
site-packages on ``PYTHONPATH``: the dependencies (cffi) are found, but not the editable install's import
hook, which would otherwise find the checkout's own extension for the copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rdmaio.cli.checks import CHECKS, NEEDS_EXTENSION
from rdmaio.cli.startup import EXTENSION_FIX, invoked_as_cli

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """A copy of the rdmaio package without its compiled extension; returns the directory holding it."""
    shutil.copytree(
        REPO / "rdmaio", tmp_path / "rdmaio", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    assert not list((tmp_path / "rdmaio").glob("_rdmaio_cffi*"))
    return tmp_path


def run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the interpreter on the copy at ``root`` (``-S``: no editable-install hook)."""
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{sysconfig.get_paths()['purelib']}")
    return subprocess.run(
        [sys.executable, "-S", *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=root, env=env
    )


def check_report(done: subprocess.CompletedProcess[str], summary: str) -> list[str]:
    """The doctor report on a broken extension: the extension line with the fix, dependent checks skipped."""
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(CHECKS) + 2 or len(lines) == len(CHECKS) + 3, done.stdout  # +hint without RDMA
    extension = [line for line in lines if line.startswith("FAIL  extension  ")]
    assert extension == [f"FAIL  extension  {summary}  -> fix: {EXTENSION_FIX}"], done.stdout
    assert "tools/dev setup" in EXTENSION_FIX and "libibverbs-dev librdmacm-dev" in EXTENSION_FIX
    for name in NEEDS_EXTENSION:
        assert any(line.startswith(f"skip  {name}") and "(see extension)" in line for line in lines), name
    assert lines[0].startswith("rdmaio 0.1.0 doctor (Python ")
    assert "extension" in next(line for line in lines if line.startswith("doctor: "))
    return lines


def test_doctor_reports_a_missing_extension(package_copy: Path) -> None:
    done = run(package_copy, "-m", "rdmaio", "doctor")
    check_report(
        done, f"rdmaio's compiled extension is missing: no _rdmaio_cffi*.so in {package_copy}/rdmaio"
    )


def test_doctor_reports_a_broken_extension(package_copy: Path) -> None:
    (package_copy / "rdmaio" / "_rdmaio_cffi.abi3.so").write_bytes(b"not an ELF file")
    done = run(package_copy, "-m", "rdmaio", "doctor")
    so = package_copy / "rdmaio" / "_rdmaio_cffi.abi3.so"
    check_report(done, f"rdmaio's compiled extension does not load: {so}: file too short")

    as_json = run(package_copy, "-m", "rdmaio", "doctor", "--json")
    assert as_json.returncode == 1, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is False
    verdicts = {c["name"]: c["verdict"] for c in doc["checks"]}
    assert verdicts["extension"] == "fail"
    assert {name: verdicts[name] for name in NEEDS_EXTENSION} == dict.fromkeys(NEEDS_EXTENSION, "skip")


def test_console_script_runs_doctor_without_the_extension(package_copy: Path) -> None:
    # The console script is a file named rdmaio that imports rdmaio.__main__; a copy of it does the same.
    script = package_copy / "bin" / "rdmaio"
    script.parent.mkdir()
    script.write_text("import sys\nfrom rdmaio.__main__ import main\nsys.exit(main())\n")
    done = run(package_copy, str(script), "doctor")
    check_report(
        done, f"rdmaio's compiled extension is missing: no _rdmaio_cffi*.so in {package_copy}/rdmaio"
    )


def test_other_commands_say_the_extension_does_not_load(package_copy: Path) -> None:
    done = run(package_copy, "-m", "rdmaio", "ping", "198.18.0.1")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"rdmaio ping: rdmaio's compiled extension is missing: no _rdmaio_cffi*.so in {package_copy}/rdmaio",
        f"rdmaio ping: {EXTENSION_FIX}; python -m rdmaio doctor checks the rest",
    ]
    usage = run(package_copy, "-m", "rdmaio", "--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m rdmaio COMMAND")


def test_import_rdmaio_in_a_program_still_raises(package_copy: Path) -> None:
    """Programs are unchanged: ``import rdmaio`` without the extension raises ImportError at once."""
    done = run(package_copy, "-c", "import rdmaio")
    assert done.returncode == 1
    assert "ImportError" in done.stderr and "_rdmaio_cffi" in done.stderr


def test_doctor_unchanged_with_the_extension(package_copy: Path) -> None:
    """With the extension present the extension check passes (and the guard does nothing)."""
    shutil.copy(next((REPO / "rdmaio").glob("_rdmaio_cffi*.so")), package_copy / "rdmaio")
    done = run(package_copy, "-m", "rdmaio", "doctor")
    assert "ok    extension  rdmaio's cffi extension loads" in done.stdout.splitlines(), done.stdout
    assert not any(line.startswith("skip") and "(see extension)" in line for line in done.stdout.splitlines())


@pytest.mark.parametrize(
    ("orig_argv", "argv0", "expected"),
    [
        (["python", "-m", "rdmaio", "doctor"], "-m", True),
        (["python", "-mrdmaio"], "-m", True),
        (["python", "-X", "dev", "-W", "error", "-Im", "rdmaio", "ping"], "-m", True),
        (["python", "-Xdev", "-m", "rdmaio"], "-m", True),
        (["/venv/bin/python", "/venv/bin/rdmaio", "doctor"], "/venv/bin/rdmaio", True),
        (["python", "-m", "rdmaio.testing.host", "--", "x"], "-m", False),
        (["python", "-m", "pytest", "-m", "rdmaio"], "-m", False),
        (["python", "-c", "import rdmaio", "-m", "rdmaio"], "-c", False),
        (["python", "app.py", "-m", "rdmaio"], "app.py", False),
        (["python", "-W", "m", "app.py"], "app.py", False),
    ],
)
def test_invoked_as_cli(orig_argv: list[str], argv0: str, expected: bool) -> None:
    assert invoked_as_cli(orig_argv, argv0) is expected


def test_doctor_peer_without_the_extension_skips_the_pair_checks(package_copy: Path) -> None:
    done = run(package_copy, "-m", "rdmaio", "doctor", "--peer", "198.18.0.2")
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[1].startswith("FAIL  extension   rdmaio's compiled extension is missing"), lines
    skipped = [line.split()[1] for line in lines[2:-1]]
    assert skipped == ["route", "handshake", "gids", "mtu", "echo", "read", "throughput"], lines
    assert all(line.startswith("skip") and line.endswith("(see extension)") for line in lines[2:-1]), lines
    assert lines[-1] == "doctor: 1 check(s) failed: extension"
