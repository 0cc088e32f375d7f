"""Port down/up (``ip link set veth1 down``: both veth ends lose carrier, so rxe0 and rxe1 both report
``IBV_EVENT_PORT_ERR``). The event reaches every endpoint on the port, which probes its peer at once:
one that stays down fails every pending call within the retry budget instead of the (longer) keepalive
bound. A port that comes back within the budget should cost nothing, but the test host's pair topology
does not recover its connectivity after a link flap yet (the flap test is in the long run, marked xfail).
Both tests run last (this module sorts last): a link taken down leaves the pair unusable afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from netfault import ECHO_SERVER, Pair, peer, set_link, wait_ready

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
            ep = await rdmaio.connect(
                pair.b.addr, port, local_addr=(pair.a.addr, 0), options=opts, timeout=30
            )
            await ep.send(b"before")
            assert await ep.recv() == b"before"
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
    reason="the pair topology loses connectivity after a link flap: after `ip link set veth1 up` and "
    "re-applying the routing, new connections still time out (seen in the VM; not yet understood)",
    strict=False,
)
@pytest.mark.timeout(180)
def test_port_flap_within_the_retry_budget_is_survived(pair: Pair) -> None:
    opts = rdmaio.Options(ack_timeout=18, retry_count=7)  # 8 x 1.07 s here; the server: 8 x 0.54 s
    proc = peer(ECHO_SERVER, pair.b.addr)
    try:
        port = int(wait_ready(proc).split()[1])

        async def main() -> dict[str, float]:
            ep = await rdmaio.connect(
                pair.b.addr, port, local_addr=(pair.a.addr, 0), options=opts, timeout=30
            )
            await ep.send(b"before")
            assert await ep.recv() == b"before"
            pending = asyncio.create_task(ep.recv())
            set_link(pair.b.netdev, False)
            await asyncio.sleep(1.0)
            set_link(pair.b.netdev, True)
            await ep.send(b"after the flap")
            assert await asyncio.wait_for(pending, 60) == b"after the flap"
            stats = ep.statistics()
            await ep.aclose()
            return stats

        stats = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
    assert stats["port_errors"] >= 1, "IBV_EVENT_PORT_ERR did not reach the endpoint"
    assert stats["keepalive_probes"] >= 1
