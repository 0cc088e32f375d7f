"""Device removal: ``rdma link delete rxe1`` while traffic runs on both devices.

One process holds everything, so that the leak and blocking checks see both sides: a server listening on
the wildcard address (so on both devices), a client on node A talking to it through rxe1 (node B's
address) and a client on node B talking to it through rxe0 (node A's address), each exchanging 64 KiB
echoes. Deleting rxe1 must

- fail every endpoint of rxe1 at once (rdma_cm's DEVICE_REMOVAL; the reactor fails the rest of the
  device's endpoints and closes its Domain), and their peers on rxe0 within the keepalive bound, each
  with a typed ``ConnectionResetError``;
- let ``rdma link delete`` finish: the kernel waits until the process has closed every resource and the
  device context (librdmacm closes it once the reactor releases the device), so its return shows that
  nothing was left on the device;
- never block the event loop (a ticker measures its largest lag);
- leave the server serving: once rxe1 is added again, new connections work in both directions, the one
  on the new rxe1 in a fresh Domain;
- leak no fd, QP, CQ, MR or cm id once everything is closed.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from netfault import Pair, provider
from rdma_state import open_fds, rdma_resources

import rdmaio
from rdmaio import verbs
from rdmaio.core.keepalive import detection_bound
from rdmaio.core.reactor import Reactor

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
VM_SLACK = 10.0  # seconds of timer and scheduling lag the emulated 1-vCPU VM may add
OPTS = rdmaio.Options(keepalive_interval=2.0, ack_timeout=15, retry_count=3)
BOUND = detection_bound(2.0, 15, 3)  # 4.5 s: the peers of the removed device's endpoints
LEAK_KINDS = ("qp", "cq", "mr", "cm_id")


async def _run(
    *args: str, limit: float = 120, diagnose: Callable[[int], str] | None = None
) -> tuple[int, float]:
    """Run a command without blocking the loop; return its exit status and how long it took. After
    ``limit`` seconds fail with what ``diagnose(pid)`` says about why it is still running."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*args)
    try:
        rc = await asyncio.wait_for(asyncio.shield(proc.wait()), limit)
    except TimeoutError:
        why = diagnose(proc.pid) if diagnose else ""
        raise AssertionError(f"{' '.join(args)} still running after {limit:.0f} s\n{why}") from None
    return rc, time.monotonic() - started


def _why_blocked(reactor: Reactor) -> Callable[[int], str]:
    """What a hanging ``rdma link delete`` waits for: its kernel stack, our uverbs fds, librdmacm's
    devices and the reactor's view."""

    def diagnose(pid: int) -> str:
        lines = []
        try:
            lines.append("kernel stack of rdma:\n" + Path(f"/proc/{pid}/stack").read_text())
        except OSError as exc:
            lines.append(f"no kernel stack: {exc}")
        fds = Path("/proc/self/fd")
        for fd in sorted(fds.iterdir(), key=lambda p: int(p.name)):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if "infiniband" in target or "uverbs" in target or "rdma_cm" in target:
                lines.append(f"fd {fd.name} -> {target}")
        lines.append(f"librdmacm lists: {sorted(verbs.cm_device_handles())}")
        lines.append(f"reactor: removed {reactor._removed}, domains {reactor._domains}")
        for key, other in list(Reactor._by_loop.items()):
            lines.append(f"reactor of {key!r}: domains {other._domains}, devices {list(other._devices)}")
        for cm_id in list(reactor._ids.values()):
            device = None if cm_id.closed else cm_id.device()
            lines.append(f"cm id {cm_id.handle:#x} closed={cm_id.closed} device={device and device.name}")
        return "\n".join(lines)

    return diagnose


def _port_active(device: str) -> bool:
    try:
        return "ACTIVE" in Path(f"/sys/class/infiniband/{device}/ports/1/state").read_text()
    except OSError:
        return False


async def _wait_active(device: str) -> None:
    for _ in range(300):
        if _port_active(device):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{device} did not come back ACTIVE")


async def _echo_once(ep: rdmaio.Endpoint, payload: bytes) -> None:
    await ep.send(payload)
    assert await ep.recv() == payload


async def _warm_up(pair: Pair) -> None:
    """Open both devices' contexts in librdmacm (they stay open), so the fd baseline includes them."""
    server = await rdmaio.serve(_echo_handler([]), "0.0.0.0", 0, options=OPTS)
    port = server.addresses[0][1]
    for dst, src in ((pair.b.addr, pair.a.addr), (pair.a.addr, pair.b.addr)):
        ep = await rdmaio.connect(dst, port, local_addr=(src, 0), options=OPTS, timeout=30)
        await _echo_once(ep, b"warm")
        await ep.aclose()
    server.close()
    await server.wait_closed()


def _echo_handler(failures: list[tuple[str, BaseException | None, float]]) -> Any:
    """An echo handler that records how each connection ended (None: EOF)."""

    async def echo(ep: rdmaio.Endpoint) -> None:
        name = f"server on {ep.get_extra_info('device')}"
        try:
            while (message := await ep.recv()) is not None:
                await ep.send(message)
        except Exception as exc:
            failures.append((name, exc, time.monotonic()))
        else:
            failures.append((name, None, time.monotonic()))

    return echo


def _kind(exc: BaseException | None) -> str:
    """``EOF``, ``typed reset`` (rdmaio's ConnectionResetError), ``typed timeout``, or the type's name."""
    if exc is None:
        return "EOF"
    if isinstance(exc, rdmaio.RdmaError) and isinstance(exc, ConnectionResetError):
        return "typed reset"
    if isinstance(exc, rdmaio.TimeoutError):
        return "typed timeout"
    return repr(exc)


async def _removal(pair: Pair) -> dict[str, Any]:
    server_failures: list[tuple[str, BaseException | None, float]] = []
    server = await rdmaio.serve(_echo_handler(server_failures), "0.0.0.0", 0, options=OPTS)
    port = server.addresses[0][1]
    # a: client on rxe0, served on rxe1; b: client on rxe1, served on rxe0.
    ep_a = await rdmaio.connect(pair.b.addr, port, local_addr=(pair.a.addr, 0), options=OPTS, timeout=30)
    ep_b = await rdmaio.connect(pair.a.addr, port, local_addr=(pair.b.addr, 0), options=OPTS, timeout=30)
    assert ep_a.get_extra_info("device") == pair.a.device
    assert ep_b.get_extra_info("device") == pair.b.device
    reactor = Reactor.current()
    old_domain = ep_b._conn.transport.domain
    failures: dict[str, tuple[BaseException | None, float]] = {}
    rounds = dict.fromkeys(("a", "b"), 0)

    async def traffic(name: str, ep: rdmaio.Endpoint) -> None:
        block = os.urandom(65536)
        key = f"client {name} on {ep.get_extra_info('device')}"
        try:
            while True:
                await ep.send(block)
                echoed = await ep.recv()
                if echoed is None:
                    failures[key] = (None, time.monotonic())  # EOF: the peer disconnected
                    return
                assert echoed == block
                rounds[name] += 1
        except Exception as exc:
            failures[key] = (exc, time.monotonic())

    lag = [0.0]

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lag[0] = max(lag[0], time.monotonic() - before - 0.01)

    tick = asyncio.create_task(ticker())
    tasks = [asyncio.create_task(traffic("a", ep_a)), asyncio.create_task(traffic("b", ep_b))]
    await asyncio.sleep(1.0)
    assert all(rounds.values()) and not failures, (rounds, failures)
    removed_at = time.monotonic()
    delete = asyncio.create_task(
        _run("rdma", "link", "delete", pair.b.device, limit=90, diagnose=_why_blocked(reactor))
    )
    _done, pending = await asyncio.wait(tasks, timeout=BOUND + 60)
    assert not pending, f"clients still running {BOUND + 60:.0f} s after the removal: {failures}"
    for _ in range(int((BOUND + 60) / 0.1)):  # the server's two handlers
        if len(server_failures) >= 2:
            break
        await asyncio.sleep(0.1)
    delete_rc, delete_s = await delete
    removal_failures, server_failures[:] = list(server_failures), []
    tick.cancel()
    assert delete_rc == 0, f"rdma link delete {pair.b.device} failed ({delete_rc})"
    assert old_domain.closed and reactor.devices_removed == 1

    # The server keeps serving: on rxe0 at once, on rxe1 once it is back (a fresh Domain).
    add_rc, _ = await _run("rdma", "link", "add", pair.b.device, "type", provider(), "netdev", pair.b.netdev)
    assert add_rc == 0
    await _wait_active(pair.b.device)
    ep_c = await rdmaio.connect(pair.b.addr, port, local_addr=(pair.a.addr, 0), options=OPTS, timeout=30)
    ep_d = await rdmaio.connect(pair.a.addr, port, local_addr=(pair.b.addr, 0), options=OPTS, timeout=30)
    for ep in (ep_c, ep_d):
        await _echo_once(ep, os.urandom(100_000))
    assert ep_d._conn.transport.domain is not old_domain and not ep_d._conn.transport.domain.closed
    for ep in (ep_a, ep_b, ep_c, ep_d):
        await ep.aclose()
    server.close()
    await server.wait_closed()
    # The new connections' handlers ended at their clients' EOF.
    assert sorted((name, exc) for name, exc, _at in server_failures) == [
        (f"server on {pair.a.device}", None),
        (f"server on {pair.b.device}", None),
    ], server_failures
    for name, exc, at in removal_failures:
        assert name not in failures, name
        failures[name] = (exc, at)
    # Summaries, not the exceptions: their tracebacks would keep the loop (and its Domains) alive.
    return {
        "failures": {name: (_kind(exc), str(exc), at - removed_at) for name, (exc, at) in failures.items()},
        "delete_s": delete_s,
        "lag": lag[0],
    }


@pytest.mark.timeout(400)
def test_device_removal_fails_its_endpoints_and_the_server_keeps_serving(
    arun: Runner, pair: Pair, record_property: Callable[[str, object], None]
) -> None:
    arun(_warm_up(pair))
    gc.collect()
    fds, resources = open_fds(), rdma_resources()
    outcome = arun(_removal(pair))
    gc.collect()  # the loop and with it its reactor's Domains (closed when the loop is collected)
    leaked = {k: rdma_resources()[k] - resources[k] for k in LEAK_KINDS}
    fds_after = open_fds()
    failures: dict[str, tuple[str, str, float]] = outcome["failures"]
    print(
        f"rdma link delete returned after {outcome['delete_s']:.1f} s; largest loop lag "
        f"{outcome['lag']:.2f} s; how each endpoint ended (s after the delete began):",
        {name: (kind, message, round(after, 2)) for name, (kind, message, after) in failures.items()},
    )
    record_property("delete_s", round(outcome["delete_s"], 2))
    record_property("loop_lag_s", round(outcome["lag"], 2))
    for name, (kind, message, after) in failures.items():
        record_property(f"{name} ended_after_s".replace(" ", "_"), round(after, 2))
        record_property(f"{name} ended_with".replace(" ", "_"), f"{kind}: {message}")
        assert after <= BOUND + VM_SLACK, (name, after)
        if name.endswith(pair.b.device):  # the removed device's own endpoints: a typed error
            assert kind == "typed reset", (name, kind, message)
        else:  # their peers: a typed error (a disconnect, or the keepalive's), or EOF
            assert kind in ("typed reset", "typed timeout", "EOF"), (name, kind, message)
    assert set(failures) == {
        f"client a on {pair.a.device}",
        f"client b on {pair.b.device}",
        f"server on {pair.a.device}",
        f"server on {pair.b.device}",
    }
    assert outcome["lag"] < VM_SLACK, "the event loop was blocked"
    assert leaked == dict.fromkeys(LEAK_KINDS, 0), leaked
    assert fds_after == fds, (fds, fds_after)
