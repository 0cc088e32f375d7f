"""The exporter of one connection's one-sided RDMA, and what arrives on it without being asked for.

:meth:`Exporter.export` registers a range and grants the peer exactly the remote access asked for, through
this connection only (a type 2 memory window bound on its queue pair; see :class:`ScopedGrant`), or, with
``scope="domain"``, through the region's own rkey; it returns the key
(:class:`~rdmaio.core.onesided.keys.RemoteKey`).
:meth:`Exporter.revoke` tells the peer, waits for its answer, deallocates the window and deregisters.
:meth:`Exporter.export_for_read` is the same grant for a rendezvous send's buffer. :meth:`Exporter.on_recv`
takes the receives that are not frames: write notices (queued for :meth:`Exporter.wait_write_notice`,
holding their receive beyond a limit and giving it back through the injected ``repost``) and control
messages (REVOKE and its ACK, and those of other layers, handed to :attr:`Exporter.control_handler`). The
control messages it sends go out through the operation engine (:meth:`OperationEngine.queue_send
<rdmaio.core.onesided.operations.OperationEngine.queue_send>`), which owns the op slots and credits.
"""

from __future__ import annotations

import builtins
import collections
import errno
import itertools
import logging
import struct
from collections.abc import Callable, Iterator
from typing import Any

from rdmaio import verbs
from rdmaio.core.backend import Backend, Waiter
from rdmaio.core.onesided.interfaces import BindWindow, Credits, Region, Window
from rdmaio.core.onesided.keys import (
    ACCESS_ATOMIC,
    ACCESS_READ,
    ACCESS_WRITE,
    KEY_VERSION,
    RemoteKey,
    WriteNotice,
    parse_access,
)
from rdmaio.core.onesided.operations import OperationEngine
from rdmaio.core.onesided.revoked import RevokedKeys
from rdmaio.errors import (
    BindQueueFullError,
    FeatureNotSupportedError,
    ProtocolError,
    VerbsError,
)
from rdmaio.verbs.native import lib

__all__ = [
    "CONTROL_SIZE",
    "CTL_FIRST_EXTERNAL",
    "CTL_REVOKE",
    "CTL_REVOKE_ACK",
    "CTL_WRITE_NOTICE",
    "MAX_BINDS_IN_FLIGHT",
    "SCOPES",
    "Exporter",
    "Grant",
    "ScopedGrant",
]

log = logging.getLogger("rdmaio.onesided")

MAX_BINDS_IN_FLIGHT = 16
"""Memory-window binds (``IBV_WR_BIND_MW``) a connection may have posted and not yet seen complete: the
send queue and the CQ reservation are enlarged by that many entries (rdmaio.core.transport), apart from
the ``max_rdma_ops`` of the one-sided requests, so that an ``export()`` never waits for an op slot."""
# control messages: version u8, type u8, 6 bytes padding, key id u64
_CONTROL = struct.Struct("!BB6xQ")
CONTROL_SIZE = _CONTROL.size
"""Bytes of a one-sided control message (a SEND without immediate data)."""
CTL_REVOKE = 1
"""Control message kind: the exporter revokes the key id it carries."""
CTL_REVOKE_ACK = 2
"""Control message kind: the importer will post nothing more on the key id it carries."""
CTL_WRITE_NOTICE = 3
"""Control message kind: a write notice sent as a message (the writer's framing has no immediate data):
its u64 carries the bytes written (high 32 bits) and the notice value (low 32 bits)."""
CTL_FIRST_EXTERNAL = 16
"""Control message kinds from here on belong to other layers (:meth:`Exporter.send_control`)."""
_WC_RECV_RDMA_WITH_IMM = int(verbs.WcOpcode.RECV_RDMA_WITH_IMM)
_WC_FLUSH = int(verbs.WcStatus.WR_FLUSH_ERR)
SCOPES = ("connection", "domain")
"""``export(scope=...)``: ``"connection"`` (the default: a window bound on this connection's queue pair)
or ``"domain"`` (the region's own rkey, valid on every queue pair of the loop's protection domain)."""


def _mw_access(bits: int) -> int:
    access = 0
    if bits & ACCESS_READ:
        access |= lib.IBV_ACCESS_REMOTE_READ
    if bits & ACCESS_WRITE:
        access |= lib.IBV_ACCESS_REMOTE_WRITE
    if bits & ACCESS_ATOMIC:
        access |= lib.IBV_ACCESS_REMOTE_ATOMIC
    return access


class ScopedGrant:
    """Memory granted through one connection: its own region (``IBV_ACCESS_MW_BIND`` and no remote flags,
    so the region's own rkey opens nothing) and a type 2 window over all of it, bound on the connection's
    queue pair (rxe checks a window's rkey against its region's bounds, not the window's: one region per
    grant keeps the grant exact). ``addr``/``rkey`` go to the peer; :meth:`close` deallocates the window,
    then deregisters (once the bind completed: a window freed under a bind still queued would fail it, and
    a failed bind moves the queue pair to the error state)."""

    __slots__ = ("addr", "bound", "close_pending", "closed", "error", "region", "rkey", "waiter", "window")

    def __init__(self, region: Region, window: Window) -> None:
        self.region = region
        self.window = window
        self.addr = region.addr
        self.rkey = window.rkey
        self.bound = False  # the bind's completion came back successful
        self.error: BaseException | None = None  # the bind failed (or the connection did first)
        self.waiter: Waiter | None = None  # a revoke waiting for the bind's completion
        self.close_pending = False
        self.closed = False

    @property
    def settled(self) -> bool:
        """The bind's completion came back (successful or not)."""
        return self.bound or self.error is not None

    def close(self) -> None:
        """Invalidate and deregister now if the bind completed, else as soon as it does (see the class)."""
        if self.closed:
            return
        if not self.settled:
            self.close_pending = True
            return
        self.close_now()

    def close_now(self) -> None:
        """Deallocate the window and deregister the region at once (the QP is gone, or the bind is done)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.window.close()
        finally:
            self.region.close()


class Grant:
    """One exported key: the key, its region ``mr``, its :class:`ScopedGrant` (None for the domain scope),
    the waiter of a revoke for the peer's ACK, and whether a revoke started."""

    __slots__ = ("ack", "key", "mr", "revoked", "scoped")

    def __init__(self, key: RemoteKey, mr: Region, scoped: ScopedGrant | None) -> None:
        self.key = key
        self.mr = mr
        self.scoped = scoped
        self.ack: Waiter | None = None
        self.revoked = False

    def close(self) -> None:
        """Invalidate and deregister (a window: once its bind completed)."""
        if self.scoped is not None:
            self.scoped.close()
        else:
            self.mr.close()


class Exporter:
    """Grants, revocation, write notices and control messages of one connection's one-sided engine.

    Given: the loop backend ``io``, the session's ``credits``, the ``operations`` engine (it sends our
    control messages; its ``error``/``closed`` are the state we check), ``register_grant(view, bits)``
    (a region with exactly those remote flags), ``register_bindable(view, readonly)`` and ``bind_window``
    (None: the device has no windows) for connection-scoped grants, ``poll()`` (polls the CQ now, to free
    bind entries), ``fail`` (fails the connection), ``wr_base`` and ``indexes`` (shared with the
    operations: a bind's wr_id), ``revoked_ids`` (the keys the peer revoked: we add them), the connection's
    ``stats``, and ``repost(slot)`` (gives a held receive back to the NIC with its credit).

    Documented plain attributes: :attr:`grants` (what we exported, by key id), :attr:`control_handler`
    (control messages of other layers), :attr:`peer_onesided`, :attr:`notice_limit`.
    """

    def __init__(
        self,
        io: Backend,
        credits: Credits,
        operations: OperationEngine,
        *,
        register_grant: Callable[[memoryview, int], Region],
        register_bindable: Callable[[memoryview, bool], Region],
        bind_window: BindWindow | None,
        poll: Callable[[], None] | None,
        fail: Callable[[BaseException], None],
        revoke_timeout: float,
        atomics: bool,
        stats: collections.Counter[str],
        wr_base: int,
        indexes: Iterator[int],
        revoked_ids: RevokedKeys,
        peer_onesided: bool,
        notice_limit: int,
        repost: Callable[[int], None] | None,
        private_pd: bool = False,
        register_read_grant: Callable[[memoryview, bool], Region] | None = None,
    ) -> None:
        self._io = io
        # The connection's QP is alone in its protection domain (a device without memory windows): a
        # region's own rkey reaches this connection only, so a grant is a region with remote flags.
        self._private_pd = private_pd
        self._register_read_grant = register_read_grant
        self._credits = credits
        self._operations = operations
        self._register_grant = register_grant
        self._register_bindable = register_bindable
        self._bind_window = bind_window
        self._poll = poll
        self._fail_connection = fail
        self._revoke_timeout = revoke_timeout
        self._atomics = atomics
        self._stats = stats
        self._wr_base = wr_base
        self._index = indexes
        self._binds: dict[int, ScopedGrant] = {}  # window binds posted, by index, until their completion
        self._bind_waiters: collections.deque[Waiter] = collections.deque()  # export_for_read() calls
        self._key_ids = itertools.count(1)  # dense per connection: the importer keeps ranges
        self.grants: dict[int, Grant] = {}
        """What we exported, by key id."""
        self.revoked_ids = revoked_ids
        """The key ids the peer revoked (added when its REVOKE arrives; the operations check them)."""
        self._notices: collections.deque[WriteNotice] = collections.deque()
        self._notice_waiter: Waiter | None = None
        self.peer_onesided = peer_onesided
        """The peer announced FEATURE_ONESIDED: it understands write notices and control messages."""
        self.notice_limit = notice_limit
        """Write notices queued beyond it keep the receive they consumed until wait_write_notice() takes
        one: the writer's credit comes back only then (back-pressure)."""
        self._held_slots: collections.deque[int] = collections.deque()
        self._repost = repost
        self.control_handler: Callable[[int, int], None] | None = None
        """Control messages of kind >= CTL_FIRST_EXTERNAL go here (the rendezvous engine's ACK/CANCEL)."""

    def _check_open(self) -> None:
        self._operations.raise_if_failed()

    # --- grants ---------------------------------------------------------------------------------------------

    def export(
        self,
        buffer: Any,
        offset: int = 0,
        length: int | None = None,
        access: str = "rw",
        scope: str = "connection",
    ) -> RemoteKey:
        """Grant the peer ``access`` to ``buffer[offset:offset+length]``; see ``Endpoint.export``."""
        self._check_open()
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        bits = parse_access(access)
        if bits & ACCESS_ATOMIC and not self._atomics:
            raise FeatureNotSupportedError(
                f"export(access={access!r}): {self._operations.device_name} does not offer remote atomics "
                "(atomic_cap NONE, as on iWARP devices such as siw): export without 'a'",
                errno=errno.EOPNOTSUPP,
            )
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError("export() needs a writable buffer (bytearray, memoryview, mmap, numpy array)")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        size = view.nbytes
        if length is None:
            length = size - offset
        if not (0 <= offset <= size and 1 <= length <= size - offset):
            raise ValueError(f"export range offset={offset} length={length} outside a buffer of {size} bytes")
        part = view[offset : offset + length]
        scoped = None
        if scope == "domain" and self._private_pd:
            raise FeatureNotSupportedError(
                f"export(scope='domain'): {self._operations.device_name} has no memory windows, so this "
                "connection has a protection domain of its own and its grants reach it only; export on "
                "each connection that needs the memory (the default scope)",
                errno=errno.EOPNOTSUPP,
            )
        if scope == "domain" or self._private_pd:
            # The region's own rkey: every QP of the loop's PD, or (a PD of its own) this one only.
            region = self._register_grant(part, bits)
            rkey = region.rkey
        else:
            scoped = self._grant_scoped(part, bits, readonly=False)
            region, rkey = scoped.region, scoped.rkey
        # Dense per-connection ids: the importer keeps the revoked ones as ranges (RevokedKeys).
        # The key tells the importer whether atomics are possible at all here (KEY_FLAG_NO_ATOMICS).
        key = RemoteKey(region.addr, rkey, length, bits, next(self._key_ids), self._atomics)
        self.grants[key.key_id] = Grant(key, region, scoped)
        self._stats["exports"] += 1
        return key

    async def export_for_read(self, view: memoryview) -> ScopedGrant | Region | None:
        """Grant the peer RDMA READ of all of ``view`` through this connection only (a rendezvous send's
        buffer; ``view`` may be read-only): an object with ``addr``, ``rkey`` and ``close()`` (which
        invalidates the grant before it deregisters). On a connection with a protection domain of its own
        (a device without memory windows) a region with remote read in it. None when the device has no
        memory windows and the connection shares the loop's PD (the caller then sends the message by
        copy: its memory is never readable by other connections). Waits while
        :data:`MAX_BINDS_IN_FLIGHT` binds are in flight."""
        if self._private_pd and self._register_read_grant is not None:
            self._check_open()
            return self._register_read_grant(view, view.readonly)
        if self._bind_window is None:
            return None
        while True:
            self._check_open()
            if len(self._binds) < MAX_BINDS_IN_FLIGHT or self._reap_binds():
                return self._grant_scoped(view, ACCESS_READ, readonly=view.readonly)
            waiter = self._io.waiter()
            self._bind_waiters.append(waiter)
            try:
                await waiter.wait()
            finally:
                if waiter in self._bind_waiters:
                    self._bind_waiters.remove(waiter)

    def _reap_binds(self) -> bool:
        """Poll the completion queue now (binds complete at once on the NIC, but only a poll frees their
        entries); True when a bind entry is free afterwards."""
        if self._poll is not None:
            self._poll()
        return len(self._binds) < MAX_BINDS_IN_FLIGHT

    def _grant_scoped(self, view: memoryview, bits: int, *, readonly: bool) -> ScopedGrant:
        """Register ``view`` for window binding only and post the bind of a type 2 window over it on this
        connection's queue pair (signalled, kind 2: :meth:`on_bind_completion` gets its completion)."""
        if self._bind_window is None:
            raise FeatureNotSupportedError(
                f"{self._operations.device_name} has no memory windows (max_mw 0, as on iWARP devices such "
                "as siw): a grant cannot be limited to one connection; export(..., scope='domain') grants "
                "it to every connection of the loop's device",
                errno=errno.EOPNOTSUPP,
                call="ibv_alloc_mw",
            )
        if len(self._binds) >= MAX_BINDS_IN_FLIGHT and not self._reap_binds():
            raise BindQueueFullError(
                f"{MAX_BINDS_IN_FLIGHT} memory-window binds of this connection have not completed yet: let "
                "the event loop run (any await) and export again"
            )
        region = self._register_bindable(view, readonly)
        index = next(self._index) & 0xFFFFFFFF
        try:
            window = self._bind_window(region, self._wr_base | index, _mw_access(bits))
        except BaseException:
            region.close()
            raise
        scoped = ScopedGrant(region, window)
        self._binds[index] = scoped
        self._stats["mw_binds"] += 1
        return scoped

    def on_bind_completion(self, index: int, status: int, vendor_err: int = 0) -> bool:
        """The completion of a window bind (True), or not one of ours (False). A failed bind fails the
        connection loudly (the NIC moved the queue pair to the error state: no key of it works)."""
        scoped = self._binds.pop(index, None)
        if scoped is None:
            return False
        if status == 0:
            scoped.bound = True
        else:
            if status == _WC_FLUSH:
                error: BaseException = self._operations.error or VerbsError(
                    "the memory-window bind was flushed: the connection is closing", call="IBV_WR_BIND_MW"
                )
            else:
                error = VerbsError(
                    f"binding a memory window failed: {verbs.wc_status_str(status)} (vendor {vendor_err}); "
                    "the key it was for never worked",
                    errno=errno.EIO,
                    call="IBV_WR_BIND_MW",
                )
                self._stats["mw_bind_failures"] += 1
                log.error("rdmaio: %s", error)
            scoped.error = error
            if status != _WC_FLUSH:
                self._fail_connection(error)
        if scoped.waiter is not None:
            scoped.waiter.set()
        if scoped.close_pending:
            scoped.close_now()
        while self._bind_waiters and len(self._binds) < MAX_BINDS_IN_FLIGHT:
            self._bind_waiters.popleft().set()
        return True

    async def revoke(self, key: RemoteKey) -> None:
        """Revoke a key this side exported; see ``Endpoint.revoke``."""
        grant = self.grants.get(key.key_id)
        if grant is None or grant.key != key:
            raise ValueError(f"{key!r} was not exported on this connection (or is already revoked)")
        if grant.revoked:
            raise ValueError(f"{key!r} is already being revoked")
        grant.revoked = True
        operations = self._operations
        try:
            usable = (
                operations.error is None and not operations.closed and self._credits.flush_error() is None
            )
            async with self._io.timeout(self._revoke_timeout):
                # A peer without FEATURE_ONESIDED would fail on a REVOKE: deallocating alone revokes.
                if usable and self.peer_onesided:
                    grant.ack = waiter = self._io.waiter()
                    self.send_control_message(CTL_REVOKE, key.key_id)
                    await waiter.wait()
                scoped = grant.scoped
                if scoped is not None and not scoped.settled and not operations.closed:
                    # The window can be freed only once its bind completed (see ScopedGrant).
                    scoped.waiter = bind_waiter = self._io.waiter()
                    await bind_waiter.wait()
        except builtins.TimeoutError:
            # The peer did not answer: deregistering alone still makes the NIC refuse the key.
            self._stats["revoke_timeouts"] += 1
        finally:
            # Always, even when cancelled or the connection failed: after this the NIC refuses the rkey
            # (a bind still in flight at a timeout: as soon as it completes). A failing deregistration raises.
            self.grants.pop(key.key_id, None)
            self._stats["revokes"] += 1
            grant.close()

    # --- notices and control messages (both sides) --------------------------------------------------------

    def on_recv(self, opcode: int, imm: int, byte_len: int, payload: memoryview, slot: int = -1) -> bool:
        """A receive completed that is not a frame: a write notice or a one-sided control message.

        Returns True when the caller should repost ``slot`` now; False when the exporter holds it (a write
        notice beyond ``notice_limit`` queued ones: it is reposted, through ``repost``, once
        :meth:`wait_write_notice` takes a notice). The credit it consumed was accounted for here.
        """
        self._credits.on_slot_used()
        if opcode == _WC_RECV_RDMA_WITH_IMM:
            return self._queue_notice(WriteNotice(byte_len, imm), slot)
        if byte_len != _CONTROL.size:
            raise ProtocolError(f"one-sided control message of {byte_len} bytes (expected {_CONTROL.size})")
        version, kind, key_id = _CONTROL.unpack(payload[: _CONTROL.size])
        if version == KEY_VERSION and kind == CTL_WRITE_NOTICE:
            # A write notice without immediate data: the peer's WRITE before it on this queue pair is
            # placed (RC order). Queued as one with immediate data is.
            self._stats["write_notices_by_message"] += 1
            return self._queue_notice(WriteNotice(key_id >> 32, key_id & 0xFFFF_FFFF), slot)
        if version == KEY_VERSION and kind >= CTL_FIRST_EXTERNAL and self.control_handler is not None:
            # The rendezvous engine's handler (rdmaio.core.rendezvous): raises if the kind is unknown.
            self.control_handler(kind, key_id)
            return True
        if version != KEY_VERSION or kind not in (CTL_REVOKE, CTL_REVOKE_ACK):
            raise ProtocolError(f"unknown one-sided control message version {version} type {kind}")
        if kind == CTL_REVOKE:
            # Mark first: no request on that key is posted from now on (the doorbell checks again when it
            # rings); those posted earlier come before the ACK on this connection, so the exporter's NIC
            # has run them when the ACK arrives. Raises ProtocolError past Options.max_revoked_key_ranges.
            self.revoked_ids.add(key_id)
            # An answer: past Options.max_queued_replies waiting, ReplyQueueFullError fails the connection.
            self.send_control_message(CTL_REVOKE_ACK, key_id, reply=True)
        else:
            grant = self.grants.get(key_id)
            if grant is not None and grant.ack is not None:
                grant.ack.set()
        return True

    def _queue_notice(self, notice: WriteNotice, slot: int) -> bool:
        """Queue a write notice (with immediate data, or as a control message), holding its receive beyond
        ``notice_limit`` queued ones; whether to repost ``slot`` now."""
        self._notices.append(notice)
        self._stats["write_notices"] += 1
        if self._notice_waiter is not None:
            self._notice_waiter.set()
        if len(self._notices) > self.notice_limit and self._repost is not None and slot >= 0:
            self._held_slots.append(slot)
            self._stats["write_notice_slots_held"] += 1
            return False
        return True

    @staticmethod
    def write_notice_message(length: int, imm: int) -> bytes:
        """The control message of a write notice of ``length`` bytes with value ``imm`` (the writer's side
        of a write without immediate data, which the operation engine sends as an op of its own; see
        ``OperationEngine.write_notice_by_message``)."""
        return _CONTROL.pack(KEY_VERSION, CTL_WRITE_NOTICE, (length & 0xFFFF_FFFF) << 32 | imm)

    async def wait_write_notice(self) -> WriteNotice:
        """The next write notice; raises the connection's error once none is left and it failed."""
        while not self._notices:
            self._operations.raise_if_failed()
            if not self.peer_onesided:
                raise FeatureNotSupportedError(
                    "the peer's rdmaio does not support one-sided frames (no FEATURE_ONESIDED in its "
                    "handshake): it cannot send write notices"
                )
            waiter = self._notice_waiter = self._io.waiter()
            try:
                await waiter.wait()
            finally:
                self._notice_waiter = None
        notice = self._notices.popleft()
        if self._held_slots and not self._operations.closed and self._repost is not None:
            # One queued notice fewer: the oldest held receive goes back, and with it one writer credit.
            self._repost(self._held_slots.popleft())
        return notice

    def send_control(self, kind: int, value: int, *, reply: bool = False) -> None:
        """Queue a control message of another layer (``kind >= CTL_FIRST_EXTERNAL``, a u64 ``value``);
        the peer's engine hands it to its :attr:`control_handler`. Sent in call order, after a credit.
        ``reply``: it answers a message of the peer's, and counts against ``Options.max_queued_replies``
        (see :meth:`OperationEngine.queue_send
        <rdmaio.core.onesided.operations.OperationEngine.queue_send>`, which raises past it)."""
        if not CTL_FIRST_EXTERNAL <= kind <= 0xFF:
            raise ValueError(f"control kind {kind} is reserved")
        self.send_control_message(kind, value, reply=reply)

    def send_control_message(self, kind: int, value: int, *, reply: bool = False) -> None:
        """Queue a control SEND of any kind (REVOKE and its ACK included; it needs a credit and an op slot,
        so it may wait for either). ``reply``: as for :meth:`send_control`."""
        self._operations.queue_send(_CONTROL.pack(KEY_VERSION, kind, value), reply=reply)

    # --- the end --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """The connection is gone (after :meth:`OperationEngine.close
        <rdmaio.core.onesided.operations.OperationEngine.close>`, whose error the binds still in flight
        take): drop the held receives, wake every waiter, free every window and deregister every grant."""
        error = self._operations.error
        self._held_slots.clear()  # the QP and its receives are gone
        while self._bind_waiters:
            self._bind_waiters.popleft().set()
        binds = list(self._binds.values())
        self._binds.clear()
        grants = list(self.grants.values())
        self.grants.clear()
        failures: list[BaseException] = []
        for grant in grants:
            if grant.ack is not None:
                grant.ack.set()
            if grant.scoped is not None and grant.scoped.waiter is not None:
                grant.scoped.waiter.set()
            try:
                # The QP is gone: no bind is left to complete, the windows go now.
                if grant.scoped is not None:
                    grant.scoped.close_now()
                else:
                    grant.mr.close()
            except Exception as exc:
                failures.append(exc)
        for scoped in binds:  # rendezvous buffers whose bind had not completed: it never will now
            scoped.error = error
            if scoped.close_pending:
                try:
                    scoped.close_now()
                except Exception as exc:
                    failures.append(exc)
        if self._notice_waiter is not None:
            self._notice_waiter.set()
        for failure in failures:
            # Teardown goes on (the connection is gone either way); the memory stays registered.
            self._stats["grant_release_failures"] += 1
            log.error("rdmaio: releasing a grant at the end of the connection failed: %s", failure)

    def statistics(self) -> dict[str, int]:
        """Grants, queued notices and the receives they hold, the peer's revoked keys (the ranges kept, and
        the floor below which every id is revoked), window binds in flight."""
        return {
            "grants": len(self.grants),
            "write_notices_queued": len(self._notices),
            "write_notice_slots_held": len(self._held_slots),
            "keys_revoked_by_peer": len(self.revoked_ids),
            "revoked_key_floor": self.revoked_ids.floor,
            "mw_binds_in_flight": len(self._binds),
        }
