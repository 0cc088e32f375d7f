"""``python -m bench``: rdmaio against perftest, rstream and TCP streams on the same device.

The harness lives at the top of the repository, beside ``rdmaio/``, and is not part of the wheel: run it
from a checkout (``python -m bench``, or ``tools/dev bench ARGS`` to run it inside the test host).

Modules: :mod:`~bench.model` (workloads, sizes, contenders, budgets, result records),
:mod:`~bench.parsers` (perftest and rstream output), :mod:`~bench.peers` (the Python
contenders' server process and client measurements), :mod:`~bench.external` (running the native
tools; ``native/cm_setup.c`` is the C setup contender it compiles), :mod:`~bench.onesided` (the
one-sided workloads), :mod:`~bench.memory` (registered bytes and RSS per idle connection),
:mod:`~bench.dask` (Dask over ``tcp://`` and ``rdma://``), :mod:`~bench.overhead` (``--overhead``:
rdmaio's own CPU and Python calls per operation natively, over the null device of
``rdmaio.testing.nullpair``, beside TCP loopback), :mod:`~bench.report` (ratios, targets,
text and markdown tables, JSON), :mod:`~bench.display` (progress), :mod:`~bench.plot` (charts) and
:mod:`~bench.driver` (the command line). See ``docs/benchmarks.md`` for the method and the current
results.
"""

from bench.driver import main

__all__ = ["main"]
