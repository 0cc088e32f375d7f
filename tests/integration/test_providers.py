"""The device under test as its provider makes it (rxe, or siw with ``--provider siw``): its transport and
features as doctor reports them, a connect refused by a port without a listener (iWARP refuses inside
``rdma_connect``, RoCE with a later REJECTED event: both are ConnectionRefusedError), and the provider's
own errno on a refused work request."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loops import Runner, arun  # arun is a fixture used by name
from test_verbs import Side, connect_pair

import rdmaio
from rdmaio import verbs
from rdmaio.cli.system import System
from rdmaio.errors import VerbsError

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120.0
NO_LISTENER_PORT = 7497

#: What doctor's features check must report for each provider of the test host.
EXPECTED_FEATURES = {
    "rxe": {"transport": "RoCE v2", "immediate_data": True, "atomics": True, "max_sge_rd": 32},
    "siw": {"transport": "iWARP", "immediate_data": False, "atomics": False, "max_mw": 0, "max_sge_rd": 1},
}


def test_device_transport_is_the_providers(provider: str) -> None:
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    (found,) = [d for d in System().sysfs_devices() if d.name == device]
    transports = {p.transport for p in found.ports}
    if provider == "siw":
        assert found.node_type == "RNIC" and transports == {"iWARP"}
        assert not any(d.name.startswith("rxe") for d in System().sysfs_devices())  # rdma_cm would pick rxe
    elif provider == "rxe":
        assert transports <= {"RoCE v2", "RoCE v1/v2"}


def test_doctor_device_checks_pass_and_features_match_the_provider(provider: str) -> None:
    """The device checks of doctor pass on the provider (before: ``FAIL gids`` on siw0, "RoCE v2 IPv4
    none"), and its features are what the provider offers."""
    done = subprocess.run(
        [sys.executable, "-m", "rdmaio", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    for name in ("devices", "verbs", "gids", "features", "mtu"):
        assert checks[name]["verdict"] == "ok", checks[name]
        assert checks[name]["fix"] is None
    device = os.environ.get("RDMAIO_TEST_DEVICE", "rxe0")
    features = checks["features"]["data"][device]
    for key, value in EXPECTED_FEATURES.get(provider, {}).items():
        assert features[key] == value, (key, features)


def test_connect_without_listener_is_connection_refused(arun: Runner[None], rdma_addr: str) -> None:
    """Before, on siw: ``VerbsError: rdma_connect() [ECONNREFUSED]``, not a ConnectionRefusedError."""

    async def main() -> None:
        for _ in range(2):  # and the id was released: a second attempt is refused the same way
            with pytest.raises(rdmaio.ConnectionRefusedError) as info:
                await asyncio.wait_for(rdmaio.connect(rdma_addr, NO_LISTENER_PORT), TIMEOUT)
            assert info.value.errno == errno.ECONNREFUSED
            assert info.value.call == "rdma_connect"
            assert f"{rdma_addr} port {NO_LISTENER_PORT}" in str(info.value)

    arun(main())


def _post_one(side: Side, opcode: int, flags: int, length: int) -> None:
    s = side.qp.send_array[0]
    s.wr_id = 1
    s.addr = side.send_mr.addr
    s.length = length
    s.lkey = side.send_mr.lkey
    s.imm_data = 7
    s.opcode = opcode
    s.send_flags = flags
    side.qp.post_sends(1)


@pytest.mark.provider("siw")
def test_send_with_immediate_on_siw_carries_siws_errno(rdma_addr: str) -> None:
    """libsiw refuses SEND_WITH_IMM with EINVAL: the error says EINVAL (the issue saw EIO)."""
    channel, listener, client, server = connect_pair(rdma_addr)
    try:
        with pytest.raises(VerbsError) as info:
            _post_one(client, verbs.lib.IBV_WR_SEND_WITH_IMM, verbs.lib.IBV_SEND_SIGNALED, 16)
        assert info.value.errno == errno.EINVAL, info.value
        assert info.value.call == "ibv_post_send"
        # the QP is still usable: a plain SEND goes through
        _post_one(client, verbs.lib.IBV_WR_SEND, verbs.lib.IBV_SEND_SIGNALED, 16)
    finally:
        client.close()
        server.close()
        listener.close()
        channel.close()
