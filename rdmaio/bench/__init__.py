"""``python -m rdmaio bench``: rdmaio against perftest, rstream and TCP streams on the same device.

Modules: :mod:`~rdmaio.bench.model` (workloads, sizes, contenders, budgets, result records),
:mod:`~rdmaio.bench.parsers` (perftest and rstream output), :mod:`~rdmaio.bench.peers` (the Python
contenders' server process and client measurements), :mod:`~rdmaio.bench.external` (running the native
tools), :mod:`~rdmaio.bench.report` (ratios, targets, table, JSON) and :mod:`~rdmaio.bench.driver` (the
command line). See ``docs/benchmarks.md`` for the method and the latest results.
"""

from rdmaio.bench.driver import main

__all__ = ["main"]
