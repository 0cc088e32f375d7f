"""A serial one-sided call touches Python once: call budgets per operation on the fakes, and the C call
behind it (``rdmaio_onesided_post_poll`` / ``rdmaio_onesided_post_batch_poll`` in rdmaio/_ffi/onesided.c)
driven through a fake provider.

The budgets count ``call`` events (``sys.setprofile``) in rdmaio's own code (``rdmaio/`` outside
``rdmaio/testing/``) while one task calls serially on an engine over :func:`rdmaio.testing.fakes.onesided_rig`
(``tools/onesided_calls.py`` prints the same figures with CPU time). Before the serial path, a 64 B
``rdma_read`` completed at its post cost 18.4 such calls (fetch_add 20.5), one completed an iteration later
29 (32), and ``fetch_add_many`` of 64 offsets 100.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from ctest import build_and_run

import rdmaio
from rdmaio.core.onesided import ACCESS_ATOMIC, ACCESS_READ, RemoteKey
from rdmaio.testing.fakes import onesided_rig

Run = Callable[[Awaitable[Any]], Any]
N = 64  # a multiple of the at-post budget (16): every run yields to the loop the same number of times


def _call(rig: Any, case: str) -> Callable[[], Awaitable[Any]]:
    engine, key = rig.engine, rig.key
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "read": lambda: engine.read(key, 0, 64),
        "write": lambda: engine.write(key, 0, b"w" * 64),
        "fetch_add": lambda: engine.fetch_add(key, 8, 1),
        "compare_swap": lambda: engine.compare_swap(key, 8, 0, 1),
        "fetch_add_many": lambda: engine.fetch_add_many(key, range(0, 512, 8), 1),
    }
    return calls[case]


async def _count(case: str, *, at_post: bool, max_ops: int = 16) -> collections.Counter[str]:
    """rdmaio's own Python calls (by function) of ``N`` serial calls of ``case``."""
    rig = onesided_rig(max_ops=max_ops, complete_at_post=at_post)
    call = _call(rig, case)
    for _ in range(3):  # the first post registers staging and makes the task a known serial caller
        await call()
    counts: collections.Counter[str] = collections.Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename
        if event == "call" and "/rdmaio/" in path and "/rdmaio/testing/" not in path:
            counts[f"{Path(path).name}:{frame.f_code.co_name}"] += 1

    sys.setprofile(hook)
    try:
        for _ in range(N):
            await call()
    finally:
        sys.setprofile(None)
    assert rig.failures == [] and rig.engine.ops == {}
    return counts


@pytest.mark.parametrize("case", ["read", "write", "fetch_add", "compare_swap"])
def test_a_serial_call_completed_at_its_post_is_one_python_call(arun: Run, case: str) -> None:
    counts = arun(_count(case, at_post=True))
    # The call's coroutine, once per call, plus the yield to the loop every 16 calls completed at their
    # post in a row (the coroutine resumed, and the backend's sleep started and resumed).
    yields = N // 16
    assert counts == {f"operations.py:{case}": N + yields, "backend.py:sleep": 2 * yields}, counts


@pytest.mark.parametrize("case", ["read", "write", "fetch_add", "compare_swap"])
def test_a_serial_call_completed_later_costs_six_python_calls(arun: Run, case: str) -> None:
    counts = arun(_count(case, at_post=False))
    # Started and resumed; its op (one object) tracked and awaited in one coroutine; one completion.
    assert counts == {
        f"operations.py:{case}": 2 * N,
        "operations.py:_serial_rest": 2 * N,
        "operations.py:__init__": N,
        "operations.py:on_completion": N,
    }, counts


@pytest.mark.parametrize(("at_post", "max_ops", "budget"), [(True, 16, 11), (False, 16, 34), (True, 64, 8)])
def test_fetch_add_many_of_64_offsets_costs_a_few_python_calls_per_wave(
    arun: Run, at_post: bool, max_ops: int, budget: int
) -> None:
    counts = arun(_count("fetch_add_many", at_post=at_post, max_ops=max_ops))
    assert sum(counts.values()) <= budget * N, counts
    assert "operations.py:release" not in counts and "revoked.py:__contains__" not in counts, counts


def test_results_and_statistics_of_calls_completed_at_their_post(arun: Run) -> None:
    async def main() -> None:
        rig = onesided_rig(complete_at_post=True)
        engine, key = rig.engine, rig.key
        assert await engine.read(key, 0, 8) == bytes(8)  # the first: not yet known as a serial caller

        def nic(wr: dict[str, int]) -> int:  # the fake NIC writes what a READ or an atomic returns
            rdmaio._ffi.ffi.memmove(rdmaio._ffi.ffi.cast("void *", wr["local_addr"]), b"abcdefgh", 8)
            return rdmaio.verbs.POSTED_DONE

        rig.port.at_post = nic
        assert await engine.read(key, 16, 8) == b"abcdefgh"
        assert await engine.fetch_add(key, 8, 5) == int.from_bytes(b"abcdefgh", sys.byteorder)
        assert await engine.compare_swap(key, 8, 1, 2) == int.from_bytes(b"abcdefgh", sys.byteorder)
        await engine.write(key, 24, b"12345678")
        assert await engine.fetch_add_many(key, [0, 8]) == [int.from_bytes(b"abcdefgh", sys.byteorder)] * 2
        posted = rig.qp.posted
        assert [wr["remote_addr"] - key.addr for wr in posted[1:5]] == [16, 8, 8, 24]
        assert (posted[2]["compare_add"], posted[3]["compare_add"], posted[3]["swap"]) == (5, 1, 2)
        assert [wr["length"] for wr in posted[1:5]] == [8, 8, 8, 8]
        stats = engine.statistics()
        # 5 single requests (the first posted on its own, then 4 at their post) and one wave of 2
        assert (stats["rdma_ops_posted"], stats["rdma_doorbells"], stats["rdma_batches"]) == (7, 6, 1)
        assert stats["rdma_completed_at_post"] == 4 and stats["rdma_ops_pending"] == 0
        assert sorted(engine.operations._free_staging) == list(range(engine.max_ops))

    arun(main())


def test_every_check_still_applies_on_the_serial_path(arun: Run) -> None:
    """A known serial caller with a port: range, access, alignment, operands and revocation still raise
    before anything is posted, and nothing is posted after the connection failed."""

    async def main() -> None:
        rig = onesided_rig(complete_at_post=True)
        engine = rig.engine
        rw = RemoteKey(0x10000, 0x77, 64, ACCESS_READ | 2, 7)
        ro = RemoteKey(0x10000, 0x77, 64, ACCESS_READ, 8)
        at = RemoteKey(0x10004, 0x77, 64, ACCESS_ATOMIC, 9)
        await engine.read(rw, 0, 8)
        posted = len(rig.qp.posted)
        for bad in (
            engine.read(rw, 60, 8),
            engine.read(rw, -1, 1),
            engine.write(ro, 0, b"x"),
            engine.write(rw, 63, b"xy"),
            engine.fetch_add(rw, 0, 1),
            engine.fetch_add(at, 0, 1),
            engine.compare_swap(at, 2, 0, 1),
        ):
            with pytest.raises(rdmaio.RemoteAccessError):
                await bad
        for bad in (engine.fetch_add(at, 4, 2**64), engine.compare_swap(at, 4, -1, 0)):
            with pytest.raises(ValueError):
                await bad
        with pytest.raises(TypeError):
            await engine.read(rw, 0.0, 8)  # type: ignore[arg-type]
        engine.revoked_ids.add(7)
        with pytest.raises(rdmaio.RemoteKeyRevokedError):
            await engine.read(rw, 0, 8)
        with pytest.raises(rdmaio.RemoteKeyRevokedError):
            await engine.fetch_add_many(rw, [0])
        assert len(rig.qp.posted) == posted and engine.ops == {}
        engine.close(rdmaio.EndpointClosedError("gone"))
        with pytest.raises(rdmaio.EndpointClosedError):
            await engine.read(ro, 0, 8)
        assert len(rig.qp.posted) == posted

    arun(main())


def test_a_failed_post_on_the_serial_path_fails_the_call_and_the_connection(arun: Run) -> None:
    async def main() -> None:
        rig = onesided_rig(complete_at_post=True)
        await rig.engine.read(rig.key, 0, 8)
        rig.qp.fail_next = True
        with pytest.raises(rdmaio.VerbsError):
            await rig.engine.fetch_add(rig.key, 8, 1)
        assert len(rig.failures) == 1 and rig.engine.closed

    arun(main())


def test_a_cancelled_serial_call_keeps_its_staging_until_the_completion(arun: Run) -> None:
    async def main() -> None:
        rig = onesided_rig(complete_at_post=True)
        engine = rig.engine

        async def caller() -> bytes:
            await engine.read(rig.key, 0, 8)  # now a known serial caller
            rig.port.at_post = lambda wr: rdmaio.verbs.POSTED  # not completed at its post
            return await engine.read(rig.key, 0, 8)

        task = asyncio.ensure_future(caller())
        for _ in range(10):  # the first read completes an iteration after its post (not a serial one)
            await asyncio.sleep(0)
        assert rig.port.polls == 1 and not task.done()  # posted through the port, waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        free = len(engine.operations._free_staging)
        assert free == engine.max_ops - 1  # the NIC may still write into it
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        assert len(engine.operations._free_staging) == engine.max_ops and engine.ops == {}

    arun(main())


def test_a_record_the_poll_took_that_is_not_its_own_is_handed_on(arun: Run) -> None:
    """POSTED_OTHER: the op is tracked before the record goes to the dispatcher (which may complete it:
    its own failure); a dispatcher that keeps the record for later gets a poll scheduled."""

    async def main() -> None:
        rig = onesided_rig(complete_at_post=True)
        engine, port = rig.engine, rig.port

        def own_failure(result: int) -> bool:
            engine.on_completion(rig.qp.posted[-1]["wr_id"], int(rdmaio.verbs.WcStatus.REM_ACCESS_ERR))
            return True

        async def caller() -> bytes:
            await engine.read(rig.key, 0, 8)  # now a known serial caller
            port.at_post = lambda wr: rdmaio.verbs.POSTED_OTHER
            port.after = own_failure
            with pytest.raises(rdmaio.RemoteAccessRefusedError):
                await engine.read(rig.key, 0, 8)
            assert engine.ops == {} and engine.operations.in_flight == 0
            port.after = lambda result: False  # kept by a dispatch in progress
            return await engine.read(rig.key, 0, 8)

        task = asyncio.ensure_future(caller())
        for _ in range(10):
            await asyncio.sleep(0)
        assert port.polls == 2 and port.polls_asked == 1 and not task.done()
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        assert await task == bytes(8)

    arun(main())


def test_waiting_for_credit_says_when_pump_has_work(arun: Run) -> None:
    """The connection skips pump() while operations.waiting_for_credit is 0: it counts exactly the
    control messages and writes with immediate data that wait for a send credit."""

    async def main() -> None:
        rig = onesided_rig(complete_at_post=False)
        ops = rig.engine.operations
        credits = {"ok": False}
        rig.engine.operations._credits.can_take_slot = lambda: credits["ok"]
        assert ops.waiting_for_credit == 0
        ops.queue_send(b"ctl")
        write = asyncio.ensure_future(rig.engine.write(rig.key, 0, b"x", imm=1))
        await asyncio.sleep(0)
        assert ops.waiting_for_credit == 2 and len(rig.qp.posted) == 0
        credits["ok"] = True
        ops.pump()
        assert ops.waiting_for_credit == 0 and len(rig.qp.posted) == 2
        await write
        ops.queue_send(b"ctl")  # posted at once: a credit is there
        assert ops.waiting_for_credit == 0
        credits["ok"] = False
        ops.queue_send(b"ctl")
        assert ops.waiting_for_credit == 1
        rig.engine.close(None)
        assert ops.waiting_for_credit == 0

    arun(main())


# --- the C calls, through a fake provider ----------------------------------------------------------------

HARNESS = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "helper.h"

/* exported verbs functions onesided.c and helper.c link against: never called here */
int ibv_get_cq_event(struct ibv_comp_channel *c, struct ibv_cq **cq, void **ctx)
{ (void)c; (void)cq; (void)ctx; errno = EAGAIN; return -1; }
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n) { (void)cq; (void)n; }
int ibv_get_async_event(struct ibv_context *c, struct ibv_async_event *e)
{ (void)c; (void)e; errno = EAGAIN; return -1; }
void ibv_ack_async_event(struct ibv_async_event *e) { (void)e; }
int rdma_get_cm_event(struct rdma_event_channel *c, struct rdma_cm_event **e)
{ (void)c; (void)e; errno = EAGAIN; return -1; }
int rdma_ack_cm_event(struct rdma_cm_event *e) { (void)e; return 0; }
int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a) { (void)c; (void)a; return EIO; }
int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int m, struct ibv_qp_init_attr *i)
{ (void)qp; (void)a; (void)m; (void)i; return EIO; }

static int post_rc, posts, wrs_in_last_post, poll_rc, polls, max_asked;
static struct ibv_send_wr last_wr;
static struct ibv_sge last_sge;
static struct ibv_wc next_wc[4];
static int pending;

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)qp;
    posts++;
    wrs_in_last_post = 0;
    for (struct ibv_send_wr *w = wr; w; w = w->next) {
        last_wr = *w;
        if (w->num_sge)
            last_sge = w->sg_list[0];
        wrs_in_last_post++;
    }
    if (post_rc)
        *bad = wr;
    return post_rc;
}
static int fake_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    (void)cq;
    polls++;
    if (n > max_asked)
        max_asked = n;
    if (poll_rc)
        return poll_rc;
    int k = 0;
    while (k < n && pending) {
        wc[k++] = next_wc[0];
        memmove(next_wc, next_wc + 1, sizeof(next_wc) - sizeof(next_wc[0]));
        pending--;
    }
    return k;
}
static void queue_wc(uint64_t wr_id, int status, uint32_t qp_num)
{
    memset(&next_wc[pending], 0, sizeof(next_wc[0]));
    next_wc[pending].wr_id = wr_id;
    next_wc[pending].status = status;
    next_wc[pending].qp_num = qp_num;
    pending++;
}

int main(void)
{
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct ibv_cq cq;
    struct rdmaio_onesided_port port;
    memset(&ctx, 0, sizeof ctx);
    memset(&qp, 0, sizeof qp);
    memset(&cq, 0, sizeof cq);
    memset(&port, 0, sizeof port);
    ctx.ops.post_send = fake_post_send;
    ctx.ops.poll_cq = fake_poll_cq;
    qp.context = &ctx;
    qp.qp_num = 17;
    cq.context = &ctx;
    port.qp = &qp;
    port.cq = &cq;
    port.wr_base = (2ull << 56) | (5ull << 32);
    port.max_inline = 64;
    uint64_t own = port.wr_base | 9;

    /* the CQ is empty: posted, in flight */
    int r = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 64, IBV_WR_RDMA_READ, 0x2000, 0x77, 0, 0);
    printf("empty=%d posts=%d wr_id_ok=%d read=%d signalled=%d inline=%d sge=%#llx/%u/%u remote=%#llx/%#x "
           "asked=%d\n", r, posts, last_wr.wr_id == own, last_wr.opcode == IBV_WR_RDMA_READ,
           !!(last_wr.send_flags & IBV_SEND_SIGNALED), !!(last_wr.send_flags & IBV_SEND_INLINE),
           (unsigned long long)last_sge.addr, last_sge.length, last_sge.lkey,
           (unsigned long long)last_wr.wr.rdma.remote_addr, last_wr.wr.rdma.rkey, max_asked);
    /* its own success, then another record behind it (left in the CQ) */
    queue_wc(own, IBV_WC_SUCCESS, 17);
    queue_wc(port.wr_base | 3, IBV_WC_SUCCESS, 17);
    r = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_WRITE, 0x2000, 0x77, 0, 0);
    printf("own=%d left=%d inline=%d asked=%d\n", r, pending, !!(last_wr.send_flags & IBV_SEND_INLINE),
           max_asked);
    pending = 0;
    /* its own failure, another request's record, another QP's: taken, to dispatch, with their key */
    queue_wc(own, IBV_WC_REM_ACCESS_ERR, 17);
    int a = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_ATOMIC_FETCH_AND_ADD, 0x2000, 0x77, 5,
                                      0);
    int add_ok = last_wr.wr.atomic.compare_add == 5 && last_wr.wr.atomic.remote_addr == 0x2000 &&
                 last_wr.wr.atomic.rkey == 0x77;
    uint64_t key_a = port.group.key;
    queue_wc(port.wr_base | 3, IBV_WC_SUCCESS, 17);
    int b = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_ATOMIC_CMP_AND_SWP, 0x2000, 0x77, 1, 2);
    int cas_ok = last_wr.wr.atomic.compare_add == 1 && last_wr.wr.atomic.swap == 2;
    queue_wc(own, IBV_WC_SUCCESS, 18);
    int c = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_READ, 0x2000, 0x77, 0, 0);
    printf("own_failure=%d other=%d other_qp=%d key=%d add_ok=%d cas_ok=%d taken_ok=%d count=%u\n", a, b, c,
           key_a == ((17ull << 24) | 5), add_ok, cas_ok, port.record.qp_num == 18 && port.record.wr_id == own,
           port.group.count);
    /* the provider refuses the request (either errno sign): nothing polled */
    int p0 = polls;
    post_rc = EINVAL;
    int e1 = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_READ, 0x2000, 0x77, 0, 0);
    post_rc = -ENOMEM;
    int e2 = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_READ, 0x2000, 0x77, 0, 0);
    post_rc = 0;
    printf("refused=%d,%d polled=%d\n", e1, e2, polls - p0);
    /* the poll fails after the post */
    poll_rc = -1;
    int f = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_READ, 0x2000, 0x77, 0, 0);
    poll_rc = 0;
    printf("poll_failed=%d errno=%d\n", f, port.poll_errno);
    /* what it never posts: a send, a write with immediate data, an atomic of another length */
    int n0 = posts;
    int s1 = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_SEND, 0, 0, 0, 0);
    int s2 = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_WRITE_WITH_IMM, 0, 0, 0, 0);
    int s3 = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 4, IBV_WR_ATOMIC_FETCH_AND_ADD, 0, 0, 0, 0);
    printf("refused_here=%d,%d,%d posted=%d\n", s1, s2, s3, posts - n0);
    /* a wave: one chain, only the last signalled, its own completion taken */
    uint64_t remote[3] = {0x2000, 0x2008, 0x2010};
    uint64_t adds[3] = {1, 2, 3};
    struct rdmaio_batch wave;
    memset(&wave, 0, sizeof wave);
    wave.wr_id = own;
    wave.local_addr = 0x1000;
    wave.lkey = 3;
    wave.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wave.rkey = 0x77;
    wave.count = 3;
    wave.remote_addr = remote;
    wave.compare_add = adds;
    queue_wc(own, IBV_WC_SUCCESS, 17);
    int w = rdmaio_onesided_post_batch_poll(&port, &wave);
    printf("wave=%d wrs=%d last_add=%llu last_signalled=%d\n", w, wrs_in_last_post,
           (unsigned long long)last_wr.wr.atomic.compare_add, !!(last_wr.send_flags & IBV_SEND_SIGNALED));
    wave.count = 0;
    int w0 = rdmaio_onesided_post_batch_poll(&port, &wave);
    /* a disabled port (its QP destroyed, or a forked child) touches nothing */
    n0 = posts;
    p0 = polls;
    port.qp = NULL;
    int d1 = rdmaio_onesided_post_poll(&port, 9, 0x1000, 3, 8, IBV_WR_RDMA_READ, 0, 0, 0, 0);
    wave.count = 3;
    int d2 = rdmaio_onesided_post_batch_poll(&port, &wave);
    printf("empty_wave=%d disabled=%d,%d touched=%d posted_total=%llu polled_total=%llu\n", w0, d1, d2,
           posts - n0 + polls - p0, (unsigned long long)port.posted, (unsigned long long)port.polled);
    return 0;
}
"""


@pytest.fixture(scope="module")
def port_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    work = tmp_path_factory.mktemp("onesided_port")
    return build_and_run(work, "harness", HARNESS, ["helper.c", "onesided.c"]).splitlines()


def test_the_port_posts_one_signalled_request_and_looks_at_the_cq_once(port_lines: list[str]) -> None:
    assert port_lines[0] == (
        "empty=0 posts=1 wr_id_ok=1 read=1 signalled=1 inline=0 sge=0x1000/64/3 remote=0x2000/0x77 asked=1"
    ), port_lines[0]


def test_the_port_takes_its_own_success_and_leaves_what_follows(port_lines: list[str]) -> None:
    # a small WRITE goes inline (max_inline 64); one record asked for, the next one left in the CQ
    assert port_lines[1] == "own=1 left=1 inline=1 asked=1", port_lines[1]


def test_the_port_hands_on_any_other_record_with_its_dispatch_key(port_lines: list[str]) -> None:
    assert port_lines[2] == ("own_failure=2 other=2 other_qp=2 key=1 add_ok=1 cas_ok=1 taken_ok=1 count=1"), (
        port_lines[2]
    )


def test_the_port_reports_the_providers_errno_and_polls_nothing_then(port_lines: list[str]) -> None:
    assert port_lines[3] == "refused=-22,-12 polled=0", port_lines[3]


def test_the_port_reports_a_failed_poll_after_the_post(port_lines: list[str]) -> None:
    assert port_lines[4] == "poll_failed=3 errno=5", port_lines[4]


def test_the_port_refuses_what_needs_a_credit_or_is_no_u64_atomic(port_lines: list[str]) -> None:
    assert port_lines[5] == "refused_here=-22,-22,-22 posted=0", port_lines[5]


def test_a_wave_is_one_chain_and_its_own_completion_is_taken(port_lines: list[str]) -> None:
    assert port_lines[6] == "wave=1 wrs=3 last_add=3 last_signalled=1", port_lines[6]


def test_a_disabled_port_touches_neither_queue(port_lines: list[str]) -> None:
    # posted counts the requests of every successful post (6 single ones and a wave of 3),
    # polled every record taken (its own success, its own failure, two others, the wave's)
    assert port_lines[7] == ("empty_wave=-22 disabled=-9,-9 touched=0 posted_total=9 polled_total=5"), (
        port_lines[7]
    )


# --- CompletionDispatcher.deliver: a record the serial call took that was not its own -----------------


def _dispatcher() -> tuple[Any, Any, list[tuple[str, list[int]]], int, int]:
    """A dispatcher over fakes with connections on QPs 7 ("a") and 8 ("b") on one CQ, recording."""
    from rdmaio.core.dispatch import CompletionDispatcher
    from rdmaio.testing.fakes import FakeCompletionBatch, FakeCompletionChannel, FakeCQ

    channel = FakeCompletionChannel()
    d = CompletionDispatcher(
        create_channel=lambda: channel,
        create_cq=lambda ch, cqe: FakeCQ(cqe),
        watch=lambda fd, cb: None,
        unwatch=lambda fd: None,
        batch=FakeCompletionBatch(16),
        max_cqe=1000,
        cq_capacity=100,
    )
    cq = d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []

    def recorder(name: str) -> Any:
        def handler(records: Any, start: int, count: int) -> None:
            seen.append(
                (name, [rdmaio.verbs.wr_index(records[i].wr_id) for i in range(start, start + count)])
            )

        return handler

    ta, tb = d.register(7), d.register(8)
    d.set_handler(7, ta, recorder("a"))
    d.set_handler(8, tb, recorder("b"))
    d.poll_now()
    return d, cq, seen, ta, tb


def test_deliver_dispatches_the_record_then_what_followed_it_in_the_cq() -> None:
    from rdmaio.testing.fakes import CompletionRecord as Rec

    d, cq, seen, ta, tb = _dispatcher()
    recv = rdmaio.verbs.WR_KIND_RECV
    cq.pending.append(Rec(rdmaio.verbs.make_wr_id(recv, ta, 2), 7))  # came after the record taken
    taken = [Rec(rdmaio.verbs.make_wr_id(recv, tb, 1), 8)]
    before = d.statistics()
    assert d.deliver(cq, taken, rdmaio.verbs.dispatch_key(8, tb)) is True
    assert seen == [("b", [1]), ("a", [2])]  # CQ order kept
    after = d.statistics()
    assert after["completions"] - before["completions"] == 2


def test_deliver_during_a_dispatch_keeps_the_record_for_the_next_poll_in_order() -> None:
    from rdmaio.testing.fakes import CompletionRecord as Rec

    d, cq, seen, ta, tb = _dispatcher()
    recv = rdmaio.verbs.WR_KIND_RECV
    key_b = rdmaio.verbs.dispatch_key(8, tb)
    results: list[bool] = []

    def a_handler(records: Any, start: int, count: int) -> None:
        seen.append(("a", [rdmaio.verbs.wr_index(records[i].wr_id) for i in range(start, start + count)]))
        # a caller running inside a handler took b's record 1; b's record 2 is still in the CQ
        results.append(d.deliver(cq, [Rec(rdmaio.verbs.make_wr_id(recv, tb, 1), 8)], key_b))
        cq.pending.append(Rec(rdmaio.verbs.make_wr_id(recv, tb, 2), 8))

    d.set_handler(7, ta, a_handler)
    cq.pending.append(Rec(rdmaio.verbs.make_wr_id(recv, ta, 0), 7))
    d.poll_now()
    assert results == [False]
    assert seen == [("a", [0]), ("b", [1]), ("b", [2])]  # kept, then delivered before b's later record
    d.close()
    assert d.deliver(cq, [Rec(rdmaio.verbs.make_wr_id(recv, tb, 3), 8)], key_b) is True
    assert d.statistics()["dropped"] >= 1


def test_the_close_state_given_to_the_engine_ends_the_serial_path_without_a_call_per_operation(
    arun: Run,
) -> None:
    """The engine is given the connection's CloseState (a Session's): a serial call asks no flush_error()
    (the state tells the engine when closing starts), and a close() started refuses the call exactly as
    flush_error() does."""
    from rdmaio.protocol.closestate import CloseState

    async def main() -> None:
        state = CloseState()
        rig = onesided_rig(complete_at_post=True, close_state=state)
        engine = rig.engine
        await engine.read(rig.key, 0, 8)
        calls: collections.Counter[str] = collections.Counter()

        def hook(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                calls[frame.f_code.co_name] += 1

        sys.setprofile(hook)
        try:
            await engine.fetch_add(rig.key, 8, 1)
        finally:
            sys.setprofile(None)
        assert calls["flush_error"] == 0 and calls["fetch_add"] == 1, calls
        state.close()
        assert state.flush_error() is not None
        posted = len(rig.qp.posted)
        with pytest.raises(rdmaio.RdmaError):
            await engine.read(rig.key, 0, 8)
        with pytest.raises(rdmaio.RdmaError):
            await engine.fetch_add_many(rig.key, [0])
        assert len(rig.qp.posted) == posted

    arun(main())


def test_the_serial_path_on_trio() -> None:
    """On trio an op's waiter is the backend's (a trio.Event), the task is trio's: calls complete at their
    post or later, and a cancelled call keeps its staging until its completion."""
    import trio

    from rdmaio.core.backend import TrioBackend

    async def main() -> None:
        io = TrioBackend()
        rig = onesided_rig(complete_at_post=True, io=io)
        engine, key, port = rig.engine, rig.key, rig.port
        assert await engine.read(key, 0, 8) == bytes(8)  # the first: posted on its own, completed later
        for _ in range(20):
            assert await engine.fetch_add(key, 8, 1) == 0
        assert engine.statistics()["rdma_completed_at_post"] == 20

        def soon(wr: dict[str, int]) -> int:
            io.call_soon(lambda: engine.on_completion(wr["wr_id"], 0))
            return rdmaio.verbs.POSTED

        port.at_post = soon  # completed one iteration later
        with trio.fail_after(5):
            assert await engine.read(key, 0, 8) == bytes(8)
        port.at_post = lambda wr: rdmaio.verbs.POSTED  # nobody completes it until the test does
        with trio.move_on_after(0.05) as scope:
            await engine.read(key, 0, 8)
        assert scope.cancelled_caught
        assert len(engine.operations._free_staging) == engine.max_ops - 1  # the NIC may still write
        engine.on_completion(rig.qp.posted[-1]["wr_id"], 0)
        assert len(engine.operations._free_staging) == engine.max_ops and engine.ops == {}

    trio.run(main)
