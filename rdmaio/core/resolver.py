"""Host names to the numeric addresses rdma_cm takes, for both ends of connection setup.

rdma_cm resolves only numeric addresses; :func:`resolve_host` turns a name into one with the loop's
``getaddrinfo`` (asyncio's executor, or trio's), and passes a numeric address through after parsing it
once (cached: a client connecting again and again to one address pays nothing per connection).
"""

from __future__ import annotations

import functools
import ipaddress
import socket

from rdmaio.core.reactor import Reactor
from rdmaio.errors import AddressError

__all__ = ["resolve_host"]


async def resolve_host(host: str, port: int, *, passive: bool = False) -> str:
    """Return a numeric IPv4/IPv6 address for ``host`` (numeric addresses are returned as they are).

    An empty ``host`` is the wildcard address when ``passive`` (listening), else the loopback address.
    Raises :class:`~rdmaio.AddressError` when the name does not resolve to an IPv4/IPv6 address."""
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
