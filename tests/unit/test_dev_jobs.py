"""tools/dev deals the integration modules into CI chunks by their measured seconds: every module runs in
exactly one chunk, and the table of seconds names modules that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / "tools" / "dev"


def _chunk_functions() -> str:
    """The chunking definitions of tools/dev (sourcing the whole script would run it)."""
    text = DEV.read_text()
    start = text.index("MODULE_SECONDS=(")
    end = text.index("\n}\n", text.index("integration_chunk() {")) + 3
    chunks = re.search(r"^INTEGRATION_CHUNKS=\d+$", text, re.MULTILINE)
    assert chunks is not None
    return chunks.group(0) + "\n" + text[start:end]


def _run(script: str) -> str:
    return subprocess.run(["bash", "-c", script], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def test_every_integration_module_runs_in_exactly_one_chunk() -> None:
    functions = _chunk_functions()
    count = int(_run(functions + 'printf "%s" "$INTEGRATION_CHUNKS"'))
    dealt: list[str] = []
    for k in range(1, count + 1):
        modules = _run(functions + f"integration_chunk {k}").split()
        assert modules, f"chunk {k} is empty"
        dealt += modules
    expected = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "tests" / "integration").glob("test_*.py")
        if path.name != "test_dask.py"
    )  # fmt: skip
    assert sorted(dealt) == expected


def test_the_seconds_table_names_existing_modules() -> None:
    names = _run(_chunk_functions() + 'printf "%s\\n" "${MODULE_SECONDS[@]%=*}"').split()
    assert names
    missing = [name for name in names if not (ROOT / "tests" / "integration" / f"{name}.py").exists()]
    assert not missing, missing
