"""Connection setup's C steps (rdmaio/_ffi/setup.c), without a device.

Compiled against fake ``rdma_set_option``/``rdma_create_qp``/``rdma_connect``/``rdma_accept`` (replaced at
link time, as in ``test_helper_c.py``), so that what each step hands the library and every failure path can
be checked: the ack timeout set before the QP, the inline fallback (half above 32 bytes, then none), the
connection parameters with the private data, the errno of the failing call and the step that failed. The
argument bounds are checked through the compiled extension itself (refused before any library call), and
the Python wrappers (:meth:`rdmaio.verbs.CMId.create_qp`, ``connect``, ``accept``) through a fake ``lib``.
"""

from __future__ import annotations

import errno
from types import SimpleNamespace
from typing import Any

import pytest
from ctest import build_and_run

from rdmaio._ffi import ffi, lib
from rdmaio.errors import ProviderError, VerbsError
from rdmaio.verbs import _base, cm

HARNESS = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "setup.h"

static int option_calls, option_level, option_name, option_value, option_fail;
static int create_calls, create_fail_above, create_errno, create_positive;
static unsigned int tried[8];
static struct ibv_qp_init_attr last_attr;
static struct rdma_conn_param last_param;
static unsigned char last_data[256];
static int connect_calls, accept_calls, connect_errno;

int rdma_set_option(struct rdma_cm_id *id, int level, int optname, void *optval, size_t optlen)
{
    (void)id;
    option_calls++;
    option_level = level;
    option_name = optname;
    option_value = optlen == 1 ? *(unsigned char *)optval : -1;
    if (option_fail) {
        errno = option_fail;
        return -1;
    }
    return 0;
}

int rdma_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    (void)id; (void)pd;
    if (create_calls < 8)
        tried[create_calls] = attr->cap.max_inline_data;
    create_calls++;
    last_attr = *attr;
    if ((int)attr->cap.max_inline_data > create_fail_above) {
        if (create_positive)
            return create_errno;
        errno = create_errno;
        return -1;
    }
    attr->cap.max_send_wr += 1; /* the device may round up */
    return 0;
}

static int keep(struct rdma_conn_param *p)
{
    last_param = *p;
    memset(last_data, 0, sizeof last_data);
    if (p->private_data && p->private_data_len)
        memcpy(last_data, p->private_data, p->private_data_len);
    if (connect_errno) {
        errno = connect_errno;
        return -1;
    }
    return 0;
}
int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *p)
{
    (void)id;
    connect_calls++;
    return keep(p);
}
int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *p)
{
    (void)id;
    accept_calls++;
    return keep(p);
}

static void reset(void)
{
    option_calls = option_fail = create_calls = create_errno = create_positive = 0;
    connect_calls = accept_calls = connect_errno = 0;
    create_fail_above = 1 << 30;
    memset(tried, 0, sizeof tried);
}

static void tries(const char *label, int rc, int step, struct ibv_qp_cap *cap)
{
    printf("%s rc=%d step=%d calls=%d tried=", label, rc, step, create_calls);
    for (int i = 0; i < create_calls && i < 8; i++)
        printf(i ? ",%u" : "%u", tried[i]);
    printf(" inline=%u\n", cap->max_inline_data);
}

int main(void)
{
    struct rdma_cm_id id;
    struct ibv_pd pd;
    struct ibv_cq scq, rcq;
    struct ibv_srq srq;
    struct ibv_qp_cap cap;
    int step, rc;
    const unsigned char hs[3] = {1, 2, 3};

    memset(&id, 0, sizeof id);

    /* 1: ack timeout set first, then one QP with what was asked */
    reset();
    rc = rdmaio_setup_qp(&id, &pd, &scq, &rcq, NULL, 40, 30, 64, 1, 14, &cap, &step);
    printf("ok rc=%d step=%d option=%d/%d/%d value=%d calls=%d send=%u recv=%u sge=%u/%u rc_type=%d "
           "scq=%d rcq=%d srq=%d sig_all=%d cap_send=%u inline=%u\n",
           rc, step, option_calls, option_level == RDMA_OPTION_ID, option_name == RDMA_OPTION_ID_ACK_TIMEOUT,
           option_value, create_calls, last_attr.cap.max_send_wr, last_attr.cap.max_recv_wr,
           last_attr.cap.max_send_sge, last_attr.cap.max_recv_sge, last_attr.qp_type == IBV_QPT_RC,
           last_attr.send_cq == &scq, last_attr.recv_cq == &rcq, last_attr.srq == NULL, last_attr.sq_sig_all,
           cap.max_send_wr, cap.max_inline_data);

    /* 2: no ack timeout asked: the option is left alone; an SRQ: no receive queue of its own */
    reset();
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, &srq, 8, 30, 0, 1, RDMAIO_SETUP_NO_ACK_TIMEOUT, &cap, &step);
    printf("srq rc=%d option_calls=%d recv=%u srq=%d\n", rc, option_calls, last_attr.cap.max_recv_wr,
           last_attr.srq == &srq);

    /* 3: inline fallback: 256 -> 128 -> 64 -> 32 -> 0; the device takes at most 40 */
    reset();
    create_fail_above = 40;
    create_errno = EINVAL;
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, NULL, 8, 8, 256, 1, RDMAIO_SETUP_NO_ACK_TIMEOUT, &cap, &step);
    tries("fit", rc, step, &cap);

    /* 4: every size refused (EINVAL): the last attempt's errno (and inline 0) */
    reset();
    create_fail_above = -1;
    create_errno = EINVAL;
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, NULL, 8, 8, 100, 1, RDMAIO_SETUP_NO_ACK_TIMEOUT, &cap, &step);
    tries("refused", rc, step, &cap);

    /* 4b: a refusal other than EINVAL is not a size refused: returned at once, with the size tried */
    reset();
    create_fail_above = -1;
    create_errno = ENOMEM;
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, NULL, 8, 8, 100, 1, RDMAIO_SETUP_NO_ACK_TIMEOUT, &cap, &step);
    tries("nomem", rc, step, &cap);

    /* 5: no fallback asked: one attempt; a provider's positive errno is handed through */
    reset();
    create_fail_above = 10;
    create_errno = EOPNOTSUPP;
    create_positive = 1;
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, NULL, 8, 8, 64, 0, RDMAIO_SETUP_NO_ACK_TIMEOUT, &cap, &step);
    tries("strict", rc, step, &cap);

    /* 6: -1 without errno: -EIO rather than success or 0, at once, with a step of its own */
    reset();
    create_fail_above = -1;
    create_errno = 0;
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, NULL, 8, 8, 64, 1, RDMAIO_SETUP_NO_ACK_TIMEOUT, &cap, &step);
    tries("noerrno", rc, step, &cap);

    /* 7: the ack timeout refused: no QP is tried */
    reset();
    option_fail = EPERM;
    rc = rdmaio_setup_qp(&id, &pd, &scq, &scq, NULL, 8, 8, 0, 1, 3, &cap, &step);
    printf("ackfail rc=%d step=%d create_calls=%d\n", rc, step, create_calls);

    /* 8: connect and accept carry the private data and the parameters */
    reset();
    rc = rdmaio_setup_connect(&id, hs, 3, 6, 2, 16, 15);
    printf("connect rc=%d calls=%d len=%u data=%u,%u,%u resp=%u init=%u retry=%u rnr=%u\n", rc,
           connect_calls, last_param.private_data_len, last_data[0], last_data[1], last_data[2],
           last_param.responder_resources, last_param.initiator_depth, last_param.retry_count,
           last_param.rnr_retry_count);
    reset();
    rc = rdmaio_setup_accept(&id, hs, 2, 1, 4, 5);
    printf("accept rc=%d calls=%d len=%u data=%u,%u resp=%u init=%u retry=%u rnr=%u\n", rc, accept_calls,
           last_param.private_data_len, last_data[0], last_data[1], last_param.responder_resources,
           last_param.initiator_depth, last_param.retry_count, last_param.rnr_retry_count);
    reset();
    rc = rdmaio_setup_connect(&id, NULL, 0, 6, 1, 1, 1);
    printf("empty rc=%d len=%u null=%d\n", rc, last_param.private_data_len, last_param.private_data == NULL);

    /* 9: the library's errno comes back; nothing is called for private data past 255 bytes */
    reset();
    connect_errno = ECONNREFUSED;
    printf("errno connect=%d", rdmaio_setup_connect(&id, hs, 3, 6, 1, 1, 1));
    printf(" accept=%d\n", rdmaio_setup_accept(&id, hs, 3, 1, 1, 1));
    reset();
    {
        static unsigned char big[300];
        printf("long connect=%d accept=%d calls=%d\n", rdmaio_setup_connect(&id, big, 256, 6, 1, 1, 1),
               rdmaio_setup_accept(&id, big, 256, 1, 1, 1), connect_calls + accept_calls);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = build_and_run(tmp_path_factory.mktemp("setup"), "harness", HARNESS, ["setup.c"])
    return {line.split()[0]: line for line in out.splitlines()}


def test_the_ack_timeout_is_set_before_the_qp_which_gets_what_was_asked(harness: dict[str, str]) -> None:
    assert harness["ok"] == (
        "ok rc=0 step=2 option=1/1/1 value=14 calls=1 send=40 recv=30 sge=1/1 rc_type=1 "
        "scq=1 rcq=1 srq=1 sig_all=0 cap_send=41 inline=64"
    ), harness["ok"]


def test_without_an_ack_timeout_the_option_is_untouched_and_an_srq_qp_has_no_receive_queue(
    harness: dict[str, str],
) -> None:
    assert harness["srq"] == "srq rc=0 option_calls=0 recv=0 srq=1", harness["srq"]


def test_a_refused_inline_size_is_halved_above_32_bytes_then_dropped(harness: dict[str, str]) -> None:
    assert harness["fit"] == "fit rc=0 step=2 calls=4 tried=256,128,64,32 inline=32", harness["fit"]


def test_a_qp_refused_at_every_inline_size_reports_the_last_errno(harness: dict[str, str]) -> None:
    assert harness["refused"] == (f"refused rc={-errno.EINVAL} step=2 calls=4 tried=100,50,25,0 inline=0"), (
        harness["refused"]
    )


def test_only_a_refused_size_is_tried_again(harness: dict[str, str]) -> None:
    """ENOMEM is not the inline size refused: asking again with less would replace its errno with the
    smaller attempts' own."""
    assert harness["nomem"] == f"nomem rc={-errno.ENOMEM} step=2 calls=1 tried=100 inline=100", harness[
        "nomem"
    ]


def test_without_fit_inline_one_attempt_and_a_providers_positive_errno(harness: dict[str, str]) -> None:
    assert harness["strict"] == f"strict rc={-errno.EOPNOTSUPP} step=2 calls=1 tried=64 inline=64", harness[
        "strict"
    ]


def test_a_failure_without_errno_says_so(harness: dict[str, str]) -> None:
    """-1 with errno 0 (libsiw's refused queue key): no retry, and a step of its own, so that the caller
    raises ProviderError instead of reporting an errno nobody set."""
    step = lib.RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO
    assert harness["noerrno"] == f"noerrno rc={-errno.EIO} step={step} calls=1 tried=64 inline=64", harness[
        "noerrno"
    ]


def test_a_refused_ack_timeout_stops_before_the_qp(harness: dict[str, str]) -> None:
    assert harness["ackfail"] == f"ackfail rc={-errno.EPERM} step=1 create_calls=0", harness["ackfail"]


def test_connect_and_accept_carry_the_private_data_and_parameters(harness: dict[str, str]) -> None:
    assert harness["connect"] == ("connect rc=0 calls=1 len=3 data=1,2,3 resp=16 init=15 retry=6 rnr=2"), (
        harness["connect"]
    )
    # the passive side's retry count is 7 (ignored by rdma_cm there, as before)
    assert harness["accept"] == "accept rc=0 calls=1 len=2 data=1,2 resp=4 init=5 retry=7 rnr=1", harness[
        "accept"
    ]
    assert harness["empty"] == "empty rc=0 len=0 null=1", harness["empty"]


def test_connect_and_accept_report_the_errno_and_refuse_long_private_data(harness: dict[str, str]) -> None:
    refused = -errno.ECONNREFUSED
    assert harness["errno"] == f"errno connect={refused} accept={refused}", harness["errno"]
    assert harness["long"] == f"long connect={-errno.EINVAL} accept={-errno.EINVAL} calls=0", harness["long"]


# --- the compiled extension: bounds refused before any library call -------------------------------------


def test_the_extensions_setup_calls_refuse_out_of_bound_arguments() -> None:
    cap = ffi.new("struct ibv_qp_cap *")
    step = ffi.new("int *", 99)
    fake = ffi.cast("void *", 1)  # never dereferenced: every call below is refused first
    args = (fake, fake, fake, fake, ffi.NULL, 8, 8, 0, 1)
    none = lib.RDMAIO_SETUP_NO_ACK_TIMEOUT
    assert lib.rdmaio_setup_qp(ffi.NULL, *args[1:], none, cap, step) == -errno.EINVAL
    assert step[0] == lib.RDMAIO_SETUP_STEP_ARGS
    assert lib.rdmaio_setup_qp(*args[:2], ffi.NULL, *args[3:], none, cap, step) == -errno.EINVAL
    assert lib.rdmaio_setup_qp(*args, none, ffi.NULL, step) == -errno.EINVAL
    for exponent in (-2, lib.RDMAIO_SETUP_MAX_ACK_TIMEOUT + 1, 1000):
        step[0] = 99
        assert lib.rdmaio_setup_qp(*args, exponent, cap, step) == -errno.EINVAL
        assert step[0] == lib.RDMAIO_SETUP_STEP_ARGS
    assert lib.rdmaio_setup_qp(ffi.NULL, *args[1:], none, cap, ffi.NULL) == -errno.EINVAL  # no step out
    data = ffi.new("uint8_t[]", 300)
    assert lib.rdmaio_setup_connect(ffi.NULL, data, 3, 6, 1, 1, 1) == -errno.EINVAL
    assert lib.rdmaio_setup_accept(ffi.NULL, data, 3, 1, 1, 1) == -errno.EINVAL
    assert lib.rdmaio_setup_connect(fake, data, 256, 6, 1, 1, 1) == -errno.EINVAL
    assert lib.rdmaio_setup_accept(fake, data, 256, 1, 1, 1) == -errno.EINVAL
    assert lib.rdmaio_setup_connect(fake, ffi.NULL, 3, 6, 1, 1, 1) == -errno.EINVAL
    assert lib.rdmaio_setup_accept(fake, ffi.NULL, 3, 1, 1, 1) == -errno.EINVAL
    assert lib.RDMAIO_SETUP_MAX_PRIVATE_DATA == 255


# --- the Python wrappers: what they pass, and how a failure is reported -----------------------------------


class _FakeSetupLib:
    """Records the setup calls and answers with ``rc`` (``step`` for rdmaio_setup_qp)."""

    RDMAIO_SETUP_NO_ACK_TIMEOUT = lib.RDMAIO_SETUP_NO_ACK_TIMEOUT
    RDMAIO_SETUP_STEP_ACK_TIMEOUT = lib.RDMAIO_SETUP_STEP_ACK_TIMEOUT
    RDMAIO_SETUP_STEP_CREATE_QP = lib.RDMAIO_SETUP_STEP_CREATE_QP
    RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO = lib.RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO

    def __init__(self, rc: int, step: int = 0, inline_tried: int = 0) -> None:
        self.rc, self.step, self.inline_tried = rc, step, inline_tried
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def rdmaio_setup_qp(self, *args: Any) -> int:
        self.calls.append(("qp", args))
        args[-1][0] = self.step
        args[-2].max_inline_data = self.inline_tried
        return self.rc

    def rdmaio_setup_connect(self, *args: Any) -> int:
        self.calls.append(("connect", args))
        return self.rc

    def rdmaio_setup_accept(self, *args: Any) -> int:
        self.calls.append(("accept", args))
        return self.rc


def _cm_id() -> cm.CMId:
    cm_id = cm.CMId.__new__(cm.CMId)
    cm_id._generation = _base.fork_generation()
    cm_id.closed = False
    cm_id._ptr = ffi.NULL
    cm_id.qp = None
    return cm_id


def _resource() -> Any:
    return SimpleNamespace(_ptr=ffi.NULL)


def test_create_qp_reports_the_failing_step_with_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeSetupLib(-errno.EPERM, lib.RDMAIO_SETUP_STEP_ACK_TIMEOUT)
    monkeypatch.setattr(cm, "lib", fake)
    with pytest.raises(VerbsError) as info:
        _cm_id().create_qp(_resource(), _resource(), _resource(), max_send_wr=8, max_recv_wr=4, ack_timeout=5)
    assert (info.value.call, info.value.errno) == ("rdma_set_option", errno.EPERM)
    args = fake.calls[0][1]
    assert args[5:10] == (8, 4, 0, False, 5)  # send, recv, inline, fit_inline, ack timeout
    fake = _FakeSetupLib(-errno.ENOMEM, lib.RDMAIO_SETUP_STEP_CREATE_QP, inline_tried=0)
    monkeypatch.setattr(cm, "lib", fake)
    with pytest.raises(VerbsError) as info:
        _cm_id().create_qp(
            _resource(),
            _resource(),
            _resource(),
            max_send_wr=8,
            max_recv_wr=4,
            max_inline_data=64,
            fit_inline=True,
        )
    assert (info.value.call, info.value.errno) == ("rdma_create_qp", errno.ENOMEM)
    assert "inline=0" in str(info.value)  # the last size tried
    assert fake.calls[0][1][5:10] == (8, 4, 64, True, lib.RDMAIO_SETUP_NO_ACK_TIMEOUT)


def test_create_qp_without_errno_raises_a_provider_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """No errno from the provider: a ProviderError (a VerbsError, an OSError) with errno None, naming
    libsiw's refused key on a siw device, not an EIO nobody reported."""
    fake = _FakeSetupLib(-errno.EIO, lib.RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO, inline_tried=64)
    monkeypatch.setattr(cm, "lib", fake)
    for device, siw in (("siw0", True), ("mlx5_0", False)):
        pd = SimpleNamespace(_ptr=ffi.NULL, context=SimpleNamespace(name=device))
        with pytest.raises(ProviderError) as info:
            _cm_id().create_qp(pd, _resource(), _resource(), max_send_wr=8, max_recv_wr=4, fit_inline=True)
        assert isinstance(info.value, VerbsError) and isinstance(info.value, OSError)
        assert (info.value.call, info.value.errno) == ("rdma_create_qp", None)
        assert f"the provider of {device} failed and gave no errno" in str(info.value)
        assert "inline=64" in str(info.value)
        assert ("SIW_INVAL_UOBJ_KEY" in str(info.value)) is siw


def test_create_qp_refuses_a_bad_ack_timeout_and_a_closed_id(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeSetupLib(0)
    monkeypatch.setattr(cm, "lib", fake)
    with pytest.raises(ValueError, match="between 0 and 31"):
        _cm_id().create_qp(
            _resource(), _resource(), _resource(), max_send_wr=8, max_recv_wr=4, ack_timeout=32
        )
    closed = _cm_id()
    closed.closed = True
    with pytest.raises(VerbsError, match="closed"):
        closed.create_qp(_resource(), _resource(), _resource(), max_send_wr=8, max_recv_wr=4)
    assert fake.calls == []


def test_connect_and_accept_pass_the_handshake_and_map_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeSetupLib(0)
    monkeypatch.setattr(cm, "lib", fake)
    cm_id = _cm_id()
    cm_id.connect(b"hello", retry_count=5, rnr_retry_count=2, responder_resources=3, initiator_depth=4)
    cm_id.accept(b"hi", rnr_retry_count=1, responder_resources=6, initiator_depth=7)
    assert fake.calls == [
        ("connect", (ffi.NULL, b"hello", 5, 5, 2, 3, 4)),
        ("accept", (ffi.NULL, b"hi", 2, 1, 6, 7)),
    ]
    with pytest.raises(ValueError, match="255"):
        cm_id.connect(b"x" * 256)
    with pytest.raises(ValueError, match="255"):
        cm_id.accept(b"x" * 256)
    fake = _FakeSetupLib(-errno.ECONNREFUSED)
    monkeypatch.setattr(cm, "lib", fake)
    with pytest.raises(VerbsError) as info:
        cm_id.connect(b"hello")
    assert (info.value.call, info.value.errno) == ("rdma_connect", errno.ECONNREFUSED)
    with pytest.raises(VerbsError) as info:
        cm_id.accept(b"hello")
    assert (info.value.call, info.value.errno) == ("rdma_accept", errno.ECONNREFUSED)
