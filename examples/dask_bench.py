"""Dask over tcp:// and rdma:// in the same run: worker-to-worker transfers and a DataFrame shuffle.

    python examples/dask_bench.py --host 198.18.0.1 [--loop asyncio,uvloop] [--sizes 1,16,64] [--reps 3]
    python examples/dask_bench.py --trace --sizes 1     # who waits for what during one transfer

The same as ``tools/dev bench --only dask``; the code is in the repository's benchmark harness,
``bench/dask.py`` (see its docstring for what is measured; it is not installed with rdmaio, so run this
from a checkout). In the test host::

    python -m rdmaio.testing.host --cpus 2 --memory 4G -- .venv/bin/python examples/dask_bench.py

Everything in that VM is 20-40x slower than natively: compare the two columns of each table, never the
absolute numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The benchmark harness (bench/) lives in the checkout, not in the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.dask import main

if __name__ == "__main__":
    sys.exit(main())
