"""Errors of the verbs layer carry what the provider said: the errno a provider returns from a post (never
EIO in its place), and a connect refused at once (iWARP connects over TCP: ``rdma_connect`` itself fails
with ECONNREFUSED when nobody listens) is :class:`rdmaio.ConnectionRefusedError`, like a ``REJECTED``
event. Natively, with the C calls replaced by fakes."""

from __future__ import annotations

import builtins
import errno
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import rdmaio
from rdmaio._ffi import ffi
from rdmaio.errors import VerbsError
from rdmaio.verbs import _base, cm, qp
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
