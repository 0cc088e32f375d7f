"""Unit tests of ``rdmaio ping`` (rdmaio/cli/ping.py) with fake endpoints: the lines, the summary, lost
and late replies, a server that closes, the errors' one-line descriptions and the option checks."""

from __future__ import annotations

import asyncio
import errno
import io
import re
import signal
from collections.abc import Callable

import pytest

import rdmaio
from rdmaio.cli import ping
from rdmaio.cli.ping import PingConfig, PingStats, describe_error, make_payload, parse_seq, ping_loop


class FakePeer:
    """Echoes what it is sent, after ``transform`` (which may drop a message by returning None)."""

    def __init__(self, transform: Callable[[int, bytes], bytes | None] = lambda seq, m: m) -> None:
        self.replies: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.transform = transform
        self.sent = 0
        self.now = 0.0

    def clock(self) -> float:
        """The time as the ping loop sees it: each reply takes 1 ms to arrive."""
        return self.now

    async def send(self, data: bytes) -> None:
        self.sent += 1
        reply = self.transform(self.sent, bytes(data))
        if reply is not None:
            self.replies.put_nowait(reply)

    async def recv(self) -> bytes | None:
        reply = await self.replies.get()
        self.now += 0.001
        return reply


def run_loop(peer: FakePeer, config: PingConfig) -> tuple[PingStats, list[str]]:
    out = io.StringIO()
    stats = PingStats()
    asyncio.run(ping_loop(peer, config, stats, out, clock=peer.clock))
    return stats, out.getvalue().splitlines()


def test_payload_round_trip() -> None:
    payload = make_payload(7, 1000)
    assert len(payload) == 1000 and parse_seq(payload) == 7
    assert make_payload(7, 1000) != make_payload(8, 1000)
    assert len(make_payload(1, ping.MIN_SIZE)) == ping.MIN_SIZE
    assert parse_seq(b"short") is None and parse_seq(b"X" * 64) is None
    with pytest.raises(ValueError, match="at least"):
        make_payload(1, ping.MIN_SIZE - 1)


def test_every_reply_prints_a_line() -> None:
    stats, lines = run_loop(FakePeer(), PingConfig("198.18.0.1", 7471, count=3, size=100, interval=0))
    assert lines == [f"100 bytes from 198.18.0.1 port 7471: seq={i} time=1.000 ms" for i in (1, 2, 3)]
    assert (stats.sent, stats.received) == (3, 3)
    summary = stats.summary("198.18.0.1 port 7471").splitlines()
    assert summary[0] == "--- 198.18.0.1 port 7471 rdmaio ping statistics ---"
    assert re.fullmatch(r"3 sent, 3 received, 0% loss, time \d+ ms", summary[1])
    assert summary[2] == "rtt min/avg/max/p99 = 1.000/1.000/1.000/1.000 ms"


def test_lost_reply_and_late_reply() -> None:
    held: list[bytes] = []

    def hold_second(seq: int, msg: bytes) -> bytes | None:
        if seq == 2:
            held.append(msg)
            return None
        if seq == 3:  # the reply to seq 2 turns up late, just before the one to seq 3: it is skipped
            peer.replies.put_nowait(held.pop())
        return msg

    peer = FakePeer(hold_second)
    config = PingConfig("h", 1, count=3, size=64, interval=0, timeout=0.05)
    stats, lines = run_loop(peer, config)
    assert lines[1] == "no reply for seq=2 within 0.05 s"
    assert lines[2] == "64 bytes from h port 1: seq=3 time=2.000 ms"  # it read the late reply first
    assert (stats.sent, stats.received) == (3, 2)
    assert "3 sent, 2 received, 33% loss" in stats.summary("h port 1")


def test_altered_reply_is_not_counted() -> None:
    peer = FakePeer(lambda seq, m: m[:-1] + b"!" if seq == 1 else m)
    stats, lines = run_loop(peer, PingConfig("h", 1, count=2, size=64, interval=0))
    assert lines[0] == "seq=1: the reply differs from what was sent"
    assert stats.received == 1


def test_server_closing_ends_the_loop() -> None:
    peer = FakePeer(lambda seq, m: None)
    peer.replies.put_nowait(None)
    with pytest.raises(ConnectionResetError, match="closed the connection"):
        run_loop(peer, PingConfig("h", 1, count=3, interval=0))


def test_percentiles() -> None:
    stats = PingStats()
    for ms in range(1, 101):
        stats.add(ms / 1000)
    assert stats.percentile(0.99) == pytest.approx(0.099)
    assert stats.percentile(0.5) == pytest.approx(0.050)
    assert PingStats().percentile(0.99) == 0.0
    assert "rtt" not in PingStats().summary("x")  # no replies, no rtt line


def test_error_lines() -> None:
    refused = describe_error(rdmaio.ConnectionRefusedError("rejected"), "198.18.0.1", 7471)
    assert refused == (
        "198.18.0.1 port 7471: connection refused: no rdmaio listener there "
        "(start one with: python -m rdmaio ping --server 198.18.0.1 7471)"
    )
    unreachable = describe_error(rdmaio.UnreachableError("no route"), "10.9.9.9", 1)
    assert unreachable.startswith("10.9.9.9 port 1: unreachable: no route")
    nodev = describe_error(rdmaio.VerbsError("rdma_create_event_channel()", errno=errno.ENODEV), "h", 1)
    assert nodev.startswith("no usable RDMA device") and "doctor" in nodev
    assert (
        describe_error(rdmaio.TimeoutError("connect timed out"), "h", 1)
        == "h port 1: no answer: connect timed out"
    )


def test_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = ping.build_parser().parse_args(["198.18.0.1", "-c", "5", "-s", "1024", "-i", "0.2"])
    assert (args.host, args.port, args.count, args.size, args.interval) == ("198.18.0.1", 7471, 5, 1024, 0.2)
    for bad in (["h", "-c", "0"], ["h", "-i", "-1"], ["h", "-s", "3"]):
        with pytest.raises(SystemExit) as exc:
            ping.main(bad)
        assert exc.value.code == 2
    assert "-s SIZE must be between 12" in capsys.readouterr().err


class FakeServer:
    """What the server side of ``ping``/``perf`` uses of :func:`rdmaio.serve`'s server."""

    def __init__(self, addresses: list[tuple[str, int]]) -> None:
        self.addresses = addresses
        self.closed = False

    async def __aenter__(self) -> FakeServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closed = True


@pytest.mark.parametrize("command", ["ping", "perf"])
def test_server_lines_and_exit_status(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ping --server`` and ``perf --server``: the listening line (scripts wait for it), a SIGINT closes the
    server and ends with status 0; a listener that cannot be made is one line on stderr and status 2."""
    from rdmaio.cli import perf

    served: list[tuple[str, int, object]] = []
    server = FakeServer([("198.18.0.1", 7471)])

    async def serve(handler: object, host: str, port: int, *, options: object = None) -> FakeServer:
        served.append((host, port, options))
        asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGINT)
        return server

    def run_server(host: str, port: int, out: io.StringIO, err: io.StringIO) -> int:
        if command == "ping":
            return asyncio.run(ping.run_server(host, port, out, err))
        return asyncio.run(perf.run_server(host, port, perf.ServerLimits(), out, err))

    monkeypatch.setattr(rdmaio, "serve", serve)
    out, err = io.StringIO(), io.StringIO()
    assert run_server("198.18.0.1", 0, out, err) == 0
    assert server.closed and err.getvalue() == ""
    lines = out.getvalue().splitlines()
    assert lines[0] == f"rdmaio {command} server listening on 198.18.0.1 port 7471"
    stopped = "rdmaio ping server stopped" if command == "ping" else "rdmaio perf server stopped after 0 runs"
    assert lines[1].startswith(stopped) and len(lines) == 2, lines
    assert served[0][:2] == ("198.18.0.1", 0)
    assert (served[0][2] is None) == (command == "ping")  # perf raises the message size; ping keeps defaults

    async def refuse(handler: object, host: str, port: int, *, options: object = None) -> FakeServer:
        raise rdmaio.AddressError("address in use", errno=errno.EADDRINUSE)

    monkeypatch.setattr(rdmaio, "serve", refuse)
    out, err = io.StringIO(), io.StringIO()
    assert run_server("198.18.0.1", 7471, out, err) == 2
    assert out.getvalue() == ""
    assert err.getvalue().startswith(f"rdmaio {command} --server: cannot listen: 198.18.0.1 port 7471: "), err
