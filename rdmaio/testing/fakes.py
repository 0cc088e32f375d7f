"""Fake verbs objects, a fake core backend and a fake Endpoint, shipped once for every unit test.

Unit tests run without an RDMA device: they drive the real core, protocol and compatibility layers over
in-memory stand-ins for the objects below them. Each stand-in lives here once (as ``trio.testing`` ships
trio's), so a test file imports it instead of carrying its own copy, and a behaviour a test relies on
(recording posted work requests, counting calls, failing on demand) is written and documented in one place.

Verbs level (what :mod:`rdmaio.verbs` hands the core):

* :class:`FakeQP` -- a queue pair that records posted sends and one-sided requests, optionally checks posted
  slots against their ring, and can hand chains to a "wire" one loop iteration later.
* :class:`FakeCMId` -- an rdma_cm id: addresses, its device, disconnect counting, accept/reject, close.
* :class:`FakeEventChannel` -- an rdma_cm event channel handing out scripted events, counting its reads.
* :class:`FakeCompletionChannel`, :class:`FakeCQ`, :class:`FakeCompletionBatch` -- a completion channel,
  CQs with scripted completion records grouped as the C helper groups them, and the poll buffer.
* :class:`FakeDevice` -- a device context: handle, name, async fd, scripted async events.
* :class:`FakeProtectionDomain` -- a protection domain: close recorded.
* :class:`FakeRegion`, :class:`FakeRegistration`, :class:`FakeWindow`, :class:`FakeRegistrar` -- memory
  registrations (a real ``cffi`` view of the buffer, so addresses are real), a cached registration, a
  type-2 memory window, and a registrar for ring chunks.
* :class:`FakeMemoryLib` -- the few C functions the memory objects call, with scripted return codes.
* :class:`FakeDeviceHandles` -- ``verbs.cm_device_handles``: the devices librdmacm still lists.

Core level:

* :class:`FakeBackend` -- the loop backend with a clock the test moves (:class:`FakeTimer`), recording
  readers and spawned tasks.
* :class:`FakeDomain` -- a device's protection domain and caches, counting closes and recording failed CQs.
* :class:`FakeTransport`, :class:`FakeReactor`, :func:`wire` -- the verbs resources of one connection
  and the reactor it registers with (or a server's acceptor adopts its ids from); :func:`wire` makes one
  transport's posts land in another's receive slots, as the NIC would, so two real connections can talk
  back to back.
* :func:`fake_completion`, :func:`completion_array` -- a work completion record (a real
  ``struct rdmaio_wc``, which the C frame rules read) and several in one array.

Compatibility-layer level:

* :class:`FakeEndpoint` (and :func:`fake_pair`) -- the parts of :class:`rdmaio.Endpoint` that
  :mod:`rdmaio.streams`, :mod:`rdmaio.anyio` and :mod:`rdmaio.dask` use, with the real one's documented
  semantics, alone (fed by the test) or as one of a connected pair.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any, ClassVar, Protocol

from rdmaio import verbs
from rdmaio._ffi import ffi, lib
from rdmaio.errors import ConnectionResetError as RdmaConnectionResetError
from rdmaio.errors import EndpointClosedError, MessageTooLargeError, VerbsError
from rdmaio.options import Options
from rdmaio.verbs.path import PathAttributes

__all__ = [
    "IWARP_ONESIDED_CAPS",
    "RXE_ONESIDED_CAPS",
    "SLOTLESS",
    "Chain",
    "CompletionGroup",
    "CompletionRecord",
    "FakeBackend",
    "FakeCMId",
    "FakeCQ",
    "FakeCapsDevice",
    "FakeCompletionBatch",
    "FakeCompletionChannel",
    "FakeDevice",
    "FakeDeviceHandles",
    "FakeDomain",
    "FakeEndpoint",
    "FakeEventChannel",
    "FakeMemoryLib",
    "FakeProtectionDomain",
    "FakeQP",
    "FakeReactor",
    "FakeRegion",
    "FakeRegistrar",
    "FakeRegistration",
    "FakeTimer",
    "FakeTransport",
    "FakeWindow",
    "PostedSend",
    "completion_array",
    "fake_completion",
    "fake_pair",
    "wire",
]

#: The bit of a send work request's index that marks a frame sent without a send slot (empty or inline).
SLOTLESS = 1 << 31


class PostedSend(tuple[int, bytes, int, int]):
    """One request of a posted chain: ``(wr_id, bytes, imm_data, send_flags)``, with its ``opcode``
    (``IBV_WR_SEND_WITH_IMM`` in the immediate framing, ``IBV_WR_SEND`` in the header framing)."""

    opcode: int


#: A posted chain as :class:`FakeQP` records it: one ``(wr_id, bytes, imm_data, send_flags)`` per request
#: (a :class:`PostedSend`, which also carries the opcode).
Chain = list[tuple[int, bytes, int, int]]

_EINVAL = 22
#: The opcodes a device without immediate data (iWARP: libsiw) refuses with EINVAL.
_IMMEDIATE_OPCODES = frozenset((int(lib.IBV_WR_SEND_WITH_IMM), int(lib.IBV_WR_RDMA_WRITE_WITH_IMM)))

_RDMA_FIELDS = ("wr_id", "local_addr", "length", "lkey", "opcode", "send_flags", "imm_data", "rkey")


# --- verbs: queue pair ---------------------------------------------------------------------------------


class FakeQP:
    """A queue pair that records what is posted on it.

    Sends: the core fills :attr:`send_array` (a real ``struct rdmaio_send[depth]``, as the sender's C ring
    fills the queue pair's) and calls :meth:`post_sends`; each call appends one chain to :attr:`posts`, the
    bytes of each request read at post time (as ``ibv_post_send`` copies inline data and the NIC reads the
    slot). With ``ring`` given, every request is checked against it: a slot request
    names a registered slot with its chunk's key, a slotless one is empty or inline. With :attr:`wire` set,
    each chain is also handed to it one loop iteration later (see :func:`wire`).

    One-sided requests: :meth:`post_rdma` (from :attr:`rdma_array`) and :meth:`post_batch` (as the C
    helper fills a batch) append one dict per request to :attr:`posted` and the request count of each
    doorbell to :attr:`calls`. Set :attr:`fail_next` to make them raise :class:`~rdmaio.VerbsError`, and
    :attr:`send_error` to make :meth:`post_sends` raise it.
    """

    def __init__(
        self,
        depth: int = 8,
        *,
        qp_num: int = 0,
        ring: Any = None,
        rdma_depth: int = 16,
        immediate: bool = True,
    ) -> None:
        self.qp_num = qp_num
        #: False: a device without immediate data (iWARP): a SEND or WRITE with immediate data is refused
        #: with EINVAL at the post, as libsiw refuses it, and nothing of the chain is posted.
        self.immediate = immediate
        # A real ``struct rdmaio_send[]``, as the queue pair's: the sender's C ring fills it.
        self.send_array: Any = ffi.new("struct rdmaio_send[]", depth)
        self.rdma_array: Any = ffi.new("struct rdmaio_rdma_op[]", rdma_depth)
        self.ring = ring
        self.posts: list[Chain] = []
        self.wire: Callable[[Chain], None] | None = None
        self.send_error: BaseException | None = None
        self.posted: list[dict[str, int]] = []
        self.calls: list[int] = []
        self.fail_next = False
        self.allow_empty_writes = False
        self.empty_writes: list[int] = []
        #: The wr_ids of the zero-length READs posted (the keepalive's probe on iWARP), allowed by
        #: :attr:`allow_empty_writes` as the WRITE probe is. Like the WRITE probe, none ever completes
        #: here: a test delivers the completion itself, or lets the peer be "gone".
        self.empty_reads: list[int] = []

    @property
    def chains(self) -> int:
        """How many chains (doorbells) :meth:`post_sends` has posted."""
        return len(self.posts)

    def post_sends(self, count: int) -> None:
        """Post the first ``count`` requests of :attr:`send_array` as one chain."""
        if self.send_error is not None:
            raise self.send_error
        assert 0 < count <= len(self.send_array), count  # the C helper would read past the array
        chain: Chain = []
        ring = self.ring
        if not self.immediate:
            for wr in self.send_array[0:count]:
                if int(wr.opcode) in _IMMEDIATE_OPCODES:
                    raise VerbsError("ibv_post_send() [EINVAL]", errno=_EINVAL, call="ibv_post_send")
        for wr in self.send_array[0:count]:
            if ring is not None and not verbs.wr_index(wr.wr_id) & SLOTLESS:
                index = verbs.wr_index(wr.wr_id)
                # Every posted slot is registered, with the key of its chunk.
                assert index < ring.slots and wr.length
                assert wr.lkey == ring.lkeys[index] >= 100
                assert not wr.send_flags & verbs.SEND_INLINE
                off = wr.addr - ring.addr
                data = bytes(ring.view[off : off + wr.length])
            else:
                if ring is not None:
                    # No slot: empty, or inline (the bytes are read at post time).
                    assert wr.length == 0 or wr.send_flags & verbs.SEND_INLINE
                data = bytes(ffi.buffer(ffi.cast("char *", wr.addr), wr.length)) if wr.length else b""
            posted = PostedSend((int(wr.wr_id), data, int(wr.imm_data), int(wr.send_flags)))
            posted.opcode = int(wr.opcode)
            chain.append(posted)
        self.posts.append(chain)
        if self.wire is not None:
            asyncio.get_running_loop().call_soon(self.wire, chain)

    def post_empty_write(self, wr_id: int) -> None:
        """A keepalive probe: recorded in :attr:`empty_writes` if :attr:`allow_empty_writes`, else fails."""
        if not self.allow_empty_writes:
            raise AssertionError("this fake queue pair expects no keepalive probe")
        self.empty_writes.append(wr_id)

    def post_empty_read(self, wr_id: int) -> None:
        """A keepalive probe on iWARP: recorded in :attr:`empty_reads` if :attr:`allow_empty_writes`, else
        fails."""
        if not self.allow_empty_writes:
            raise AssertionError("this fake queue pair expects no keepalive probe")
        self.empty_reads.append(wr_id)

    def _check_fail(self) -> None:
        if self.fail_next:
            raise VerbsError("fake post failure", errno=12, call="ibv_post_send")

    def post_rdma(self, count: int) -> None:
        """Post the first ``count`` one-sided requests of :attr:`rdma_array` with one doorbell."""
        self._check_fail()
        if not self.immediate:
            for i in range(count):
                if int(self.rdma_array[i].opcode) in _IMMEDIATE_OPCODES:
                    raise VerbsError("ibv_post_send() [EINVAL]", errno=_EINVAL, call="ibv_post_send")
        self.calls.append(count)
        for i in range(count):
            wr = self.rdma_array[i]
            entry = {name: int(getattr(wr, name)) for name in _RDMA_FIELDS}
            entry.update(remote_addr=int(wr.remote_addr), compare_add=int(wr.compare_add), swap=int(wr.swap))
            self.posted.append(entry)

    def post_batch(
        self, wr_id: int, opcode: int, local_addr: int, lkey: int, rkey: int, remote_addr: Any, **arrays: Any
    ) -> None:
        """As the C helper fills a batch: request i at ``local_addr + local_offset[i]`` (default ``8 * i``),
        ``length[i]`` bytes (default 8), only the last signalled; each request is one entry of
        :attr:`posted`, the batch one entry of :attr:`calls`."""
        self._check_fail()
        count = len(remote_addr)
        self.calls.append(count)
        lengths, offsets = arrays.get("length"), arrays.get("local_offset")
        compare_add = arrays.get("compare_add")
        for i in range(count):
            self.posted.append(
                {
                    "wr_id": wr_id,
                    "local_addr": local_addr + (offsets[i] if offsets is not None else 8 * i),
                    "length": lengths[i] if lengths is not None else 8,
                    "lkey": lkey,
                    "opcode": opcode,
                    "send_flags": int(lib.IBV_SEND_SIGNALED) if i == count - 1 else 0,
                    "rkey": rkey,
                    "remote_addr": remote_addr[i],
                    "compare_add": compare_add[i] if compare_add is not None else 0,
                }
            )


# --- verbs: rdma_cm ------------------------------------------------------------------------------------


class FakeCMId:
    """An rdma_cm id: its handle, addresses, port and device; counts disconnects, records close.

    With :attr:`on_disconnect` set, each :meth:`disconnect` calls it one loop iteration later (the
    peer's DISCONNECTED event, in a back-to-back pair). The id of a connection request records how a
    server answers it: :meth:`accept` keeps the connection parameters in :attr:`accepted`,
    :meth:`reject` sets :attr:`rejected`.
    """

    def __init__(
        self,
        handle: int = 0,
        device: Any = None,
        *,
        local_address: tuple[str, int] = ("198.18.0.1", 2),
        peer_address: tuple[str, int] = ("198.18.0.2", 1),
        port_num: int = 1,
    ) -> None:
        self.handle = handle
        self._device = device
        self.local_address = local_address
        self.peer_address = peer_address
        self.port_num = port_num
        self.disconnects = 0
        self.on_disconnect: Callable[[], None] | None = None
        self.accepted: dict[str, int] | None = None
        self.rejected = False
        self.closed = False

    def device(self) -> Any:
        """The device the id is bound to (None before address resolution)."""
        return self._device

    def disconnect(self) -> None:
        """Count the call; schedule :attr:`on_disconnect` if set."""
        self.disconnects += 1
        if self.on_disconnect is not None:
            asyncio.get_running_loop().call_soon(self.on_disconnect)

    def accept(self, private_data: bytes, **params: int) -> None:
        """Accept the connection request: the parameters (``rnr_retry_count``, ``responder_resources``,
        ``initiator_depth``) are kept in :attr:`accepted`; the private data is not kept."""
        self.accepted = params

    def reject(self) -> None:
        """Reject the connection request (recorded in :attr:`rejected`)."""
        self.rejected = True

    def close(self) -> None:
        """Destroy the id (recorded in :attr:`closed`)."""
        self.closed = True

    #: What :meth:`query_path` answers besides the port and the GIDs (a RoCE v2 port of 4096 bytes).
    path_link_layer = "Ethernet"
    path_gid_type = "RoCE v2"
    path_gid_index = 1
    path_mtu = 4096
    #: Calls of :meth:`query_path` (each one is system calls on a real id).
    path_queries = 0

    def query_path(self) -> PathAttributes:
        """The path as a device would report it: the GIDs are the IPv4-mapped addresses of the local and
        peer addresses (as RoCE v2 GIDs are), the rest the ``path_*`` class attributes; counted in
        :attr:`path_queries`. Raises :class:`~rdmaio.VerbsError` once :meth:`close` ran, as a real id."""
        if self.closed:
            raise VerbsError("CMId is closed", call="rdma_destroy_id")
        self.path_queries += 1

        def gid(address: tuple[str, int]) -> bytes:
            return ipaddress.IPv6Address(f"::ffff:{address[0]}").packed

        return PathAttributes(
            port=self.port_num,
            link_layer=self.path_link_layer,
            iwarp=False,
            local_gid=gid(self.local_address),
            remote_gid=gid(self.peer_address),
            gid_index=self.path_gid_index,
            gid_type=self.path_gid_type,
            active_mtu=self.path_mtu,
            path_mtu=self.path_mtu,
        )


class FakeEventChannel:
    """An rdma_cm event channel that hands out the given events in order, then None. :attr:`events` may be
    extended later; :attr:`calls` counts the reads (each one a system call on a real channel, the empty
    read too)."""

    fd = 41

    def __init__(self, *events: verbs.CMEvent) -> None:
        self.closed = False
        self.events: collections.deque[verbs.CMEvent] = collections.deque(events)
        self.calls = 0

    def get_event(self) -> verbs.CMEvent | None:
        """The next scripted event, None when there is none (a non-blocking channel); counted in
        :attr:`calls`."""
        self.calls += 1
        return self.events.popleft() if self.events else None

    def close(self) -> None:
        """Destroy the channel (recorded in :attr:`closed`)."""
        self.closed = True


class FakeDeviceHandles:
    """Stands in for ``verbs.cm_device_handles``: answers from :attr:`answers` (the last one repeats),
    each answer recorded in :attr:`calls`."""

    def __init__(self) -> None:
        self.answers: list[set[int]] = [set()]
        self.calls: list[set[int]] = []

    def __call__(self) -> set[int]:
        answer = self.answers[0] if len(self.answers) == 1 else self.answers.pop(0)
        self.calls.append(answer)
        return answer


# --- verbs: completions --------------------------------------------------------------------------------


@dataclasses.dataclass
class CompletionRecord:
    """A completion to script on a :class:`FakeCQ` (what the dispatcher reads, plus what a receiver reads);
    :meth:`FakeCQ.poll_grouped` writes it into a real ``struct rdmaio_wc`` of the poll buffer."""

    wr_id: int
    qp_num: int
    status: int = 0
    opcode: int = 0
    byte_len: int = 0
    imm_data: int = 0
    flags: int = 0
    vendor_err: int = 0


@dataclasses.dataclass
class CompletionGroup:
    """One group of a polled batch: the records of one dispatch key, ``count`` of them from ``start``."""

    key: int
    start: int
    count: int


_WC_FIELDS = ("wr_id", "status", "opcode", "byte_len", "imm_data", "flags", "vendor_err", "qp_num")


def _wc_fields(record: Any) -> dict[str, int]:
    return {name: int(getattr(record, name, 0)) for name in _WC_FIELDS}


def completion_array(records: Any) -> Any:
    """The completion records ``records`` (from :func:`fake_completion`, :class:`CompletionRecord` or any
    object with their fields) copied into one ``struct rdmaio_wc`` array, as a CQ poll hands them to a
    completion handler: the C frame rules read it."""
    array = ffi.new("struct rdmaio_wc[]", max(len(records), 1))
    for i, record in enumerate(records):
        array[i] = record[0] if isinstance(record, ffi.CData) else _wc_fields(record)
    return array


class FakeCompletionBatch:
    """The poll buffer: room for ``size`` real ``struct rdmaio_wc`` records (:attr:`records`), filled by
    :meth:`FakeCQ.poll_grouped`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.records: Any = ffi.new("struct rdmaio_wc[]", size)
        self.groups: list[CompletionGroup] = []
        self.ngroups = 0

    def copy_records(self, start: int, count: int) -> Any:
        """Records ``start`` to ``start + count`` of the last poll (a new ``struct rdmaio_wc[count]``)."""
        if not 0 <= start <= start + count <= self.size:
            raise IndexError(f"records {start}..{start + count} of a batch of {self.size}")
        copy = ffi.new("struct rdmaio_wc[]", max(count, 1))
        ffi.memmove(copy, self.records + start, count * ffi.sizeof("struct rdmaio_wc"))
        return copy


class FakeCQ:
    """A completion queue with scripted completions (append to :attr:`pending`); each instance gets a new
    :attr:`handle`. Closing twice is an error; a close is written to ``log`` when one is given."""

    _next_handle: ClassVar[int] = 0x1000

    def __init__(self, cqe: int, log: list[str] | None = None) -> None:
        FakeCQ._next_handle += 0x40
        self.handle = FakeCQ._next_handle
        self.cqe = cqe
        self.pending: list[Any] = []  # CompletionRecord or fake_completion() records
        self.closed = False
        self.log = log

    def poll_grouped(self, batch: FakeCompletionBatch) -> int:
        """Move up to ``batch.size`` records into ``batch``, grouped by dispatch key in first-seen order
        (as the C helper does); returns how many."""
        taken, self.pending = self.pending[: batch.size], self.pending[batch.size :]
        order: dict[int, list[Any]] = {}
        for rec in taken:
            order.setdefault(verbs.dispatch_key(rec.qp_num, verbs.wr_tag(rec.wr_id)), []).append(rec)
        batch.groups, start = [], 0
        for key, recs in order.items():
            batch.groups.append(CompletionGroup(key, start, len(recs)))
            for rec in recs:
                batch.records[start] = _wc_fields(rec)
                start += 1
        batch.ngroups = len(batch.groups)
        return len(taken)

    def close(self) -> None:
        """Destroy the CQ (once)."""
        assert not self.closed, "CQ destroyed twice"
        self.closed = True
        if self.log is not None:
            self.log.append(f"destroy cq {self.cqe}")


class FakeCompletionChannel:
    """A completion channel: append CQ handles to :attr:`fired`; :meth:`drain_events` reports each once."""

    fd = 42

    def __init__(self, log: list[str] | None = None) -> None:
        self.fired: list[int] = []
        self.closed = False
        self.log = log

    def drain_events(self) -> tuple[list[int], bool, int]:
        """(the CQs that fired, deduplicated in order; whether more may wait; how many events)."""
        fired, self.fired = self.fired, []
        return list(dict.fromkeys(fired)), False, len(fired)

    def close(self) -> None:
        """Destroy the channel (written to ``log`` when one is given)."""
        self.closed = True
        if self.log is not None:
            self.log.append("destroy channel")


def fake_completion(
    wr_id: int,
    opcode: int,
    byte_len: int = 0,
    imm_data: int = 0,
    flags: int = 0,
    status: int = 0,
    qp_num: int = 0,
) -> Any:
    """A work completion: a real ``struct rdmaio_wc`` (a cffi pointer to one, with the fields the
    completion handlers read); :func:`completion_array` puts several in one array, as a poll does."""
    return ffi.new(
        "struct rdmaio_wc *",
        {
            "wr_id": wr_id,
            "status": status,
            "opcode": opcode,
            "byte_len": byte_len,
            "imm_data": imm_data,
            "flags": flags,
            "vendor_err": 0,
            "qp_num": qp_num,
        },
    )


# --- verbs: device -------------------------------------------------------------------------------------


class FakeDevice:
    """A device context: a handle, a name (``fake<handle>``), an async fd and scripted async events."""

    def __init__(self, handle: int, *events: verbs.AsyncEvent, async_fd: int | None = None) -> None:
        self.handle = handle
        self.name = f"fake{handle}"
        self.async_fd = 100 + handle if async_fd is None else async_fd
        self.events: collections.deque[verbs.AsyncEvent] = collections.deque(events)

    def get_async_event(self) -> verbs.AsyncEvent | None:
        """The next scripted async event, None when there is none."""
        return self.events.popleft() if self.events else None


class FakeProtectionDomain:
    """A protection domain on ``device`` (what a :class:`~rdmaio.core.domain.Domain` asks of its own):
    :meth:`close` recorded in :attr:`closed`. Monkeypatch it in for ``rdmaio.core.domain``'s
    ``ProtectionDomain`` to build a real Domain without a device."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.closed = False

    def close(self) -> None:
        """Deallocate the protection domain (recorded in :attr:`closed`)."""
        self.closed = True


# --- verbs: memory -------------------------------------------------------------------------------------


class FakeRegion:
    """A memory region over ``buffer``: real ``addr``/``length`` (a cffi view keeps the buffer referenced),
    ``lkey == rkey`` unique per region (and per window, which draws from the same counter).

    ``readonly`` defaults to the buffer's own; with ``log`` given, registration and deregistration are
    written to it (``"reg <length>"``, ``"dereg <length>"``). :attr:`closes` counts :meth:`close` calls;
    with ``strict`` a second close is an error.
    """

    next_key: ClassVar[int] = 0x100

    def __init__(
        self,
        buffer: Any,
        access: int = 0,
        readonly: bool | None = None,
        *,
        log: list[str] | None = None,
        strict: bool = False,
    ) -> None:
        if readonly is None:
            readonly = memoryview(buffer).readonly
        self.buffer = buffer
        self.cbuf: Any = ffi.from_buffer(buffer, require_writable=not readonly)
        self.addr = int(ffi.cast("uintptr_t", self.cbuf))
        self.length = len(self.cbuf)
        FakeRegion.next_key += 1
        self.lkey = self.rkey = FakeRegion.next_key
        self.access = access
        self.closed = False
        self.closes = 0
        self.strict = strict
        self.log = log
        if log is not None:
            log.append(f"reg {self.length}")

    def close(self) -> None:
        """Deregister (recorded; a second call is an error when ``strict``)."""
        assert not (self.strict and self.closed), "region deregistered twice"
        self.closes += 1
        self.closed = True
        if self.log is not None:
            self.log.append(f"dereg {self.length}")


class FakeWindow:
    """A type-2 memory window bound over ``region`` by the bind request ``wr_id`` (pending until the test
    completes it); freeing it after its region is deregistered is an error."""

    def __init__(self, region: FakeRegion, wr_id: int, access: int) -> None:
        self.region = region
        self.wr_id = wr_id
        self.access = access
        FakeRegion.next_key += 1
        self.rkey = FakeRegion.next_key
        self.closed = False

    def close(self) -> None:
        """Free the window (its region must still be registered)."""
        assert not self.region.closed, "a window must be freed before its region is deregistered"
        self.closed = True


class FakeRegistration:
    """A registration-cache entry over ``buffer``: its region, address and key; :meth:`release` recorded."""

    def __init__(self, buffer: Any) -> None:
        self.region = FakeRegion(buffer)
        self.addr, self.lkey = self.region.addr, self.region.lkey
        self.released = False

    def release(self) -> None:
        """Hand the registration back to the cache."""
        self.released = True


class FakeRegistrar:
    """Registers ring chunks: chunk n gets ``lkey == first_lkey + n``. :attr:`chunks` holds every chunk's
    size in slots of ``slot_size`` bytes, :attr:`calls` counts registrations, :attr:`live` maps the lkeys
    registered now to their sizes (a region's ``close()`` removes it) and :attr:`slots` sums them."""

    def __init__(self, slot_size: int, first_lkey: int = 100) -> None:
        self.slot_size = slot_size
        self.first_lkey = first_lkey
        self.chunks: list[int] = []
        self.live: dict[int, int] = {}
        self.calls = 0

    def __call__(self, view: memoryview) -> Any:
        lkey = self.first_lkey + self.calls
        self.calls += 1
        slots = view.nbytes // self.slot_size
        self.chunks.append(slots)
        self.live[lkey] = slots
        return SimpleNamespace(lkey=lkey, close=lambda: self.live.pop(lkey))

    @property
    def slots(self) -> int:
        """Slots registered now."""
        return sum(self.live.values())


class FakeMemoryLib:
    """The C functions the memory objects call (``ibv_dereg_mr``, ``rdmaio_alloc_mw``,
    ``rdmaio_dealloc_mw``), returning the scripted codes; the freeing calls are recorded in :attr:`calls`."""

    def __init__(self, dereg_rc: int = 0, alloc_rc: int = 0, dealloc_rc: int = 0) -> None:
        self.dereg_rc = dereg_rc
        self.alloc_rc = alloc_rc
        self.dealloc_rc = dealloc_rc
        self.calls: list[str] = []

    def ibv_dereg_mr(self, ptr: Any) -> int:
        """Deregister: returns :attr:`dereg_rc`."""
        self.calls.append("ibv_dereg_mr")
        return self.dereg_rc

    def rdmaio_alloc_mw(self, pd: Any, out: Any) -> int:
        """Allocate a window: returns :attr:`alloc_rc`."""
        return self.alloc_rc

    def rdmaio_dealloc_mw(self, ptr: Any) -> int:
        """Free a window: returns :attr:`dealloc_rc`."""
        self.calls.append("ibv_dealloc_mw")
        return self.dealloc_rc


# --- core ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FakeTimer:
    """A timer of :class:`FakeBackend`: due at ``due`` on its clock unless cancelled."""

    due: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        """Cancel the timer."""
        self.cancelled = True


class FakeBackend:
    """The loop backend, with a clock the test moves: records readers added and removed, the names of
    spawned tasks (their coroutines are closed, never run) and the timers :meth:`call_later` made: those
    not run yet in :attr:`pending` (run by :meth:`advance`), all of them, in the order they were made, in
    :attr:`timers` (so a test can also cancel-check or fire one by hand)."""

    def __init__(self) -> None:
        self.readers: dict[int, Callable[[], None]] = {}
        self.removed_readers: list[int] = []
        self.spawned: list[str] = []
        self.now = 0.0
        self.pending: list[FakeTimer] = []
        self.timers: list[FakeTimer] = []

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Watch ``fd`` (recorded in :attr:`readers`)."""
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd`` (recorded in :attr:`removed_readers`)."""
        self.readers.pop(fd, None)
        self.removed_readers.append(fd)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Record the task's name; close the coroutine unrun."""
        coro.close()
        self.spawned.append(name)

    def clock(self) -> float:
        """The fake clock's time (:attr:`now`)."""
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeTimer:
        """A timer due ``delay`` seconds from :attr:`now`."""
        timer = FakeTimer(self.now + delay, callback)
        self.pending.append(timer)
        self.timers.append(timer)
        return timer

    def call_soon(self, callback: Callable[[], None]) -> FakeTimer:
        """A timer due now (it runs at the next :meth:`advance`)."""
        return self.call_later(0.0, callback)

    def advance(self, seconds: float) -> None:
        """Move the clock on and run the timers that are due and not cancelled, in order."""
        self.now += seconds
        due = [t for t in self.pending if t.due <= self.now]
        self.pending = [t for t in self.pending if t.due > self.now]
        for timer in due:
            if not timer.cancelled:
                timer.callback()


class FakeDomain:
    """A device's protection domain and registration caches: counts :meth:`close` calls and records the
    CQs the reactor reports failed (:attr:`failed_cqs`)."""

    def __init__(self) -> None:
        self.closes = 0
        self.closed = False
        self.failed_cqs: list[int] = []

    def cq_failed(self, handle: int) -> None:
        """The device reported an error on CQ ``handle`` (recorded in :attr:`failed_cqs`)."""
        self.failed_cqs.append(handle)

    def close(self) -> None:
        """Close the domain (counted)."""
        self.closes += 1
        self.closed = True


class FakeReactor:
    """The per-loop reactor a connection registers with (or a server's acceptor adopts the ids of
    connection requests from): a backend and keepalive timers, CM handlers by id, the handlers of adopted
    ids by id handle, watched QP keys, released ids, counted drains of the CM event channel.

    ``backend`` defaults to an asyncio backend on the running loop (then create the reactor inside one);
    pass a :class:`FakeBackend` to drive its timers by hand without a loop (:attr:`timers`).
    """

    def __init__(self, backend: Any = None) -> None:
        from rdmaio.core.backend import AsyncioBackend
        from rdmaio.core.keepalive import KeepaliveTimers

        self.backend: Any = AsyncioBackend(asyncio.get_running_loop()) if backend is None else backend
        self.keepalive_timers = KeepaliveTimers(self.backend)
        self.cm_handlers: dict[Any, Callable[[Any], None]] = {}
        self.handlers: dict[int, Callable[[Any], None]] = {}
        self.released: list[Any] = []
        self.watched: set[Any] = set()
        self.drained = 0

    @property
    def timers(self) -> list[FakeTimer]:
        """Every timer made on the backend, in order (with a :class:`FakeBackend` as the backend)."""
        timers: list[FakeTimer] = self.backend.timers
        return timers

    def set_handler(self, cm_id: Any, handler: Callable[[Any], None]) -> None:
        """Route ``cm_id``'s events to ``handler``."""
        self.cm_handlers[cm_id] = handler

    def adopt_id(self, event: Any, handler: Callable[[Any], None]) -> FakeCMId:
        """The new id of a connection request: a :class:`FakeCMId` with the event's id handle, its peer
        at ``(event.source, 40000 + handle)`` (a fake event names its source host in ``source``; without
        one, the default peer host), and ``handler`` for its later events in :attr:`handlers`."""
        handle = event.id_handle
        self.handlers[handle] = handler
        source = getattr(event, "source", "198.18.0.2")
        return FakeCMId(handle, peer_address=(source, 40000 + handle))

    def drain_cm_events(self) -> None:
        """Handle the CM events waiting now: there are none here; counted in :attr:`drained`."""
        self.drained += 1

    def watch_qp(self, *key: Any) -> None:
        """Watch a QP's async events: the key (all but the handler) is added to :attr:`watched`."""
        self.watched.add(key[:-1])

    def unwatch_qp(self, *key: Any) -> None:
        """Stop watching a QP."""
        self.watched.discard(key)

    def watch_port(self, *args: Any) -> None:
        """Watch a port's async events (ignored)."""

    def unwatch_port(self, *args: Any) -> None:
        """Stop watching a port (ignored)."""

    def release_id(self, cm_id: Any) -> None:
        """Take back a cm id (recorded in :attr:`released`)."""
        self.released.append(cm_id)


class FakeTransport:
    """The verbs resources of one side of a connection, in memory: a send ring (real, over
    :class:`FakeRegistrar`), a receive ring of ``depth`` slots (:attr:`initial`: all posted when it is
    made), a :class:`FakeQP`, and the receive slots posted (:attr:`posted`, in order). Completions come
    from :func:`wire` through the handler the connection sets; :meth:`close` is recorded.

    Where the core makes a :class:`~rdmaio.core.transport.Transport` itself (a server's acceptor),
    monkeypatch :meth:`for_cm_id` in for it: it takes the real constructor's arguments and records every
    transport it makes in :attr:`made`.
    """

    #: The transports :meth:`for_cm_id` made, in order. A test that reads it gives it a fresh list first
    #: (``monkeypatch.setattr(FakeTransport, "made", [])``), so no test sees another's.
    made: ClassVar[list[FakeTransport]] = []

    def __init__(
        self, qp_num: int, tag: int, *, slot_size: int = 4096, depth: int = 8, immediate: bool = True
    ) -> None:
        from rdmaio.core.rings import SlotRing
        from rdmaio.protocol.handshake import Capabilities

        self.slot_size = slot_size
        self.depth = depth
        self.initial = depth
        self.cm_id: Any = None
        self.max_inline = 0
        self.tag = tag
        self.send_ring = SlotRing(slot_size, depth, FakeRegistrar(slot_size))
        self.qp = FakeQP(depth, qp_num=qp_num, immediate=immediate)
        self.recv_ring = SimpleNamespace(view=memoryview(bytearray(slot_size * depth)))
        # immediate=False: a device without immediate data, as iWARP's (siw): its queue pair refuses
        # SEND/WRITE with immediate data, its capabilities (rdmaio.core.negotiation) say so, and a SEND
        # that finds no posted receive is recorded in rnr_violations (iWARP would end the connection).
        self.device = SimpleNamespace(
            name="fake0" if immediate else "fakeiw0",
            handle=1 if immediate else 2,
            transport="InfiniBand" if immediate else "iWARP",
            capabilities=Capabilities(
                immediate=immediate, atomics=immediate, memory_windows=immediate, max_read_sge=1
            ),
        )
        self.rnr_violations = 0
        self.cq = SimpleNamespace(handle=2)
        self.pd = None
        self.domain = SimpleNamespace(registrations=None)
        self.registered_bytes = 2 * slot_size * depth
        self.shared = None  # receives of its own, no shared receive queue
        self.posted: collections.deque[int] = collections.deque(range(depth))
        self.handler: Callable[[Any, int, int], None] | None = None
        self.closed = False

    @classmethod
    def for_cm_id(
        cls, reactor: Any, cm_id: Any, options: Options, initial_recv: int | None = None
    ) -> FakeTransport:
        """Made as the core makes a Transport: for ``cm_id`` (kept in :attr:`cm_id`), with
        ``initial_recv`` receive slots (``options.recv_depth`` when None) of ``options.slot_size``
        bytes; appended to :attr:`made`."""
        depth = options.recv_depth if initial_recv is None else initial_recv
        transport = cls(0, 0, slot_size=options.slot_size, depth=depth)
        transport.cm_id = cm_id
        cls.made.append(transport)
        return transport

    def set_completion_handler(self, handler: Callable[[Any, int, int], None]) -> None:
        """Where completions of this transport go (``handler(wcs, start, count)``)."""
        self.handler = handler

    def poll_completions(self) -> None:
        """Nothing to poll: :func:`wire` delivers completions itself."""

    def onesided_port(self, wr_base: int) -> None:
        """No serial one-sided port: this fake carries no one-sided requests."""
        return None

    def post_receives(self, slots: list[int]) -> None:
        """Repost receive slots."""
        self.posted.extend(slots)

    def grow_receives(self, n: int) -> int:
        """Grow the receive ring: this one does not grow (returns 0)."""
        return 0

    def close(self) -> None:
        """Destroy the resources (recorded in :attr:`closed`)."""
        self.closed = True


def wire(sender: FakeTransport, receiver: FakeTransport) -> Callable[[Chain], None]:
    """The NIC from ``sender`` to ``receiver``: each frame of a chain lands in the receiver's next posted
    slot and completes there as a receive with immediate data; signalled sends complete on the sender.
    Assign the result to ``sender.qp.wire``."""
    slot_size = receiver.slot_size
    recv_opcode = int(verbs.WcOpcode.RECV)
    send_opcode = int(verbs.WcOpcode.SEND)
    recv_base = verbs.make_wr_id(verbs.WR_KIND_RECV, receiver.tag, 0)  # | slot
    plain_send = int(lib.IBV_WR_SEND)

    def deliver(chain: Chain) -> None:
        recvs: list[tuple[int, ...]] = []
        sends = []
        for request in chain:
            wr_id, data, imm, flags = request
            if not receiver.posted:
                # No posted receive: RNR on RoCE/InfiniBand, the end of the connection on iWARP. Credits
                # must make this impossible; the test reads the count.
                receiver.rnr_violations += 1
                continue
            slot = receiver.posted.popleft()  # credits guarantee one is posted (no RNR)
            assert 0 <= slot < len(receiver.recv_ring.view) // slot_size  # a slot of the receive ring
            receiver.recv_ring.view[slot * slot_size : slot * slot_size + len(data)] = data
            # struct rdmaio_wc fields in order: wr_id, status, opcode, byte_len, imm_data, flags, ...
            if getattr(request, "opcode", -1) == plain_send:  # the header framing: no immediate data
                recvs.append((recv_base | slot, 0, recv_opcode, len(data), 0, 0))
            else:
                recvs.append((recv_base | slot, 0, recv_opcode, len(data), imm, verbs.WC_WITH_IMM))
            if flags & verbs.SEND_SIGNALED:
                sends.append(fake_completion(wr_id, send_opcode))
        assert receiver.handler is not None and sender.handler is not None
        if not receiver.closed and recvs:
            # one struct rdmaio_wc array, as a poll fills: the C frame rules read it
            receiver.handler(ffi.new("struct rdmaio_wc[]", recvs), 0, len(recvs))
        if sends and not sender.closed:
            sender.handler(sends, 0, len(sends))

    return deliver


# --- compatibility layers: a fake Endpoint -------------------------------------------------------------


class _Event(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> object: ...


def _event_type() -> Callable[[], _Event]:
    """The running async library's Event (trio's under trio, asyncio's otherwise)."""
    try:
        import sniffio

        library = sniffio.current_async_library()
    except Exception:
        library = "asyncio"
    if library == "trio":
        import trio

        return trio.Event
    return asyncio.Event


class FakeEndpoint:
    """The parts of :class:`rdmaio.Endpoint` the compatibility layers use, in memory.

    It keeps the real endpoint's documented semantics: reads return buffered data first; then, with
    nothing buffered, they raise ``EndpointClosedError`` after our close or abort (or ``abort_error``),
    return ``b""``/``None``/0 at the peer's EOF, raise the failure (``ConnectionResetError`` when the peer
    disconnected without EOF), and raise ``EndpointClosedError`` once torn down. A blocked read wakes only
    on data, EOF or teardown (``close()`` itself does not wake it). Writes after ``write_eof``, close or a
    failure raise; ``send`` of more than ``max_message_size`` (None: no limit) raises
    ``MessageTooLargeError``.

    Alone (no :attr:`peer`), the test plays the peer: :meth:`feed`, :meth:`feed_eof`, :meth:`fail`; what
    is written is recorded in :attr:`written` and :attr:`sent` (its sizes in :attr:`sent_sizes`), flow
    control is driven by :attr:`drain_gate` and the graceful close by :attr:`close_gate`. This works on
    asyncio and trio (waits use the running library's Event).

    In a pair (:meth:`pair`, asyncio only), messages ``send`` goes to the peer at once (after a
    checkpoint); with ``rendezvous_from`` set, a ``send`` of at least that many bytes returns once the peer
    has read the whole message. Bytes ``write`` queues are in :attr:`pending` until "the NIC" takes them
    (:meth:`post`), on the next loop iteration unless a test turns :attr:`auto_post` off and posts by
    hand; never more than the peer's ``recv_buffer_limit`` is buffered unread there, and ``drain`` waits
    above the high water mark until the low one. ``close`` flushes, sends EOF, then disconnects, bounded
    by ``close_timeout``; ``abort`` drops queued data and the peer sees a disconnect without EOF.
    """

    def __init__(
        self,
        name: str = "a",
        options: Options | None = None,
        *,
        extra: dict[str, Any] | None = None,
        max_message_size: int | None = 1 << 20,
        abort_error: Callable[[], BaseException] | None = None,
    ) -> None:
        self._event = _event_type()
        self._options = options or Options()
        self.name = name
        self.extra: dict[str, Any] = (
            {"sockname": (name, 7471), "peername": (f"peer-of-{name}", 7471), "device": "fake0", "qp_num": 7}
            if extra is None
            else dict(extra)
        )
        self.max_message_size = max_message_size
        self.abort_error = abort_error
        self.peer: FakeEndpoint | None = None
        # receiving
        self.rx: collections.deque[bytes] = collections.deque()
        self.rx_done: collections.deque[_Event | None] = collections.deque()  # rendezvous sends waiting
        self.rx_bytes = 0
        self.peer_eof = False
        self.reads = 0
        self._readers = 0
        # sending
        self.written = bytearray()
        self.sent: list[bytes] = []
        self.sent_sizes: list[int] = []
        self.pending = bytearray()
        self.auto_post = True
        self.rendezvous_from: int | None = None
        self.eof_requested = False
        self.eof_sent = False
        self.drain_gate: _Event | None = None
        # lifetime
        self.error: BaseException | None = None  # what ended the endpoint, first of them
        self.failure: BaseException | None = None  # what reads and sends raise after buffered data/EOF
        self.closing = False
        self.aborted = False
        self.disconnected = False
        self.torn_down = False
        self.close_gate: _Event | None = None
        self.write_eof_calls = 0
        self.abort_calls = 0
        self.aclose_calls = 0
        self._changed = self._event()
        self._closed = self._event()

    @classmethod
    def pair(cls, options: Options | None = None, **kwargs: Any) -> tuple[FakeEndpoint, FakeEndpoint]:
        """Two endpoints ``a`` and ``b`` connected to each other (inside a running asyncio loop)."""
        a, b = cls("a", options, **kwargs), cls("b", options, **kwargs)
        a.peer, b.peer = b, a
        return a, b

    # --- attributes

    @property
    def options(self) -> Options:
        """The endpoint's options."""
        return self._options

    @options.setter
    def options(self, options: Options) -> None:
        self._options = options

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """An entry of :attr:`extra`."""
        return self.extra.get(name, default)

    def is_closing(self) -> bool:
        """True once closed, aborted or torn down."""
        return self.closing or self.torn_down

    def at_eof(self) -> bool:
        """True when nothing is buffered and nothing more can arrive."""
        return not self.rx and (self.peer_eof or self.failure is not None or self.torn_down)

    # --- the peer's side, driven by a test (alone)

    def feed(self, *messages: bytes) -> None:
        """Messages (or stream bytes) arrive from the peer."""
        for message in messages:
            self._deliver(message)

    def feed_eof(self) -> None:
        """The peer's EOF arrives."""
        self._deliver_eof()

    def fail(self, exc: BaseException) -> None:
        """The peer died or the transport failed with ``exc``: the endpoint is torn down."""
        self._set_failure(exc)
        self._teardown()

    def kill_peer(self) -> None:
        """The peer dies: it vanishes, we see a disconnect without EOF."""
        assert self.peer is not None
        self.peer.peer = None
        self.peer._teardown()
        self._on_disconnect()

    # --- receiving

    def _deliver(self, data: bytes, done: _Event | None = None) -> None:
        self.rx.append(data)
        self.rx_done.append(done)
        self.rx_bytes += len(data)
        self._wake()

    def _deliver_eof(self) -> None:
        self.peer_eof = True
        self._wake()

    def _closed_error(self) -> BaseException:
        if self.aborted and self.failure is not None and self.abort_error is not None:
            return self.failure
        return EndpointClosedError("endpoint is closed")

    async def _wait_data(self) -> bool:
        """True when something is buffered, False at EOF; raises like the real endpoint."""
        while not self.rx:
            if self.closing:
                raise self._closed_error()
            if self.peer_eof:
                return False
            if self.failure is not None:
                raise self.failure
            if self.torn_down:
                raise EndpointClosedError("endpoint is closed")
            await self._wait_change()
        return True

    def _take(self, n: int) -> bytes:
        """Up to ``n`` bytes of the first buffered message; its rest stays first."""
        head = self.rx[0]
        if len(head) > n:
            self.rx[0] = head[n:]
            head = head[:n]
        else:
            self.rx.popleft()
            done = self.rx_done.popleft()
            if done is not None:
                done.set()
                if self.peer is not None:
                    self.peer._wake()
        self.rx_bytes -= len(head)
        peer = self.peer
        if peer is not None and peer.auto_post and peer.pending:
            asyncio.get_running_loop().call_soon(peer.post)  # credits return to the sender
        return head

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` stream bytes; ``b""`` at EOF. Empty messages are skipped."""
        assert n > 0
        self.reads += 1
        assert not self._readers, "two readers"
        self._readers += 1
        try:
            while True:
                while self.rx and not self.rx[0]:
                    self._take(1)  # the byte stream skips empty messages
                if self.rx:
                    return self._take(n)
                if not await self._wait_data():
                    return b""
        finally:
            self._readers -= 1

    async def recv(self) -> bytes | None:
        """The next message (or its unread rest); None at EOF."""
        if not await self._wait_data():
            return None
        return self._take(len(self.rx[0]))

    async def recv_into(self, buffer: bytearray | memoryview) -> int:
        """Copy what fits of the next message into ``buffer`` (the rest stays for the next read); 0 at EOF."""
        if not await self._wait_data():
            return 0
        target = memoryview(buffer).cast("B")
        data = self._take(target.nbytes)
        target[: len(data)] = data
        return len(data)

    # --- sending

    def _send_error(self) -> BaseException | None:
        if self.closing:
            return self._closed_error()
        if self.eof_requested:
            return EndpointClosedError("write() after write_eof()")
        if self.failure is not None:
            return self.failure
        if self.torn_down:
            return EndpointClosedError("endpoint is closed")
        return None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue stream bytes (alone: taken at once, recorded in :attr:`written`)."""
        error = self._send_error()
        if error is not None:
            raise error
        self.written += data
        if self.peer is not None:
            self.pending += data
            if self.auto_post:
                asyncio.get_running_loop().call_soon(self.post)

    def post(self, n: int | None = None) -> None:
        """The NIC takes ``n`` (default: all) queued bytes; EOF goes once nothing is queued.

        As with credits, no more than the peer's ``recv_buffer_limit`` is ever buffered unread there.
        """
        if self.torn_down or self.peer is None:
            return
        n = len(self.pending) if n is None else min(n, len(self.pending))
        n = max(0, min(n, self.peer.options.recv_buffer_limit - self.peer.rx_bytes))
        if n:
            chunk = bytes(self.pending[:n])
            del self.pending[:n]
            self.peer._deliver(chunk)
        if not self.pending and self.eof_requested and not self.eof_sent:
            self.eof_sent = True
            self.peer._deliver_eof()
        self._wake()

    async def drain(self) -> None:
        """Wait while :attr:`drain_gate` is set, and while more than the high water mark is queued until
        no more than the low one is."""
        error = self._send_error()
        if error is not None:
            raise error
        while self.drain_gate is not None:
            await self.drain_gate.wait()
            error = self._send_error()
            if error is not None:
                raise error
        if len(self.pending) <= self._options.write_high_water:
            return
        while len(self.pending) > self._options.write_low_water:
            error = self._send_error()
            if error is not None:
                raise error
            await self._wait_change()

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send one message (see the class docstring for a pair's rendezvous sends)."""
        error = self._send_error()
        if error is not None:
            raise error
        size = memoryview(data).nbytes
        if self.max_message_size is not None and size > self.max_message_size:
            raise MessageTooLargeError(f"{size} > {self.max_message_size}")
        peer = self.peer
        if peer is not None:
            await asyncio.sleep(0)
            peer = self.peer
            if peer is None:
                error = self._send_error()
                raise error if error is not None else EndpointClosedError("endpoint is closed")
        self.sent.append(bytes(data))
        self.sent_sizes.append(size)
        if peer is not None:
            rendezvous = self.rendezvous_from is not None and size >= self.rendezvous_from
            done = self._event() if rendezvous else None
            peer._deliver(bytes(data), done)
            while done is not None and not done.is_set():
                error = self._send_error()
                if error is not None:
                    raise error
                await self._wait_change()
        await self.drain()

    def get_write_buffer_size(self) -> int:
        """Bytes queued and not yet taken by the NIC."""
        return len(self.pending)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Set the water marks ``drain`` uses (both required here)."""
        assert high is not None and low is not None
        self._options = dataclasses.replace(self._options, write_high_water=high, write_low_water=low)

    def write_eof(self) -> None:
        """Send EOF once the queued bytes are out (counted in :attr:`write_eof_calls`)."""
        self.write_eof_calls += 1
        if self.torn_down:
            return
        self.eof_requested = True
        if self.peer is not None and self.auto_post:
            asyncio.get_running_loop().call_soon(self.post)

    # --- lifetime

    def close(self) -> None:
        """Start the graceful close: alone, torn down at once (or when :attr:`close_gate` is set, in
        ``wait_closed``); in a pair, after the queued bytes and EOF are out or ``close_timeout``."""
        if self.closing or self.torn_down:
            return
        self.closing = True
        self.eof_requested = True
        if self.error is None:
            self.error = EndpointClosedError("endpoint is closed")
        if self.peer is not None:
            asyncio.get_running_loop().create_task(self._graceful())
        elif self.close_gate is None:
            self._teardown()

    async def _graceful(self) -> None:
        try:
            async with asyncio.timeout(self._options.close_timeout):
                while not self.torn_down and (self.pending or not self.eof_sent):
                    if self.auto_post:
                        self.post()
                        if not self.pending and self.eof_sent:
                            break
                    await self._wait_change()
        except TimeoutError:
            pass
        finally:
            self._teardown()

    async def wait_closed(self) -> None:
        """Wait until the endpoint is torn down."""
        if self.close_gate is not None and not self.torn_down:
            await self.close_gate.wait()
            self._teardown()
        await self._closed.wait()

    async def aclose(self) -> None:
        """``close()`` then ``wait_closed()`` (counted in :attr:`aclose_calls`)."""
        self.aclose_calls += 1
        self.close()
        await self.wait_closed()

    def abort(self) -> None:
        """Drop queued data and tear down now (counted in :attr:`abort_calls`); with ``abort_error``,
        our later reads and sends raise it."""
        self.abort_calls += 1
        self.aborted = self.closing = True
        self.pending.clear()
        if self.abort_error is not None:
            self._set_failure(self.abort_error())
        elif self.error is None:
            self.error = EndpointClosedError("endpoint is closed")
        self._teardown()

    def _set_failure(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        if self.error is None:
            self.error = exc

    def _on_disconnect(self) -> None:
        self.disconnected = True
        self._set_failure(RdmaConnectionResetError("the peer disconnected without sending EOF"))
        self._teardown()

    def _teardown(self) -> None:
        if not self.torn_down:
            self.torn_down = True
            peer, self.peer = self.peer, None
            if peer is not None:
                peer._on_disconnect()
            self._closed.set()
        self._wake()

    # --- waiting

    def _wake(self) -> None:
        self._changed.set()
        self._changed = self._event()

    async def _wait_change(self) -> None:
        await self._changed.wait()


def fake_pair(options: Options | None = None, **kwargs: Any) -> tuple[FakeEndpoint, FakeEndpoint]:
    """Two connected :class:`FakeEndpoint` objects (see :meth:`FakeEndpoint.pair`)."""
    return FakeEndpoint.pair(options, **kwargs)


# --- one-sided: a serial request's post-and-poll, and an engine over fakes ------------------------------


class FakeSerialPort:
    """A connection's one-sided port (``rdmaio.core.onesided.interfaces.SerialPort``) over a :class:`FakeQP`:
    :meth:`post_poll` records the request in the QP's ``posted``/``calls`` as ``post_rdma`` does, then
    answers as the C call would: :attr:`at_post` (called with the request's dict) returns the outcome
    (``verbs.POSTED`` when None: the fake device has not completed it yet). :attr:`after` is called for
    ``POSTED_OTHER`` / ``POSTED_POLL_FAILED`` (it dispatches what the poll took, as the dispatcher would,
    and returns whether it did); :attr:`failures` are the outcomes of :meth:`post_error`."""

    def __init__(self, qp: FakeQP) -> None:
        self.qp = qp
        self.at_post: Callable[[dict[str, int]], int] | None = None
        self.after: Callable[[int], bool] = lambda result: True
        self.polls = 0
        self.polls_asked = 0
        self.wr_base = verbs.make_wr_id(verbs.WR_KIND_ONESIDED, 0, 0)

    def post_poll(
        self,
        index: int,
        local_addr: int,
        lkey: int,
        length: int,
        opcode: int,
        remote_addr: int,
        rkey: int,
        compare_add: int,
        swap: int,
    ) -> int:
        """Post one request (recorded), then poll once (the outcome :attr:`at_post` decides)."""
        qp = self.qp
        if qp.fail_next:
            return -12
        qp.calls.append(1)
        entry = {
            "wr_id": self.wr_base | index,
            "local_addr": local_addr,
            "length": length,
            "lkey": lkey,
            "opcode": opcode,
            "send_flags": int(lib.IBV_SEND_SIGNALED),
            "imm_data": 0,
            "rkey": rkey,
            "remote_addr": remote_addr,
            "compare_add": compare_add,
            "swap": swap,
        }
        qp.posted.append(entry)
        self.polls += 1
        return verbs.POSTED if self.at_post is None else self.at_post(entry)

    def post_batch_poll(
        self, wr_id: int, opcode: int, local_addr: int, lkey: int, rkey: int, remote_addr: Any, **arrays: Any
    ) -> int:
        """A wave, recorded as :meth:`FakeQP.post_batch` records it, then one poll: :attr:`at_post` decides
        (called with the wave's last request)."""
        qp = self.qp
        if qp.fail_next:
            return -12
        FakeQP.post_batch(qp, wr_id, opcode, local_addr, lkey, rkey, remote_addr, **arrays)
        self.polls += 1
        return verbs.POSTED if self.at_post is None else self.at_post(qp.posted[-1])

    def after_poll(self, result: int) -> bool:
        """What the poll took that was not the request's own success: :attr:`after` handles it."""
        return self.after(result)

    def post_error(self, result: int) -> BaseException:
        """The error of a failed post (``result`` is ``-errno``)."""
        return VerbsError("fake post failure", errno=-result, call="ibv_post_send")

    def poll(self) -> None:
        """A poll of the dispatcher (counted in :attr:`polls_asked`)."""
        self.polls_asked += 1


def onesided_rig(
    *,
    max_ops: int = 16,
    complete_at_post: bool = True,
    record: bool = True,
    close_state: Any = None,
    io: Any = None,
    atomics: bool = True,
) -> SimpleNamespace:
    """A :class:`~rdmaio.core.onesided.OneSidedEngine` on the running asyncio loop over a :class:`FakeQP`
    whose fake device completes every request at its post (``complete_at_post``: the completion is taken by
    the post's own poll) or one loop iteration later (through ``on_completion``, as a connection's handler
    delivers it). Batch waves always complete one iteration later. Returns ``engine``, ``qp``, ``port`` and
    a ``key`` granting everything on 4 KiB (for tools/onesided_calls.py and the call-count tests). Without
    ``record``, a single request completed at its post is not recorded (the port's call returns at once,
    as cheap as a fake of the C call can be: for CPU figures). The engine is given ``close_state`` (a
    :class:`~rdmaio.protocol.closestate.CloseState`; a new one when None, kept in ``rig.close_state``) as a
    connection's is given its Session's, and the credits' ``flush_error`` is its own, as a Session's is.
    ``io``: the loop backend (a TrioBackend under trio; the running asyncio loop's when None).
    ``atomics``: False for an engine on a device without remote atomics (``atomic_cap`` NONE).
    """
    from rdmaio.core.backend import AsyncioBackend
    from rdmaio.core.onesided import ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, OneSidedEngine, RemoteKey
    from rdmaio.protocol.closestate import CloseState

    if io is None:
        call_soon: Callable[..., Any] = asyncio.get_running_loop().call_soon
        io = AsyncioBackend(asyncio.get_running_loop())
    else:
        backend = io

        def call_soon(fn: Callable[..., None], *args: Any) -> Any:
            return backend.call_soon(lambda: fn(*args))

    qp = FakeQP()
    port = FakeSerialPort(qp)
    if complete_at_post and not record:
        done = verbs.POSTED_DONE
        port.post_poll = lambda *request: done  # type: ignore[method-assign]
        port.post_batch_poll = lambda *wave, **arrays: done  # type: ignore[method-assign]
    state = close_state if close_state is not None else CloseState()
    rig = SimpleNamespace(qp=qp, port=port, failures=[], close_state=state)
    credits = SimpleNamespace(
        can_take_slot=lambda: True,
        take_slot=lambda: None,
        on_slot_used=lambda: None,
        flush_error=state.flush_error,
    )

    def fail(exc: BaseException) -> None:
        rig.failures.append(exc)
        rig.engine.close(exc)

    engine = OneSidedEngine(
        io,
        qp,
        credits,
        register_local=FakeRegion,
        register_grant=lambda view, bits: FakeRegion(view, bits),
        cache_get=FakeRegistration,
        fail=fail,
        max_ops=max_ops,
        max_inline=0,
        revoke_timeout=5.0,
        port=port,
        close_state=state,
        atomics=atomics,
    )
    rig.engine = engine
    if complete_at_post:
        port.at_post = lambda entry: verbs.POSTED_DONE
    else:

        def complete_later(entry: dict[str, int]) -> int:
            call_soon(engine.on_completion, entry["wr_id"], 0)
            return verbs.POSTED

        port.at_post = complete_later
    post_batch = qp.post_batch

    def post_batch_completed_later(wr_id: int, *args: Any, **arrays: Any) -> None:
        post_batch(wr_id, *args, **arrays)
        call_soon(engine.on_completion, wr_id, 0)

    qp.post_batch = post_batch_completed_later  # type: ignore[method-assign]
    original_post_rdma = qp.post_rdma

    def post_rdma_completed_later(count: int) -> None:
        start = len(qp.posted)
        original_post_rdma(count)
        for entry in qp.posted[start:]:
            call_soon(engine.on_completion, entry["wr_id"], 0)

    qp.post_rdma = post_rdma_completed_later  # type: ignore[method-assign]
    rig.key = RemoteKey(0x10000, 0x77, 4096, ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC, 1)
    return rig


# --- verbs: devices by one-sided capability (what an iWARP device lacks) --------------------------------

#: The one-sided capabilities of Soft-iWARP (siw) and other iWARP devices: no remote atomics
#: (``atomic_cap`` NONE) and no memory windows (``max_mw`` 0).
IWARP_ONESIDED_CAPS = verbs.OneSidedCaps("NONE", 16, 16, max_mw=0, mw_type1=False, mw_type2=False)
#: Those of Soft-RoCE (rxe, Linux 6.1): atomics among its own requests, type 1 and 2 windows.
RXE_ONESIDED_CAPS = verbs.OneSidedCaps("HCA", 128, 128, max_mw=524287, mw_type1=True, mw_type2=True)


class FakeCapsDevice:
    """A device context answering :meth:`query_onesided_caps` with ``caps`` (e.g.
    :data:`IWARP_ONESIDED_CAPS`); ``handle`` keeps it apart from other devices in the process-wide
    capability cache (:func:`rdmaio.core.onesided.caps.cached_caps`). :attr:`queries` counts the queries."""

    def __init__(self, caps: verbs.OneSidedCaps, *, name: str = "siw0", handle: int = 0x51A0) -> None:
        self.caps = caps
        self.name = name
        self.handle = handle
        self.queries = 0

    def query_onesided_caps(self) -> verbs.OneSidedCaps:
        """The scripted capabilities."""
        self.queries += 1
        return self.caps
