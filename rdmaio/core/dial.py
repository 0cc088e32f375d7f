"""Dialing: the connecting side of connection setup, from a host and port to a started Connection.

:func:`dial` resolves the host, creates a cm id on the loop's event channel, resolves the RDMA address
and route, creates the connection's verbs resources (:class:`~rdmaio.core.transport.Transport`) with
the receive window of :func:`~rdmaio.core.negotiation.local_handshake`, offers the one-sided READ/atomic
depth the device allows, sends the connect request with the handshake, reads the peer's handshake from
ESTABLISHED, picks the session class (:func:`~rdmaio.core.shared_receive.new_session`) and returns the
started :class:`~rdmaio.core.connection.Connection`. On any failure (a typed error for each rdma_cm
failure event: :func:`connect_error`), or when cancelled, what it created is released.

The public :func:`rdmaio.connect` wraps it with its timeout and the Endpoint.
"""

from __future__ import annotations

import collections
import errno

from rdmaio.core.backend import Backend, Waiter
from rdmaio.core.capabilities import DEVICE_CAPS, device_capabilities
from rdmaio.core.connection import Connection
from rdmaio.core.negotiation import local_handshake
from rdmaio.core.onesided import rd_atomic_depth
from rdmaio.core.port_retry import try_another_port
from rdmaio.core.reactor import Reactor
from rdmaio.core.resolver import resolve_host
from rdmaio.core.shared_receive import new_session
from rdmaio.core.transport import Transport
from rdmaio.errors import (
    AddressError,
    ConnectionRefusedError,
    HandshakeError,
    UnreachableError,
)
from rdmaio.options import Options
from rdmaio.protocol import Handshake
from rdmaio.verbs import CMEvent, CMEventType
from rdmaio.verbs.cm import ConnectAddressError

__all__ = [
    "IWARP_BACKLOG_RESET",
    "CMEventQueue",
    "connect_error",
    "dial",
]

# rdma_cm reports "no listener on that port" as REJECTED with IB CM reason 8 (invalid service id).
_REJECT_NO_LISTENER = 8
# On iWARP the iw_cm reports a refused TCP/MPA connect as REJECTED with a negative errno: -ECONNREFUSED
# (nobody listens, or the listener's MPA reject) and -ECONNRESET (the listener's kernel reset it before
# handing it to the application: its listen backlog, the kernel TCP one, is full).
_IWARP_REFUSED = -errno.ECONNREFUSED
_IWARP_RESET = -errno.ECONNRESET
IWARP_BACKLOG_RESET = "reset before it was accepted: the listener's kernel backlog is full"
"""What the error says of a connection an iWARP listener's kernel reset before rdmaio saw it."""


class CMEventQueue:
    """Collects the CM events of a cm id that is still being set up, for one coroutine to await."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._events: collections.deque[CMEvent] = collections.deque()
        self._waiter: Waiter | None = None

    def put(self, event: CMEvent) -> None:
        """Reactor handler: queue one event."""
        self._events.append(event)
        if self._waiter is not None:
            self._waiter.set()

    async def get(self) -> CMEvent:
        """Next event of the id."""
        while not self._events:
            self._waiter = self._backend.waiter()
            try:
                await self._waiter.wait()
            finally:
                self._waiter = None
        return self._events.popleft()


def connect_error(event: CMEvent, where: str) -> Exception:
    """The typed error of an rdma_cm event that ends a connection attempt to ``where`` (a description of
    the peer): refused (no listener, rejected, or on iWARP reset by the listener's kernel backlog: every
    one a :class:`~rdmaio.ConnectionRefusedError`), address or route not resolved, or unreachable."""
    name = event.event.name
    if event.event == CMEventType.REJECTED:
        if event.status == _REJECT_NO_LISTENER:
            return ConnectionRefusedError(
                f"connection refused by {where}: no listener on that port", errno=111, call="rdma_connect"
            )
        if event.status == _IWARP_RESET:
            return ConnectionRefusedError(
                f"connection to {where} {IWARP_BACKLOG_RESET} (iWARP, status {event.status})",
                errno=111,
                call="rdma_connect",
            )
        if event.status == _IWARP_REFUSED:
            return ConnectionRefusedError(
                f"connection refused by {where}: no listener on that port, or the listener rejected it "
                f"(iWARP, status {event.status})",
                errno=111,
                call="rdma_connect",
            )
        return ConnectionRefusedError(
            f"connection rejected by {where} (status {event.status})", errno=111, call="rdma_connect"
        )
    if event.event == CMEventType.ADDR_ERROR:
        return AddressError(
            f"cannot resolve {where} to an RDMA device (status {event.status})",
            errno=-event.status if event.status < 0 else None,
            call="rdma_resolve_addr",
        )
    if event.event == CMEventType.ROUTE_ERROR:
        return UnreachableError(
            f"no route to {where} (status {event.status})",
            errno=-event.status if event.status < 0 else None,
            call="rdma_resolve_route",
        )
    return UnreachableError(
        f"{where} unreachable: {name} (status {event.status})",
        errno=-event.status if event.status < 0 else 113,
        call="rdma_connect",
    )


async def dial(
    reactor: Reactor, host: str, port: int, local_addr: tuple[str, int] | None, opts: Options
) -> Connection:
    """Connect to ``host``:``port`` (``local_addr``: bind the local side) on ``reactor``'s loop and return
    the started connection. Raises :class:`~rdmaio.ConnectionRefusedError`, :class:`~rdmaio.AddressError`,
    :class:`~rdmaio.UnreachableError` or :class:`~rdmaio.HandshakeError` (see :func:`rdmaio.connect`);
    unbounded in time: the caller sets the deadline."""
    address = await resolve_host(host, port)
    src = None
    if local_addr is not None:
        src = (await resolve_host(local_addr[0], local_addr[1]), local_addr[1])
    attempt = 1
    while True:
        events = CMEventQueue(reactor.backend)
        cm_id = reactor.create_id(events.put)
        transport: Transport | None = None
        try:
            cm_id.resolve_addr(address, port, src=src, timeout_ms=opts.cm_timeout_ms)
            event = await events.get()
            if event.event != CMEventType.ADDR_RESOLVED:
                raise connect_error(event, f"{host} port {port}")
            cm_id.resolve_route(opts.cm_timeout_ms)
            event = await events.get()
            if event.event != CMEventType.ROUTE_RESOLVED:
                raise connect_error(event, f"{host} port {port}")
            # The receives posted at first: local_handshake's initial window (a dialer always grows). The
            # handshake comes after the transport: it announces the device's capabilities (iWARP: no immediate
            # data) and the inline size its queue pair took.
            transport = Transport(reactor, cm_id, opts, min(opts.initial_depth, opts.recv_depth))
            device = transport.device
            caps = DEVICE_CAPS.get(
                (device.handle, transport.max_inline, opts.framing)
            ) or device_capabilities(device, transport.max_inline, opts)
            handshake = local_handshake(opts, caps=caps)
            depth = rd_atomic_depth(transport.device, opts.max_rdma_ops)  # one-sided READs/atomics in flight
            cm_id.connect(
                handshake.encode(),
                retry_count=opts.retry_count,
                rnr_retry_count=opts.rnr_retry_count,
                responder_resources=depth,
                initiator_depth=depth,
            )
            event = await events.get()
            if event.event != CMEventType.ESTABLISHED:
                raise connect_error(event, f"{host} port {port}")
            try:
                peer = Handshake.decode(event.private_data)
                session = new_session(handshake, peer, transport)  # HandshakeError if no common framing
            except HandshakeError:
                cm_id.disconnect()
                raise
            return Connection(reactor, cm_id, transport, session, opts)
        except ConnectAddressError as exc:
            if transport is not None:
                transport.close()
            reactor.release_id(cm_id)
            # The setup bench on siw, connecting again and again to one server, met a port still in TIME_WAIT
            # in each of its runs (see port_retry).
            if not try_another_port(exc.errno, src[1] if src is not None else 0, attempt):
                raise
            attempt += 1
        except BaseException:
            if transport is not None:
                transport.close()
            reactor.release_id(cm_id)
            raise
