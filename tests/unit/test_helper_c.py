"""The C helper's CQ drain, compiled against fake verbs functions (no device, no libibverbs needed).

``ibv_get_cq_event``/``ibv_ack_cq_events`` are replaced at link time and ``ibv_poll_cq``/
``ibv_req_notify_cq`` (static inline in verbs.h) go through a fake context's ops, so the error paths that
a real device rarely takes can be driven: every CQ event read must be acked, even when a later read fails,
or ``ibv_destroy_cq`` blocks the loop thread for good.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

FFI_DIR = Path(__file__).resolve().parents[2] / "rdmaio" / "_ffi"

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
    struct ibv_context ctx;
    struct ibv_cq cq;
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
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is needed to build the C helper (tools/dev setup installs it)")
    work = tmp_path_factory.mktemp("helper")
    (work / "harness.c").write_text(HARNESS)
    binary = work / "harness"
    subprocess.run(
        [
            gcc,
            "-std=gnu11",
            "-Wall",
            "-I",
            str(FFI_DIR),
            str(work / "harness.c"),
            str(FFI_DIR / "helper.c"),
            "-o",
            str(binary),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout


def test_events_read_before_a_failing_read_are_acked(harness: str) -> None:
    first = harness.splitlines()[0]
    assert first == "rc=-5 acked=3 events=3 notified=0", first


def test_normal_drain_acks_rearms_and_polls(harness: str) -> None:
    second = harness.splitlines()[1]
    assert second == "rc=0 acked=3 events=3 notified=1", second
