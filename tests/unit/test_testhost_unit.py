"""Unit tests of the test host's pure parts (rdmaio/testing/host/), its conftest rules and report check.

Nothing here boots a VM or needs an RDMA device.
"""

from __future__ import annotations

import importlib.util
import lzma
import os
import shutil
import struct
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from rdmaio.testing import host
from rdmaio.testing.host import launcher, preflight
from rdmaio.testing.host.kernel import has_pvh_entry

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------
# The guest script
# ---------------------------------------------------------------------------------------------------------


def make_script(cmd: list[str], env: dict[str, str] | None = None, tmp: Path = Path("/w")) -> str:
    return host.guest_script(cmd, workdir=tmp, run_dir=tmp / ".testhost" / "run-1", env=env or {})


def command_line(script: str) -> str:
    """The command part of a guest script (it may span lines when an argument has a newline)."""
    before, sep, _after = script.partition(" </dev/null\nrc=$?\n")
    assert sep, script
    return before.split('|| fail "cannot cd to /w"\n', 1)[1]


def test_guest_script_sets_up_rxe_on_dummy_netdev() -> None:
    script = make_script(["true"])
    assert "modprobe -a rdma_rxe rdma_ucm ib_uverbs" in script
    assert "link add dum0 type dummy" in script
    assert "link set dum0 up" in script
    assert "addr add 198.18.0.1/24 dev dum0" in script
    assert "addr add 198.18.0.2/24 dev dum0" in script
    assert "rdma link add rxe0 type rxe netdev dum0" in script
    assert "rdma link show rxe0/1" in script
    assert "ulimit -l unlimited" in script
    assert "ulimit -n 65536" in script
    assert "testhost: rxe0 ready at 198.18.0.1 after" in script
    # Setup happens before the command, the exit status is written after it.
    assert script.index("rdma link add") < script.index("\ntrue </dev/null") < script.index('>"$RUN_DIR/rc"')
    assert "cd /w ||" in script


def test_guest_script_is_valid_bash() -> None:
    script = make_script(["python", "-c", "print('x')"], {"RDMAIO_X": "a b"})
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["<%s>\n", "a b", "it's", '"double"', "$HOME", "`id`", "back\\slash", "*", ""],
        ["semi;colon", "a && b", "new\nline", "tab\there", "-n", "~", "!x", "{a,b}"],
    ],
)
def test_command_is_quoted_exactly(args: list[str]) -> None:
    line = command_line(make_script(["dump_args", *args]))
    dump = 'dump_args() { printf "%s\\0" "$@"; }\n'
    done = subprocess.run(["bash", "-c", dump + line], capture_output=True, check=True)
    assert done.stdout.decode().split("\0")[:-1] == args


def test_command_runs_with_its_arguments(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print(repr(sys.argv[1:]))", "a b", "it's", '"q"', "$X"]
    line = command_line(make_script(cmd))
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(cmd[3:])


def test_empty_command_is_rejected() -> None:
    with pytest.raises(ValueError):
        make_script([])


def test_filter_env_passes_only_the_documented_variables() -> None:
    environ = {
        "RDMAIO_FOO": "1",
        "PYTEST_ADDOPTS": "-x",
        "CI": "true",
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "PYTHONPATH": "/work",
        "AWS_SECRET_ACCESS_KEY": "no",
        "PYTHONHOME": "no",
        "RDMAIOX": "no",
        "CI_TOKEN": "no",
        "TERM": "no",
        "RDMAIO_BAD-NAME": "no",
    }
    assert host.filter_env(environ) == {
        "CI": "true",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "PATH": "/usr/bin",
        "PYTEST_ADDOPTS": "-x",
        "PYTHONPATH": "/work",
        "RDMAIO_FOO": "1",
    }


def test_exports_are_quoted_and_harness_values_win() -> None:
    env = {
        "RDMAIO_NOTE": 'it\'s a "test" $(id) `id`\nline2',
        "RDMAIO_TEST_ADDR": "10.9.9.9",
        "RDMAIO_REQUIRE_DEVICE": "0",
        "SECRET": "x",
        "PATH": "/opt/bin:/usr/bin",
    }
    script = make_script(["true"], env)
    exports = script.split('after $REPLY s" >&2\n', 1)[1].split("\ncd /w ||", 1)[0]
    assert "SECRET" not in exports
    probe = "env | grep -E '^(RDMAIO_|PATH=)' | sort"
    out = subprocess.run(["bash", "-c", f"{exports}\n{probe}"], capture_output=True, text=True, check=True)
    values = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert values["RDMAIO_TEST_ADDR"] == "198.18.0.1"
    assert values["RDMAIO_TEST_ADDR2"] == "198.18.0.2"
    assert values["RDMAIO_REQUIRE_DEVICE"] == "1"
    assert values["RDMAIO_TESTHOST"] == "1"
    assert values["RDMAIO_TEST_DEVICE"] == "rxe0"
    assert values["RDMAIO_TEST_NETDEV"] == "dum0"
    assert values["PATH"].startswith("/opt/bin:/usr/bin")
    note = subprocess.run(
        ["bash", "-c", f'{exports}\nprintf "%s" "$RDMAIO_NOTE"'], capture_output=True, text=True, check=True
    )
    assert note.stdout == env["RDMAIO_NOTE"]


# ---------------------------------------------------------------------------------------------------------
# Kernel selection
# ---------------------------------------------------------------------------------------------------------


def fake_kernels(tmp_path: Path, releases: list[str], with_rxe: list[str]) -> tuple[Path, Path]:
    boot = tmp_path / "boot"
    mods = tmp_path / "modules"
    boot.mkdir()
    for rel in releases:
        (boot / f"vmlinuz-{rel}").write_bytes(b"not a real kernel")
        (boot / f"config-{rel}").write_text("")
    for rel in with_rxe:
        rxe = mods / rel / "kernel" / "drivers" / "infiniband" / "sw" / "rxe"
        rxe.mkdir(parents=True)
        (rxe / "rdma_rxe.ko.xz").write_bytes(b"")
    return boot, mods


def test_find_kernel_picks_newest_by_version(tmp_path: Path) -> None:
    rels = ["6.1.0-9-amd64", "6.1.0-10-amd64", "5.10.0-30-amd64"]
    boot, mods = fake_kernels(tmp_path, rels, rels)
    assert host.find_kernel(boot, mods) == boot / "vmlinuz-6.1.0-10-amd64"


def test_find_kernel_prefers_a_kernel_with_rxe(tmp_path: Path) -> None:
    boot, mods = fake_kernels(tmp_path, ["6.1.0-10-amd64", "6.12.0-1-cloud-amd64"], ["6.1.0-10-amd64"])
    assert host.find_kernel(boot, mods) == boot / "vmlinuz-6.1.0-10-amd64"


def test_find_kernel_falls_back_to_newest_without_rxe(tmp_path: Path) -> None:
    boot, mods = fake_kernels(tmp_path, ["6.1.0-10-amd64", "6.12.0-1-cloud-amd64"], [])
    assert host.find_kernel(boot, mods) == boot / "vmlinuz-6.12.0-1-cloud-amd64"
    assert host.rxe_module("6.12.0-1-cloud-amd64", mods) is None


def test_find_kernel_without_kernels_is_a_preflight_error(tmp_path: Path) -> None:
    (tmp_path / "boot").mkdir()
    with pytest.raises(host.PreflightError, match="no kernel image"):
        host.find_kernel(tmp_path / "boot", tmp_path)


def test_rxe_module_finds_compressed_modules(tmp_path: Path) -> None:
    _boot, mods = fake_kernels(tmp_path, ["6.1.0-10-amd64"], ["6.1.0-10-amd64"])
    found = host.rxe_module("6.1.0-10-amd64", mods)
    assert found is not None and found.name == "rdma_rxe.ko.xz"


def bzimage(version: str, payload: bytes = b"") -> bytes:
    """A minimal fake bzImage: boot header with version string and payload fields."""
    setup_sects = 1
    data = bytearray(0x400)
    data[0x1F1] = setup_sects
    data[0x202:0x206] = b"HdrS"
    data[0x20E:0x210] = (0x300 - 0x200).to_bytes(2, "little")
    text = f"{version} (builder@example) #1 SMP".encode() + b"\0"
    data[0x300 : 0x300 + len(text)] = text
    struct.pack_into("<II", data, 0x248, 0, len(payload))
    return bytes(data) + payload


def test_kernel_release_from_header_and_from_name(tmp_path: Path) -> None:
    image = tmp_path / "bzImage"
    image.write_bytes(bzimage("6.1.0-56-amd64"))
    assert host.kernel_release(image) == "6.1.0-56-amd64"
    named = tmp_path / "vmlinuz-6.2.0-1-amd64"
    named.write_bytes(b"garbage")
    assert host.kernel_release(named) == "6.2.0-1-amd64"


def elf_with_notes(notes: list[tuple[bytes, int]]) -> bytes:
    """A minimal ELF64 with one PT_NOTE segment holding ``notes`` (name, type)."""
    body = b""
    for name, ntype in notes:
        n = name + b"\0"
        body += struct.pack("<III", len(n), 4, ntype) + n.ljust((len(n) + 3) // 4 * 4, b"\0") + b"\0" * 4
    header = bytearray(0x40)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x20, 0x40)  # e_phoff
    struct.pack_into("<HH", header, 0x36, 0x38, 1)  # e_phentsize, e_phnum
    ph = bytearray(0x38)
    struct.pack_into("<I", ph, 0, 4)  # PT_NOTE
    struct.pack_into("<Q", ph, 8, 0x40 + 0x38)  # p_offset
    struct.pack_into("<Q", ph, 32, len(body))  # p_filesz
    return bytes(header) + bytes(ph) + body


def test_decompress_kernel_and_pvh_detection(tmp_path: Path) -> None:
    elf = elf_with_notes([(b"GNU", 3), (b"Xen", 18)])
    image = tmp_path / "vmlinuz-9.9.9-test"
    image.write_bytes(bzimage("9.9.9-test", lzma.compress(elf, format=lzma.FORMAT_XZ)))
    assert host.decompress_kernel(image) == elf
    assert has_pvh_entry(elf)
    assert not has_pvh_entry(elf_with_notes([(b"GNU", 3), (b"Xen", 17)]))
    if shutil.which("strings"):
        cached = host.uncompressed_kernel(image, tmp_path / "cache")
        assert cached is not None and cached.read_bytes() == elf
        assert host.uncompressed_kernel(image, tmp_path / "cache") == cached  # reused


def test_kernel_without_pvh_is_not_uncompressed(tmp_path: Path) -> None:
    image = tmp_path / "vmlinuz-9.9.9-test"
    image.write_bytes(bzimage("9.9.9-test", lzma.compress(elf_with_notes([(b"GNU", 3)]))))
    assert host.uncompressed_kernel(image, tmp_path / "cache") is None
    image.write_bytes(bzimage("9.9.9-test", b"\x28\xb5\x2f\xfd zstd is not supported"))
    assert host.decompress_kernel(image) is None


# ---------------------------------------------------------------------------------------------------------
# Local RDMA detection
# ---------------------------------------------------------------------------------------------------------

RDMA_LINK_ACTIVE = """\
link mlx5_0/1 subnet_prefix fe80:0000:0000:0000 lid 3 sm_lid 1 lmc 0 state ACTIVE physical_state LINK_UP
link rxe0/1 state ACTIVE physical_state LINK_UP netdev eth1
"""


def fake_sysfs(tmp_path: Path, *devices: str) -> Path:
    sysfs = tmp_path / "infiniband"
    sysfs.mkdir()
    for dev in devices:
        (sysfs / dev).mkdir()
    return sysfs


def test_parse_rdma_links() -> None:
    links = host.parse_rdma_links(RDMA_LINK_ACTIVE + "garbage\n\nlink bnxt/1 state DOWN netdev eth2\n")
    assert [(lk.device, lk.port, lk.state, lk.netdev) for lk in links] == [
        ("mlx5_0", "1", "ACTIVE", None),
        ("rxe0", "1", "ACTIVE", "eth1"),
        ("bnxt", "1", "DOWN", "eth2"),
    ]


def test_local_rdma_found(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path, "mlx5_0", "rxe0")
    found = host.find_local_rdma(sysfs, RDMA_LINK_ACTIVE, lambda nd: ["10.1.2.3"] if nd == "eth1" else [])
    assert found == host.LocalRdma("rxe0", "eth1", "10.1.2.3")
    assert host.have_local_rdma(sysfs, RDMA_LINK_ACTIVE, lambda nd: ["10.1.2.3"])


@pytest.mark.parametrize(
    ("devices", "links", "addrs"),
    [
        ((), RDMA_LINK_ACTIVE, ["10.1.2.3"]),  # empty sysfs
        (("rxe0",), "", ["10.1.2.3"]),  # no links
        (("rxe0",), "link rxe0/1 state DOWN physical_state DISABLED netdev eth1\n", ["10.1.2.3"]),
        (("rxe0",), "link rxe0/1 state ACTIVE physical_state LINK_UP\n", ["10.1.2.3"]),  # no netdev
        (("rxe0",), RDMA_LINK_ACTIVE, []),  # netdev without IPv4
        (("other",), RDMA_LINK_ACTIVE, ["10.1.2.3"]),  # link of a device sysfs does not list
    ],
)
def test_local_rdma_not_usable(
    tmp_path: Path, devices: tuple[str, ...], links: str, addrs: list[str]
) -> None:
    sysfs = fake_sysfs(tmp_path, *devices)
    assert not host.have_local_rdma(sysfs, links, lambda nd: addrs)


def test_local_rdma_missing_sysfs(tmp_path: Path) -> None:
    assert not host.have_local_rdma(tmp_path / "nope", RDMA_LINK_ACTIVE, lambda nd: ["10.1.2.3"])


# ---------------------------------------------------------------------------------------------------------
# run() and main() without a VM
# ---------------------------------------------------------------------------------------------------------


def test_vng_command(tmp_path: Path) -> None:
    argv = host.vng_command(
        "/v/vng", Path("/boot/k"), workdir=tmp_path, script=tmp_path / "g.sh", cpus=2, memory="2G"
    )
    assert argv[:3] == ["/v/vng", "--run", "/boot/k"]
    assert "--disable-kvm" in argv
    assert argv[argv.index("--rwdir") + 1] == str(tmp_path)
    assert argv[argv.index("--memory") + 1] == "2G"
    assert argv[argv.index("--cpus") + 1] == "2"
    assert argv[-2:] == ["--exec", f"bash {tmp_path / 'g.sh'}"]


def test_main_without_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert host.main(["--force-vm", "--"]) == host.EXIT_PREFLIGHT
    assert "no command given" in capsys.readouterr().err


def test_bad_kernel_path_is_a_clear_preflight_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = [
        "--force-vm",
        "--no-install",
        "--kernel",
        str(tmp_path / "missing"),
        "--workdir",
        str(tmp_path),
    ]
    rc = host.main([*options, "--", "true"])
    assert rc == host.EXIT_PREFLIGHT
    err = capsys.readouterr().err
    assert f"error: kernel image {tmp_path / 'missing'} not found" in err


def test_workdir_with_unshareable_characters_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "a b"
    bad.mkdir()
    assert host.run(["true"], force_vm=True, install=False, workdir=bad) == host.EXIT_PREFLIGHT
    assert "cannot share" in capsys.readouterr().err


def test_local_mode_runs_directly_with_harness_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "find_local_rdma", lambda: host.LocalRdma("mlx5_0", "eth9", "10.0.0.7"))
    monkeypatch.delenv("RDMAIO_TEST_ADDR", raising=False)
    out = tmp_path / "env.txt"
    code = (
        "import os, sys; e = os.environ; "
        f"open({str(out)!r}, 'w').write(' '.join(e.get(k, '-') for k in "
        "('RDMAIO_TESTHOST', 'RDMAIO_TEST_ADDR', 'RDMAIO_TEST_DEVICE', 'RDMAIO_TEST_NETDEV', "
        "'RDMAIO_REQUIRE_DEVICE')) + ' ' + os.getcwd()); sys.exit(3)"
    )
    assert host.run([sys.executable, "-c", code], workdir=tmp_path) == 3
    assert out.read_text() == f"local 10.0.0.7 mlx5_0 eth9 1 {tmp_path}"
    assert "mode: local" in capsys.readouterr().err


FAKE_VNG = """#!/bin/sh
# Fake vng for tests: find the guest script, then behave as told by $FAKE_VNG_MODE.
while [ $# -gt 0 ]; do
    if [ "$1" = --exec ]; then script=${2#bash }; fi
    shift
done
run_dir=$(dirname "$script")
echo "fake vng: booting"
echo "fake vng: kernel noise" >&2
case "$FAKE_VNG_MODE" in
    rc) echo 12.5 >"$run_dir/ready"; echo "command output"; echo "$FAKE_VNG_RC" >"$run_dir/rc"; exit 0 ;;
    noboot) echo "fake vng: kernel panic"; exit 0 ;;
    hang) sleep 60 ;;
esac
"""


@pytest.fixture
def fake_vm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    vng = tmp_path / "vng"
    vng.write_text(FAKE_VNG)
    vng.chmod(0o755)
    kernel = tmp_path / "vmlinuz-0-test"
    kernel.write_bytes(b"")
    monkeypatch.setattr(launcher, "find_local_rdma", lambda: None)
    monkeypatch.setattr(
        launcher, "plan_vm", lambda kernel_arg, install, provider="rxe": preflight.VmPlan(kernel, str(vng))
    )
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.mark.parametrize("rc", [0, 1, 2, 3, 124])
def test_vm_exit_status_comes_from_the_rc_file(
    fake_vm: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], rc: int
) -> None:
    monkeypatch.setenv("FAKE_VNG_MODE", "rc")
    monkeypatch.setenv("FAKE_VNG_RC", str(rc))
    assert host.run(["true"], workdir=fake_vm, fast_boot=False) == rc
    out, err = capfd.readouterr()
    assert "command output" in out
    assert f"command exit status {rc}" in err
    assert not list((fake_vm / ".testhost").glob("run-*"))  # cleaned up


def test_vm_that_never_ran_the_command_is_exit_3(
    fake_vm: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_VNG_MODE", "noboot")
    assert host.run(["true"], workdir=fake_vm, fast_boot=False) == host.EXIT_HOST_FAILED
    err = capfd.readouterr().err
    assert "the VM failed to boot or set up RDMA" in err
    assert "| fake vng: kernel panic" in err


def test_vm_timeout(
    fake_vm: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_VNG_MODE", "hang")
    assert host.run(["true"], workdir=fake_vm, fast_boot=False, timeout=1) == host.EXIT_TIMEOUT
    assert "timeout" in capfd.readouterr().err


SIGTERM_DRIVER = """
import sys
from pathlib import Path
from rdmaio.testing import host
from rdmaio.testing.host import launcher, preflight
vng, kernel, work = sys.argv[1:4]
launcher.find_local_rdma = lambda: None
launcher.plan_vm = lambda kernel_arg, install, provider="rxe": preflight.VmPlan(Path(kernel), vng)
sys.exit(host.main(["--workdir", work, "--stock-boot", "--", "true"]))
"""


def test_sigterm_kills_the_vm_and_cleans_up(fake_vm: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FAKE_VNG_MODE": "hang", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", SIGTERM_DRIVER, str(tmp_path / "vng"), str(tmp_path / "vmlinuz-0-test")]
    proc = subprocess.Popen([*args, str(fake_vm)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"fake vng: booting\n"
    (run_dir,) = (fake_vm / ".testhost").glob("run-*")
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert not run_dir.exists()

    def vm_processes() -> list[str]:
        cmdlines = []
        for entry in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                cmdlines.append(entry.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
        return [c for c in cmdlines if str(run_dir) in c]

    # The fake VM (sh running sleep) was killed; give the kernel a moment to reap it.
    deadline = time.monotonic() + 10
    while vm_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not vm_processes()


# ---------------------------------------------------------------------------------------------------------
# The integration conftest's rules and the report check, end to end through pytest
# ---------------------------------------------------------------------------------------------------------


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_integration_report", REPO / "tools/check_integration_report.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_inner_pytest(tmp_path: Path, test_source: str, env: dict[str, str]) -> tuple[int, str, Path]:
    suite = tmp_path / "suite"
    suite.mkdir(parents=True)
    shutil.copy(REPO / "tests/integration/conftest.py", suite / "conftest.py")
    (suite / "test_inner.py").write_text(test_source)
    report = tmp_path / "inner.xml"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RDMAIO_", "PYTEST_")) and k != "CI"}
    pin = ["--rootdir", str(suite), "-c", os.devnull, str(suite)]  # ignore the repository's configuration
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", f"--junitxml={report}", *pin],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=suite,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr, report


INNER_TESTS = """
import pytest

@pytest.fixture(autouse=True)
def require_device():
    pass  # this machine may have no RDMA device: test the skip rule alone

def test_plain():
    pass

def test_skips():
    pytest.skip("no frobnicator")
"""


def test_skip_becomes_failure_under_require_device(tmp_path: Path) -> None:
    rc, out, report = run_inner_pytest(
        tmp_path, INNER_TESTS, {"RDMAIO_REQUIRE_DEVICE": "1", "RDMAIO_TESTHOST": "1"}
    )
    assert rc == 1, out
    assert "skipped under RDMAIO_REQUIRE_DEVICE: no frobnicator" in out
    checker = load_checker()
    assert checker.main([str(report)]) == 1


def test_skips_allowed_outside_the_harness(tmp_path: Path) -> None:
    rc, out, report = run_inner_pytest(tmp_path, INNER_TESTS, {})
    assert rc == 0, out
    assert "1 passed, 1 skipped" in out
    checker = load_checker()
    summary = checker.summarize(ET.parse(report).getroot())
    assert summary.skipped and summary.properties["testhost"] == ""


def test_require_device_skips_without_a_device(tmp_path: Path) -> None:
    source = (
        "import conftest\n\nconftest.SYSFS_INFINIBAND = conftest.Path('/nonexistent')\n\n\n"
        "def test_x():\n    pass\n"
    )
    rc, out, _report = run_inner_pytest(tmp_path, source, {})
    assert rc == 0 and "1 skipped" in out, out
    rc, out, _report = run_inner_pytest(tmp_path / "ci", source, {"CI": "true"})
    assert rc == 1 and "skipped under RDMAIO_REQUIRE_DEVICE: no RDMA device in /nonexistent" in out, out


def test_checker_accepts_a_clean_report_from_the_test_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "ok.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites>'
        '<testsuite name="pytest" tests="2" failures="0" errors="0" skipped="0">'
        '<properties><property name="testhost" value="1"/><property name="kernel" value="6.1"/></properties>'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"/></testsuite></testsuites>'
    )
    checker = load_checker()
    assert checker.main([str(report)]) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("cases", "testhost", "problem"),
    [
        ("", "1", "no test ran"),
        ('<testcase name="a"><skipped message="no device"/></testcase>', "1", "1 test(s) skipped"),
        ('<testcase name="a"><failure message="boom"/></testcase>', "1", "1 test(s) failed"),
        ('<testcase name="a"><error message="setup"/></testcase>', "1", "1 test(s) errored"),
        ('<testcase name="a"/>', "", "did not run inside the test host"),
        ('<testcase name="a"/>', None, "no 'testhost' property"),
    ],
)
def test_checker_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cases: str, testhost: str | None, problem: str
) -> None:
    props = (
        f'<properties><property name="testhost" value="{testhost}"/></properties>'
        if testhost is not None
        else ""
    )
    report = tmp_path / "bad.xml"
    report.write_text(f'<testsuites><testsuite name="pytest">{props}{cases}</testsuite></testsuites>')
    checker = load_checker()
    assert checker.main([str(report)]) == 1
    assert problem in capsys.readouterr().out


def test_checker_missing_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_checker().main([str(tmp_path / "none.xml")]) == 1
    assert "does not exist" in capsys.readouterr().out


def test_guest_script_pair_topology_sets_up_two_rxe_devices_on_a_veth_pair() -> None:
    tmp = Path("/w")
    script = host.guest_script(
        ["true"], workdir=tmp, run_dir=tmp / ".testhost" / "run-1", env={}, topology="pair"
    )
    assert "link add veth0 type veth peer name veth1" in script
    assert "rdma link add rxe0 type rxe netdev veth0" in script
    assert "rdma link add rxe1 type rxe netdev veth1" in script
    assert "link add dum0" not in script
    # Each address stops being local to the routing of the other end, so traffic crosses the veth.
    assert "route del local 198.18.0.2 table local" in script
    assert "rule add pref 101 iif veth1 lookup 101" in script
    assert "rdma link show rxe0/1" in script and "rdma link show rxe1/1" in script
    assert "export RDMAIO_TOPOLOGY=pair" in script
    assert "export RDMAIO_TEST_DEVICE2=rxe1" in script
    assert "export RDMAIO_TEST_ADDR6_2=fd00:198:18::2" in script
    assert script.index("rdma link add rxe1") < script.index("\ntrue </dev/null")
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr


def test_guest_script_refuses_an_unknown_topology() -> None:
    tmp = Path("/w")
    with pytest.raises(ValueError, match="topology"):
        host.guest_script(["true"], workdir=tmp, run_dir=tmp, env={}, topology="ring")
