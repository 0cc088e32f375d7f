"""The programs on the docs' pages (docs/quickstart.md, the home page) run as the pages say they do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_program(tmp_path: Path, rdma_addr: str) -> None:
    page = (REPO / "docs/quickstart.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert "198.18.0.1" in code
    program = tmp_path / "hello.py"
    program.write_text(code.replace("198.18.0.1", rdma_addr))  # the same in the VM; a local NIC's otherwise
    run = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    assert run.stdout == f"b'hello over RDMA' via {device}\n"
    assert "prints `b'hello over RDMA' via rxe0`" in page


def test_home_page_example(tmp_path: Path, rdma_addr: str) -> None:
    """The ten lines on the documentation's home page run and print what an echo server sends back."""
    page = (REPO / "docs/index.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    program = tmp_path / "home.py"
    program.write_text(code.replace("198.18.0.1", rdma_addr))
    run = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "b'hello'\n"
