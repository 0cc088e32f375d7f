"""Errors of the verbs layer carry what the provider said: the errno a provider returns from a post (never
EIO in its place), and a connect refused at once (iWARP connects over TCP: ``rdma_connect`` itself fails
with ECONNREFUSED when nobody listens) is :class:`rdmaio.ConnectionRefusedError`, like a ``REJECTED``
event. Natively, with the C calls replaced by fakes."""

from __future__ import annotations

import builtins
import errno
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import rdmaio
from rdmaio._ffi import ffi
from rdmaio.core.dial import IWARP_BACKLOG_RESET, connect_error
from rdmaio.errors import VerbsError
from rdmaio.verbs import CMEvent, CMEventType, _base, cm, qp
from rdmaio.verbs import srq as srq_module
from rdmaio.verbs._base import make_sockaddr


def _bare(cls: type[Any], **attrs: Any) -> Any:
    """An instance of a verbs class without its C object (the C calls it makes are faked)."""
    obj = cls.__new__(cls)
    obj.closed = False
    obj._generation = _base.fork_generation()
    obj._dependents = {}
    obj._parents = []
    obj._ptr = ffi.NULL
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


@pytest.fixture
def cm_id(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    peer = make_sockaddr("198.18.0.2", 7471)
    fake = SimpleNamespace(
        rc=-errno.ECONNREFUSED,
        rdma_get_peer_addr=lambda ptr: ffi.cast("struct sockaddr *", peer),
    )
    fake.rdmaio_setup_connect = lambda *args: fake.rc
    monkeypatch.setattr(cm, "lib", fake)
    obj = _bare(cm.CMId)
    obj.fake = fake
    yield obj
    obj.closed = True  # nothing to destroy: there is no C object


def test_connect_refused_at_once_is_connection_refused_error(cm_id: Any) -> None:
    """Before: ``VerbsError: rdma_connect() [ECONNREFUSED]``, which is no ConnectionRefusedError."""
    with pytest.raises(rdmaio.ConnectionRefusedError) as info:
        cm_id.connect(b"handshake")
    assert isinstance(info.value, builtins.ConnectionRefusedError)
    assert isinstance(info.value, VerbsError)  # still the failed call's error, as callers caught it before
    assert info.value.errno == errno.ECONNREFUSED
    assert info.value.call == "rdma_connect"
    assert str(info.value) == (
        "rdma_connect() [ECONNREFUSED]: connection refused by 198.18.0.2 port 7471: no listener on that port"
    )


def test_connect_refused_names_no_peer_when_the_id_has_none(cm_id: Any) -> None:
    cm_id.fake.rdma_get_peer_addr = lambda ptr: ffi.NULL
    with pytest.raises(rdmaio.ConnectionRefusedError, match="refused by the peer: no listener"):
        cm_id.connect(b"")


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOMEM, errno.ETIMEDOUT])
def test_other_connect_errors_stay_verbs_errors_with_their_errno(cm_id: Any, err: int) -> None:
    cm_id.fake.rc = -err
    with pytest.raises(VerbsError) as info:
        cm_id.connect(b"")
    assert not isinstance(info.value, builtins.ConnectionRefusedError)
    assert info.value.errno == err and info.value.call == "rdma_connect"


@pytest.mark.parametrize(
    "err", [errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN]
)
def test_connect_unreachable_at_once_is_unreachable_error(cm_id: Any, err: int) -> None:
    """iWARP's TCP connect inside rdma_connect fails at once when the peer cannot be reached. Before:
    ``VerbsError: rdma_connect() [ETIMEDOUT]``, which is no UnreachableError."""
    cm_id.fake.rc = -err
    with pytest.raises(rdmaio.UnreachableError) as info:
        cm_id.connect(b"")
    assert isinstance(info.value, VerbsError) and isinstance(info.value, OSError)
    assert not isinstance(info.value, builtins.ConnectionRefusedError)
    assert info.value.errno == err and info.value.call == "rdma_connect"
    assert str(info.value) == (
        f"rdma_connect() [{errno.errorcode[err]}]: 198.18.0.2 port 7471 unreachable: {os.strerror(err)}"
    )


@pytest.mark.parametrize("err", [errno.EADDRNOTAVAIL, errno.EADDRINUSE])
def test_connect_from_an_unusable_local_address_is_address_error(cm_id: Any, err: int) -> None:
    cm_id.fake.rc = -err
    with pytest.raises(rdmaio.AddressError) as info:
        cm_id.connect(b"")
    assert isinstance(info.value, VerbsError)
    assert info.value.errno == err and info.value.call == "rdma_connect"
    assert "cannot connect to 198.18.0.2 port 7471 from this address" in str(info.value)


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOMEM, errno.EPROTO])
def test_connect_errors_without_a_meaning_for_the_peer_stay_plain_verbs_errors(cm_id: Any, err: int) -> None:
    cm_id.fake.rc = -err
    with pytest.raises(VerbsError) as info:
        cm_id.connect(b"")
    assert type(info.value) is VerbsError
    assert info.value.errno == err


@pytest.mark.parametrize("err", [errno.EINVAL, errno.EOPNOTSUPP, errno.ENOMEM])
def test_post_send_error_carries_the_providers_errno(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    """A provider that refuses a work request (siw: -EINVAL for SEND_WITH_IMM) is reported with its errno,
    never as EIO; the C helper hands it up as -errno whichever sign the provider used."""
    bad = ffi.new("int[1]")

    def post_sends(ptr: Any, sends: Any, count: int, bad_index: Any) -> int:
        bad_index[0] = 1
        return -err

    monkeypatch.setattr(qp, "lib", SimpleNamespace(rdmaio_post_sends=post_sends))
    queue = _bare(qp.QueuePair, _sends=ffi.new("struct rdmaio_send[]", 2), _bad=bad)
    try:
        with pytest.raises(VerbsError) as info:
            queue.post_sends(2)
    finally:
        queue.closed = True
    assert info.value.errno == err != errno.EIO
    assert info.value.call == "ibv_post_send"
    assert str(info.value).startswith(f"ibv_post_send() [{errno.errorcode[err]}]: ")
    assert "request 1 of 2" in str(info.value)


def _event(kind: CMEventType, status: int) -> CMEvent:
    return CMEvent(kind, status, 0, 0, b"", 0, 0, 0, 0, None)


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (-errno.ECONNRESET, f"connection to 198.18.0.1 port 7471 {IWARP_BACKLOG_RESET} (iWARP, status -104)"),
        (-errno.ECONNREFUSED, "refused by 198.18.0.1 port 7471: no listener on that port, or the listener"),
        (8, "connection refused by 198.18.0.1 port 7471: no listener on that port"),
        (28, "connection rejected by 198.18.0.1 port 7471 (status 28)"),
    ],
)
def test_a_rejected_connect_is_connection_refused_with_what_the_transport_said(
    status: int, says: str
) -> None:
    """iWARP reports a connect its listener's kernel reset (the kernel's listen backlog is full) as REJECTED
    with -ECONNRESET, and a TCP/MPA refusal with -ECONNREFUSED; InfiniBand/RoCE use the IB CM reasons.
    Each is a ConnectionRefusedError (errno ECONNREFUSED) naming what happened. Before: the iWARP ones read
    "connection rejected (status -104)", which names neither cause."""
    exc = connect_error(_event(CMEventType.REJECTED, status), "198.18.0.1 port 7471")
    assert isinstance(exc, rdmaio.ConnectionRefusedError) and isinstance(exc, builtins.ConnectionRefusedError)
    assert exc.errno == errno.ECONNREFUSED and exc.call == "rdma_connect"
    assert says in str(exc), str(exc)


@pytest.mark.parametrize("kind", [CMEventType.UNREACHABLE, CMEventType.CONNECT_ERROR])
def test_an_unreachable_event_stays_unreachable_error(kind: CMEventType) -> None:
    exc = connect_error(_event(kind, -errno.ETIMEDOUT), "198.18.0.1 port 7471")
    assert isinstance(exc, rdmaio.UnreachableError) and exc.errno == errno.ETIMEDOUT


def _bare_srq(monkeypatch: pytest.MonkeyPatch, query_rc: int) -> Any:
    """A SharedReceiveQueue as created with 16 receives, 1 scatter entry and limit 4, on a fake device whose
    ``ibv_query_srq`` returns ``query_rc`` (and fills 32/2/5 when it answers)."""
    calls: list[str] = []

    def query(ptr: Any, attr: Any) -> int:
        calls.append("ibv_query_srq")
        if query_rc == 0:
            attr.max_wr, attr.max_sge, attr.srq_limit = 32, 2, 5
        return query_rc

    monkeypatch.setattr(srq_module, "lib", SimpleNamespace(ibv_query_srq=query))
    obj = _bare(srq_module.SharedReceiveQueue, max_wr=16, max_sge=1, armed_limit=4, query_supported=None)
    obj.calls = calls
    obj._destroy = lambda: None  # there is no C object, whatever the test leaves behind
    return obj


@pytest.mark.parametrize("rc", [errno.EOPNOTSUPP, -errno.EOPNOTSUPP, errno.ENOSYS])
def test_srq_query_on_a_device_without_it_answers_what_was_created(
    monkeypatch: pytest.MonkeyPatch, rc: int
) -> None:
    """Soft-iWARP's ibv_query_srq is EOPNOTSUPP. Before: ``VerbsError: ibv_query_srq() [EOPNOTSUPP]``."""
    srq = _bare_srq(monkeypatch, rc)
    assert srq.query() == (16, 1, 4)
    assert srq.query_supported is False
    srq.armed_limit = 2  # what arm_limit records
    assert srq.query() == (16, 1, 2)
    assert srq.calls == ["ibv_query_srq"]  # asked once: the device's answer does not change


def test_srq_query_answers_from_the_device_when_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    srq = _bare_srq(monkeypatch, 0)
    assert srq.query() == (32, 2, 5) and srq.query_supported is True


@pytest.mark.parametrize("rc", [errno.EINVAL, -errno.EIO])
def test_srq_query_other_failures_still_raise(monkeypatch: pytest.MonkeyPatch, rc: int) -> None:
    srq = _bare_srq(monkeypatch, rc)
    with pytest.raises(VerbsError) as info:
        srq.query()
    assert info.value.errno == abs(rc) and info.value.call == "ibv_query_srq"
    assert srq.query_supported is None
