"""``rdmaio.connect()``: open a connection (:func:`rdmaio.core.dial.dial`) within a deadline; return its
Endpoint."""

from __future__ import annotations

import builtins
from typing import Any

from rdmaio.core.dial import dial
from rdmaio.core.metrics import connect_failed
from rdmaio.core.reactor import Reactor
from rdmaio.endpoint import Endpoint
from rdmaio.errors import TimeoutError
from rdmaio.options import Options

__all__ = ["connect"]


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
    reactor = Reactor.current()
    try:
        try:
            async with reactor.backend.timeout(timeout):
                return Endpoint(await dial(reactor, host, port, local_addr, opts))
        except builtins.TimeoutError as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise TimeoutError(
                f"connect to {host} port {port} timed out after {timeout} s", call="connect"
            ) from exc
    except Exception as exc:
        connect_failed(reactor.backend, exc)  # process metrics: refused, or failed by error type
        raise
