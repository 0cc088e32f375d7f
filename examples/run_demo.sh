#!/usr/bin/env bash
# The README's demo, run inside the test host: `rdmaio doctor`, echo server + client on asyncio and uvloop,
# the asyncio-streams and anyio (trio) examples, the one-sided KV store, key scope per connection, zero-copy large messages,
# many connections on one shared receive queue,
# `rdmaio ping` against `ping --server`, then a short
# benchmark table (the harness in bench/, run from the checkout: cd'ed into below). Exits non-zero if any
# step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ADDR=${RDMAIO_TEST_ADDR:-198.18.0.1}

run_echo() {
    local port=$1; shift
    "$PY" examples/echo_server.py "$ADDR" "$port" "$@" > ".testhost/echo_server_$port.log" 2>&1 &
    local server=$!
    for _ in $(seq 1 200); do
        grep -q "listening" ".testhost/echo_server_$port.log" 2>/dev/null && break
        kill -0 "$server" 2>/dev/null || { cat ".testhost/echo_server_$port.log"; return 1; }
        sleep 0.1
    done
    local rc=0
    "$PY" examples/echo_client.py "$ADDR" "$port" "$@" || rc=$?
    kill -TERM "$server"
    wait "$server" || rc=$?
    cat ".testhost/echo_server_$port.log"
    return $rc
}

mkdir -p .testhost
echo "== rdmaio doctor =="
"$PY" -m rdmaio doctor
echo "== echo on asyncio =="
run_echo 7471
echo "== echo on uvloop =="
run_echo 7472 --uvloop
echo "== asyncio streams echo over RDMA =="
"$PY" examples/streams_echo.py --transport rdma --host "$ADDR"
echo "== anyio echo over RDMA on trio =="
"$PY" examples/anyio_echo.py --transport rdma --host "$ADDR" --backend trio
echo "== one-sided key-value store: compare_swap / fetch_add / rdma_write puts, rdma_read gets, batched gets (rdma_read_many + fetch_add_many) =="
"$PY" examples/onesided_kv.py "$ADDR" --clients 4
echo "== key scope: a key exported to client A is refused by the NIC on client B's connection (type 2 memory windows) =="
"$PY" examples/key_scope.py "$ADDR"
echo "== capabilities: the framing and path a connection uses, RDMA WRITE/READ, fetch_add (atomics on rxe) =="
"$PY" examples/capabilities.py "$ADDR"
echo "== the same with the header framing forced (what iWARP devices, which have no immediate data, use) =="
"$PY" examples/capabilities.py "$ADDR" --framing header --uvloop
echo "== zero-copy: large messages by rendezvous (RDMA READ into the receiver's buffer), SHA-256 checked =="
"$PY" examples/zerocopy_transfer.py "$ADDR" --sizes 64K,1M,16M
echo "== shared receive queue: 20 connections' echoes on one SRQ, credits lent from what it holds =="
"$PY" examples/shared_receive_queue.py "$ADDR" --clients 20 --messages 100
echo "== rdmaio ping -v: the path record (device, transport, GIDs, MTU, credits, features), then 5 round trips =="
"$PY" -m rdmaio ping --server "$ADDR" 7479 > .testhost/ping_server.log 2>&1 &
ping_server=$!
# Wait for its "listening" line (a fixed sleep is not enough in the emulated VM, where a Python process
# takes seconds to start).
for _ in $(seq 1 600); do
    grep -q "listening" .testhost/ping_server.log 2>/dev/null && break
    kill -0 "$ping_server" 2>/dev/null || { cat .testhost/ping_server.log; exit 1; }
    sleep 0.1
done
"$PY" -m rdmaio ping -v -c 5 -i 0.2 "$ADDR" 7479 || { cat .testhost/ping_server.log; kill "$ping_server"; exit 1; }
kill -INT "$ping_server"; wait "$ping_server" || true
echo "== the Python path of one small message: files and calls of one send (to its post) and one recv =="
"$PY" tools/trace_path.py
echo "== benchmark (quick) =="
"$PY" -m bench --quick --sizes 64,64K,1M --json reports/bench-demo.json
echo "== one-sided benchmark (quick): fetch_add per call and in fetch_add_many batches against ib_atomic_bw, the READ round trip against ib_read_lat =="
"$PY" -m bench --quick --only fetch_add,fetch_add_many,read_lat \
    --contenders rdmaio-asyncio,ib_atomic_bw,ib_read_lat --json reports/bench-demo-onesided.json
