"""``rdmaio.connect()``: resolve, create the connection's resources, handshake, return an Endpoint."""

from __future__ import annotations

import builtins
import collections
import functools
import ipaddress
import socket
from typing import Any

from rdmaio.core.backend import Backend, Waiter
from rdmaio.core.onesided import rd_atomic_depth
from rdmaio.core.reactor import Reactor
from rdmaio.core.shared_receive import new_session
from rdmaio.core.transport import Transport
from rdmaio.endpoint import Endpoint
from rdmaio.errors import (
    AddressError,
    ConnectionRefusedError,
    HandshakeError,
    TimeoutError,
    UnreachableError,
)
from rdmaio.options import Options
from rdmaio.protocol import (
    FEATURE_BATCH,
    FEATURE_GROW,
    FEATURE_ONESIDED,
    FEATURE_RECLAIM,
    FEATURE_RNDV,
    Handshake,
)
from rdmaio.verbs import CMEvent, CMEventType

__all__ = ["connect", "local_handshake", "resolve_host"]

# rdma_cm reports "no listener on that port" as REJECTED with IB CM reason 8 (invalid service id).
_REJECT_NO_LISTENER = 8


async def resolve_host(host: str, port: int, *, passive: bool = False) -> str:
    """Return a numeric IPv4/IPv6 address for ``host`` (numeric addresses are returned as they are)."""
    if not host:
        return "0.0.0.0" if passive else "127.0.0.1"
    numeric = _numeric(host)
    if numeric is not None:
        return numeric
    try:
        infos = await Reactor.current().backend.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE if passive else 0
        )
    except socket.gaierror as exc:
        raise AddressError(
            f"cannot resolve {host!r}: {exc.strerror}", errno=exc.errno, call="getaddrinfo"
        ) from exc
    for family, *_rest, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return str(sockaddr[0])
    raise AddressError(f"{host!r} has no IPv4/IPv6 address", call="getaddrinfo")


@functools.lru_cache(maxsize=256)
def _numeric(host: str) -> str | None:
    """``host`` as a normalised numeric address, None if it is a name (cached: a client connecting again
    and again to one address parses it once)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def local_handshake(options: Options, *, grow: bool = True) -> Handshake:
    """The handshake this side announces for ``options``: a growing receive window (FEATURE_GROW, starting
    at ``options.initial_depth``) unless ``grow`` is false (a server answering a peer that cannot grow).

    FEATURE_GROW is announced even when ``initial_depth`` equals ``recv_depth`` (a fixed ring): the bit also
    says this side accepts a growing peer, and a server gives a peer without it only a small fixed window
    (:attr:`Options.initial_depth`), since it must post that window before it accepts."""
    initial = min(options.initial_depth, options.recv_depth)
    return Handshake(
        recv_depth=options.recv_depth,
        slot_size=options.slot_size,
        max_message_size=options.max_message_size,
        features=(FEATURE_BATCH if options.batch_limit else 0)
        | (FEATURE_GROW if grow else 0)
        | FEATURE_ONESIDED
        | (FEATURE_RNDV if options.rndv_threshold else 0)
        | (FEATURE_RECLAIM if options.shared_receive_queue else 0),
        initial_depth=initial if grow else 0,
    )


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


def _connect_error(event: CMEvent, where: str) -> Exception:
    name = event.event.name
    if event.event == CMEventType.REJECTED:
        if event.status == _REJECT_NO_LISTENER:
            return ConnectionRefusedError(
                f"connection refused by {where}: no listener on that port", errno=111, call="rdma_connect"
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


async def connect(
    host: str,
    port: int,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - the asyncio.open_connection-style API has one
    local_addr: tuple[str, int] | None = None,
    options: Options | dict[str, Any] | None = None,
) -> Endpoint:
    """Open an RDMA connection to ``host``:``port`` and return the connected :class:`Endpoint`.

    ``host`` is an IPv4/IPv6 address or a name (resolved with ``getaddrinfo``) of an RDMA-capable
    interface. ``local_addr`` binds the local side. ``options`` is an :class:`Options` or a dict of
    overrides. Raises :class:`~rdmaio.ConnectionRefusedError` when nobody listens,
    :class:`~rdmaio.AddressError` / :class:`~rdmaio.UnreachableError` when the peer cannot be reached,
    :class:`~rdmaio.TimeoutError` after ``timeout`` seconds, :class:`~rdmaio.HandshakeError` when the
    peer does not speak our protocol.
    """
    opts = Options.coerce(options)
    if timeout is None:
        timeout = opts.connect_timeout
    where = f"{host} port {port}"
    try:
        async with Reactor.current().backend.timeout(timeout):
            return await _connect(host, port, local_addr, opts, where)
    except builtins.TimeoutError as exc:
        if isinstance(exc, TimeoutError):
            raise
        raise TimeoutError(f"connect to {where} timed out after {timeout} s", call="connect") from exc


async def _connect(
    host: str, port: int, local_addr: tuple[str, int] | None, opts: Options, where: str
) -> Endpoint:
    address = await resolve_host(host, port)
    src = None
    if local_addr is not None:
        src = (await resolve_host(local_addr[0], local_addr[1]), local_addr[1])
    reactor = Reactor.current()
    events = CMEventQueue(reactor.backend)
    cm_id = reactor.create_id(events.put)
    transport: Transport | None = None
    try:
        cm_id.resolve_addr(address, port, src=src, timeout_ms=opts.cm_timeout_ms)
        event = await events.get()
        if event.event != CMEventType.ADDR_RESOLVED:
            raise _connect_error(event, where)
        cm_id.resolve_route(opts.cm_timeout_ms)
        event = await events.get()
        if event.event != CMEventType.ROUTE_RESOLVED:
            raise _connect_error(event, where)
        handshake = local_handshake(opts)
        transport = Transport(reactor, cm_id, opts, handshake.initial_depth)
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
            raise _connect_error(event, where)
        try:
            peer = Handshake.decode(event.private_data)
        except HandshakeError:
            cm_id.disconnect()
            raise
        return Endpoint(reactor, cm_id, transport, new_session(handshake, peer, transport), opts)
    except BaseException:
        if transport is not None:
            transport.close()
        reactor.release_id(cm_id)
        raise
