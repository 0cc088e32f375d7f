"""The C helper's CQ drain, compiled against fake verbs functions (no device, no libibverbs needed).

``ibv_get_cq_event``/``ibv_ack_cq_events`` are replaced at link time and ``ibv_poll_cq``/
``ibv_req_notify_cq`` (static inline in verbs.h) go through a fake context's ops, so the error paths that
a real device rarely takes can be driven: every CQ event read must be acked, even when a later read fails,
or ``ibv_destroy_cq`` blocks the loop thread for good.
"""

from __future__ import annotations

import pytest
from ctest import build_and_run

HARNESS = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "helper.h"

static struct ibv_cq *the_cq;
static int events_left, fail_errno, acked, notified;

int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **ctx)
{
    (void)channel;
    if (events_left > 0) {
        events_left--;
        *cq = the_cq;
        *ctx = NULL;
        return 0;
    }
    errno = fail_errno;
    return -1;
}
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n) { (void)cq; acked += (int)n; }
int ibv_get_async_event(struct ibv_context *c, struct ibv_async_event *e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
void ibv_ack_async_event(struct ibv_async_event *e) { (void)e; }
int rdma_get_cm_event(struct rdma_event_channel *c, struct rdma_cm_event **e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
int rdma_ack_cm_event(struct rdma_cm_event *e) { (void)e; return 0; }
static int fake_poll(struct ibv_cq *cq, int n, struct ibv_wc *wc) { (void)cq; (void)n; (void)wc; return 0; }
static int fake_notify(struct ibv_cq *cq, int solicited) { (void)cq; (void)solicited; notified++; return 0; }

int main(void)
{
    /* static: the fake ibv_get_cq_event hands out the_cq, which points at it */
    static struct ibv_context ctx;
    static struct ibv_cq cq;
    struct rdmaio_wc out[4];
    unsigned int events = 99;
    memset(&ctx, 0, sizeof ctx);
    memset(&cq, 0, sizeof cq);
    ctx.ops.poll_cq = fake_poll;
    ctx.ops.req_notify_cq = fake_notify;
    cq.context = &ctx;
    the_cq = &cq;
    for (int round = 0; round < 2; round++) {
        events_left = 3;
        fail_errno = round == 0 ? EIO : EAGAIN;
        acked = notified = 0;
        int rc = rdmaio_drain_cq(NULL, &cq, out, 4, &events);
        printf("rc=%d acked=%d events=%u notified=%d\n", rc, acked, events, notified);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_and_run(tmp_path_factory.mktemp("helper"), "harness", HARNESS, ["helper.c"])


# A channel serving several CQs (a Domain's pool) and a CQ returning scripted completions: the channel drain
# must ack each CQ's events in one call per CQ and re-arm each fired CQ once; the grouped poll must group
# by (qp_num << 24) | tag and keep the CQ order within a key.
MULTI_HARNESS = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "helper.h"

static struct ibv_cq *script[16];
static int nscript, pos, fail_errno;
static struct ibv_cq cqs[3];
static int acks[3], ack_calls[3], armed[3];
static struct ibv_wc pending[2048];
static int npending, polled;

static int idx(struct ibv_cq *cq) { return (int)(cq - cqs); }

int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **ctx)
{
    (void)channel;
    if (pos < nscript) {
        *cq = script[pos++];
        *ctx = NULL;
        return 0;
    }
    errno = fail_errno;
    return -1;
}
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n) { acks[idx(cq)] += (int)n; ack_calls[idx(cq)]++; }
int ibv_get_async_event(struct ibv_context *c, struct ibv_async_event *e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
void ibv_ack_async_event(struct ibv_async_event *e) { (void)e; }
int rdma_get_cm_event(struct rdma_event_channel *c, struct rdma_cm_event **e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
int rdma_ack_cm_event(struct rdma_cm_event *e) { (void)e; return 0; }
static int fake_poll(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    (void)cq;
    int k = npending - polled < n ? npending - polled : n;
    memcpy(wc, &pending[polled], sizeof(*wc) * (size_t)k);
    polled += k;
    return k;
}
static int fake_notify(struct ibv_cq *cq, int solicited) { (void)solicited; armed[idx(cq)]++; return 0; }

static void add_wc(uint32_t qp, uint32_t tag, uint32_t index)
{
    struct ibv_wc *wc = &pending[npending++];
    memset(wc, 0, sizeof(*wc));
    wc->qp_num = qp;
    wc->wr_id = ((uint64_t)1 << 56) | ((uint64_t)tag << 32) | index;
    wc->byte_len = index;
}

static void reset(void)
{
    pos = nscript = 0;
    memset(acks, 0, sizeof acks);
    memset(ack_calls, 0, sizeof ack_calls);
    memset(armed, 0, sizeof armed);
}

int main(void)
{
    struct ibv_context ctx;
    struct ibv_cq *fired[4];
    unsigned int events;
    int err;
    memset(&ctx, 0, sizeof ctx);
    ctx.ops.poll_cq = fake_poll;
    ctx.ops.req_notify_cq = fake_notify;
    for (int i = 0; i < 3; i++) {
        memset(&cqs[i], 0, sizeof cqs[i]);
        cqs[i].context = &ctx;
    }

    /* 1: events for CQ 2, 0, 2, 2, 0 then EAGAIN */
    reset();
    struct ibv_cq *s1[] = {&cqs[2], &cqs[0], &cqs[2], &cqs[2], &cqs[0]};
    memcpy(script, s1, sizeof s1); nscript = 5; fail_errno = EAGAIN;
    int n = rdmaio_drain_channel(NULL, fired, 4, &events, &err);
    printf("drain n=%d events=%u err=%d fired=%d,%d acks=%d/%d,%d/%d,%d/%d armed=%d,%d,%d\n", n, events, err,
           idx(fired[0]), idx(fired[1]), acks[0], ack_calls[0], acks[1], ack_calls[1], acks[2], ack_calls[2],
           armed[0], armed[1], armed[2]);

    /* 2: a read fails with EIO after two events: both acked and re-armed, the error reported */
    reset();
    struct ibv_cq *s2[] = {&cqs[1], &cqs[1]};
    memcpy(script, s2, sizeof s2); nscript = 2; fail_errno = EIO;
    n = rdmaio_drain_channel(NULL, fired, 4, &events, &err);
    printf("error n=%d events=%u err=%d acks=%d armed=%d\n", n, events, err, acks[1], armed[1]);

    /* 3: more CQs than fired[] holds: the extra one is acked and re-armed, n says so */
    reset();
    struct ibv_cq *s3[] = {&cqs[0], &cqs[1], &cqs[2], &cqs[2]};
    memcpy(script, s3, sizeof s3); nscript = 4; fail_errno = EAGAIN;
    n = rdmaio_drain_channel(NULL, fired, 2, &events, &err);
    printf("overflow n=%d events=%u acks=%d,%d,%d armed=%d,%d,%d\n", n, events, acks[0], acks[1], acks[2],
           armed[0], armed[1], armed[2]);

    /* 4: grouped poll of interleaved completions of three keys */
    struct rdmaio_wc scratch[8], out[8];
    struct rdmaio_wc_group groups[8];
    int ngroups;
    npending = polled = 0;
    add_wc(7, 1, 0); add_wc(9, 2, 0); add_wc(7, 1, 1); add_wc(7, 3, 0); add_wc(9, 2, 1); add_wc(7, 1, 2);
    n = rdmaio_poll_grouped(&cqs[0], scratch, out, 8, groups, &ngroups);
    printf("grouped n=%d groups=%d", n, ngroups);
    for (int g = 0; g < ngroups; g++) {
        printf(" [%llu:%u+%u:", (unsigned long long)groups[g].key, groups[g].start, groups[g].count);
        for (uint32_t k = 0; k < groups[g].count; k++)
            printf("%s%u.%u", k ? "," : "", out[groups[g].start + k].qp_num,
                   (unsigned)(out[groups[g].start + k].wr_id & 0xffffffffu));
        printf("]");
    }
    printf("\n");

    /* 5: a full batch (1024 records, 300 keys, each key's indexes ascending): stable and complete */
    npending = polled = 0;
    for (int i = 0; i < 1024; i++)
        add_wc((uint32_t)(i % 300) + 100, (uint32_t)(i % 300) * 7 + 1, (uint32_t)i);
    static struct rdmaio_wc bs[1024], bo[1024];
    static struct rdmaio_wc_group bg[1024];
    n = rdmaio_poll_grouped(&cqs[0], bs, bo, 1024, bg, &ngroups);
    int ok = n == 1024 && ngroups == 300, total = 0;
    for (int g = 0; g < ngroups && ok; g++) {
        ok = ok && bg[g].start == (uint32_t)total;
        for (uint32_t k = 0; k < bg[g].count; k++) {
            const struct rdmaio_wc *wc = &bo[bg[g].start + k];
            uint64_t key = ((uint64_t)wc->qp_num << 24) | ((wc->wr_id >> 32) & 0xffffff);
            ok = ok && key == bg[g].key;
            if (k)
                ok = ok && (wc->wr_id & 0xffffffffu) > (bo[bg[g].start + k - 1].wr_id & 0xffffffffu);
        }
        total += (int)bg[g].count;
    }
    printf("big n=%d groups=%d stable=%d total=%d\n", n, ngroups, ok, total);

    /* 6: an empty CQ and a batch above the limit */
    npending = polled = 0;
    n = rdmaio_poll_grouped(&cqs[0], scratch, out, 8, groups, &ngroups);
    int too_big = rdmaio_poll_grouped(&cqs[0], scratch, out, RDMAIO_MAX_POLL + 1, groups, &ngroups);
    printf("empty n=%d groups=%d too_big=%d\n", n, ngroups, too_big);
    return 0;
}
"""


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return build_and_run(tmp_path_factory.mktemp("multi"), "multi", MULTI_HARNESS, ["helper.c"]).splitlines()


def test_channel_drain_acks_per_cq_and_rearms_each_fired_cq_once(multi: list[str]) -> None:
    # CQ 2 fired first (3 events), CQ 0 second (2 events); one ack call and one re-arm per fired CQ.
    assert multi[0] == "drain n=2 events=5 err=0 fired=2,0 acks=2/1,0/0,3/1 armed=1,0,1", multi[0]


def test_channel_drain_acks_and_reports_events_read_before_a_failing_read(multi: list[str]) -> None:
    assert multi[1] == "error n=1 events=2 err=5 acks=2 armed=1", multi[1]


def test_channel_drain_acks_and_rearms_cqs_it_cannot_list(multi: list[str]) -> None:
    # n > max_fired tells the caller to poll every CQ; the unlisted CQ 2 is still acked and re-armed.
    assert multi[2].startswith("overflow n=3 events=4 acks=1,1,2 "), multi[2]
    armed = [int(x) for x in multi[2].split("armed=")[1].split(",")]
    assert armed[0] == armed[1] == 1 and armed[2] >= 1


def test_grouped_poll_groups_by_key_in_first_seen_order_keeping_cq_order(multi: list[str]) -> None:
    key = lambda qp, tag: (qp << 24) | tag  # noqa: E731
    assert multi[3] == (
        f"grouped n=6 groups=3 [{key(7, 1)}:0+3:7.0,7.1,7.2] [{key(9, 2)}:3+2:9.0,9.1] [{key(7, 3)}:5+1:7.0]"
    ), multi[3]


def test_grouped_poll_of_a_full_batch_is_stable_and_complete(multi: list[str]) -> None:
    assert multi[4] == "big n=1024 groups=300 stable=1 total=1024", multi[4]


def test_grouped_poll_of_an_empty_cq_and_an_oversized_batch(multi: list[str]) -> None:
    assert multi[5] == "empty n=0 groups=0 too_big=-22", multi[5]


def test_events_read_before_a_failing_read_are_acked(harness: str) -> None:
    first = harness.splitlines()[0]
    assert first == "rc=-5 acked=3 events=3 notified=0", first


def test_normal_drain_acks_rearms_and_polls(harness: str) -> None:
    second = harness.splitlines()[1]
    assert second == "rc=0 acked=3 events=3 notified=1", second


# Every post path of the helper with a provider that refuses the work request: the provider's own errno
# comes back (negative as rxe and siw return it, positive as libibverbs documents it), never EIO, and the
# memory-window calls pass the bind's fields through and report their provider's errno the same way.
POST_HARNESS = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "helper.h"

int ibv_get_cq_event(struct ibv_comp_channel *c, struct ibv_cq **cq, void **ctx)
{
    (void)c; (void)cq; (void)ctx; errno = EAGAIN; return -1;
}
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n) { (void)cq; (void)n; }
int ibv_get_async_event(struct ibv_context *c, struct ibv_async_event *e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
void ibv_ack_async_event(struct ibv_async_event *e) { (void)e; }
int rdma_get_cm_event(struct rdma_event_channel *c, struct rdma_cm_event **e)
{
    (void)c; (void)e; errno = EAGAIN; return -1;
}
int rdma_ack_cm_event(struct rdma_cm_event *e) { (void)e; return 0; }

static int post_rc;           /* what the fake provider returns */
static struct ibv_send_wr last_wr;
static struct ibv_mw_bind_info last_bind;
static uint32_t last_bind_rkey;

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)qp;
    last_wr = *wr;
    if (wr->opcode == IBV_WR_BIND_MW) {
        last_bind = wr->bind_mw.bind_info;
        last_bind_rkey = wr->bind_mw.rkey;
    }
    if (post_rc)
        *bad = wr;
    return post_rc;
}
static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)qp;
    if (post_rc)
        *bad = wr;
    return post_rc;
}
static struct ibv_mw the_mw;
static int alloc_errno, dealloc_rc;
static struct ibv_mw *fake_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type)
{
    (void)pd;
    if (alloc_errno || type != IBV_MW_TYPE_2) {
        errno = alloc_errno ? alloc_errno : EINVAL;
        return NULL;
    }
    return &the_mw;
}
static int fake_dealloc_mw(struct ibv_mw *mw) { (void)mw; return dealloc_rc; }

int main(void)
{
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct ibv_pd pd;
    struct ibv_mr mr;
    int bad = 99;
    memset(&ctx, 0, sizeof ctx);
    memset(&qp, 0, sizeof qp);
    memset(&pd, 0, sizeof pd);
    memset(&mr, 0, sizeof mr);
    ctx.ops.post_send = fake_post_send;
    ctx.ops.post_recv = fake_post_recv;
    ctx.ops.alloc_mw = fake_alloc_mw;
    ctx.ops.dealloc_mw = fake_dealloc_mw;
    qp.context = &ctx;
    pd.context = &ctx;
    the_mw.context = &ctx;
    the_mw.rkey = 0x1234ff;

    int rcs[] = {-EINVAL, EINVAL, -ENOMEM, ENOMEM, 0};
    for (int i = 0; i < 5; i++) {
        post_rc = rcs[i];
        struct rdmaio_send sends[3];
        struct rdmaio_rdma_op ops[2];
        memset(sends, 0, sizeof sends);
        memset(ops, 0, sizeof ops);
        ops[0].opcode = IBV_WR_RDMA_READ;
        ops[1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        int s = rdmaio_post_sends(&qp, sends, 3, &bad);
        int bs = bad;
        int r = rdmaio_post_rdma(&qp, ops, 2, &bad);
        uint64_t remote[2] = {1, 2};
        struct rdmaio_batch b;
        memset(&b, 0, sizeof b);
        b.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
        b.count = 2;
        b.remote_addr = remote;
        int t = rdmaio_post_batch(&qp, &b, &bad);
        uint32_t slots[2] = {0, 1};
        int v = rdmaio_post_recv_slots(&qp, 1, 0, 64, 0, slots, 2);
        uint32_t rkey = 0;
        int w = rdmaio_post_bind_mw(&qp, &the_mw, &mr, 0x1000, 0x2000, 7, 42, &rkey);
        printf("rc=%d sends=%d bad=%d rdma=%d batch=%d recv=%d bind=%d\n", rcs[i], s, bs, r, t, v, w);
    }
    /* a successful bind: the fields reach the work request, the window gets a fresh key */
    post_rc = 0;
    uint32_t rkey = 0;
    int w = rdmaio_post_bind_mw(&qp, &the_mw, &mr, 0x1000, 0x2000, 7, 42, &rkey);
    printf("bind=%d opcode_ok=%d signalled=%d wr_id=%llu addr=%#llx len=%#llx access=%u mr_ok=%d rkey=%#x "
           "wr_rkey=%#x\n", w, last_wr.opcode == IBV_WR_BIND_MW, !!(last_wr.send_flags & IBV_SEND_SIGNALED),
           (unsigned long long)last_wr.wr_id, (unsigned long long)last_bind.addr,
           (unsigned long long)last_bind.length, last_bind.mw_access_flags, last_bind.mr == &mr, rkey,
           last_bind_rkey);
    struct ibv_mw *out = NULL;
    alloc_errno = 0;
    int a = rdmaio_alloc_mw(&pd, &out);
    alloc_errno = EOPNOTSUPP;
    int a2 = rdmaio_alloc_mw(&pd, &out);
    dealloc_rc = EBUSY;
    int d = rdmaio_dealloc_mw(&the_mw);
    dealloc_rc = 0;
    int d2 = rdmaio_dealloc_mw(&the_mw);
    printf("alloc=%d same=%d unsupported=%d dealloc_busy=%d dealloc=%d\n", a, out == &the_mw, a2, d, d2);
    return 0;
}
"""


@pytest.fixture(scope="module")
def posts(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return build_and_run(tmp_path_factory.mktemp("posts"), "posts", POST_HARNESS, ["helper.c"]).splitlines()


@pytest.mark.parametrize(("line", "rc", "errno_"), [(0, -22, -22), (1, 22, -22), (2, -12, -12), (3, 12, -12)])
def test_every_post_path_reports_the_providers_errno(
    posts: list[str], line: int, rc: int, errno_: int
) -> None:
    # siw returns -EINVAL for an opcode it lacks, libibverbs documents a positive errno: both come back as
    # -errno (rdmaio.verbs turns it into VerbsError(errno, call="ibv_post_send"/"ibv_post_recv")), not -EIO.
    e = errno_
    assert posts[line] == f"rc={rc} sends={e} bad=0 rdma={e} batch={e} recv={e} bind={e}", posts[line]


def test_post_paths_succeed_with_their_counts(posts: list[str]) -> None:
    assert posts[4] == "rc=0 sends=3 bad=-1 rdma=2 batch=2 recv=2 bind=0", posts[4]


def test_a_window_bind_carries_its_fields_and_a_fresh_key(posts: list[str]) -> None:
    assert posts[5] == (
        "bind=0 opcode_ok=1 signalled=1 wr_id=42 addr=0x1000 len=0x2000 access=7 mr_ok=1 rkey=0x123400 "
        "wr_rkey=0x123400"
    ), posts[5]


def test_window_allocation_and_release_report_the_providers_errno(posts: list[str]) -> None:
    assert posts[6] == "alloc=0 same=1 unsupported=-95 dealloc_busy=-16 dealloc=0", posts[6]
