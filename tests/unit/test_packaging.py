"""Packaging: the build stops with one clear line when the rdma-core headers are missing (also when
pip installs the sdist), the sdist carries what a build needs, the wheel carries the package and not the
benchmark harness (``bench/`` and its C contender stay in the repository), the sdist installs into a fresh
venv and works there, and the version has one source."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
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
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``python -m build``: the sdist, then the wheel built from it (the extension compiled here)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "-o", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (found_sdist,) = out.glob("rdmaio-*.tar.gz")
    (found_wheel,) = out.glob("rdmaio-*.whl")
    return found_sdist, found_wheel


@pytest.fixture(scope="module")
def sdist(dists: tuple[Path, Path]) -> Path:
    return dists[0]


@pytest.fixture(scope="module")
def wheel(dists: tuple[Path, Path]) -> Path:
    return dists[1]


def test_wheel_carries_the_package_and_not_the_harness(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    for needed in (
        "rdmaio/__init__.py",
        "rdmaio/__main__.py",
        "rdmaio/cli/doctor.py",
        "rdmaio/testing/__init__.py",
    ):
        assert needed in names, needed
    assert any(n.startswith("rdmaio/_rdmaio_cffi") and n.endswith(".so") for n in names)  # the extension
    # The comparative harness and its C contender stay in the repository.
    assert [n for n in names if n.startswith("bench/") or "/bench/" in n] == []
    assert [n for n in names if "cm_setup" in n] == []
    assert [n for n in names if n.endswith(".c") and not n.startswith("rdmaio/_ffi/")] == []
    assert (REPO / "bench" / "native" / "cm_setup.c").is_file()  # it did not go missing from the checkout


def fresh_venv(tmp_path: Path) -> Path:
    """A new venv with no rdmaio, whose only third-party packages are this venv's (no download).

    The venv gets no pip (pip runs from this venv with ``--python``); a ``.pth`` file adds a directory of
    links to this venv's site-packages minus rdmaio itself (its editable install included), so cffi,
    pycparser and setuptools are there for the build and for the extension at run time.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    deps = tmp_path / "deps"
    deps.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if entry.name.startswith(("rdmaio", "__editable__", "_rdmaio")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    (Path(site) / "test_dependencies.pth").write_text(f"{deps}\n")
    return venv


def test_the_sdist_installs_and_works_in_a_fresh_venv(sdist: Path, tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path)
    python, rdmaio_cmd = venv / "bin" / "python", venv / "bin" / "rdmaio"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--ignore-installed",
            "--no-cache-dir",  # build it here, never reuse a cached wheel
            str(sdist),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    work = tmp_path / "elsewhere"  # not the checkout: nothing may come from the source tree
    work.mkdir()
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util, rdmaio; print(rdmaio.__file__); print(importlib.util.find_spec('bench'))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
    )
    assert where.returncode == 0, where.stderr
    module_file, bench_spec = where.stdout.splitlines()
    assert Path(module_file).is_relative_to(venv)  # the installed copy, not the checkout
    assert bench_spec == "None"  # the harness is not installed
    doctor = subprocess.run(
        [str(rdmaio_cmd), "doctor"], capture_output=True, text=True, timeout=300, cwd=work
    )
    # Without an RDMA device doctor reports what is missing (exit status 1); it must run its checks.
    assert doctor.returncode in (0, 1), doctor.stdout + doctor.stderr
    assert "Traceback" not in doctor.stdout + doctor.stderr
    assert "ok    extension  rdmaio's cffi extension loads" in doctor.stdout
    host = subprocess.run(
        [str(python), "-m", "rdmaio.testing.host", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
    )
    assert host.returncode == 0, host.stderr
    assert host.stdout.startswith("usage:")
    moved = subprocess.run([str(rdmaio_cmd), "bench"], capture_output=True, text=True, timeout=120, cwd=work)
    assert moved.returncode == 2 and "tools/dev bench" in moved.stderr


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
