"""The key ids a peer revoked, in bounded memory (the importer side of revocation; sans-IO).

An exporter numbers the keys of one connection 1, 2, 3, ...
(:meth:`rdmaio.core.onesided.exporter.Exporter.export`). The importer must remember every id it was told is
revoked for as long as the connection lives: a key may reach it by any path and be used at any time, and a
request on a revoked key would meet a deallocated window (a remote access error, which ends the
connection). Dense ids make that memory small: the ids are kept as a *floor* (every id below it is
revoked) and a sorted list of disjoint ranges above it. Revoking keys in the order they were exported only
moves the floor; keeping one key for long while others come and go costs one range for the gap it leaves.
Only ids interleaved with keys still alive cost a range each, and ``limit`` bounds them: past it
:meth:`RevokedKeys.add` raises :class:`~rdmaio.errors.ProtocolError` (a peer revoking ids it never issued,
or an exporter holding thousands of keys interleaved with revoked ones). A REVOKE for an id already revoked
changes nothing.
"""

from __future__ import annotations

from bisect import bisect_right

from rdmaio.errors import ProtocolError

__all__ = ["RevokedKeys"]


class RevokedKeys:
    """A set of revoked key ids as a floor plus at most ``limit`` disjoint ranges ``[start, end)``."""

    __slots__ = ("_ends", "_floor", "_starts", "limit", "top")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._floor = 1  # key ids start at 1: every id below the floor is revoked (0 was never issued)
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.top = 1
        """No key id from this one up is revoked (a request's check compares with it before it looks up
        the ranges)."""

    def __contains__(self, key_id: object) -> bool:
        if not isinstance(key_id, int):
            return False
        if key_id < self._floor:
            return True
        i = bisect_right(self._starts, key_id) - 1
        return i >= 0 and key_id < self._ends[i]

    def __len__(self) -> int:
        """The ranges held above the floor (what the bound counts)."""
        return len(self._starts)

    @property
    def floor(self) -> int:
        """Every key id below this one is revoked."""
        return self._floor

    def add(self, key_id: int) -> bool:
        """Mark ``key_id`` revoked; False if it already was. Raises ProtocolError when a new range would
        exceed ``limit``."""
        if key_id in self:
            return False
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, key_id)  # ranges before i start at or below key_id (and end before it)
        joins_left = i > 0 and ends[i - 1] == key_id
        joins_right = i < len(starts) and starts[i] == key_id + 1
        if joins_left and joins_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif joins_left:
            ends[i - 1] = key_id + 1
        elif joins_right:
            starts[i] = key_id
        elif key_id == self._floor:
            self._floor += 1
        else:
            if len(starts) >= self.limit:
                raise ProtocolError(
                    f"the peer revoked key id {key_id}: more than {self.limit} separate ranges of revoked "
                    "key ids (Options.max_revoked_key_ranges; ids it never issued?)"
                )
            starts.insert(i, key_id)
            ends.insert(i, key_id + 1)
        if starts and starts[0] == self._floor:  # the first range now touches the floor: absorb it
            self._floor = ends[0]
            del starts[0], ends[0]
        self.top = ends[-1] if ends else self._floor
        return True
