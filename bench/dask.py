"""``python -m bench --only dask``: Dask over ``tcp://`` and ``rdma://`` in the same run.

For each event loop (``distributed.admin.event-loop``: asyncio, uvloop) and each protocol it starts
``LocalCluster(protocol=..., host=HOST, n_workers=2, processes=True, threads_per_worker=1)`` and measures:

- *transfer N MiB*: an array of N MiB made on worker A is needed by a task pinned to worker B, so B
  fetches it from A (distributed's ``get_data``: one comm message, on a comm from B's connection pool);
  the time from submitting that task to its result, median of ``reps`` runs with fresh data each time.
  It includes one scheduling round trip (client -> scheduler -> worker B -> scheduler -> client), which
  is what a Dask user sees; the ``--trace`` timeline separates the two.
- *shuffle R rows*: ``DataFrame.shuffle(on="k", shuffle_method="p2p")`` of R rows in 8 partitions, median
  of ``reps`` runs after a warm-up.

Needs ``rdmaio[dask]``. The example ``examples/dask_bench.py`` runs the same code. Everything in the test
host's VM is 20-40x slower than natively: compare the two columns of one run, never absolute numbers.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

MiB = 1024 * 1024
DEFAULT_SIZES = (1, 16, 64)
"""Transfer sizes in MiB."""
DEFAULT_ROWS = 200_000
FRAMING_CHUNKS = (64 * 1024, 1024 * 1024, 4 * MiB, 64 * MiB)
"""Chunk sizes --framing compares (the first fits one 64 KiB slot: one frame per message)."""
_TRACE_MODULE = "__rdmaio_bench_dask_trace__"

__all__ = ["DEFAULT_ROWS", "DEFAULT_SIZES", "build_parser", "main", "run"]

Progress = Callable[[str], None]


def _module(name: str) -> Any:
    """Import ``name`` untyped: dask, distributed and pandas have no (complete) type hints."""
    return importlib.import_module(name)


def make_array(nbytes: int, salt: int) -> Any:
    """Runs on worker A: a fresh array of ``nbytes``."""
    import numpy as np

    array = np.empty(nbytes // 8, dtype="f8")
    array.fill(salt)
    return array


def checksum(array: Any) -> float:
    """Runs on worker B, after the array was fetched from worker A."""
    return float(array[0] + array[-1])


def _workers(client: Any) -> tuple[str, str]:
    worker_a, worker_b = sorted(client.scheduler_info()["workers"])
    return worker_a, worker_b


def transfer_once(client: Any, size_mib: int, salt: int) -> float:
    """Seconds from submitting the task on worker B that needs worker A's array to its result."""
    wait = _module("distributed").wait
    worker_a, worker_b = _workers(client)
    data = client.submit(make_array, size_mib * MiB, salt, workers=[worker_a], pure=False)
    wait(data)
    begin = time.perf_counter()
    result = client.submit(checksum, data, workers=[worker_b], allow_other_workers=False, pure=False)
    if result.result() != 2 * salt:
        raise RuntimeError(f"transfer of {size_mib} MiB: wrong checksum")
    elapsed = time.perf_counter() - begin
    del data, result  # release both before the next round
    return elapsed


def bench_transfer(client: Any, size_mib: int, reps: int) -> float:
    """Median seconds to move ``size_mib`` MiB from worker A to worker B (see the module docstring)."""
    return statistics.median(transfer_once(client, size_mib, salt) for salt in range(reps))


def bench_shuffle(client: Any, rows: int, reps: int) -> float:
    """Median seconds of a p2p shuffle of ``rows`` rows (after one warm-up)."""
    import numpy as np

    dd, pd, wait = _module("dask.dataframe"), _module("pandas"), _module("distributed").wait
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"k": rng.integers(0, 1000, rows), "v": rng.random(rows), "w": rng.random(rows)})
    ddf = client.persist(dd.from_pandas(df, npartitions=8))
    wait(ddf)

    def once() -> float:
        begin = time.perf_counter()
        shuffled = ddf.shuffle(on="k", npartitions=8, shuffle_method="p2p").persist()
        wait(shuffled)
        elapsed = time.perf_counter() - begin
        del shuffled
        return elapsed

    once()
    return statistics.median(once() for _ in range(reps))


# --- the per-process timeline (--trace) ---------------------------------------------------------------

Record = tuple[float, float, str, str, str]


def _summary(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("op") or value.get("status") or sorted(map(str, value))[:3])
    if isinstance(value, list | tuple):
        return "[" + ",".join(_summary(v) for v in value[:4]) + (",..." if len(value) > 4 else "") + "]"
    return type(value).__name__


def install_trace(role: str) -> None:
    """Runs in every process: time each comm connect/read/write/close of tcp:// and rdma:// into a list.

    Timestamps are ``time.time()``: every process of a LocalCluster shares the machine's clock. Installed
    once per process; a second call clears the records.
    """
    import distributed.comm.tcp as tcp

    import rdmaio.dask.comm as rdma

    if _TRACE_MODULE in sys.modules:
        sys.modules[_TRACE_MODULE].records.clear()
        return
    holder = types.ModuleType(_TRACE_MODULE)
    records: list[Record] = []
    holder.records = records  # type: ignore[attr-defined]
    sys.modules[_TRACE_MODULE] = holder

    def wrap(cls: Any, name: str) -> None:
        original = getattr(cls, name)

        async def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            begin = time.time()
            detail = ""
            if name == "write" and args:
                detail = _summary(args[0])
            elif name == "connect" and args:
                detail = str(args[0])
            try:
                result = await original(self, *args, **kwargs)
            except BaseException as exc:
                records.append((begin, time.time(), role, name, f"{detail} !{type(exc).__name__}"))
                raise
            if name == "read":
                detail = _summary(result)
            elif name == "write":
                detail += f" {result} B"
            peer = "" if name == "connect" else str(getattr(self, "peer_address", ""))
            records.append((begin, time.time(), role, name, f"{detail} {peer}".strip()))
            return result

        setattr(cls, name, traced)

    for cls in (tcp.TCP, rdma.RDMAComm):
        for name in ("read", "write", "close"):
            wrap(cls, name)
    for connector in (tcp.TCPConnector, rdma.RDMAConnector):
        wrap(connector, "connect")


def collect_trace() -> list[Record]:
    """Runs in every process: the records since :func:`install_trace`."""
    return list(sys.modules[_TRACE_MODULE].records)


def trace_transfer(client: Any, size_mib: int, out: Progress) -> None:
    """Print a merged timeline of every comm call of all processes during one transfer."""
    wait = _module("distributed").wait
    worker_a, worker_b = _workers(client)
    data = client.submit(make_array, size_mib * MiB, 99, workers=[worker_a], pure=False)
    wait(data)
    for address, role in ((worker_a, "A"), (worker_b, "B")):
        client.run(install_trace, role, workers=[address])
    client.run_on_scheduler(install_trace, "S")  # LocalCluster: the client's process too
    install_trace("C")
    begin = time.time()
    result = client.submit(checksum, data, workers=[worker_b], allow_other_workers=False, pure=False)
    result.result()
    end = time.time()
    time.sleep(0.5)  # let the trailing messages land
    records = collect_trace() + client.run_on_scheduler(collect_trace)
    for address in (worker_a, worker_b):
        records += client.run(collect_trace, workers=[address])[address]
    out(f"trace of one {size_mib} MiB transfer: {(end - begin) * 1000:.1f} ms submit-to-result")
    out("  start ms   dur ms  proc  call     detail")
    for start, stop, role, name, detail in sorted(set(records)):  # the scheduler's come back twice
        if stop >= begin and start <= end + 0.1:
            out(f"  {(start - begin) * 1000:8.1f} {(stop - start) * 1000:8.1f}  {role:4}  {name:7}  {detail}")


# --- the comm's data path alone (--framing) ---------------------------------------------------------


async def framing_throughput(host: str, size: int, reps: int, chunks: Sequence[int]) -> dict[str, float]:
    """MiB/s of one ``size``-byte frame between two endpoints of this process: plain ``send``/``recv``
    of 1 MiB messages, then the comm's framing (``write_frames``/``read_frames`` into a preallocated
    buffer) at each chunk size. Medians of ``reps``; no Dask, no serialisation, no other process."""
    import asyncio

    import rdmaio
    from rdmaio.dask.framing import read_frames, write_frames

    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()
    server = await rdmaio.serve(accepted.put, host, 0)
    port = server.addresses[0][1]
    client = await rdmaio.connect(host, port)
    peer = await accepted.get()
    payload = memoryview(bytearray(size))
    results: dict[str, float] = {}

    async def timed(send: Any, receive: Any) -> float:
        times = []
        for _ in range(reps):
            begin = time.perf_counter()
            await asyncio.gather(send(), receive())
            times.append(time.perf_counter() - begin)
        return size / MiB / statistics.median(times)

    async def send_plain() -> None:
        for start in range(0, size, MiB):
            await client.send(payload[start : start + MiB])

    async def recv_plain() -> None:
        got = 0
        while got < size:
            message = await peer.recv()
            assert message is not None
            got += len(message)

    tcp_accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    tcp_server = await asyncio.start_server(lambda r, w: tcp_accepted.put_nowait((r, w)), host, 0)
    _tcp_reader, tcp_writer = await asyncio.open_connection(host, tcp_server.sockets[0].getsockname()[1])
    tcp_peer_reader, tcp_peer_writer = await tcp_accepted.get()

    async def send_tcp() -> None:
        for start in range(0, size, MiB):
            tcp_writer.write(payload[start : start + MiB])
            await tcp_writer.drain()

    async def recv_tcp() -> None:
        await tcp_peer_reader.readexactly(size)

    try:
        results["TCP stream, same address"] = await timed(send_tcp, recv_tcp)
        results["send/recv 1 MiB messages"] = await timed(send_plain, recv_plain)
        for chunk in chunks:

            async def send_frames(chunk: int = chunk) -> None:
                await write_frames(client, [b"header", payload], chunk)

            async def recv_frames() -> None:
                frames = await read_frames(peer)
                assert frames is not None and frames[1].nbytes == size

            results[f"framing, chunk {chunk // 1024} KiB"] = await timed(send_frames, recv_frames)
    finally:
        client.abort()
        peer.abort()
        server.close()
        for writer in (tcp_writer, tcp_peer_writer):
            writer.close()
        tcp_server.close()
    return results


def rxe_ceiling(host: str, device: str | None) -> str:
    """``ib_write_bw`` at 1 MiB (perftest, C, no Python) in this machine now: rxe's own throughput."""
    from bench.external import ExternalConfig, run_external
    from bench.model import Workload

    try:
        samples = run_external("ib_write_bw", [Workload.STREAM], MiB, 64, ExternalConfig(host, device))
    except (OSError, RuntimeError) as exc:
        return f"not measured: {exc}"
    sample = samples.get(Workload.STREAM)
    if sample is None or not sample.ok or not sample.bytes_per_s:
        return f"not measured: {sample.error if sample is not None else 'no sample'}"
    return f"{sample.bytes_per_s / MiB:.1f} MiB/s"


# --- running --------------------------------------------------------------------------------------


def run_protocol(protocol: str, loop: str, args: argparse.Namespace, progress: Progress) -> dict[str, float]:
    """Start a cluster on ``protocol`` and ``loop`` and run every measurement on it."""
    import dask

    distributed = _module("distributed")
    results: dict[str, float] = {}
    with (
        dask.config.set({"distributed.admin.event-loop": loop}),
        distributed.LocalCluster(
            protocol=protocol, host=args.host, n_workers=2, threads_per_worker=1, processes=True,
            dashboard_address=None, silence_logs=logging.ERROR,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):  # fmt: skip
        client.wait_for_workers(2)
        transfer_once(client, 1, 0)  # warm-up: imports, worker-to-worker connections
        if args.trace:
            progress(f"{protocol}://, {loop}:")
            for size in args.sizes:
                trace_transfer(client, size, progress)
            return results
        for size in args.sizes:
            name = f"transfer {size} MiB"
            results[name] = bench_transfer(client, size, args.reps)
            progress(f"{loop} {protocol}:// {name}: {results[name] * 1000:.1f} ms")
        if args.rows:
            name = f"shuffle {args.rows} rows"
            results[name] = bench_shuffle(client, args.rows, args.reps)
            progress(f"{loop} {protocol}:// {name}: {results[name] * 1000:.1f} ms")
    return results


def render_table(results: dict[str, dict[str, float]], loop: str, args: argparse.Namespace) -> str:
    """Markdown: one row per measurement, one column per protocol, the tcp/rdma time ratio."""
    protocols = list(results)
    lines = [
        f"loop: {loop}, host: {args.host}, median of {args.reps}",
        "",
        "| measurement | " + " | ".join(f"{p}://" for p in protocols) + " | rdma vs tcp |",
        "| --- | " + " | ".join("---" for _ in protocols) + " | --- |",
    ]
    for name in results[protocols[0]]:
        cells = []
        for protocol in protocols:
            seconds = results[protocol][name]
            cell = f"{seconds * 1000:.1f} ms"
            if name.startswith("transfer"):
                cell += f" ({int(name.split()[1]) / seconds:.1f} MiB/s)"
            cells.append(cell)
        ratio = ""
        if "tcp" in results and "rdma" in results:
            ratio = f"{results['tcp'][name] / results['rdma'][name]:.2f}x tcp's speed"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, progress: Progress) -> dict[str, dict[str, dict[str, float]]]:
    """Every loop x protocol; returns ``{loop: {protocol: {measurement: seconds}}}`` and prints tables."""
    try:
        import distributed  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"the dask workload needs rdmaio[dask]: {exc}") from exc
    everything: dict[str, dict[str, dict[str, float]]] = {}
    for loop in args.loops:
        per_loop = everything.setdefault(loop, {})
        for protocol in args.protocols:
            per_loop[protocol] = run_protocol(protocol, loop, args, progress)
        if not args.trace:
            print("\n" + render_table(per_loop, loop, args), end="", flush=True)
    return everything


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The options of the Dask comparison (shared by ``examples/dask_bench.py``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the Dask comparison's options to ``parser``."""
    parser.add_argument("--host", default="198.18.0.1", help="an address of the RDMA interface")
    parser.add_argument("--loop", dest="loops", type=_csv, default=["asyncio", "uvloop"])
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in _csv(s)], default=list(DEFAULT_SIZES),
        help="transfer sizes in MiB, comma-separated (default 1,16,64)",
    )  # fmt: skip
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="shuffle rows (0: no shuffle)")
    parser.add_argument("--reps", type=int, default=3, help="median of this many runs per figure")
    parser.add_argument("--protocols", type=_csv, default=["tcp", "rdma"])
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print a timeline of every process's comm calls during one transfer of each size instead "
        "of measuring",
    )
    parser.add_argument(
        "--framing",
        action="store_true",
        help="measure the comm's data path alone (two endpoints in this process, no Dask) at the "
        "largest --sizes",
    )


def _uvloop_run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print one table per loop."""
    args = build_parser().parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    if args.framing:
        import asyncio

        size = max(args.sizes) * MiB
        for loop in args.loops:
            runner = asyncio.run if loop == "asyncio" else _uvloop_run
            figures = runner(framing_throughput(args.host, size, args.reps, FRAMING_CHUNKS))
            print(f"\ncomm data path, {loop}, one {size // MiB} MiB frame, median of {args.reps}")
            for name, rate in figures.items():
                print(f"  {name:28} {rate:8.1f} MiB/s")
        print(f"\nib_write_bw 1 MiB (C, rxe's ceiling now): {rxe_ceiling(args.host, None)}", flush=True)
        return 0
    run(args, lambda line: print(line, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
