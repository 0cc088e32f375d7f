"""Unit tests of ``rdmaio perf`` (rdmaio/cli/perf.py): option, size and mode parsing, the percentile maths,
the control header's validation, and whole client/server runs in this process over the null device
(:class:`rdmaio.testing.nullpair.NullListener`): every mode's ``--json`` document and its figures adding
up, the refusals (busy, limits, unknown mode, version, atomics), the exit statuses and their one-line
messages, the progress line, the server's header and run deadlines."""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import signal
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import pytest

import rdmaio
from rdmaio.__main__ import USAGE
from rdmaio.__main__ import main as rdmaio_main
from rdmaio.cli import perf
from rdmaio.cli.perf import (
    MODES,
    SCHEMA,
    ClientConfig,
    PerfRefusedError,
    PerfServer,
    RunRequest,
    ServerLimits,
    decode_request,
    format_size,
    latency_summary,
    parse_modes,
    parse_size,
    parse_sizes,
    percentile,
    render_table,
    run_client,
)
from rdmaio.testing.nullpair import NullDevice, NullListener

Run = Callable[[Coroutine[Any, Any, Any]], Any]


# --- parsing and numbers ---------------------------------------------------------------------------------


def test_sizes() -> None:
    assert [parse_size(s) for s in ("64", "64K", "64k", "1M", "1G", "64KiB", "8kb", " 2M ")] == [
        64,
        65536,
        65536,
        1 << 20,
        1 << 30,
        65536,
        8192,
        2 << 20,
    ]
    for bad in ("0", "", "K", "1.5K", "-1", "2G", "64X", "1T"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert parse_sizes("64,64K,1M") == [64, 65536, 1 << 20]
    assert parse_sizes("1M,64,1024,1K") == [1 << 20, 64, 1024]  # order kept, repeats dropped
    assert [format_size(n) for n in (64, 1024, 1536, 65536, 1 << 20, 3 << 30)] == [
        "64 B",
        "1 KiB",
        "1536 B",
        "64 KiB",
        "1 MiB",
        "3 GiB",
    ]


def test_modes() -> None:
    assert parse_modes("message") == ["message"]
    assert parse_modes("echo, read,echo") == ["echo", "read"]
    assert parse_modes("all") == list(MODES)
    assert parse_modes("atomic,all") == ["atomic", "message", "stream", "echo", "read", "write"]
    with pytest.raises(ValueError, match="unknown mode 'bogus'"):
        parse_modes("echo,bogus")
    # atomic runs once, with its 8-byte operand, whatever the sizes
    config = ClientConfig("h", modes=("message", "atomic", "echo"), sizes=(64, 4096))
    assert config.runs() == [("message", 64), ("message", 4096), ("atomic", 8), ("echo", 64), ("echo", 4096)]


def test_percentiles_nearest_rank() -> None:
    samples = [n / 1e6 for n in range(1000, 0, -1)]  # 1..1000 us, unsorted
    ordered = sorted(samples)
    assert percentile(ordered, 0.5) == pytest.approx(500e-6)
    assert percentile(ordered, 0.9) == pytest.approx(900e-6)
    assert percentile(ordered, 0.99) == pytest.approx(990e-6)
    assert percentile(ordered, 0.999) == pytest.approx(999e-6)  # 0.999 * 1000 is 998.99...: still rank 999
    assert percentile(ordered, 1.0) == pytest.approx(1000e-6)
    assert percentile(ordered, 0.0) == pytest.approx(1e-6)
    assert percentile([], 0.5) == 0.0
    assert percentile([7.0], 0.999) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0  # the smallest with half at or below it
    summary = latency_summary(samples)
    assert summary is not None
    assert list(summary) == ["samples", "min", "mean", "p50", "p90", "p99", "p99.9", "max"]
    assert summary["samples"] == 1000
    assert (summary["min"], summary["p99.9"], summary["max"]) == pytest.approx((1.0, 999.0, 1000.0))
    assert summary["mean"] == pytest.approx(500.5)
    assert latency_summary([]) is None


def test_options(capsys: pytest.CaptureFixture[str]) -> None:
    parser = perf.build_parser()
    args = parser.parse_args(
        [
            "198.18.0.2",
            "7000",
            "--mode",
            "echo,read",
            "--size",
            "64,64K,1M",
            "--time",
            "2",
            "-P",
            "4",
            "--json",
        ]
    )
    assert (args.host, args.port, args.mode, args.size) == (
        "198.18.0.2",
        7000,
        ["echo", "read"],
        [64, 65536, 1 << 20],
    )
    assert (args.time, args.parallel, args.json, args.server, args.bind) == (2.0, 4, True, False, None)
    defaults = parser.parse_args(["h"])
    assert (defaults.port, defaults.mode, defaults.size, defaults.time, defaults.parallel) == (
        perf.DEFAULT_PORT,
        ["message"],
        [65536],
        10.0,
        1,
    )
    server = parser.parse_args(["--server", "--max-clients", "2", "--max-size", "1M", "--max-exported", "4M"])
    assert (server.server, server.host, server.max_clients, server.max_size, server.max_exported) == (
        True,
        None,
        2,
        1 << 20,
        4 << 20,
    )
    for bad, message in (
        (["h", "--size", "0"], "size out of range"),
        (["h", "--size", "1.5K"], "not a size"),
        (["h", "--mode", "nope"], "unknown mode 'nope'"),
        (["h", "--time", "0"], "must be positive"),
        (["h", "-P", "0"], "must be positive"),
        (["h", "--loop", "trio"], "invalid choice"),
        ([], "HOST is required"),
    ):
        with pytest.raises(SystemExit) as exc:
            perf.main(bad)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        perf.main(["--help"])
    assert exc.value.code == 0
    assert "--parallel" in capsys.readouterr().out


def test_wired_into_the_command() -> None:
    assert "perf      throughput and latency between two hosts" in USAGE
    with pytest.raises(SystemExit) as exc:
        rdmaio_main(["perf", "--help"])
    assert exc.value.code == 0


class ExtraInfo:
    """An endpoint's ``get_extra_info`` alone, from a dict (a name mapped to an exception raises it)."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra = extra

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        value = self.extra.get(name, default)
        if isinstance(value, Exception):
            raise value
        return value


def test_path_record_sources() -> None:
    """The record comes from ``get_extra_info("rdma")`` when it has ``describe()``; without it (an rdmaio
    before the path record) from the older keys, a key that cannot be read showing as None."""

    class Described:
        def describe(self) -> str:
            return "rxe0 port 1, RoCE v2"

    older = {
        "device": "rxe0",
        "port": 1,
        "mtu": rdmaio.VerbsError("ibv_query_port", errno=5),
        "max_inline": 256,
    }
    text, record = perf.path_record(ExtraInfo(older | {"qp_num": 17, "peername": ("198.18.0.2", 7472)}))
    assert text == "path: rxe0 port 1, MTU None, max inline 256"
    assert record == {
        "device": "rxe0",
        "port": 1,
        "mtu": None,
        "max_inline": 256,
        "qp_num": 17,
        "sockname": None,
        "peername": ["198.18.0.2", 7472],
    }
    text, record = perf.path_record(ExtraInfo({"rdma": Described()}))
    assert (text, record) == ("path: rxe0 port 1, RoCE v2", {"describe": "rxe0 port 1, RoCE v2"})


# --- the control header ----------------------------------------------------------------------------------


def header(**fields: Any) -> bytes:
    body = {"perf": 1, "mode": "message", "size": 64, "time": 1, "stream": 0, "streams": 1} | fields
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


def test_header_round_trip_and_refusals() -> None:
    limits = ServerLimits(max_size=1 << 20, max_time=60)
    request = RunRequest("echo", 4096, 2.5, 1, 3)
    assert decode_request(request.encode(), limits) == request
    assert decode_request(header(stream=..., streams=...), limits) == RunRequest("message", 64, 1.0)
    cases = [
        (None, "header"),
        (b"not json", "header"),
        (b"[1, 2]", "header"),
        (b'{"mode": "message"}', "header"),
        (b"{" + b" " * perf.MAX_CONTROL + b"}", "header"),
        (header(perf=2), "version"),
        (header(mode="bogus"), "mode"),
        (header(mode=...), "mode"),
        (header(size=0), "size"),
        (header(size=(1 << 20) + 1), "size"),
        (header(size="64"), "size"),
        (header(size=True), "size"),
        (header(mode="atomic", size=64), "size"),
        (header(time=0), "time"),
        (header(time=61), "time"),
        (header(time=True), "time"),
        (b'{"perf": 1, "mode": "message", "size": 64, "time": NaN}', "time"),
        (header(stream=3, streams=3), "header"),
        (header(stream=-1), "header"),
    ]
    for data, reason in cases:
        with pytest.raises(PerfRefusedError) as refused:
            decode_request(data, limits)
        assert refused.value.reason == reason, (data, refused.value)
    with pytest.raises(PerfRefusedError, match=r"unknown mode 'bogus' \(this server knows: message, stream"):
        decode_request(header(mode="bogus"), limits)
    with pytest.raises(PerfRefusedError, match="version 2 is not spoken here"):
        decode_request(header(perf=2), limits)


# --- whole runs over the null device ---------------------------------------------------------------------


class Bench:
    """A perf server and a connector over one null listener: each connection the client opens is served
    by ``server.handle`` in its own task, as ``rdmaio.serve`` does."""

    def __init__(self, limits: ServerLimits | None = None) -> None:
        self.listener = NullListener(NullDevice())
        self.log = io.StringIO()
        self.server = PerfServer(limits, self.log)
        self.tasks: set[asyncio.Task[None]] = set()
        self.connections = 0
        self.on_connect: Callable[[rdmaio.Endpoint, rdmaio.Endpoint], None] | None = None

    async def connect(self, host: str, port: int, bind: str | None, wait: float) -> rdmaio.Endpoint:
        client, served = await self.listener.connect()
        self.connections += 1
        if self.on_connect is not None:
            self.on_connect(client, served)
        task = asyncio.ensure_future(self.server.handle(served))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return client

    async def run(self, config: ClientConfig, progress: io.StringIO | None = None) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        status = await run_client(config, out, err, connect=self.connect, progress=progress)
        await asyncio.gather(*self.tasks)  # every handler finished: none left waiting
        assert self.server.active == 0 and self.server.exported == 0
        return status, out.getvalue(), err.getvalue()


def check_document(doc: dict[str, Any], modes: Sequence[str], sizes: Sequence[int], parallel: int) -> None:
    """The documented schema, every figure positive, and the server's counts equal to the client's."""
    assert set(doc) == {"schema", "rdmaio", "server", "path", "options", "results", "error"}
    assert doc["schema"] == SCHEMA and doc["rdmaio"] == rdmaio.__version__ and doc["error"] is None
    assert doc["path"]["device"] == "fake0"  # the extra-info record of the null device
    assert doc["options"] == {
        "modes": list(modes),
        "sizes": list(sizes),
        "time": doc["options"]["time"],
        "parallel": parallel,
        "bind": None,
        "loop": "auto",
    }
    expected = [(m, s) for m in modes for s in ((8,) if m == "atomic" else sizes)]
    assert [(r["mode"], r["size"]) for r in doc["results"]] == expected
    run_keys = {
        "mode",
        "size",
        "time",
        "parallel",
        "seconds",
        "operations",
        "bytes",
        "client_bytes",
        "bytes_per_second",
        "bits_per_second",
        "operations_per_second",
        "latency_us",
        "server",
        "connections",
    }
    for r in doc["results"]:
        what = (r["mode"], r["size"])
        assert set(r) == run_keys, what
        assert len(r["connections"]) == r["parallel"] == parallel
        for name in ("seconds", "operations", "bytes", "bytes_per_second", "operations_per_second"):
            assert r[name] > 0, (what, name)
        assert r["bytes"] == r["operations"] * r["size"] == r["client_bytes"], what
        assert r["bytes_per_second"] == pytest.approx(sum(c["bytes_per_second"] for c in r["connections"]))
        for c in r["connections"]:
            assert set(c) == {
                "operations",
                "bytes",
                "client_bytes",
                "seconds",
                "bytes_per_second",
                "operations_per_second",
                "server",
            }
            server = c["server"]
            if r["mode"] in ("message", "stream"):
                assert server["bytes"] == c["client_bytes"] == c["bytes"], what
            if r["mode"] in ("message", "echo"):
                assert server["messages"] == c["operations"], what
            if r["mode"] == "atomic":
                assert server["counter"] == c["operations"], what
        if r["mode"] in ("message", "stream"):
            assert r["latency_us"] is None and r["server"]["bytes"] == r["client_bytes"]
        else:
            latency = r["latency_us"]
            assert latency["samples"] == r["operations"], what
            ordered = [latency[k] for k in ("min", "p50", "p90", "p99", "p99.9", "max")]
            assert ordered[0] > 0 and ordered == sorted(ordered), what


@pytest.mark.parametrize("parallel", [1, 3])
def test_every_mode_json(arun: Run, parallel: int) -> None:
    async def main() -> None:
        bench = Bench()
        config = ClientConfig(
            "198.18.0.2", modes=MODES, sizes=(64, 5000), seconds=0.05, parallel=parallel, json=True
        )
        status, out, err = await bench.run(config)
        assert (status, err) == (0, "")
        doc = json.loads(out)  # stdout is the one document and nothing else
        check_document(doc, MODES, [64, 5000], parallel)
        assert bench.connections == 11 * parallel
        assert (bench.server.runs, bench.server.refused) == (11 * parallel, 0)
        log = bench.log.getvalue().splitlines()
        assert sum(" done in " in line for line in log) == 11 * parallel

    arun(main())


def test_human_output(arun: Run) -> None:
    async def main() -> None:
        config = ClientConfig("198.18.0.2", modes=("echo", "message"), sizes=(64,), seconds=0.05)
        status, out, err = await Bench().run(config)
        assert (status, err) == (0, "")
        lines = out.splitlines()
        assert lines[0] == "rdmaio perf to 198.18.0.2 port 7472"
        # the path record's lines (rdmaio.PathInfo.describe() of the null device's connection)
        table = next(i for i, line in enumerate(lines) if line.startswith("mode "))
        path = "\n".join(lines[1:table])
        assert path.startswith("path: fake0 port 1, ") and "GID" in path and "features:" in path
        header = "mode size conns seconds ops ops/s bandwidth p50 us p90 p99 p99.9 max"
        assert lines[table].split() == header.split()
        echo, message = lines[table + 1].split(), lines[table + 2].split()
        assert echo[:4] == ["echo", "64", "B", "1"] and len(echo) == 14  # bandwidth is 2 words, 5 latencies
        assert message[:4] == ["message", "64", "B", "1"] and message[-5:] == ["-"] * 5
        assert len(lines) == table + 3

    arun(main())


def test_render_table_aligns_columns() -> None:
    run = {
        "mode": "read",
        "size": 1 << 20,
        "parallel": 2,
        "seconds": 10.0,
        "operations": 12345,
        "operations_per_second": 1234.5,
        "bytes_per_second": 1.25e9,
        "latency_us": {"p50": 10.0, "p90": 20.0, "p99": 30.0, "p99.9": 40.0, "max": 50.0},
    }
    table = render_table([run, {**run, "mode": "message", "latency_us": None, "bytes_per_second": 1e6}])
    lines = table.splitlines()
    assert lines[1].split() == [
        "read",
        "1",
        "MiB",
        "2",
        "10.00",
        "12345",
        "1.23k",
        "10.0",
        "Gbit/s",
        "10.0",
        "20.0",
        "30.0",
        "40.0",
        "50.0",
    ]
    assert lines[2].split()[-7:] == ["8.00", "Mbit/s", "-", "-", "-", "-", "-"]
    assert len({len(line) for line in lines[:2]}) == 1  # right-aligned columns end together


def test_progress_line_on_a_terminal(arun: Run) -> None:
    async def main() -> None:
        progress = io.StringIO()
        config = ClientConfig("h", modes=("message",), sizes=(64,), seconds=1.3)
        status, _out, _err = await Bench().run(config, progress)
        assert status == 0
        text = progress.getvalue()
        # one update after 1 s, rewritten in place, and the line cleared at the end of the run
        assert text.startswith("\r\x1b[2Kmessage 64 B: 1/1.3 s  ") and "ops/s" in text
        assert text.endswith("\r\x1b[2K") and "\n" not in text
        quiet = io.StringIO()
        json_config = ClientConfig("h", modes=("message",), sizes=(64,), seconds=1.3, json=True)
        assert (await Bench().run(json_config, quiet))[0] == 0
        assert quiet.getvalue() == ""  # --json: no progress

    arun(main())


# --- refusals and failures -------------------------------------------------------------------------------


def test_busy_server_refuses_with_exit_3(arun: Run) -> None:
    async def main() -> None:
        bench = Bench(ServerLimits(max_clients=1))
        config = ClientConfig(
            "198.18.0.2", modes=("message",), sizes=(64,), seconds=0.05, parallel=2, json=True
        )
        status, out, err = await bench.run(config)
        assert status == perf.EXIT_REFUSED == 3
        assert err == (
            "rdmaio perf: 198.18.0.2 port 7472: the server refused the run: server busy: 1 runs in progress "
            "(its --max-clients is 1)\n"
        )
        doc = json.loads(out)
        assert doc["error"] == {"kind": "refused", "message": err[len("rdmaio perf: ") : -1]}
        assert doc["results"] == []
        assert bench.server.refused == 1
        assert "refused: server busy" in bench.log.getvalue()

    arun(main())


def test_exported_memory_budget(arun: Run) -> None:
    async def main() -> None:
        bench = Bench(ServerLimits(max_exported=6000))
        ok = ClientConfig("h", modes=("read",), sizes=(5000,), seconds=0.05, json=True)
        assert (await bench.run(ok))[0] == 0
        two = ClientConfig("h", modes=("write",), sizes=(5000,), seconds=0.05, parallel=2)
        status, _out, err = await bench.run(two)
        assert status == 3 and "5000 more would pass its --max-exported of 6000" in err

    arun(main())


def test_limits_refuse_size_and_time(arun: Run) -> None:
    async def main() -> None:
        bench = Bench(ServerLimits(max_size=1024, max_time=0.5))
        status, _out, err = await bench.run(ClientConfig("h", sizes=(4096,), seconds=0.05))
        assert status == 3 and "size 4096 is outside what this server accepts (1 to 1024 bytes)" in err
        status, _out, err = await bench.run(ClientConfig("h", sizes=(64,), seconds=1.0))
        assert status == 3 and "time 1.0 is outside what this server accepts (up to 0.5 s)" in err

    arun(main())


def test_atomics_unsupported_by_the_server_device(arun: Run) -> None:
    async def main() -> None:
        bench = Bench()

        def no_atomics(client: rdmaio.Endpoint, served: rdmaio.Endpoint) -> None:
            export = served.export

            def export_without_atomics(buffer: Any, *args: Any, access: str = "rw", **kwargs: Any) -> Any:
                if "a" in access:  # what the engine raises on a device with atomic_cap NONE
                    raise rdmaio.RemoteAccessError(
                        "this device does not support remote atomics (atomic_cap NONE)"
                    )
                return export(buffer, *args, access=access, **kwargs)

            served.export = export_without_atomics  # type: ignore[method-assign]

        bench.on_connect = no_atomics
        config = ClientConfig("h", modes=("read", "atomic"), sizes=(64,), seconds=0.05, json=True)
        status, out, err = await bench.run(config)
        assert status == 3
        assert "the server's device does not support remote atomics" in err
        doc = json.loads(out)
        assert [r["mode"] for r in doc["results"]] == ["read"]  # what ran before the refusal is kept
        assert doc["error"]["kind"] == "refused"

    arun(main())


async def raw_exchange(data: bytes, limits: ServerLimits | None = None) -> dict[str, Any]:
    """Send ``data`` as the first message to a perf server over a null pair; return its answer."""
    bench = Bench(limits)
    client = await bench.connect("h", 1, None, 1.0)
    await client.send(data)
    answer = await client.recv()
    assert answer is not None
    assert await client.recv() is None  # the server closed after refusing
    await client.aclose()
    await asyncio.gather(*bench.tasks)
    return dict(json.loads(answer))


def test_unknown_mode_and_version_from_another_client(arun: Run) -> None:
    async def main() -> None:
        assert await raw_exchange(header(mode="bogus")) == {
            "perf": 1,
            "ok": False,
            "reason": "mode",
            "error": "unknown mode 'bogus' (this server knows: message, stream, echo, read, write, atomic)",
        }
        answer = await raw_exchange(header(perf=2, mode="future"))
        assert (answer["ok"], answer["reason"]) == (False, "version")
        assert (await raw_exchange(b"hello"))["reason"] == "header"

    arun(main())


def test_refused_answer_decoded_by_the_client(arun: Run) -> None:
    """The client's side of a refusal it cannot cause itself (a newer server's reason, say)."""

    async def main() -> None:
        bench = Bench()

        def refuse(client: rdmaio.Endpoint, served: rdmaio.Endpoint) -> None:
            async def handle(ep: rdmaio.Endpoint) -> None:
                await ep.recv()
                await ep.send(b'{"perf":1,"ok":false,"reason":"maintenance","error":"down for maintenance"}')
                await ep.aclose()

            bench.server.handle = handle  # type: ignore[method-assign]

        bench.on_connect = refuse
        status, _out, err = await bench.run(ClientConfig("h", seconds=0.05))
        assert status == 3 and err.endswith("the server refused the run: down for maintenance\n")

    arun(main())


def test_a_ping_server_is_not_a_perf_server(arun: Run) -> None:
    async def main() -> None:
        bench = Bench()

        async def echo(ep: rdmaio.Endpoint) -> None:  # what rdmaio ping --server does
            try:
                while (msg := await ep.recv()) is not None:
                    await ep.send(msg)
            except ConnectionError:
                pass  # the perf client aborts when it sees its header come back
            ep.abort()

        bench.server.handle = echo  # type: ignore[method-assign]
        status, out, err = await bench.run(ClientConfig("h", seconds=0.05, json=True))
        assert status == perf.EXIT_CONNECT
        assert err == (
            "rdmaio perf: h port 7472: the server echoed the header back: an rdmaio ping server, "
            "not a perf server\n"
        )
        assert json.loads(out)["error"]["kind"] == "not-perf-server"

    arun(main())


def test_connection_refused_is_exit_2_and_one_line(arun: Run) -> None:
    async def main() -> None:
        async def refused(host: str, port: int, bind: str | None, wait: float) -> rdmaio.Endpoint:
            raise rdmaio.ConnectionRefusedError("rdma_connect rejected: no listener on that port")

        for as_json in (False, True):
            out, err = io.StringIO(), io.StringIO()
            config = ClientConfig("198.18.0.2", 7000, json=as_json)
            status = await run_client(config, out, err, connect=refused)
            assert status == perf.EXIT_CONNECT == 2
            assert err.getvalue() == (
                "rdmaio perf: 198.18.0.2 port 7000: no perf server is listening there "
                "(start one with: python -m rdmaio perf --server 198.18.0.2 7000)\n"
            )
            if as_json:
                doc = json.loads(out.getvalue())
                assert doc["error"]["kind"] == "no-server" and doc["path"] is None and doc["results"] == []
            else:
                assert out.getvalue() == ""

    arun(main())


def test_connection_lost_during_a_run_is_exit_1(arun: Run) -> None:
    async def main() -> None:
        bench = Bench()
        bench.on_connect = lambda client, served: asyncio.get_running_loop().call_later(0.05, served.abort)
        status, _out, err = await bench.run(ClientConfig("h", modes=("echo",), sizes=(64,), seconds=5))
        assert status == perf.EXIT_RUN_FAILED == 1
        assert err.startswith("rdmaio perf: ") and len(err.splitlines()) == 1
        assert bench.server.active == 0

    arun(main())


def test_interrupt_keeps_the_finished_runs(arun: Run) -> None:
    async def main() -> None:
        bench = Bench()

        def interrupt_second(client: rdmaio.Endpoint, served: rdmaio.Endpoint) -> None:
            if bench.connections == 2:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the second run sets up

        bench.on_connect = interrupt_second
        config = ClientConfig("h", modes=("message", "echo"), sizes=(64,), seconds=0.05, json=True)
        out, err = io.StringIO(), io.StringIO()
        status = await run_client(config, out, err, connect=bench.connect)
        assert status == perf.EXIT_INTERRUPTED == 130
        doc = json.loads(out.getvalue())
        assert [r["mode"] for r in doc["results"]] == ["message"]
        assert doc["error"] == {"kind": "interrupted", "message": "interrupted"}
        assert err.getvalue() == "rdmaio perf: interrupted\n"
        await asyncio.wait_for(asyncio.gather(*bench.tasks), 5)  # the server's side ended too

    arun(main())


# --- the server's own deadlines --------------------------------------------------------------------------


def test_server_drops_a_connection_without_header(arun: Run) -> None:
    async def main() -> None:
        bench = Bench(ServerLimits(header_timeout=0.05))
        client = await bench.connect("h", 1, None, 1.0)
        with pytest.raises(ConnectionError):
            assert await client.recv() is None  # the server aborts: a reset, or the end of the stream
            raise ConnectionResetError
        await asyncio.gather(*bench.tasks)
        assert "no header within 0.05 s, dropped" in bench.log.getvalue()
        assert bench.server.active == 0
        client.abort()

    arun(main())


def test_server_aborts_a_run_past_its_time_and_grace(arun: Run) -> None:
    async def main() -> None:
        bench = Bench(ServerLimits(grace=0.05))
        client = await bench.connect("h", 1, None, 1.0)
        await client.send(RunRequest("message", 64, 0.05).encode())
        answer = json.loads(await client.recv() or b"")
        assert answer["ok"] is True
        await client.send(bytes(64))  # and never EOF
        await asyncio.wait_for(asyncio.gather(*bench.tasks), 5)
        assert "message run still going after 0.1 s: aborted" in bench.log.getvalue()
        assert (bench.server.active, bench.server.exported) == (0, 0)
        client.abort()

    arun(main())


def test_exit_statuses_are_distinct() -> None:
    statuses = [
        perf.EXIT_OK,
        perf.EXIT_RUN_FAILED,
        perf.EXIT_CONNECT,
        perf.EXIT_REFUSED,
        perf.EXIT_INTERRUPTED,
    ]
    assert statuses == [0, 1, 2, 3, 130]
    assert not math.isnan(perf.ServerLimits().max_time)


def test_latency_samples_are_bounded(arun: Run) -> None:
    """Past ``max_samples`` per connection a uniform sample is kept: memory stays bounded on long runs."""

    async def main() -> None:
        # A small sample bound and a run long enough to pass it many times over even on a loaded machine
        # (the test counts operations, it does not time them).
        config = ClientConfig("h", modes=("echo", "atomic"), sizes=(64,), seconds=0.2, parallel=2, json=True)
        config = dataclasses.replace(config, max_samples=3)
        status, out, _err = await Bench().run(config)
        assert status == 0
        for r in json.loads(out)["results"]:
            assert r["operations"] > 6  # more operations than kept samples
            assert r["latency_us"]["samples"] == 6  # 3 per connection

    arun(main())


def test_reservoir_keeps_a_uniform_sample() -> None:
    rng_state = random.getstate()
    random.seed(28)
    try:
        kept = array.array("d", range(100))
        for seen in range(100, 100_000):
            perf._reservoir(kept, seen, float(seen))
    finally:
        random.setstate(rng_state)
    assert len(kept) == 100 and all(0 <= v < 100_000 for v in kept)
    assert sum(v >= 50_000 for v in kept) > 30  # later samples get their share (about half)
    assert sum(v < 100 for v in kept) < 10  # the first hundred do not stay (about 0.1 of them)


def test_malformed_key_from_the_server_is_one_line(arun: Run) -> None:
    async def main() -> None:
        bench = Bench()

        async def bad_key(ep: rdmaio.Endpoint) -> None:
            await ep.recv()
            await ep.send(b'{"perf":1,"ok":true,"key":"zz"}')
            with contextlib.suppress(ConnectionError):
                await ep.recv()  # the client aborts
            ep.abort()

        bench.server.handle = bad_key  # type: ignore[method-assign]
        status, _out, err = await bench.run(ClientConfig("h", modes=("read",), sizes=(64,), seconds=0.05))
        assert status == perf.EXIT_RUN_FAILED
        assert err.startswith("rdmaio perf: h port 7472: the server's key for the read run is malformed")
        assert len(err.splitlines()) == 1

    arun(main())


class NeverSuspends:
    """An endpoint whose sends and drains return without suspending (as rdmaio's do below the write
    high-water mark) and whose peer reports at once."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, data: bytes) -> None:
        self.sent += len(data)

    def write(self, data: bytes) -> None:
        self.sent += len(data)

    async def drain(self) -> None:
        return None

    def write_eof(self) -> None:
        pass

    async def recv(self) -> bytes:
        report = {"perf": 1, "report": {"bytes": self.sent, "messages": 0, "seconds": 0.01}}
        return json.dumps(report).encode()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["message", "stream"])
def test_one_way_loops_let_the_timer_run(arun: Run, mode: str) -> None:
    """A run ends when its time is up even if no send ever suspends: the loop gets a turn every 256
    operations (without it the timer never ran and the run never ended: the test timed out)."""

    async def main() -> None:
        ep: Any = NeverSuspends()
        stop, live = perf._Stop(), perf._Live()
        asyncio.get_running_loop().call_later(0.05, stop.stop)
        request = RunRequest(mode, 64, 0.05)
        result = await perf._measure_connection(ep, request, {}, stop, live, 0.0, 1.0)
        assert result.operations == live.operations > 0
        assert result.server["bytes"] == result.client_bytes == 64 * result.operations

    arun(main())


def test_doctor_probes_are_answered(arun: Run) -> None:
    """``rdmaio doctor --peer`` against a perf server: a connection whose first message is a doctor probe
    is handed to :func:`rdmaio.cli.peer.serve_doctor_session` (probes answered, other messages echoed)."""
    from rdmaio.cli.peer import PROBE_PREFIX, probe_request

    async def main() -> None:
        bench = Bench()
        client = await bench.connect("h", 1, None, 1.0)
        await client.send(probe_request("info"))
        reply = await client.recv()
        assert reply is not None and reply.startswith(PROBE_PREFIX)
        info = json.loads(reply[len(PROBE_PREFIX) :])
        assert info["version"] == rdmaio.__version__
        await client.send(b"an echo")
        assert await client.recv() == b"an echo"
        assert bench.server.active == 1  # the session holds a client slot while it lasts
        await client.aclose()
        await asyncio.gather(*bench.tasks)
        assert bench.server.active == 0
        log = bench.log.getvalue()
        assert ": doctor probe\n" in log and "doctor probe done, 2 messages" in log

    arun(main())


def test_doctor_probe_on_a_busy_server(arun: Run) -> None:
    from rdmaio.cli.peer import probe_request

    async def main() -> None:
        bench = Bench(ServerLimits(max_clients=1))
        first = await bench.connect("h", 1, None, 1.0)
        await first.send(RunRequest("message", 64, 5.0).encode())
        assert json.loads(await first.recv() or b"")["ok"] is True  # one run holds the only slot
        second = await bench.connect("h", 1, None, 1.0)
        await second.send(probe_request("info"))
        with pytest.raises(ConnectionError):
            if await second.recv() is None:
                raise ConnectionResetError  # the server aborted it: a reset, or the end of the stream
        assert "doctor probe refused: server busy" in bench.log.getvalue()
        first.abort()
        second.abort()
        await asyncio.gather(*bench.tasks)

    arun(main())


@pytest.mark.parametrize("mode", ["message", "stream"])
def test_a_run_makes_at_least_one_operation(arun: Run, mode: str) -> None:
    """A loaded machine may run the run's timer before its tasks start: each connection still makes one
    operation, so no figure of a run is zero (a unit run under load saw ``operations == 0`` fail)."""

    async def main() -> None:
        ep: Any = NeverSuspends()
        stop, live = perf._Stop(), perf._Live()
        stop.stop()  # the time is already up
        result = await perf._measure_connection(ep, RunRequest(mode, 64, 0.05), {}, stop, live, 0.0, 1.0)
        assert result.operations == 1 and result.client_bytes == 64

    arun(main())
