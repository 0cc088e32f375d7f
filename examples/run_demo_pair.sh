#!/usr/bin/env bash
# The demo's two-node part, run inside the test host's pair topology (two rxe devices on a veth pair: node A
# 198.18.0.1, node B 198.18.0.2), as a user runs it on two hosts: `rdmaio perf --server` on node B, then from
# node A `rdmaio doctor --peer` (route, GIDs, MTU, handshake, echo, READ, throughput: every check against
# the live server) and `rdmaio perf` in every mode, whose first lines are the path record (which device,
# transport, GIDs and MTU carry the connection). Last, a program reads the same path record and the
# process's metrics snapshot. Exits non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
A=198.18.0.1
B=198.18.0.2
PORT=7472

mkdir -p .testhost
"$PY" -m rdmaio perf --server "$B" "$PORT" > .testhost/perf_server.log 2>&1 &
server=$!
trap 'kill -INT "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    grep -q "listening" .testhost/perf_server.log 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || { cat .testhost/perf_server.log; exit 1; }
    sleep 0.1
done

echo "== rdmaio doctor --peer: node A checks the pair against the perf server on node B =="
"$PY" -m rdmaio doctor --peer "$B" "$PORT" --timeout 60
echo "== rdmaio perf from node A to node B: the path record, then every mode (1 s per size; the VM is emulated) =="
"$PY" -m rdmaio perf "$B" "$PORT" --bind "$A" --mode all --size 64,64K --time 1
echo "== from a program: the path record of a connection from node A to node B, and the metrics snapshot =="
"$PY" - "$A" "$B" <<'PYEOF'
import asyncio
import sys

import rdmaio
import rdmaio.metrics


async def echo(ep: rdmaio.Endpoint) -> None:
    while (message := await ep.recv()) is not None:
        await ep.send(message)


async def main(local: str, peer: str) -> None:
    server = await rdmaio.serve(echo, peer, 0)
    port = server.addresses[0][1]
    async with await rdmaio.connect(peer, port, local_addr=(local, 0)) as ep:
        print(ep.get_extra_info("rdma").describe())
        for size in (64, 4096, 1 << 20):
            await ep.send(b"x" * size)
            assert len(await ep.recv()) == size
    server.close()
    await server.wait_closed()
    snap = rdmaio.metrics.snapshot(hardware=False)
    print("metrics (non-zero samples):")
    for family in snap:
        for sample in family.samples:
            if sample.value:
                labels = ",".join(f"{k}={v}" for k, v in sample.labels.items())
                print(f"  {family.name}{{{labels}}} {sample.value:g}")


asyncio.run(main(sys.argv[1], sys.argv[2]))
PYEOF
kill -INT "$server"; wait "$server" || true
trap - EXIT
tail -n 3 .testhost/perf_server.log
