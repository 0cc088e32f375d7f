"""Port down/up (``ip link set veth1 down``: both veth ends lose carrier, so rxe0 and rxe1 both report
``IBV_EVENT_PORT_ERR``). The event reaches every endpoint on the port, which probes its peer at once:
one that stays down fails every pending call within the retry budget instead of the (longer) keepalive
bound. The flap test (down, 1 s, up; the pair's routing re-applied, see :func:`netfault.set_link`) wants
the event to reach the open endpoint and that connection to survive or fail typed; a new connection after
the flap does not work on rxe here (a strict xfail in the long run; docs/testhost.md says what was seen).
These tests run last (this module sorts last): a link taken down leaves the pair unable to connect
afterwards."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Callable

import pytest
from netfault import ECHO_SERVER, Pair, connected, peer, set_link, wait_ready

import rdmaio
from rdmaio.core.keepalive import ack_timeout_seconds, detection_bound

VM_SLACK = 10.0  # seconds of timer and scheduling lag the emulated 1-vCPU VM may add


@pytest.mark.timeout(180)
def test_port_down_fails_pending_calls_within_the_retry_budget(
    pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    opts = rdmaio.Options(ack_timeout=15, retry_count=3)  # budget 4 x 0.13 s; keepalive stays at 10 s
    budget = 4 * ack_timeout_seconds(15)
    keepalive_bound = detection_bound(10.0, 15, 3)
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> tuple[float, float]:
            ep = await connected(pair, port, opts, b"before")
            pending = asyncio.create_task(ep.recv())  # idle: nothing in flight to time out
            await asyncio.sleep(0.2)
            set_link(pair.b.netdev, False)
            down = time.monotonic()
            with pytest.raises(ConnectionResetError) as failed:
                await asyncio.wait_for(pending, 60)
            elapsed = time.monotonic() - down
            assert isinstance(failed.value, rdmaio.RdmaError)
            port_errors = ep.statistics()["port_errors"]
            await ep.aclose()
            return elapsed, port_errors

        elapsed, port_errors = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
    print(f"port down: idle recv() failed after {elapsed:.1f} s (budget {budget:.2f} s)")
    record_property("failed_after_s", round(elapsed, 2))
    assert port_errors == 1
    assert elapsed <= budget + VM_SLACK < keepalive_bound + VM_SLACK


@pytest.mark.long
@pytest.mark.xfail(
    reason="needs a pair on which no link went down with a connection open: after the port-down test above "
    "(same boot) rxe refuses new connections, so this test's connect times out; run it in its own boot "
    "(docs/testhost.md)",
    strict=False,
    raises=rdmaio.TimeoutError,
)
@pytest.mark.timeout(180)
def test_port_flap_reaches_the_endpoint_and_it_survives_or_fails_typed(
    pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    """A 1 s link flap, inside the retry budget: IBV_EVENT_PORT_ERR reaches the open endpoint, and the
    connection either carries on (an echo after the flap arrives) or fails with a typed error, within 60 s
    of the link coming back; what happened is recorded."""
    opts = rdmaio.Options(ack_timeout=18, retry_count=6)  # 7 x 1.07 s here; the server: 7 x 0.54 s
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> tuple[str, float, dict[str, float]]:
            ep = await connected(pair, port, opts, b"before")
            pending = asyncio.create_task(ep.recv())
            set_link(pair.b.netdev, False)
            await asyncio.sleep(1.0)
            set_link(pair.b.netdev, True)
            up = time.monotonic()
            try:
                await ep.send(b"after the flap")
                assert await asyncio.wait_for(pending, 60) == b"after the flap"
                existing = "survived"
            except ConnectionError as exc:
                assert isinstance(exc, rdmaio.RdmaError), repr(exc)
                existing = f"failed: {type(exc).__name__}: {exc}"
            except builtins.TimeoutError:
                raise AssertionError("the open connection neither recovered nor failed in 60 s") from None
            ended = time.monotonic() - up
            stats = ep.statistics()
            await ep.aclose()
            return existing, ended, stats

        existing, ended, stats = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
    print(f"port flap: the open connection {existing} ({ended:.1f} s after link up)")
    record_property("existing_connection", existing)
    record_property("ended_after_s", round(ended, 2))
    assert stats["port_errors"] >= 1, "IBV_EVENT_PORT_ERR did not reach the endpoint"


@pytest.mark.long
@pytest.mark.xfail(
    reason="rxe in the pair topology does not recover from a link flap: new connections after link up "
    "time out although routes, rules, GIDs, neighbours and both GSI QPs (RTS) look as before (rxe0's GSI "
    "sends the REQs, rxe1's sends nothing back); see docs/testhost.md",
    strict=True,
    raises=rdmaio.TimeoutError,
)
@pytest.mark.timeout(120)
def test_new_connections_after_a_port_flap(pair: Pair) -> None:
    """A connection is open across a 1 s flap; once the link is back it is aborted, and a new connection
    to the server (which stayed up) must work. Strict xfail: it records rxe's behaviour here (with no
    connection open across the flap a new one works), and fails (XPASS) the day the device recovers."""
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> None:
            old = await connected(pair, port, greeting=b"before")
            set_link(pair.b.netdev, False)
            await asyncio.sleep(1.0)
            set_link(pair.b.netdev, True)
            old.abort()
            ep = await connected(pair, port, greeting=b"new connection")
            await ep.aclose()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
