"""Probe what the RDMA device supports for one-sided operations (run in the test host).

Prints the device's atomic capability, READ/atomic depths, memory-window support (by allocating a type 1
and a type 2 window) and the remote access a QP connected by rdmaio really has; then tries a type 2 window
for real (``probe_bind``): the exporter binds it over part of an MR registered with MW_BIND
(``IBV_WR_BIND_MW`` on its QP), the importer READs through the window's rkey (inside the window, then
outside it on a second connection), and the exporter invalidates it (``IBV_WR_LOCAL_INV``) and the
importer READs once more (that must fail). Each expected failure costs a connection (a remote access
error moves the importer's QP to the error state), so each step has its own.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from typing import Any

import rdmaio
from rdmaio import verbs
from rdmaio._ffi import ffi, lib
from rdmaio.core.onesided import ACCESS_READ, WR_KIND_ONESIDED, RemoteKey

_PROBE_INDEX = 0xFFFF_FF00  # an op index the engine never hands out (it counts up from 1)


async def main(addr: str) -> None:
    async def handler(ep: rdmaio.Endpoint) -> None:
        async with ep:
            await ep.recv()

    server = await rdmaio.serve(handler, addr, 0)
    port = server.addresses[0][1]
    async with server:
        ep = await rdmaio.connect(addr, port, timeout=30)
        tr = ep._conn.transport
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


async def _pair(addr: str) -> tuple[Any, rdmaio.Endpoint, rdmaio.Endpoint]:
    accepted: asyncio.Queue[rdmaio.Endpoint] = asyncio.Queue()

    async def handler(ep: rdmaio.Endpoint) -> None:
        await accepted.put(ep)
        await ep.wait_closed()

    server = await rdmaio.serve(handler, addr, 0)
    importer = await rdmaio.connect(addr, server.addresses[0][1], timeout=30)
    exporter = await asyncio.wait_for(accepted.get(), 30)
    return server, exporter, importer


async def _post_and_wait(ep: rdmaio.Endpoint, post: Any) -> str:
    """Run ``post(wr_id)`` (a C probe call) and wait for its completion on the shared CQ; its status."""
    engine = ep._conn.onesided
    wr_id = verbs.make_wr_id(WR_KIND_ONESIDED, ep._conn.transport.tag or 0, _PROBE_INDEX)
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    original = engine.on_completion

    def spy(got: int, status: int, vendor_err: int = 0) -> None:
        if got == wr_id and not done.done():
            done.set_result("success" if status == 0 else verbs.wc_status_str(status))
        else:
            original(got, status, vendor_err)

    engine.on_completion = spy  # type: ignore[method-assign]
    try:
        rc = post(wr_id)
        if rc != 0:
            return f"post failed: errno {-rc}"
        return await asyncio.wait_for(done, 30)
    except TimeoutError:
        return "no completion within 30 s"
    finally:
        engine.on_completion = original  # type: ignore[method-assign]


async def _bind(exporter: rdmaio.Endpoint, buf: bytearray, offset: int, length: int) -> tuple[str, Any, int]:
    """Register ``buf`` with MW_BIND and bind a type 2 window over ``buf[offset:offset+length]``."""
    pd = exporter._conn.transport.pd._ptr
    cbuf = ffi.from_buffer(buf, require_writable=True)
    access = lib.IBV_ACCESS_LOCAL_WRITE | lib.IBV_ACCESS_REMOTE_READ | lib.IBV_ACCESS_MW_BIND
    mr = lib.ibv_reg_mr(pd, cbuf, len(buf), access)
    if mr == ffi.NULL:
        return f"ibv_reg_mr with MW_BIND failed: errno {ffi.errno}", None, 0
    out, rkey = ffi.new("struct ibv_mw **"), ffi.new("uint32_t *")
    base = int(ffi.cast("uintptr_t", cbuf)) + offset
    status = await _post_and_wait(
        exporter,
        lambda wr_id: lib.rdmaio_probe_bind_mw(
            exporter._conn.transport.qp._ptr,
            pd,
            mr,
            base,
            length,
            lib.IBV_ACCESS_REMOTE_READ,
            wr_id,
            out,
            rkey,
        ),
    )
    exporter._probe_keep = (cbuf, mr, out)  # type: ignore[attr-defined]  # alive for the probe's length
    return status, out[0], int(rkey[0])


async def _read_via(importer: rdmaio.Endpoint, addr: int, rkey: int, length: int) -> str:
    key = RemoteKey(addr, rkey, length, ACCESS_READ, secrets.randbits(64))
    try:
        data = await asyncio.wait_for(importer.rdma_read(key, 0, length), 30)
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {exc}"
    runs = sorted({f"{b:#04x} x {data.count(b)}" for b in data})
    return f"ok ({len(data)} bytes: {', '.join(runs)})"


async def probe_bind(addr: str) -> None:
    """Type 2 memory windows for real: bind, READ inside, READ outside, invalidate, READ again."""
    # 0x11 before the window, 0xab in it, 0xcd after it: what a READ returns shows where it read.
    buf = bytearray(b"\x11" * 4096 + b"\xab" * 1024 + b"\xcd" * 3072)
    window = (4096, 1024)  # offset, length of the window inside the 8 KiB MR
    for step in ("inside", "straddling", "before", "after LOCAL_INV"):
        server, exporter, importer = await _pair(addr)
        try:
            status, mw, rkey = await _bind(exporter, buf, *window)
            print(f"bind type 2 window ({step} step): {status}, rkey {rkey:#x}")
            if status != "success":
                return
            base = int(ffi.cast("uintptr_t", exporter._probe_keep[0])) + window[0]  # type: ignore[attr-defined]
            if step == "inside":
                print("  READ inside the window:", await _read_via(importer, base, rkey, window[1]))
            elif step == "straddling":
                print("  READ across the window's end:", await _read_via(importer, base + 512, rkey, 1024))
            elif step == "before":
                print("  READ before the window:", await _read_via(importer, base - 4096, rkey, 1024))
            else:
                qp, inv_rkey = exporter._conn.transport.qp._ptr, rkey
                inv = await _post_and_wait(
                    exporter,
                    lambda wr_id: lib.rdmaio_probe_local_inv(qp, inv_rkey, wr_id),  # noqa: B023
                )
                print("  LOCAL_INV:", inv)
                print("  READ after LOCAL_INV:", await _read_via(importer, base, rkey, window[1]))
            if mw is not None:
                print("  ibv_dealloc_mw:", lib.rdmaio_probe_dealloc_mw(mw))
        finally:
            importer.abort()
            exporter.abort()
            server.close()
            _cbuf, mr, _out = getattr(exporter, "_probe_keep", (None, None, None))
            if mr is not None:
                lib.ibv_dereg_mr(mr)


if __name__ == "__main__":
    address = sys.argv[1] if len(sys.argv) > 1 else "198.18.0.1"
    asyncio.run(main(address))
    asyncio.run(probe_bind(address))
