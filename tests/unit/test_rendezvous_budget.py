"""The device's rendezvous send budget where connections register in caches of their own (a device without
memory windows: each connection has a protection domain and a registration cache of its own): the budget
and the sends waiting for their peers are counted in the Domain's cache, so that peers that never answer
share one device budget instead of each connection getting a whole one."""

from __future__ import annotations

import collections
from types import SimpleNamespace

from rdmaio.core.domain import RegistrationCache
from rdmaio.core.rendezvous import SEND_SHARE, RendezvousEngine
from rdmaio.options import Options

MiB = 1 << 20


def cache(max_pinned: int) -> RegistrationCache:
    """A registration cache whose registrations are fakes (only their length is used)."""
    return RegistrationCache(
        lambda buf, access: SimpleNamespace(length=len(buf), close=lambda: None),
        lambda buf: (id(buf), len(buf)),
        max_pinned,
    )


class FakeConnection:
    """What the engine takes from its connection (held weakly by the engine: a class, not a namespace)."""

    def __init__(self) -> None:
        self.io = SimpleNamespace()
        self.rxbuf = SimpleNamespace()
        self.session = SimpleNamespace(rendezvous=True)
        self.onesided = SimpleNamespace(control_handler=None)
        self.stats: collections.Counter[str] = collections.Counter()
        self.engine: RendezvousEngine | None = None


CONNECTIONS: list[FakeConnection] = []  # alive for the test's engines


def engine(domain: RegistrationCache, private: RegistrationCache | None) -> RendezvousEngine:
    """The rendezvous engine of a connection on ``domain``'s device (with a cache of its own if
    ``private``), made by ``RendezvousEngine.for_connection`` as a connection makes it."""
    conn = FakeConnection()
    CONNECTIONS.append(conn)
    transport = SimpleNamespace(
        pd=object(), private_registrations=private, domain=SimpleNamespace(registrations=domain)
    )
    made = RendezvousEngine.for_connection(conn, transport, Options(rndv_threshold=64 * 1024))
    assert made is not None
    conn.engine = made
    return made


def test_connections_with_caches_of_their_own_share_the_device_send_budget() -> None:
    """One connection's sends waiting for its peer (8 MiB) leave the next connection half of what is left of
    the device's 16 MiB, whether the connections register in the Domain's cache or in their own."""
    for private in (False, True):
        domain = cache(32 * MiB)
        first = engine(domain, cache(32 * MiB) if private else None)
        second = engine(domain, cache(32 * MiB) if private else None)
        assert first.send_budget == second.send_budget == 16 * MiB // SEND_SHARE
        # What RendezvousEngine.send counts for a send registered and waiting for its peer.
        assert domain.try_reserve(8 * MiB, domain.max_pinned // 2)
        domain.send_pinned += 8 * MiB
        first._send_pinned += 8 * MiB
        assert first.send_budget == 16 * MiB // SEND_SHARE  # its own sends do not count against it
        assert second.send_budget == (16 - 8) * MiB // SEND_SHARE, private
