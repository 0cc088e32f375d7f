"""Functions that the Dask integration tests run inside workers and schedulers.

They live in a small module of their own, put on ``PYTHONPATH`` for the CLI processes: Dask pickles
task functions by reference, and importing the test module itself in every process would import
pytest and pandas there too, which costs minutes in the test host's VM.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from distributed import get_worker


async def loop_module() -> str:
    """Which event loop implementation runs this process's distributed loop."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def square_unless_victim(x: int, marker_dir: str) -> int:
    """On the worker named ``victim``: say so with a file, then hang until killed. Elsewhere: x * x."""
    if get_worker().name == "victim":
        (Path(marker_dir) / f"started-{x}").touch()
        time.sleep(3600)
    return x * x
