"""Accepting: the listening side of connection setup, from rdma_cm connection requests to started
Connections.

An :class:`Acceptor` owns a server's listening cm ids and the connections it has accepted at the rdma_cm
level but that are not established yet (:class:`PendingConnection`). For each CONNECT_REQUEST it decides
admission before creating anything: closed, backlog full (the pending connections plus those its owner
holds established but not yet served), or the source address at ``Options.max_pending_per_source``
pending: rejected at once, so a flood costs a cm id and a REJ per request and pins nothing. Then it
decodes the peer's handshake, answers with :func:`~rdmaio.core.negotiation.accepting_handshake` (the
receive window a half-open request may hold), creates the verbs resources
(:class:`~rdmaio.core.transport.Transport`), grants the one-sided depth both sides allow, accepts, picks
the session class (:func:`~rdmaio.core.shared_receive.new_session`) and starts the establishment
deadline (``Options.establish_timeout``). On ESTABLISHED it starts the
:class:`~rdmaio.core.connection.Connection` and hands it to its owner; a request that fails or times out
is dropped with everything it held.

The public :class:`rdmaio.StreamServer` is its owner: it wraps each connection in an Endpoint and serves
it (handler or ``accept()``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sized

from rdmaio.core.backend import Handle
from rdmaio.core.capabilities import DEVICE_CAPS, device_capabilities
from rdmaio.core.connection import Connection
from rdmaio.core.negotiation import accepting_handshake, local_handshake
from rdmaio.core.onesided import rd_atomic_depth
from rdmaio.core.port_retry import try_another_port
from rdmaio.core.reactor import Reactor
from rdmaio.core.shared_receive import new_session
from rdmaio.core.transport import Transport
from rdmaio.errors import HandshakeError, VerbsError
from rdmaio.options import Options
from rdmaio.protocol import FEATURE_GROW, Handshake, Session
from rdmaio.protocol.framing import negotiate_framing
from rdmaio.verbs import CMEvent, CMEventType, CMId

__all__ = ["Acceptor", "PendingConnection"]

log = logging.getLogger("rdmaio")


class PendingConnection:
    """A connection accepted but not yet ESTABLISHED: its resources, its source address and its deadline."""

    __slots__ = ("cm_id", "deadline", "session", "source", "transport")

    def __init__(
        self, cm_id: CMId, transport: Transport, session: Session, source: str, deadline: Handle
    ) -> None:
        self.cm_id = cm_id
        self.transport = transport
        self.session = session
        self.source = source
        self.deadline = deadline


class Acceptor:
    """The listeners and pending connections of one server (see the module docstring).

    ``on_connection(connection)`` is called with each started connection; ``on_device_removal()`` when the
    device under a listener goes away (the owner closes); ``on_timed_out()`` after a pending connection
    was dropped at its deadline. ``queued`` is the owner's collection of connections established but not
    served yet: with the pending ones, what ``backlog`` bounds.
    """

    def __init__(
        self,
        reactor: Reactor,
        options: Options,
        backlog: int,
        *,
        queued: Sized,
        on_connection: Callable[[Connection], None],
        on_device_removal: Callable[[], None],
        on_timed_out: Callable[[], None],
    ) -> None:
        self._reactor = reactor
        self._io = reactor.backend
        self._options = options
        self.backlog = backlog
        self._queued = queued
        self._on_connection = on_connection
        self._on_device_removal = on_device_removal
        self._on_timed_out = on_timed_out
        self._listeners: list[CMId] = []
        self.listening = False  # from a successful listen() until close()
        self._pending: dict[int, PendingConnection] = {}  # by cm id handle
        self._pending_by_source: collections.Counter[str] = collections.Counter()
        #: The ``(host, port)`` of each listener (the port chosen when 0 was asked).
        self.addresses: list[tuple[str, int]] = []
        self.accepted = 0  # established and handed to the owner
        self.rejected = 0  # every rejection (closed, bad handshake, no resources, backlog, source)
        self.refused_backlog = 0  # of those: the backlog was full
        self.refused_source = 0  # of those: the source had max_pending_per_source pending
        self.timed_out = 0  # accepted but not established within establish_timeout
        self.peak_waiting = 0

    def listen(self, hosts: list[str], port: int) -> None:
        """Listen on every address of ``hosts`` (numeric) at ``port``; on failure none stays open."""
        try:
            for host in hosts:
                listener = self._listen_on(host, port)
                address = listener.local_address
                if address:
                    self.addresses.append(address)
        except BaseException:
            listeners, self._listeners = self._listeners, []
            for listener in listeners:
                self._reactor.release_id(listener)
            self.addresses = []
            raise
        self.listening = True

    def _listen_on(self, host: str, port: int) -> CMId:
        """A listening id on ``host``:``port`` (0: a port rdma_cm picks), kept in ``_listeners``."""
        attempt = 1
        while True:
            listener = self._reactor.create_id(self._on_listener_event)
            self._listeners.append(listener)
            listener.set_reuseaddr()
            listener.bind_addr(host, port)
            try:
                listener.listen(self.backlog)
                return listener
            except VerbsError as exc:
                if not try_another_port(exc.errno, port, attempt):  # Soft-iWARP's TCP still holds it
                    raise
                self._listeners.remove(listener)
                self._reactor.release_id(listener)
                attempt += 1

    def close(self) -> None:
        """Stop listening and drop every pending connection (what they hold is released)."""
        self.listening = False
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            self._reactor.release_id(listener)
        for handle in list(self._pending):
            pending = self._take_pending(handle)
            if pending is not None:
                self._drop_pending(pending)

    @property
    def pending(self) -> int:
        """Connections accepted and not established yet."""
        return len(self._pending)

    def pending_held(self) -> tuple[int, int]:
        """What the pending connections hold: (registered bytes of receive slots, receives lent from the
        shared receive queue)."""
        registered = shared = 0
        for pending in self._pending.values():
            transport = pending.transport
            registered += transport.registered_bytes
            if transport.shared is not None:
                shared += transport.shared.pool.ledger.window(transport.shared.key)
        return registered, shared

    # --- rdma_cm events ---------------------------------------------------------------------------

    def _on_listener_event(self, event: CMEvent) -> None:
        if event.event == CMEventType.CONNECT_REQUEST:
            self._on_connect_request(event)
        elif event.event == CMEventType.DEVICE_REMOVAL:
            log.error("rdmaio: RDMA device removed under the listener %s; closing it", self.addresses)
            self._on_device_removal()
        else:
            log.debug("rdmaio: listener ignores %s", event.event.name)

    def _on_connect_request(self, event: CMEvent) -> None:
        cm_id = self._reactor.adopt_id(event, self._on_pending_event)
        if not self.listening:
            self._reject(cm_id, "server is closed")
            return
        if len(self._pending) + len(self._queued) >= self.backlog:
            # Before any resource is created: a flood costs a cm id and a REJ per request, nothing pinned.
            self.refused_backlog += 1
            self._reject(cm_id, f"backlog of {self.backlog} connections is full")
            return
        peer_address = cm_id.peer_address
        source = peer_address[0] if peer_address else ""
        if self._pending_by_source[source] >= self._options.max_pending_per_source:
            self.refused_source += 1
            self._reject(
                cm_id,
                f"{source} already has {self._pending_by_source[source]} connections pending "
                f"(Options.max_pending_per_source)",
            )
            return
        try:
            peer = Handshake.decode(event.private_data)
        except HandshakeError as exc:
            self._reject(cm_id, f"bad handshake: {exc}")
            return
        transport = None
        try:
            handshake = accepting_handshake(
                local_handshake(self._options, grow=bool(peer.features & FEATURE_GROW)), peer, self._options
            )
            transport = Transport(self._reactor, cm_id, self._options, handshake.initial_depth)
            # The device's capabilities (iWARP: no immediate data) and the inline size its queue pair took:
            # known once the transport exists.
            device = transport.device
            caps = DEVICE_CAPS.get(
                (device.handle, transport.max_inline, self._options.framing)
            ) or device_capabilities(device, transport.max_inline, self._options)
            handshake = dataclasses.replace(handshake, caps=caps)
            theirs = peer.caps
            if (
                caps.header_framing
                or not caps.immediate
                or (theirs is not None and (theirs.header_framing or not theirs.immediate))
            ):
                negotiate_framing(handshake, peer)  # refused here (HandshakeError) if they cannot agree
            # One-sided READs/atomics in flight: what we allow, capped by what the request offers (rdma_cm
            # reports the request's values from our side's point of view).
            depth = rd_atomic_depth(transport.device, self._options.max_rdma_ops)
            cm_id.accept(
                handshake.encode(),
                rnr_retry_count=self._options.rnr_retry_count,
                responder_resources=max(1, min(depth, event.responder_resources)),
                initiator_depth=max(1, min(depth, event.initiator_depth)),
            )
        except Exception as exc:
            log.warning("rdmaio: cannot accept a connection: %s", exc)
            if transport is not None:
                transport.close()
            self._reject(cm_id, str(exc))
            return
        handle = cm_id.handle
        deadline = self._io.call_later(
            self._options.establish_timeout, lambda: self._establish_timed_out(handle)
        )
        self._pending[handle] = PendingConnection(
            cm_id, transport, new_session(handshake, peer, transport), source, deadline
        )
        self._pending_by_source[source] += 1
        self.peak_waiting = max(self.peak_waiting, len(self._pending) + len(self._queued))

    def _on_pending_event(self, event: CMEvent) -> None:
        pending = self._take_pending(event.id_handle)
        if pending is None:
            return
        if event.event != CMEventType.ESTABLISHED:
            log.info("rdmaio: connection attempt failed before it was established: %s", event.event.name)
            self._drop_pending(pending)
            return
        connection = Connection(
            self._reactor, pending.cm_id, pending.transport, pending.session, self._options
        )
        self.accepted += 1
        self._on_connection(connection)

    # --- pending connections ----------------------------------------------------------------------

    def _take_pending(self, handle: int) -> PendingConnection | None:
        """Remove a pending connection from the books (its deadline cancelled); None if it is not there."""
        pending = self._pending.pop(handle, None)
        if pending is not None:
            pending.deadline.cancel()
            count = self._pending_by_source[pending.source] - 1
            if count > 0:
                self._pending_by_source[pending.source] = count
            else:
                del self._pending_by_source[pending.source]
        return pending

    def _drop_pending(self, pending: PendingConnection) -> None:
        """Release what a pending connection holds: QP, receives (or shared-receive lease), cm id."""
        try:
            pending.transport.close()
        finally:
            self._reactor.release_id(pending.cm_id)

    def _establish_timed_out(self, handle: int) -> None:
        # A busy loop handles one rdma_cm event per wake-up: the ESTABLISHED event may be waiting in the
        # channel already (the client then believes it is connected). Handle what is there first.
        self._reactor.drain_cm_events()
        pending = self._take_pending(handle)
        if pending is None:
            return
        self.timed_out += 1
        log.info(
            "rdmaio: dropping a connection from %s not established within %s s (Options.establish_timeout)",
            pending.source,
            self._options.establish_timeout,
        )
        self._drop_pending(pending)
        self._on_timed_out()

    def _reject(self, cm_id: CMId, why: str) -> None:
        self.rejected += 1
        log.info("rdmaio: rejecting a connection request: %s", why)
        try:
            cm_id.reject()
        except VerbsError as exc:
            log.debug("rdmaio: rdma_reject failed: %s", exc)
        self._reactor.release_id(cm_id)
