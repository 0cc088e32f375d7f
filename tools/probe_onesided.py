"""Probe what the RDMA device supports for one-sided operations (run in the test host).

Prints the device's atomic capability, READ/atomic depths, memory-window support (by allocating a type 1
and a type 2 window) and the remote access a QP connected by rdmaio really has.
"""

from __future__ import annotations

import asyncio
import sys

import rdmaio
from rdmaio._ffi import ffi, lib


async def main(addr: str) -> None:
    async def handler(ep: rdmaio.Endpoint) -> None:
        async with ep:
            await ep.recv()

    server = await rdmaio.serve(handler, addr, 0)
    port = server.addresses[0][1]
    async with server:
        ep = await rdmaio.connect(addr, port, timeout=30)
        tr = ep._transport
        caps = ffi.new("struct rdmaio_onesided_caps *")
        assert lib.rdmaio_query_onesided_caps(tr.device._ptr, caps) == 0
        flags = int(caps.device_cap_flags)
        atomic = {lib.IBV_ATOMIC_NONE: "NONE", lib.IBV_ATOMIC_HCA: "HCA", lib.IBV_ATOMIC_GLOB: "GLOB"}
        print("device", tr.device.name)
        print("atomic_cap", atomic.get(caps.atomic_cap, caps.atomic_cap))
        print("max_qp_rd_atom", caps.max_qp_rd_atom, "max_qp_init_rd_atom", caps.max_qp_init_rd_atom)
        print("max_mw", caps.max_mw)
        print("cap MEM_WINDOW", bool(flags & lib.IBV_DEVICE_MEM_WINDOW))
        print("cap MEM_WINDOW_TYPE_2A", bool(flags & lib.IBV_DEVICE_MEM_WINDOW_TYPE_2A))
        print("cap MEM_WINDOW_TYPE_2B", bool(flags & lib.IBV_DEVICE_MEM_WINDOW_TYPE_2B))
        for t in (1, 2):
            rc = lib.rdmaio_probe_mw(tr.pd._ptr, t)
            print(f"ibv_alloc_mw type {t}:", "ok" if rc == 0 else f"errno {-rc}")
        acc, rd, drd = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        assert lib.rdmaio_qp_access(tr.qp._ptr, acc, rd, drd) == 0
        names = {
            "LOCAL_WRITE": lib.IBV_ACCESS_LOCAL_WRITE,
            "REMOTE_WRITE": lib.IBV_ACCESS_REMOTE_WRITE,
            "REMOTE_READ": lib.IBV_ACCESS_REMOTE_READ,
            "REMOTE_ATOMIC": lib.IBV_ACCESS_REMOTE_ATOMIC,
        }
        print(
            "qp_access_flags",
            [n for n, v in names.items() if acc[0] & v],
            "max_rd_atomic",
            rd[0],
            "max_dest_rd_atomic",
            drd[0],
        )
        await ep.send(b"bye")
        await ep.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "198.18.0.1"))
