"""Dask over tcp:// and rdma:// in the same run: worker-to-worker transfers and a DataFrame shuffle.

    python examples/dask_bench.py --host 198.18.0.1 [--loop asyncio|uvloop] [--sizes 1,16,64] [--repeat 5]

For each protocol it starts ``LocalCluster(protocol=..., host=HOST, n_workers=2, processes=True)`` and
measures:

- *transfer*: an array of N MiB made on worker A is needed by a task pinned to worker B, so B fetches it
  from A (distributed's ``get_data``, one comm message); the time from submitting that task to its result,
  median of ``--repeat`` runs with fresh data each time. It includes one scheduling round trip, which is
  what a Dask user sees.
- *shuffle*: ``dd.DataFrame.shuffle(on="k", shuffle_method="p2p")`` of ``--rows`` rows, median of
  ``--repeat`` runs after a warm-up.

Prints a Markdown table. In the test host: ``python -m rdmaio.testing.host --cpus 2 -- .venv/bin/python
examples/dask_bench.py``. Everything in that VM is 20-40x slower than natively: compare the two rows of
each measurement, never the absolute numbers.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, LocalCluster, wait

MiB = 1024 * 1024


def make_array(nbytes: int, salt: int) -> np.ndarray:
    """Runs on worker A: a fresh array of ``nbytes``."""
    array = np.empty(nbytes // 8, dtype="f8")
    array.fill(salt)
    return array


def checksum(array: np.ndarray) -> float:
    """Runs on worker B, after the array was fetched from worker A."""
    return float(array[0] + array[-1])


def _median_seconds(run: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_transfer(client: Client, size_mib: int, repeat: int) -> float:
    """Median seconds to move ``size_mib`` MiB from worker A to worker B (see the module docstring)."""
    worker_a, worker_b = sorted(client.scheduler_info()["workers"])
    times = []
    for salt in range(repeat):
        data = client.submit(make_array, size_mib * MiB, salt, workers=[worker_a], pure=False)
        wait(data)
        begin = time.perf_counter()
        result = client.submit(checksum, data, workers=[worker_b], allow_other_workers=False, pure=False)
        assert result.result() == 2 * salt
        times.append(time.perf_counter() - begin)
        del data, result  # release both before the next round
    return statistics.median(times)


def bench_shuffle(client: Client, rows: int, repeat: int) -> float:
    """Median seconds of a p2p shuffle of ``rows`` rows (after one warm-up)."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"k": rng.integers(0, 1000, rows), "v": rng.random(rows), "w": rng.random(rows)})
    ddf = client.persist(dd.from_pandas(df, npartitions=8))
    wait(ddf)

    def once() -> None:
        shuffled = ddf.shuffle(on="k", npartitions=8, shuffle_method="p2p").persist()
        wait(shuffled)
        del shuffled

    once()
    return _median_seconds(once, repeat)


_TRACE_MODULE = "__dask_bench_trace__"


def install_trace(role: str) -> None:
    """Runs in every process: time each comm connect/read/write/close of tcp:// and rdma:// into a list.

    Timestamps are ``time.time()``: every process of a LocalCluster shares the machine's clock.
    """
    import types

    import distributed.comm.tcp as tcp

    import rdmaio.dask.comm as rdma

    if _TRACE_MODULE in sys.modules:
        sys.modules[_TRACE_MODULE].records.clear()  # type: ignore[attr-defined]
        return
    holder = types.ModuleType(_TRACE_MODULE)
    records: list[tuple[float, float, str, str, str]] = []
    holder.records = records  # type: ignore[attr-defined]
    sys.modules[_TRACE_MODULE] = holder

    def summary(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("op") or value.get("status") or sorted(value)[:3])
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(summary(v) for v in value[:4]) + (",..." if len(value) > 4 else "") + "]"
        return type(value).__name__

    def wrap(cls: Any, name: str) -> None:
        original = getattr(cls, name)

        async def traced(self: Any, *a: Any, **k: Any) -> Any:
            begin = time.time()
            detail = summary(a[0]) if name == "write" and a else (str(a[0]) if name == "connect" else "")
            try:
                result = await original(self, *a, **k)
            except BaseException as exc:
                records.append((begin, time.time(), role, name, f"{detail} !{type(exc).__name__}"))
                raise
            if name == "read":
                detail = summary(result)
            elif name == "write":
                detail += f" {result} B"
            peer = getattr(self, "peer_address", "") if name != "connect" else ""
            records.append((begin, time.time(), role, name, f"{detail} {peer}".strip()))
            return result

        setattr(cls, name, traced)

    for cls in (tcp.TCP, rdma.RDMAComm):
        for name in ("read", "write", "close"):
            wrap(cls, name)
    for cls in (tcp.TCPConnector, rdma.RDMAConnector):
        wrap(cls, "connect")


def collect_trace() -> list[tuple[float, float, str, str, str]]:
    """Runs in every process: the records since install_trace()."""
    return list(sys.modules[_TRACE_MODULE].records)  # type: ignore[attr-defined]


def trace_transfer(client: Client, size_mib: int) -> None:
    """Print a merged timeline of every comm operation of all processes during one transfer."""
    worker_a, worker_b = sorted(client.scheduler_info()["workers"])
    roles = {worker_a: "A", worker_b: "B"}
    data = client.submit(make_array, size_mib * MiB, 99, workers=[worker_a], pure=False)
    wait(data)
    for address, role in roles.items():
        client.run(install_trace, role, workers=[address])
    client.run_on_scheduler(install_trace, "S")
    install_trace("C")
    begin = time.time()
    result = client.submit(checksum, data, workers=[worker_b], allow_other_workers=False, pure=False)
    result.result()
    end = time.time()
    time.sleep(0.5)  # let the trailing messages land
    records = collect_trace()
    for address in roles:
        records += client.run(collect_trace, workers=[address])[address]
    records += client.run_on_scheduler(collect_trace)
    print(f"\ntrace of one {size_mib} MiB transfer: {(end - begin) * 1000:.1f} ms submit-to-result")
    print("  start ms   dur ms  proc  call     detail")
    # With LocalCluster the scheduler runs in the client's process: its records come back twice.
    for start, stop, role, name, detail in sorted(set(records)):
        if stop < begin or start > end + 0.1:
            continue
        print(f"  {(start - begin) * 1000:8.1f} {(stop - start) * 1000:8.1f}  {role:4}  {name:7}  {detail}")
    sys.stdout.flush()


def run_protocol(protocol: str, args: argparse.Namespace) -> dict[str, float]:
    """Start a cluster on ``protocol`` and run every measurement on it."""
    results: dict[str, float] = {}
    with (
        LocalCluster(
            protocol=protocol, host=args.host, n_workers=2, threads_per_worker=1, processes=True,
            dashboard_address=None, silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        client.wait_for_workers(2)
        bench_transfer(client, 1, 1)  # warm-up: imports, connections
        if args.trace:
            print(f"\n{protocol}://, loop {dask.config.get('distributed.admin.event-loop')}:")
            for size in args.sizes:
                trace_transfer(client, size)
            return results
        for size in args.sizes:
            results[f"transfer {size} MiB"] = bench_transfer(client, size, args.repeat)
        results[f"shuffle {args.rows} rows"] = bench_shuffle(client, args.rows, args.repeat)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run both protocols and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="198.18.0.1", help="an address of the RDMA interface")
    parser.add_argument("--loop", default="asyncio", help="asyncio, uvloop or both: asyncio,uvloop")
    parser.add_argument("--sizes", default="1,16,64", help="transfer sizes in MiB, comma-separated")
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--protocols", default="tcp,rdma")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print a timeline of each process's comm calls for one "
        "transfer of each size instead of measuring",
    )
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    for loop in args.loop.split(","):
        all_results: dict[str, dict[str, float]] = {}
        with dask.config.set({"distributed.admin.event-loop": loop}):
            for protocol in args.protocols.split(","):
                all_results[protocol] = run_protocol(protocol, args)
        if not args.trace:
            print_table(all_results, args, loop)
    return 0


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace, loop: str) -> None:
    """Markdown: one row per measurement, one column per protocol, plus throughput for transfers."""
    protocols = list(results)
    print(f"\nloop: {loop}, host: {args.host}, median of {args.repeat}\n")
    print("| measurement | " + " | ".join(f"{p}://" for p in protocols) + " | rdma/tcp |")
    print("| --- | " + " | ".join("---" for _ in protocols) + " | --- |")
    for name in results[protocols[0]]:
        cells = []
        for protocol in protocols:
            seconds = results[protocol][name]
            cell = f"{seconds * 1000:.1f} ms"
            if name.startswith("transfer"):
                size = int(name.split()[1])
                cell += f" ({size / seconds:.0f} MiB/s)"
            cells.append(cell)
        ratio = ""
        if "tcp" in results and "rdma" in results:
            ratio = f"{results['tcp'][name] / results['rdma'][name]:.2f}x faster"
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
