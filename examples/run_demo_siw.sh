#!/usr/bin/env bash
# The demo's Soft-iWARP part, run inside the test host with `--provider siw` (siw0: iWARP, no immediate
# data, no atomics, no memory windows): `rdmaio doctor` (transport, MAC-based GIDs, features), the
# capabilities example (the header framing, RDMA WRITE/READ on an export in the connection's own protection
# domain, fetch_add refused up front), the asyncio-streams and anyio examples, and zero-copy large messages.
# Exits non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ADDR=${RDMAIO_TEST_ADDR:-198.18.0.1}

echo "== rdmaio doctor on Soft-iWARP =="
"$PY" -m rdmaio doctor
echo "== what the connection uses of its devices: header framing, path, one-sided, atomics (asyncio, then uvloop) =="
"$PY" examples/capabilities.py "$ADDR"
"$PY" examples/capabilities.py "$ADDR" --uvloop
echo "== asyncio streams echo over iWARP =="
"$PY" examples/streams_echo.py --transport rdma --host "$ADDR"
echo "== anyio echo over iWARP on trio =="
"$PY" examples/anyio_echo.py --transport rdma --host "$ADDR" --backend trio
echo "== zero-copy large messages over iWARP (RDMA READ from a region of the connection's own PD), SHA-256 checked =="
"$PY" examples/zerocopy_transfer.py "$ADDR" --sizes 64K,1M,16M
