"""Every shell command that README.md and docs/*.md show runs as written, as a new user would run it.

The commands are the lines of the ```sh``` (``bash``, ``shell``, ``console``) code blocks; a command continues
over a trailing backslash or an open quote. Each runs with ``bash -c`` in a view of the checkout (a temporary
directory whose entries link to the checkout's, so a file a page tells the reader to create, such as the
quickstart's ``hello.py``, is created there and not in the checkout), with ``.venv/bin`` first on ``PATH``
(the pages' bare ``python`` and ``rdmaio`` assume the virtualenv is active), bounded by a timeout, and must
exit 0; a command whose comment says ``exit status N`` must exit N.

This module runs inside the test host, where a nested ``python -m rdmaio.testing.host -- CMD`` finds the
device and runs CMD directly, so the test-host commands of the pages are run too. The commands that cannot
run here are in :data:`NOT_RUN` with the reason, each matching at least one command; a command shown twice
runs once; the number of commands run is asserted (:data:`EXPECTED_RUN`), so a page's new command must be
run or listed, and the test can never pass by running nothing. A synopsis (a command with an upper-case
placeholder such as ``HOST`` or ``[PORT]``) is not run.

Untagged code blocks are output or formats, never commands: one that starts like a command fails the test
(tag it ``sh``). docs/performance-log.md is not read: it is the dated record of past runs, with the commands
as they were then.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "performance-log.md"),
]
SHELL_TAGS = {"sh", "bash", "shell", "console"}
COMMAND_START = re.compile(r"^(\$ )?(sudo |tools/dev|\.venv/bin/|python|rdmaio |pip |apt-get |export )")
TIMEOUT = 600.0  # bounds a hang only: everything in the VM is 20-40x slower than natively

# (pattern matched against the start of the command, why it is not run here)
NOT_RUN: list[tuple[str, str]] = [
    ("tools/dev test", "the whole suite, which boots test hosts itself (this test is part of it)"),
    ("tools/dev demo", "boots its own test host and runs benchmarks (CI runs it as its own job)"),
    (
        "tools/dev setup",
        "every tools/dev command and CI's set-up run it; inside the test host it could reinstall",
    ),
    ("tools/dev bench", "a benchmark run (its own test host; minutes); never in CI"),
    ("python -m bench --overhead", "a benchmark (minutes natively; never in the VM)"),
    ("python -m rdmaio.testing.host --cpus 2 --memory", "a benchmark in a larger test host (minutes)"),
    (
        "python -m rdmaio.testing.host --topology pair",
        "boots a two-node test host of its own (the fault suite)",
    ),
    (".venv/bin/python -m rdmaio.testing.host --cpus 2", "a benchmark in a larger test host (minutes)"),
    (
        ".venv/bin/python -m bench --from-json",
        "re-prints reports/bench.json, which the benchmark run above it writes",
    ),
    (
        "python -m rdmaio.testing.host --provider siw",
        "boots a Soft-iWARP test host of its own (tools/dev test runs the siw suites as a job of its own)",
    ),
    ("apt-get install", "installs system packages (root, network)"),
    ("sudo apt-get install", "installs system packages (root, network)"),
    ("pip install rdmaio", "installs from PyPI (network): rdmaio, rdmaio[dask]"),
    ("pip install .", "would replace the editable install these tests run from"),
]
SYNOPSIS = "a synopsis: its upper-case words (HOST, PORT, CMD, ...) are placeholders"
"""Why a command with a placeholder is not run (``rdmaio ping --server HOST [PORT]``)."""
PLACEHOLDER = re.compile(r"^\[?-*[A-Z]{2,}(\.\.\.)?\]?$")
EXPECTED_RUN = 9
"""Commands run (not listed in NOT_RUN, duplicates once): update it with the pages."""


@dataclass(frozen=True)
class Command:
    """One shell command of a page: its text as shown, where, and the exit status it must end with."""

    text: str
    page: str
    line: int
    expected_status: int

    @property
    def key(self) -> str:
        """The command without comments and extra spaces (what NOT_RUN and duplicates are matched on)."""
        return " ".join(shlex.split(self.text, comments=True))


def _complete(text: str) -> bool:
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def commands_of(page: Path) -> list[Command]:
    """The commands of a page's shell code blocks, in order."""
    text = page.read_text()
    found: list[Command] = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        tag, body = block.group(1), block.group(2)
        first_line = text[: block.start()].count("\n") + 2
        if tag not in SHELL_TAGS:
            starts = [line for line in body.splitlines() if COMMAND_START.match(line)]
            assert not (tag == "" and starts), (
                f"{page.name}:{first_line}: an untagged block with commands ({starts[0]!r}): tag it ```sh"
            )
            continue
        pending: list[str] = []
        start = first_line
        for i, line in enumerate(body.splitlines()):
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if not pending:
                start = first_line + i
            pending.append(line.removeprefix("$ "))
            joined = "\n".join(pending)
            if _complete(joined):
                status = re.search(r"#.*\bexit status (\d+)", pending[-1])
                found.append(Command(joined, page.name, start, int(status.group(1)) if status else 0))
                pending = []
        assert not pending, f"{page.name}:{start}: a command that never ends: {pending}"
    return found


def all_commands() -> tuple[list[Command], list[tuple[Command, str]]]:
    """(commands to run, (command, reason) not run); a command shown twice is counted once."""
    to_run: list[Command] = []
    not_run: list[tuple[Command, str]] = []
    seen: set[str] = set()
    for page in PAGES:
        for command in commands_of(page):
            if command.key in seen:
                continue
            seen.add(command.key)
            reason = next((why for prefix, why in NOT_RUN if command.key.startswith(prefix)), None)
            if reason is None and any(PLACEHOLDER.match(word) for word in command.key.split()):
                reason = SYNOPSIS
            if reason is None:
                to_run.append(command)
            else:
                not_run.append((command, reason))
    return to_run, not_run


def checkout_view(tmp: Path) -> Path:
    """A directory whose entries link to the checkout's: commands run from the checkout, files they
    create (a page's program) land here."""
    view = tmp / "checkout"
    view.mkdir()
    for entry in REPO.iterdir():
        (view / entry.name).symlink_to(entry)
    return view


def page_program(page: str, name: str) -> str | None:
    """The program a page tells the reader to save as ``name`` (the python block after the sentence)."""
    text = (REPO / ("README.md" if page == "README.md" else f"docs/{page}")).read_text()
    match = re.search(rf"Save this as `{re.escape(name)}`.*?```python\n(.*?)```", text, re.DOTALL)
    return match.group(1) if match else None


def test_the_lists_are_current() -> None:
    """Every NOT_RUN entry matches a command; the count of commands run is the one expected."""
    to_run, not_run = all_commands()
    used = {prefix for prefix, _ in NOT_RUN if any(c.key.startswith(prefix) for c, _ in not_run)}
    assert [prefix for prefix, _ in NOT_RUN if prefix not in used] == []
    assert len(to_run) == EXPECTED_RUN, [f"{c.page}:{c.line}: {c.key}" for c in to_run]


def test_documented_commands_work(tmp_path: Path) -> None:
    to_run, _ = all_commands()
    assert len(to_run) == EXPECTED_RUN
    view = checkout_view(tmp_path)
    env = dict(os.environ, PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    failures = []
    ran = 0
    for command in to_run:
        for program in re.findall(r"python (\w+\.py)\b", command.text):
            if not (view / program).exists() and (code := page_program(command.page, program)) is not None:
                (view / program).write_text(code)  # the reader saved it, as the page says
        try:
            done = subprocess.run(
                ["bash", "-c", command.text],
                cwd=view,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            failures.append(
                f"{command.page}:{command.line}: {command.key}: no end within {TIMEOUT:g} s ({exc})"
            )
            continue
        ran += 1
        if done.returncode != command.expected_status:
            failures.append(
                f"{command.page}:{command.line}: {command.key}: exit status {done.returncode}, expected "
                f"{command.expected_status}\n--- stdout\n{done.stdout[-3000:]}"
                f"\n--- stderr\n{done.stderr[-3000:]}"
            )
        assert "Traceback" not in done.stderr or done.returncode != 0, (command.key, done.stderr)
    assert failures == [], "\n\n".join(failures)
    assert ran == EXPECTED_RUN


def test_a_command_that_needs_its_server_is_not_shown_alone() -> None:
    """A client command of an example or of ping, shown alone, fails (nobody listens): the pages must show
    it with its server (as one test-host command) or describe it in prose."""
    to_run, _ = all_commands()
    alone = [
        c.key
        for c in to_run
        if re.search(r"examples/echo_client\.py|rdmaio ping (-c \d+ )?\d", c.key) and "--server" not in c.key
    ]
    assert alone == []


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_pages_parse(page: str) -> None:
    """Each page's blocks parse into whole commands (no open quote or continuation left at a block's end)."""
    commands_of(REPO / ("README.md" if page == "README.md" else f"docs/{page}"))


if (
    __name__ == "__main__"
):  # list what would run and what not: python tests/integration/test_documented_commands.py
    run, skipped = all_commands()
    for c in run:
        print(f"run   {c.page}:{c.line}: {c.key} (exit status {c.expected_status})")
    for c, why in skipped:
        print(f"skip  {c.page}:{c.line}: {c.key}  -- {why}")
    sys.exit(0)
