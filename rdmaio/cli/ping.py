"""``python -m rdmaio ping``: round-trip times over an rdmaio connection, with ping's habits.

``ping --server HOST [PORT]`` echoes every message it receives; ``ping HOST [PORT]`` sends ``-c COUNT``
messages of ``-s SIZE`` bytes, one every ``-i INTERVAL`` seconds, prints a line per reply and ends with
sent/received/loss and ``min/avg/max/p99``. Ctrl-C stops early and still prints the summary. ``-v`` first
prints the connection's path record (:meth:`rdmaio.PathInfo.describe`: device, transport, GIDs, MTU).

Exit status of the client: 0 when every message came back, 1 when some did not (or the connection was
lost), 2 when no connection could be made or the options are wrong. Like rping and ``ib_send_lat``,
each message waits for its reply before the next one is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import math
import signal
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    import rdmaio

__all__ = [
    "DEFAULT_PORT",
    "PingConfig",
    "PingPeer",
    "PingStats",
    "build_parser",
    "describe_error",
    "main",
    "make_payload",
    "parse_seq",
    "ping_loop",
    "serve_until_signalled",
]

DEFAULT_PORT = 7471
_HEADER = struct.Struct("!4sQ")  # magic, sequence number
_MAGIC = b"RPNG"
MIN_SIZE = _HEADER.size


class PingPeer(Protocol):
    """What the ping loop needs of an endpoint (an :class:`rdmaio.Endpoint`, or a fake in tests)."""

    async def send(self, data: bytes) -> None:
        """Send one message."""

    async def recv(self) -> bytes | None:
        """Receive one message; None at the end of the stream."""


@dataclass(frozen=True, slots=True)
class PingConfig:
    """The client's settings."""

    host: str
    port: int = DEFAULT_PORT
    count: int | None = None
    """Messages to send; None: until interrupted."""
    size: int = 64
    interval: float = 1.0
    timeout: float = 10.0
    """Seconds to wait for each reply before counting it lost."""
    verbose: bool = False
    """Print the connection's path record (:class:`rdmaio.PathInfo`) before pinging (``-v``)."""


@dataclass(slots=True)
class PingStats:
    """What has been sent and received so far, with the round-trip times in seconds."""

    sent: int = 0
    received: int = 0
    rtts: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def add(self, rtt: float) -> None:
        """Record one reply."""
        self.received += 1
        self.rtts.append(rtt)

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the round-trip times, nearest-rank method; 0.0 without replies."""
        if not self.rtts:
            return 0.0
        ordered = sorted(self.rtts)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def summary(self, target: str) -> str:
        """ping's closing lines: counts and loss, then ``rtt min/avg/max/p99``."""
        loss = 100.0 * (self.sent - self.received) / self.sent if self.sent else 0.0
        elapsed_ms = (time.perf_counter() - self.started) * 1000
        lines = [
            f"--- {target} rdmaio ping statistics ---",
            f"{self.sent} sent, {self.received} received, {loss:.0f}% loss, time {elapsed_ms:.0f} ms",
        ]
        if self.rtts:
            ms = [x * 1000 for x in (min(self.rtts), sum(self.rtts) / len(self.rtts), max(self.rtts))]
            p99 = self.percentile(0.99) * 1000
            lines.append(f"rtt min/avg/max/p99 = {ms[0]:.3f}/{ms[1]:.3f}/{ms[2]:.3f}/{p99:.3f} ms")
        return "\n".join(lines)


def make_payload(seq: int, size: int) -> bytes:
    """A message of ``size`` bytes carrying ``seq`` (and a pattern the reply must repeat)."""
    if size < MIN_SIZE:
        raise ValueError(f"size must be at least {MIN_SIZE} bytes")
    body = bytes((seq + i) & 0xFF for i in range(min(size - MIN_SIZE, 256)))
    reps = (size - MIN_SIZE) // 256 + 1 if body else 0
    return _HEADER.pack(_MAGIC, seq) + (body * reps)[: size - MIN_SIZE]


def parse_seq(message: bytes) -> int | None:
    """The sequence number of a ping message, or None if it is not one."""
    if len(message) < MIN_SIZE:
        return None
    magic, seq = _HEADER.unpack_from(message)
    return int(seq) if magic == _MAGIC else None


async def _await_reply(peer: PingPeer, seq: int, payload: bytes) -> bool:
    """Wait for the reply to ``seq``: True if it came back intact, False if it came back altered."""
    while True:
        reply = await peer.recv()
        if reply is None:
            raise ConnectionResetError("the server closed the connection")
        got = parse_seq(reply)
        if got is not None and got < seq:
            continue  # the late reply to a message already counted lost
        return reply == payload


async def ping_loop(
    peer: PingPeer,
    config: PingConfig,
    stats: PingStats,
    out: TextIO,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Send, wait for the echo, print a line; ``config.count`` times (forever when None)."""
    seq = 0
    while config.count is None or seq < config.count:
        seq += 1
        payload = make_payload(seq, config.size)
        start = clock()
        await peer.send(payload)
        stats.sent += 1
        try:
            intact = await asyncio.wait_for(_await_reply(peer, seq, payload), config.timeout)
        except TimeoutError:
            print(f"no reply for seq={seq} within {config.timeout:g} s", file=out, flush=True)
        else:
            rtt = clock() - start
            if intact:
                stats.add(rtt)
                print(
                    f"{config.size} bytes from {config.host} port {config.port}: seq={seq} "
                    f"time={rtt * 1000:.3f} ms",
                    file=out,
                    flush=True,
                )
            else:
                print(f"seq={seq}: the reply differs from what was sent", file=out, flush=True)
        if config.count is None or seq < config.count:
            await asyncio.sleep(max(0.0, start + config.interval - clock()))


def describe_error(exc: BaseException, host: str, port: int) -> str:
    """One line for an error that stopped ping, naming what failed and what to try."""
    import rdmaio

    where = f"{host} port {port}"
    if isinstance(exc, rdmaio.ConnectionRefusedError):
        return (
            f"{where}: connection refused: no rdmaio listener there "
            f"(start one with: python -m rdmaio ping --server {host} {port})"
        )
    if isinstance(exc, rdmaio.UnreachableError | rdmaio.AddressError):
        return f"{where}: unreachable: {exc} (is {host} the address of an RDMA device? rdmaio doctor)"
    if isinstance(exc, TimeoutError):
        return f"{where}: no answer: {exc}"
    if isinstance(exc, rdmaio.DeviceError) or getattr(exc, "errno", None) == errno.ENODEV:
        return f"no usable RDMA device: {exc} (python -m rdmaio doctor tells why)"
    if isinstance(exc, ConnectionError):
        return f"{where}: connection lost: {exc}"
    return f"{where}: {type(exc).__name__}: {exc}"


def on_signals(callback: Callable[[], object]) -> Callable[[], None]:
    """Call ``callback`` on SIGINT/SIGTERM while the loop runs; returns the undo."""
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, callback)

    def undo() -> None:
        for sig in signals:
            loop.remove_signal_handler(sig)

    return undo


async def serve_until_signalled(
    command: str,
    handler: Callable[[rdmaio.Endpoint], Awaitable[None]],
    host: str,
    port: int,
    options: rdmaio.Options | None,
    out: TextIO,
    err: TextIO,
) -> bool:
    """Serve ``handler`` on ``host``:``port`` until SIGINT/SIGTERM: the server side of ``rdmaio COMMAND``.

    Prints ``rdmaio COMMAND server listening on ADDR port PORT`` to ``out`` once the listener is up (scripts
    and tests wait for that line) and returns True after a signal closed the server. When the listener
    cannot be made, prints ``rdmaio COMMAND --server: cannot listen: ...`` to ``err`` and returns False.
    """
    import rdmaio

    try:
        server = await rdmaio.serve(handler, host, port, options=options)
    except (OSError, rdmaio.RdmaError) as exc:
        print(
            f"rdmaio {command} --server: cannot listen: {describe_error(exc, host, port)}",
            file=err,
            flush=True,
        )
        return False
    stop = asyncio.Event()
    undo = on_signals(stop.set)
    try:
        async with server:
            addr, bound = server.addresses[0] if server.addresses else (host, port)
            print(f"rdmaio {command} server listening on {addr} port {bound}", file=out, flush=True)
            await stop.wait()
    finally:
        undo()
    return True


async def run_client(config: PingConfig, out: TextIO, err: TextIO) -> int:
    """Connect, ping until done or interrupted, print the summary; returns the exit status."""
    import rdmaio

    target = f"{config.host} port {config.port}"
    try:
        ep = await rdmaio.connect(config.host, config.port, timeout=max(config.timeout, 1.0))
    except (OSError, rdmaio.RdmaError) as exc:
        print(f"rdmaio ping: {describe_error(exc, config.host, config.port)}", file=err, flush=True)
        return 2
    device = ep.get_extra_info("device", "?")
    print(f"PING {target} over {device}: {config.size} bytes per message", file=out, flush=True)
    if config.verbose:
        path = ep.get_extra_info("rdma")
        if path is not None:
            print(path.describe(), file=out, flush=True)
    stats = PingStats()
    task = asyncio.current_task()
    assert task is not None
    undo = on_signals(task.cancel)
    lost_connection = False
    try:
        async with ep:
            await ping_loop(ep, config, stats, out)
    except asyncio.CancelledError:
        task.uncancel()  # Ctrl-C: stop pinging, still print the summary
    except (OSError, rdmaio.RdmaError) as exc:
        lost_connection = True
        print(f"rdmaio ping: {describe_error(exc, config.host, config.port)}", file=err, flush=True)
    finally:
        undo()
    print(stats.summary(target), file=out, flush=True)
    return 0 if stats.sent and stats.received == stats.sent and not lost_connection else 1


async def run_server(host: str, port: int, out: TextIO, err: TextIO) -> int:
    """Echo every message on every connection until SIGINT/SIGTERM; returns the exit status.

    Doctor's probes (``rdmaio doctor --peer``) are answered by :class:`rdmaio.cli.peer.ProbeResponder`.
    """
    import rdmaio
    from rdmaio.cli.peer import ProbeResponder

    async def echo(ep: rdmaio.Endpoint) -> None:
        peername = ep.get_extra_info("peername")
        peer = f"{peername[0]} port {peername[1]}" if isinstance(peername, tuple) else str(peername)
        print(f"connection from {peer}", file=out, flush=True)
        count = 0
        # `rdmaio doctor --peer` probes: answered (this side's path, a key to READ) instead of echoed.
        probes = ProbeResponder(ep)
        try:
            async with ep:
                while (msg := await ep.recv()) is not None:
                    if not await probes.answer(msg):
                        await ep.send(msg)
                    count += 1
        except (OSError, rdmaio.RdmaError) as exc:
            print(f"{peer}: {type(exc).__name__}: {exc}", file=out, flush=True)
        print(f"{peer}: closed after {count} messages", file=out, flush=True)

    if not await serve_until_signalled("ping", echo, host, port, None, out, err):
        return 2
    print("rdmaio ping server stopped", file=out, flush=True)
    return 0


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``ping``."""
    parser = argparse.ArgumentParser(
        prog="rdmaio ping",
        description="Round-trip times over an rdmaio connection (client), or answer them (--server).",
    )
    parser.add_argument("host", metavar="HOST", help="address of the server's RDMA interface")
    parser.add_argument("port", metavar="PORT", nargs="?", type=int, default=DEFAULT_PORT)
    parser.add_argument("--server", action="store_true", help="answer pings on HOST PORT")
    parser.add_argument("-c", dest="count", type=_positive(int), metavar="COUNT", help="stop after COUNT")
    parser.add_argument("-s", dest="size", type=int, default=64, metavar="SIZE", help="message size (64)")
    parser.add_argument(
        "-i", dest="interval", type=_positive(float), default=1.0, metavar="INTERVAL", help="seconds (1)"
    )
    parser.add_argument(
        "-W", dest="timeout", type=_positive(float), default=10.0, metavar="TIMEOUT", help="reply wait (10)"
    )
    parser.add_argument(
        "-v",
        dest="verbose",
        action="store_true",
        help="print the connection's path: device, transport, GIDs, MTU, credits, features",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ping (or the server); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.server:
        return asyncio.run(run_server(args.host, args.port, sys.stdout, sys.stderr))
    if not MIN_SIZE <= args.size <= 64 * 1024 * 1024:
        parser.error(f"-s SIZE must be between {MIN_SIZE} and {64 * 1024 * 1024} bytes")
    count = int(args.count) if args.count else None
    config = PingConfig(args.host, args.port, count, args.size, args.interval, args.timeout, args.verbose)
    return asyncio.run(run_client(config, sys.stdout, sys.stderr))
