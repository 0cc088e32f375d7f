"""Packaging: the build stops with one clear line when the rdma-core headers are missing (also when
pip installs the sdist), the sdist carries what a build needs, and the version has one source."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

import rdmaio

REPO = Path(__file__).resolve().parents[2]
MESSAGE = (
    "rdmaio: rdma-core headers not found; install them with: apt-get install libibverbs-dev librdmacm-dev"
    " (Fedora/RHEL: dnf install rdma-core-devel)"
)


def without_headers(tmp_path: Path) -> dict[str, str]:
    """An environment in which the build script searches only an empty include directory."""
    empty = tmp_path / "include"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RDMAIO_INCLUDE_DIRS"}
    env["RDMAIO_SYSTEM_INCLUDE_DIRS"] = str(empty)
    return env


def test_build_script_names_the_packages(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "rdmaio/_ffi/build.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=without_headers(tmp_path),
        cwd=tmp_path,
    )
    assert run.returncode == 1
    assert run.stderr == MESSAGE + "\n"  # one line, nothing else (no traceback)
    assert run.stdout == ""


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("rdmaio-*.tar.gz")
    return found


def test_sdist_contents(sdist: Path) -> None:
    assert sdist.name == f"rdmaio-{rdmaio.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "setup.py",
        "pyproject.toml",
        "LICENSE",
        "CHANGELOG.md",
        "rdmaio/py.typed",
        "rdmaio/_ffi/build.py",
        "rdmaio/_ffi/cdefs.h",
        "rdmaio/_ffi/helper.c",
        "rdmaio/_ffi/helper.h",
        "rdmaio/cli/doctor.py",
    ):
        assert needed in names, needed


def test_installing_the_sdist_without_headers_fails_with_the_line(sdist: Path, tmp_path: Path) -> None:
    # pip wheel runs the same build as pip install, without touching this venv.
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(sdist),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=without_headers(tmp_path),
    )
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert output.count(MESSAGE) == 1, output
    assert "Traceback" not in output


def test_version_has_one_source() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|a\d+|b\d+|rc\d+)?", rdmaio.__version__)
    assert project["license"] == "MIT"  # an SPDX expression, not the deprecated table
    assert f"## [{rdmaio.__version__}]" in (REPO / "CHANGELOG.md").read_text()
