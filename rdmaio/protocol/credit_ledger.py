"""The credit ledger of one shared receive queue (sans-IO): :class:`SharedCreditLedger`, one per SRQ.

With a shared receive queue (SRQ) the receives a connection's peer may consume are no longer posted on
that connection's own queue: every connection of a device draws from one pool of posted receives. A SEND
that finds the SRQ empty meets RNR exactly as with a per-connection queue, so the credits granted to all
peers together must never exceed what the SRQ holds. The ledger owns the count of receives posted in the
SRQ and lends them to connections as *windows*; its invariant: the receives every peer may still consume
(credits it holds, credits and frames in flight, credits owed to it) add up to at most the receives posted
in the SRQ. Each connection gives receives back through the reclaim protocol of
:mod:`rdmaio.protocol.reclaim`.

The argument, the choices and what other stacks do are in docs/protocol.md ("Shared receive queue and
credits"); ``tests/unit/test_shared_credits.py`` simulates many connections against one ledger.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass

from rdmaio.protocol.reclaim import MIN_WINDOW, RETURN_KEEP

__all__ = ["SharedCreditLedger"]


@dataclass(slots=True)
class _Lease:
    """One connection's share of the pool."""

    window: int  # receives attributed to it: outstanding + consumed and not yet reposted or released
    outstanding: int  # receives its peer may still consume: credits held, in flight, owed
    target: int  # the window the ledger wants it to have; reposts above it go to the pool
    max_window: int  # its announced recv_depth
    reclaimable: bool  # its peer answers RECLAIM
    request: int = 0  # growth asked for and not granted yet
    active: bool = True  # consumed a receive since the last tick()
    reclaim: bool = False  # a RECLAIM should be sent (take_reclaims)
    closing: bool = False


class SharedCreditLedger:
    """The receives posted in one shared receive queue and the windows lent to its connections.

    Invariant (checked by :meth:`check`): ``sum(outstanding) <= posted``, where ``posted`` is the receives
    in the SRQ and a connection's *outstanding* receives are those its peer may still consume (credits it
    holds, grants and frames in flight, credits owed to it). A frame consumes one posted receive and one
    outstanding receive of its connection together, so every SEND finds a receive; only a repost adds to
    ``posted``, and the ledger lends a receive (:meth:`take_grants`, :meth:`on_reposted`) only out of
    ``free = posted - sum(outstanding)``.

    The I/O layer reports: receives posted on new buffers (:meth:`on_buffers_added`), each receive
    consumed (:meth:`on_consumed`), each buffer reposted (:meth:`on_reposted`, which says how many
    credits go back to the connection and how many to the pool), RETURN frames (:meth:`on_returned`),
    connections opened (:meth:`open`), closed (:meth:`close`) and gone (:meth:`retire`), and a periodic
    :meth:`tick`. It acts on: :meth:`take_grants` (grow those sessions), :meth:`take_reclaims` (ask those
    peers for credits back) and :meth:`want_buffers` (post that many more buffers, if it can).
    """

    def __init__(self, *, buffers: int, max_buffers: int, reserve: int = MIN_WINDOW) -> None:
        if reserve < MIN_WINDOW:
            raise ValueError(f"reserve {reserve} is below the smallest window {MIN_WINDOW}")
        if not 0 <= buffers <= max_buffers:
            raise ValueError(f"buffers {buffers} out of range 0..{max_buffers}")
        self.reserve = reserve
        self.max_buffers = max_buffers
        self._buffers = buffers  # every buffer: posted in the SRQ or consumed and not reposted
        self._posted = buffers
        self._committed = 0  # sum of outstanding
        self._leases: dict[Hashable, _Lease] = {}
        self._waiters: collections.deque[Hashable] = collections.deque()
        self._grants: list[tuple[Hashable, int]] = []
        self._wanted = 0  # buffers the pool would like added
        self._overrun_held = 0  # buffers consumed beyond a lease and not posted again
        self.refused = 0  # connections refused for lack of receives
        self.overruns = 0  # receives consumed beyond a lease (a peer sending without credits)
        self.limit_events = 0

    def __repr__(self) -> str:
        return (
            f"<SharedCreditLedger buffers={self._buffers} posted={self._posted} "
            f"committed={self._committed} leases={len(self._leases)} waiters={len(self._waiters)}>"
        )

    # -- the pool -------------------------------------------------------------------------------------------

    @property
    def buffers(self) -> int:
        """Receive buffers the pool owns (posted or consumed and not reposted)."""
        return self._buffers

    @property
    def posted(self) -> int:
        """Receives posted in the SRQ, as the ledger counts them."""
        return self._posted

    @property
    def free(self) -> int:
        """Posted receives lent to no connection."""
        return self._posted - self._committed

    @property
    def connections(self) -> int:
        """Connections with a lease (open or closing)."""
        return len(self._leases)

    def want_buffers(self) -> int:
        """How many more buffers the pool would like posted (bounded by ``max_buffers``); the I/O layer
        posts what it can and reports it with :meth:`on_buffers_added`."""
        return min(self._wanted, self.max_buffers - self._buffers)

    def on_buffers_added(self, n: int) -> None:
        """``n`` receives were posted on new buffers."""
        if not 0 <= n <= self.max_buffers - self._buffers:
            raise ValueError(f"cannot add {n} buffers to {self._buffers} of at most {self.max_buffers}")
        self._buffers += n
        self._posted += n
        self._wanted = max(0, self._wanted - n)
        self._serve()

    @property
    def srq_limit(self) -> int:
        """The low watermark to arm the SRQ with (``ibv_modify_srq``, ``IBV_SRQ_LIMIT``): a quarter of the
        buffers, at least 1. The event is a hint (the device drained the queue faster than completions were
        seen), never what prevents RNR: the invariant does that."""
        return max(1, self._buffers // 4)

    def on_limit_event(self) -> None:
        """The SRQ went below :attr:`srq_limit` (``IBV_EVENT_SRQ_LIMIT_REACHED``; it disarms itself):
        treat it as pressure (grow the pool if it may, take idle credits back). Re-arm after reposting."""
        self.limit_events += 1
        self._wanted = max(self._wanted, self._buffers // 2 or 1)
        self.tick()

    # -- connections ----------------------------------------------------------------------------------------

    def open(self, key: Hashable, initial: int, max_window: int, *, reclaimable: bool) -> bool:
        """Lend ``initial`` receives to a new connection (its peer starts with that many credits); False
        (and a wish for more buffers) if the pool cannot lend them now.

        A connection whose peer cannot answer RECLAIM keeps its initial window for life: credits lent to
        it beyond that could not be taken back."""
        if key in self._leases:
            raise ValueError(f"connection {key!r} already has a lease")
        if not self.reserve <= initial <= max_window:
            raise ValueError(f"initial window {initial} out of range {self.reserve}..{max_window}")
        if self.free < initial:
            self._wanted = max(self._wanted, initial - self.free)
            self.refused += 1
            self._pressure(newcomers=1)
            return False
        self._committed += initial
        if not self._waiters:
            self._wanted = 0  # the admission it was wished for has happened
        self._leases[key] = _Lease(
            initial, initial, initial, max_window if reclaimable else initial, reclaimable
        )
        return True

    def on_consumed(self, key: Hashable) -> bool:
        """A receive of the SRQ completed for ``key``'s connection (any frame, or a one-sided request that
        consumes a receive). False if it was beyond the lease (its peer sent without a credit): the SRQ
        holds one receive fewer than the other leases count on, which the I/O layer must end by failing
        that connection and reporting the buffer's repost with :meth:`on_overrun_reposted`."""
        lease = self._leases[key]
        if self._posted <= 0:
            raise RuntimeError(
                f"a receive was consumed for {key!r} with none posted: the ledger is out of step"
            )
        self._posted -= 1
        lease.active = True
        if lease.outstanding <= 0:
            self._overrun_held += 1
            self.overruns += 1
            return False
        lease.outstanding -= 1
        self._committed -= 1
        return True

    def on_overrun_reposted(self, n: int) -> None:
        """``n`` buffers consumed beyond a lease (:meth:`on_consumed` returned False) were posted again."""
        if not 0 <= n <= self._overrun_held:
            raise ValueError(f"{n} overrun buffers reposted, {self._overrun_held} were taken")
        self._overrun_held -= n
        self._posted += n

    def on_reposted(self, key: Hashable, n: int = 1) -> tuple[int, int]:
        """``n`` buffers that ``key``'s frames consumed were posted in the SRQ again. Returns ``(back,
        released)``: give ``back`` to the session (``on_recv_reposted``) and release the others
        (``release_receives``); the window shrinks toward its target, never below the reserve."""
        lease = self._leases[key]
        if not 0 <= n <= lease.window - lease.outstanding:
            raise ValueError(f"{key!r} has {lease.window - lease.outstanding} consumed receives, not {n}")
        self._posted += n
        released = min(n, max(0, lease.window - lease.target))
        back = n - released
        lease.window -= released
        lease.outstanding += back
        self._committed += back
        if released:
            self._serve()
        return back, released

    def on_returned(self, key: Hashable, returned: int) -> None:
        """The peer gave back ``returned`` credits (a RETURN frame; its own receive goes to
        :meth:`on_consumed` first)."""
        lease = self._leases[key]
        if not 0 <= returned <= lease.outstanding:
            raise ValueError(f"{key!r} cannot return {returned} of {lease.outstanding} outstanding")
        lease.outstanding -= returned
        lease.window -= returned
        self._committed -= returned
        if returned:
            self._serve()

    def request(self, key: Hashable, n: int) -> None:
        """``key``'s connection would like its window ``n`` receives larger (it sees load); served in order
        of request as receives come free, up to its ``max_window``."""
        lease = self._leases[key]
        if lease.closing or n <= 0:
            return
        lease.request = min(lease.request + n, lease.max_window - lease.window)
        if lease.request and key not in self._waiters:
            self._waiters.append(key)
        self._serve()

    def take_grants(self) -> list[tuple[Hashable, int]]:
        """Windows grown since the last call: ``(key, n)``; the I/O layer calls ``grow_receives(n)``."""
        grants, self._grants = self._grants, []
        return grants

    def take_reclaims(self) -> list[Hashable]:
        """Connections whose peers should be asked for credits back (``request_reclaim()``)."""
        keys = [key for key, lease in self._leases.items() if lease.reclaim]
        for key in keys:
            self._leases[key].reclaim = False
        return keys

    def tick(self) -> None:
        """Periodic: connections that consumed nothing since the last tick are idle; their windows go back
        to the reserve (reposts above it are released, and the peer is asked for what it holds)."""
        for key, lease in self._leases.items():
            if (
                not lease.active
                and lease.target > self.reserve
                and not lease.closing
                and key not in self._waiters
            ):
                lease.target = self.reserve
                # Only worth a RECLAIM if the peer would give back something: it keeps RETURN_KEEP.
                lease.reclaim = lease.reclaimable and lease.outstanding > self.reserve + RETURN_KEEP
            lease.active = False
        self._pressure()

    def close(self, key: Hashable) -> None:
        """``key``'s connection is closing: every receive it gives back goes to the pool. Its outstanding
        receives stay lent until :meth:`retire`, since frames already sent may still consume them."""
        lease = self._leases[key]
        lease.closing = True
        lease.target = 0
        lease.request = 0
        lease.reclaim = False
        if key in self._waiters:
            self._waiters.remove(key)

    def retire(self, key: Hashable) -> None:
        """``key``'s QP is destroyed and its completions were polled: nothing consumes its outstanding
        receives any more; they go back to the pool. Its consumed buffers must have been reposted."""
        lease = self._leases[key]
        if lease.window != lease.outstanding:
            raise ValueError(f"{key!r} still has {lease.window - lease.outstanding} consumed buffers")
        del self._leases[key]
        if key in self._waiters:
            self._waiters.remove(key)
        self._committed -= lease.outstanding
        self._serve()

    def set_reclaimable(self, key: Hashable, reclaimable: bool) -> None:
        """Whether ``key``'s peer answers RECLAIM (known once its handshake arrived); only such windows grow
        beyond what they were opened with."""
        lease = self._leases[key]
        lease.reclaimable = reclaimable
        if not reclaimable:
            lease.max_window = lease.window

    def set_max_window(self, key: Hashable, max_window: int) -> None:
        """``key``'s announced ``recv_depth``, the ceiling of its window (when the peer answers RECLAIM)."""
        lease = self._leases[key]
        if lease.reclaimable:
            lease.max_window = max(lease.window, max_window)

    def unreturned(self, key: Hashable) -> int:
        """Receives ``key``'s frames consumed that were not reposted or released yet."""
        lease = self._leases[key]
        return lease.window - lease.outstanding

    def window(self, key: Hashable) -> int:
        """``key``'s current window (what its session's ``recv_depth`` must equal)."""
        return self._leases[key].window

    def outstanding(self, key: Hashable) -> int:
        """``key``'s outstanding receives (what its session's ``posted`` must equal)."""
        return self._leases[key].outstanding

    def check(self) -> None:
        """Raise AssertionError unless the ledger's invariants hold (cheap; for tests and debugging)."""
        committed = sum(lease.outstanding for lease in self._leases.values())
        windows = sum(lease.window for lease in self._leases.values())
        assert committed == self._committed, (committed, self._committed)
        # Overrun buffers are missing from the SRQ until reposted: only then can the invariant be short.
        assert 0 <= self._committed <= self._posted + self._overrun_held, self
        assert windows + self.free + self._overrun_held == self._buffers <= self.max_buffers, (windows, self)
        for lease in self._leases.values():
            assert 0 <= lease.outstanding <= lease.window <= lease.max_window, lease
            assert lease.closing or lease.window >= self.reserve, lease

    # -- policy ---------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        """Grant free receives to the waiting connections, oldest request first; partial grants allowed so
        the head never blocks behind a request larger than what is free."""
        while self._waiters and self.free > 0:
            key = self._waiters[0]
            lease = self._leases[key]
            n = min(lease.request, self.free, lease.max_window - lease.window)
            if n > 0:
                lease.window += n
                lease.outstanding += n
                lease.target = max(lease.target, lease.window)
                lease.request -= n
                self._committed += n
                self._grants.append((key, n))
            if lease.request <= 0 or lease.window >= lease.max_window:
                lease.request = 0
                self._waiters.popleft()
        self._pressure()

    def _pressure(self, newcomers: int = 0) -> None:
        """While requests wait: wish for more buffers, and bring every other window down to a fair share
        of the largest pool (releasing on repost, reclaiming from peers that answer RECLAIM). A refused
        connection (``newcomers``) counts in the share, so that a later attempt finds its reserve free."""
        if not self._waiters and not self._wanted:
            return
        waiting = sum(self._leases[key].request for key in self._waiters)
        self._wanted = max(self._wanted, waiting - self.free)
        if not self._leases:
            return
        fair = max(self.reserve, self.max_buffers // (len(self._leases) + newcomers))
        for key, lease in self._leases.items():
            if lease.closing or key in self._waiters:
                continue
            if lease.target > fair:
                lease.target = fair
            # Only when the peer would give back something (it keeps RETURN_KEEP): no RECLAIM/RETURN
            # exchange that returns nothing, over and over.
            if lease.reclaimable and lease.outstanding > lease.target + RETURN_KEEP:
                lease.reclaim = True
        # A waiter whose window already is its fair share while the pool cannot grow asks for no more: its
        # request would otherwise wait forever for receives no one has to give.
        if self._buffers >= self.max_buffers:
            for key in list(self._waiters):
                lease = self._leases[key]
                if lease.window >= fair and self.free == 0:
                    lease.request = 0
                    self._waiters.remove(key)
