"""Unit tests of the test host's Soft-iWARP provider (``--provider siw``): the guest script (siw0, no rxe,
the module loaded from the run directory), the pair with two siw devices, and the out-of-tree build of
``siw.ko`` (package names, commands, cache key, one build under a lock, the message when packages are
missing). Nothing here boots a VM or builds a module."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from rdmaio.testing.host import cli, guest, launcher, siw
from rdmaio.testing.host.status import EXIT_PREFLIGHT, PreflightError

RUN_DIR = Path("/w/.testhost/run-1")
RELEASE = "6.1.0-56-amd64"


def script_for(provider: str, topology: str = "single") -> str:
    return guest.guest_script(
        ["true"], workdir=Path("/w"), run_dir=RUN_DIR, env={}, topology=topology, provider=provider
    )


def bash_ok(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr


def test_siw_guest_script_sets_up_siw0_and_no_rxe() -> None:
    script = script_for("siw")
    assert "rdma link add siw0 type siw netdev dum0" in script
    # with rxe and siw on one netdev, rdma_cm would pick rxe: no rxe module, no rxe device
    assert "rdma_rxe" not in script and "type rxe" not in script and "rxe0" not in script
    assert "modprobe -a ib_core crc32c_generic libcrc32c rdma_ucm ib_uverbs" in script
    assert f"insmod {RUN_DIR}/siw.ko" in script
    assert script.index("insmod") < script.index("rdma link add siw0")
    assert "export RDMAIO_TEST_DEVICE=siw0" in script
    assert "export RDMAIO_TEST_PROVIDER=siw" in script
    assert "read -r state </sys/class/infiniband/siw0/ports/1/state" in script
    bash_ok(script)


def test_rxe_guest_script_is_unchanged_but_names_its_provider() -> None:
    script = script_for("rxe")
    assert "modprobe -a rdma_rxe rdma_ucm ib_uverbs" in script
    assert "rdma link add rxe0 type rxe netdev dum0" in script
    assert "siw" not in script.replace("RDMAIO_TEST_PROVIDER=rxe", "")
    assert "insmod" not in script
    assert "export RDMAIO_TEST_PROVIDER=rxe" in script


def test_siw_pair_sets_up_a_siw_device_on_each_veth() -> None:
    script = script_for("siw", "pair")
    assert "rdma link add siw0 type siw netdev veth0" in script
    assert "rdma link add siw1 type siw netdev veth1" in script
    assert "type rxe" not in script and "rdma_rxe" not in script
    assert "export RDMAIO_TEST_DEVICE=siw0" in script and "export RDMAIO_TEST_DEVICE2=siw1" in script
    assert "route del local 198.18.0.2 table local" in script  # the same routing as with rxe
    assert "rdma link show siw1/1" in script
    assert "net.ipv4.ip_nonlocal_bind=1" in script  # siw binds TCP sockets to the nodes' addresses
    assert "ip_nonlocal_bind" not in script_for("rxe", "pair")
    bash_ok(script)


def test_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="provider"):
        script_for("efa")


def test_cli_refuses_an_unknown_provider(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--provider", "efa", "--", "true"])
    assert info.value.code == 2
    assert "invalid choice: 'efa'" in capsys.readouterr().err


def test_siw_always_uses_the_vm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Even with a device on this machine, --provider siw boots the VM (it loads a module, adds siw0)."""
    monkeypatch.setattr(launcher, "find_local_rdma", lambda: pytest.fail("must not look for a local device"))
    planned: list[str] = []

    def plan_vm(kernel: object, install: bool, provider: str = "rxe") -> None:
        planned.append(provider)
        raise PreflightError("stop here")

    monkeypatch.setattr(launcher, "plan_vm", plan_vm)
    assert launcher.run(["true"], workdir=tmp_path, provider="siw") == EXIT_PREFLIGHT
    assert planned == ["siw"]


def test_package_names_derive_from_the_kernel_release(monkeypatch: pytest.MonkeyPatch) -> None:
    assert siw.series(RELEASE) == "6.1"
    assert siw.headers_package(RELEASE) == "linux-headers-6.1.0-56-amd64"
    assert siw.source_package(RELEASE) == "linux-source-6.1"
    versions = {"linux-image-6.1.0-56-amd64": "6.1.192-2"}
    monkeypatch.setattr(siw, "dpkg_version", versions.get)
    # the source pinned to the image's version: the same package version is the same source
    assert siw.wanted_packages(RELEASE) == ["linux-headers-6.1.0-56-amd64", "linux-source-6.1=6.1.192-2"]
    with pytest.raises(PreflightError, match="series"):
        siw.series("weird")


def fake_src(tmp_path: Path, *, headers: bool = True, tarball: bool = True) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    if headers:
        (src / f"linux-headers-{RELEASE}").mkdir()
        (src / f"linux-headers-{RELEASE}" / "Makefile").write_text("")
    if tarball:
        (src / "linux-source-6.1.tar.xz").write_bytes(b"")
    return src


def test_missing_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    versions = {"linux-image-6.1.0-56-amd64": "6.1.192-2"}
    monkeypatch.setattr(siw, "dpkg_version", versions.get)
    src = fake_src(tmp_path, headers=False, tarball=False)
    assert siw.missing_packages(RELEASE, src) == [
        "linux-headers-6.1.0-56-amd64",
        "linux-source-6.1=6.1.192-2",
    ]
    with pytest.raises(PreflightError) as info:
        siw.ensure_module(RELEASE, tmp_path / "cache", src)
    assert "apt-get install linux-headers-6.1.0-56-amd64 linux-source-6.1=6.1.192-2" in str(info.value)


def test_a_source_of_another_version_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    versions = {"linux-image-6.1.0-56-amd64": "6.1.192-2", "linux-source-6.1": "6.1.190-1"}
    monkeypatch.setattr(siw, "dpkg_version", versions.get)
    assert siw.missing_packages(RELEASE, fake_src(tmp_path)) == ["linux-source-6.1=6.1.192-2"]


def test_build_commands_extract_only_the_driver_directory(tmp_path: Path) -> None:
    src = fake_src(tmp_path)
    extract, make = siw.build_commands(RELEASE, src / "linux-source-6.1.tar.xz", Path("/b"), src)
    assert extract[:5] == ["tar", "-xf", str(src / "linux-source-6.1.tar.xz"), "-C", "/b"]
    assert extract[-2:] == ["--wildcards", "linux-source-6.1/drivers/infiniband/sw/siw/*"]
    assert make[:4] == [
        "make",
        "-C",
        str(src / f"linux-headers-{RELEASE}"),
        "M=/b/linux-source-6.1/drivers/infiniband/sw/siw",
    ]
    assert "CONFIG_RDMA_SIW=m" in make and make[-1] == "modules"


def test_cache_key_is_the_release_and_source_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(siw, "dpkg_version", {"linux-source-6.1": "6.1.192-2"}.get)
    target = siw.cached_module(RELEASE, tmp_path, fake_src(tmp_path))
    assert target == tmp_path / "siw-6.1.0-56-amd64-6.1.192-2.ko"


def test_module_is_built_once_even_by_two_test_hosts_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(siw, "dpkg_version", {"linux-source-6.1": "6.1.192-2"}.get)
    src = fake_src(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "siw-6.1.0-56-amd64-6.1.100-1.ko").write_bytes(b"an older source's build")
    builds: list[Path] = []

    def build(release: str, target: Path, src_dir: Path) -> None:
        builds.append(target)
        time.sleep(0.2)  # the other caller arrives while this one holds the lock
        target.write_bytes(b"siw.ko")

    monkeypatch.setattr(siw, "build_module", build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(siw.ensure_module(RELEASE, cache, src)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(builds) == 1
    assert results == [cache / "siw-6.1.0-56-amd64-6.1.192-2.ko"] * 2
    assert sorted(p.name for p in cache.glob("siw-*.ko")) == ["siw-6.1.0-56-amd64-6.1.192-2.ko"]
    assert siw.ensure_module(RELEASE, cache, src) == results[0] and len(builds) == 1  # cached
