"""Unit tests of rdmaio.core.dispatch.CompletionDispatcher with fake verbs objects (no device).

The fakes keep what matters: a channel that reports which CQs fired, CQs that hand out scripted completion
records grouped by (qp_num << 24) | tag in first-seen order (as the C helper does), a poll buffer of a fixed
size, and fd watches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from rdmaio import verbs
from rdmaio.core.dispatch import CompletionDispatcher
from rdmaio.errors import VerbsError
from rdmaio.testing.fakes import (
    CompletionGroup,
    FakeCompletionBatch,
    FakeCompletionChannel,
    FakeCQ,
)
from rdmaio.testing.fakes import (
    CompletionRecord as Rec,
)


class Harness:
    def __init__(self, capacity: int = 100, max_cqe: int = 1000, batch: int = 4) -> None:
        self.log: list[str] = []
        self.channel = FakeCompletionChannel(self.log)
        self.watched: dict[int, Any] = {}
        self.created: list[FakeCQ] = []

        def create_cq(channel: Any, cqe: int) -> FakeCQ:
            cq = FakeCQ(cqe, self.log)
            self.created.append(cq)
            self.log.append(f"create cq {cqe}")
            return cq

        def unwatch(fd: int) -> None:
            self.log.append(f"unwatch {fd}")
            del self.watched[fd]

        self.d = CompletionDispatcher(
            create_channel=lambda: self.channel,
            create_cq=create_cq,
            watch=lambda fd, cb: self.watched.__setitem__(fd, cb),
            unwatch=unwatch,
            batch=FakeCompletionBatch(batch),
            max_cqe=max_cqe,
            cq_capacity=capacity,
        )

    def complete(self, cq: Any, qp_num: int, tag: int, *indexes: int, kind: int = verbs.WR_KIND_RECV) -> None:
        """Completions land in ``cq`` and its event is pending on the channel."""
        for index in indexes:
            cq.pending.append(Rec(verbs.make_wr_id(kind, tag, index), qp_num))
        self.channel.fired.append(cq.handle)

    def wake(self) -> None:
        self.watched[FakeCompletionChannel.fd]()


def recorder(seen: list[tuple[str, list[int]]], name: str) -> Any:
    def handler(records: Any, start: int, count: int) -> None:
        seen.append((name, [verbs.wr_index(records[i].wr_id) for i in range(start, start + count)]))

    return handler


def two_connections() -> tuple[Harness, Any, list[tuple[str, list[int]]], int, int]:
    """A dispatcher with connections on QPs 7 ("a") and 8 ("b") on one CQ, their handlers recording."""
    h = Harness(batch=16)
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    ta, tb = h.d.register(7), h.d.register(8)
    h.d.set_handler(7, ta, recorder(seen, "a"))
    h.d.set_handler(8, tb, recorder(seen, "b"))
    return h, cq, seen, ta, tb


# --- reservations ------------------------------------------------------------------------------------


def test_reservations_are_first_fit_and_a_new_cq_comes_only_when_none_has_room() -> None:
    h = Harness(capacity=100)
    a = h.d.reserve(60)
    b = h.d.reserve(30)  # fits next to a
    c = h.d.reserve(50)  # does not fit: second CQ
    d = h.d.reserve(10)  # first fit: the first CQ still has 10
    assert a.cq is b.cq is d.cq and c.cq is not a.cq
    assert h.log == ["create cq 100", "create cq 100"]
    assert h.watched.keys() == {FakeCompletionChannel.fd}  # one fd for every CQ
    stats = h.d.statistics()
    assert stats["cqs"] == 2 and stats["reserved"] == 150 and stats["capacity"] == 200


def test_released_entries_are_reused_and_an_empty_cq_beyond_the_first_is_destroyed() -> None:
    h = Harness(capacity=100)
    a = h.d.reserve(80)
    b = h.d.reserve(80)
    assert a.cq is not b.cq
    b.release()
    b.release()  # idempotent
    assert h.log[-1] == "destroy cq 100" and h.d.statistics()["cqs"] == 1
    a.release()  # the first CQ stays for the next connection
    assert h.d.statistics()["cqs"] == 1 and h.d.statistics()["reserved"] == 0
    c = h.d.reserve(100)
    assert c.cq is a.cq and len(h.created) == 2


def test_a_reservation_larger_than_the_pooled_size_gets_its_own_cq_up_to_max_cqe() -> None:
    h = Harness(capacity=100, max_cqe=500)
    big = h.d.reserve(300)
    assert big.cq.cqe == 300
    with pytest.raises(VerbsError, match="allows 500"):
        h.d.reserve(501)
    with pytest.raises(ValueError):
        h.d.reserve(0)


def test_a_failed_cq_takes_no_new_reservation_and_goes_when_empty() -> None:
    h = Harness(capacity=100)
    a = h.d.reserve(10)
    h.d.cq_failed(a.cq.handle)
    b = h.d.reserve(10)
    assert b.cq is not a.cq
    a.release()
    assert a.cq.closed and h.d.cqs == [b.cq]


# --- tags and dispatch -------------------------------------------------------------------------------


def test_tags_are_unique_among_live_connections_and_wrap_around() -> None:
    h = Harness()
    tags = [h.d.register(qp) for qp in range(5)]
    assert len(set(tags)) == 5 and 0 not in tags
    h.d._next_tag = verbs.WR_TAG_MASK  # near the end of the 24-bit space
    last = h.d.register(99)
    wrapped = h.d.register(100)
    assert last == verbs.WR_TAG_MASK and wrapped not in tags and 1 <= wrapped <= verbs.WR_TAG_MASK


def test_completions_are_dispatched_by_key_once_per_group_in_cq_order() -> None:
    h, cq, seen, ta, tb = two_connections()
    for i in range(3):  # interleaved in the CQ
        h.complete(cq, 7, ta, i)
        h.complete(cq, 8, tb, 10 + i)
    h.wake()
    assert seen == [("a", [0, 1, 2]), ("b", [10, 11, 12])]
    stats = h.d.statistics()
    assert stats["wakeups"] == 1 and stats["events"] == 6 and stats["completions"] == 6
    assert stats["dispatched"] == 2 and stats["dropped"] == 0


def test_a_full_batch_is_polled_again_until_the_cq_is_empty() -> None:
    h = Harness(batch=4)
    cq = h.d.reserve(20).cq
    seen: list[tuple[str, list[int]]] = []
    tag = h.d.register(7)
    h.d.set_handler(7, tag, recorder(seen, "a"))
    h.complete(cq, 7, tag, *range(10))
    h.wake()
    assert seen == [("a", [0, 1, 2, 3]), ("a", [4, 5, 6, 7]), ("a", [8, 9])]
    assert h.d.statistics()["polls"] == 3


def test_only_the_cqs_that_fired_are_polled() -> None:
    h = Harness(capacity=10)
    first, second = h.d.reserve(10).cq, h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    tag = h.d.register(7)
    h.d.set_handler(7, tag, recorder(seen, "a"))
    second.pending.append(Rec(verbs.make_wr_id(1, tag, 5), 7))  # no event for it yet
    h.complete(first, 7, tag, 1)
    h.wake()
    assert seen == [("a", [1])] and second.pending
    h.d.poll_now()  # polls every CQ
    assert seen[-1] == ("a", [5]) and not second.pending


def test_a_stale_tag_of_a_reused_qp_number_is_dropped() -> None:
    """A destroyed connection's late completion (same QP number, old tag) never reaches the new one."""
    h = Harness()
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    old = h.d.register(7)
    h.d.set_handler(7, old, recorder(seen, "old"))
    h.d.unregister(7, old)
    h.d.unregister(7, old)  # idempotent
    new = h.d.register(7)  # the QP number is reused
    h.d.set_handler(7, new, recorder(seen, "new"))
    assert new != old
    h.complete(cq, 7, old, 1, 2)  # late completions of the destroyed QP
    h.complete(cq, 7, new, 3)
    h.wake()
    assert seen == [("new", [3])]
    assert h.d.statistics()["dropped"] == 2


def test_completions_before_the_handler_is_set_are_kept_and_delivered_first_in_order() -> None:
    h = Harness(batch=16)
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    tag = h.d.register(7)  # the QP exists, the endpoint does not yet
    h.complete(cq, 7, tag, 0, 1)
    h.wake()  # another connection's wake-up polls the shared CQ
    assert seen == [] and h.d.statistics()["stashed"] == 2
    h.d.set_handler(7, tag, recorder(seen, "a"))
    h.complete(cq, 7, tag, 2)
    h.wake()  # the next dispatch delivers the kept ones first
    assert seen == [("a", [0, 1]), ("a", [2])]
    # poll_now delivers kept completions too (what the endpoint schedules at construction)
    tag2 = h.d.register(8)
    h.complete(cq, 8, tag2, 5)
    h.wake()
    h.d.set_handler(8, tag2, recorder(seen, "b"))
    h.d.poll_now()
    assert seen[-1] == ("b", [5])


def test_kept_completions_of_a_connection_that_never_got_a_handler_are_dropped() -> None:
    h = Harness()
    cq = h.d.reserve(10).cq
    tag = h.d.register(7)
    h.complete(cq, 7, tag, 0, 1, 2)
    h.wake()
    h.d.unregister(7, tag)
    assert h.d.statistics()["dropped"] == 3
    with pytest.raises(KeyError):
        h.d.set_handler(7, tag, recorder([], "late"))


def test_poll_now_from_a_handler_is_deferred_until_the_dispatch_is_done() -> None:
    """A handler that polls (an endpoint tearing down) must not overwrite the records being dispatched."""
    h = Harness(batch=16)
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    ta, tb = h.d.register(7), h.d.register(8)
    calls = {"a": 0}

    def a(records: Any, start: int, count: int) -> None:
        calls["a"] += 1
        seen.append(("a", [verbs.wr_index(records[i].wr_id) for i in range(start, start + count)]))
        if calls["a"] == 1:
            cq.pending.append(Rec(verbs.make_wr_id(1, tb, 20), 8))  # lands while we dispatch, no event
            h.d.poll_now()  # re-entrant: deferred
            assert seen == [("a", [0])]  # nothing dispatched inside

    h.d.set_handler(7, ta, a)
    h.d.set_handler(8, tb, recorder(seen, "b"))
    h.complete(cq, 7, ta, 0)
    h.complete(cq, 8, tb, 10)
    h.wake()
    # b's group of the first batch, then the deferred poll picked up what landed meanwhile
    assert seen == [("a", [0]), ("b", [10]), ("b", [20])]


# --- deliver: records a serial one-sided call took from the CQ that were not its own success -------------


def test_records_a_caller_took_go_after_kept_ones_and_the_cq_is_drained_after_them() -> None:
    """deliver(): completions kept (they came before their handler was set) are delivered first, then the
    records the caller took, then whatever the CQ holds, polled until a batch comes back short."""
    h = Harness(batch=2)
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    tag = h.d.register(7)
    h.complete(cq, 7, tag, 0)  # arrives before the handler is set: kept
    h.wake()
    h.d.set_handler(7, tag, recorder(seen, "a"))
    key = verbs.dispatch_key(7, tag)
    mine = verbs.make_wr_id(verbs.WR_KIND_ONESIDED, tag, 9)
    assert h.d.deliver(cq, [Rec(mine, 7, status=int(verbs.WcStatus.REM_ACCESS_ERR))], key)
    assert seen == [("a", [0]), ("a", [9])]
    cq.pending += [Rec(verbs.make_wr_id(verbs.WR_KIND_RECV, tag, i), 7) for i in (1, 2, 3)]
    assert h.d.deliver(cq, [Rec(mine, 7)], key)  # then more than one batch of the CQ: all of it
    assert [i for _, idx in seen[2:] for i in idx] == [9, 1, 2, 3] and not cq.pending


def test_a_handler_that_unregisters_another_connection_mid_batch_drops_its_group() -> None:
    h = Harness(batch=16)
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    ta, tb = h.d.register(7), h.d.register(8)

    def a(records: Any, start: int, count: int) -> None:
        seen.append(("a", [start]))
        h.d.unregister(8, tb)  # connection b is torn down by a's processing

    h.d.set_handler(7, ta, a)
    h.d.set_handler(8, tb, recorder(seen, "b"))
    h.complete(cq, 7, ta, 0)
    h.complete(cq, 8, tb, 1, 2)
    h.wake()
    assert seen == [("a", [0])] and h.d.statistics()["dropped"] == 2


def test_a_failing_handler_does_not_starve_the_others(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(batch=16)
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    ta, tb = h.d.register(7), h.d.register(8)

    def broken(records: Any, start: int, count: int) -> None:
        raise RuntimeError("boom")

    h.d.set_handler(7, ta, broken)
    h.d.set_handler(8, tb, recorder(seen, "b"))
    h.complete(cq, 7, ta, 0)
    h.complete(cq, 8, tb, 1)
    h.wake()
    assert seen == [("b", [1])]
    assert any("completion handler" in r.message for r in caplog.records)


def test_channel_read_error_polls_every_cq(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(capacity=10)
    h.d.reserve(10)
    second = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    tag = h.d.register(7)
    h.d.set_handler(7, tag, recorder(seen, "a"))
    second.pending.append(Rec(verbs.make_wr_id(1, tag, 4), 7))

    def failing() -> tuple[list[int], bool, int]:
        raise VerbsError.from_errno("ibv_get_cq_event", 5)

    h.channel.drain_events = failing  # type: ignore[method-assign]
    h.wake()
    assert seen == [("a", [4])]
    assert any("completion channel" in r.message for r in caplog.records)


# --- lifetime ----------------------------------------------------------------------------------------


def test_close_unwatches_the_fd_before_destroying_cqs_and_channel() -> None:
    h = Harness(capacity=10)
    h.d.reserve(10)
    h.d.reserve(10)
    h.d.close()
    h.d.close()  # idempotent
    assert h.log[-4:] == ["unwatch 42", "destroy cq 10", "destroy cq 10", "destroy channel"]
    assert h.d.closed and h.d.statistics()["cqs"] == 0
    with pytest.raises(VerbsError):
        h.d.reserve(1)


def test_close_at_loop_end_does_not_touch_the_gone_loop() -> None:
    h = Harness()
    h.d.reserve(10)
    h.d.close(unwatch=False)
    assert "unwatch 42" not in h.log and h.log[-1] == "destroy channel"


def test_releasing_after_close_is_harmless() -> None:
    h = Harness()
    r = h.d.reserve(10)
    h.d.close()
    r.release()
    assert r.released


# --- shared receive queue aliases ---------------------------------------------------------------------


def test_srq_alias_keeps_until_the_handler_is_set_and_orphans_go_to_the_tag_handler() -> None:
    h = Harness()
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    h.d.set_orphan_handler(0, recorder(seen, "orphan"))
    tag = h.d.register(7)
    h.d.register_alias(7, 0)  # SRQ receives carry tag 0, whichever QP takes them
    h.complete(cq, 7, 0, 1, 2)
    h.wake()
    assert seen == []  # kept: the endpoint's handler is not set yet
    h.d.set_handler(7, tag, recorder(seen, "own"))
    h.d.set_handler(7, 0, recorder(seen, "srq"))
    h.complete(cq, 7, 0, 3)
    h.complete(cq, 7, tag, 9, kind=verbs.WR_KIND_SEND)
    h.wake()
    assert ("srq", [1, 2]) in seen and ("srq", [3]) in seen and ("own", [9]) in seen
    seen.clear()
    h.d.unregister(7, tag)
    h.d.unregister_alias(7, 0)
    h.complete(cq, 7, 0, 4)  # a late completion of a QP that is gone: its buffer must go back
    h.complete(cq, 7, tag, 5, kind=verbs.WR_KIND_SEND)  # a connection's own: dropped as before
    h.wake()
    assert seen == [("orphan", [4])] and h.d.statistics()["dropped"] == 1
    h.d.set_orphan_handler(0, None)
    h.complete(cq, 8, 0, 6)
    h.wake()
    assert h.d.statistics()["dropped"] == 2


def test_unregistering_an_alias_hands_kept_completions_to_the_orphan_handler() -> None:
    h = Harness()
    cq = h.d.reserve(10).cq
    seen: list[tuple[str, list[int]]] = []
    h.d.set_orphan_handler(0, recorder(seen, "orphan"))
    h.d.register_alias(5, 0)
    h.complete(cq, 5, 0, 1, 2)
    h.wake()
    h.d.unregister_alias(5, 0)  # the connection failed before its endpoint existed
    assert seen == [("orphan", [1, 2])]


# --- the per-wake-up cost ----------------------------------------------------------------------------


def _dispatcher_calls(action: Any) -> dict[str, int]:
    """Python calls made in rdmaio/core/dispatch.py while ``action()`` runs, by function name (the fakes'
    own calls and the handlers' are not the dispatcher's)."""
    import collections
    import sys

    counts: collections.Counter[str] = collections.Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith("rdmaio/core/dispatch.py"):
            counts[frame.f_code.co_name] += 1

    sys.setprofile(hook)
    try:
        action()
    finally:
        sys.setprofile(None)
    return dict(counts)


def test_one_wake_up_with_one_group_costs_three_dispatcher_calls() -> None:
    # The chain of a wake-up is _on_readable -> _poll (which drains each CQ that fired) -> _dispatch (which
    # calls each group's handler): no call per CQ, per poll or per group beyond that (it was six: a
    # comprehension, _drain and _call as well).
    h, cq, seen, ta, tb = two_connections()
    h.complete(cq, 7, ta, 1)
    h.wake()  # warm: the first wake-up is no different, but keep the measured one typical
    h.complete(cq, 7, ta, 2)
    h.complete(cq, 8, tb, 3)
    calls = _dispatcher_calls(h.wake)
    assert seen == [("a", [1]), ("a", [2]), ("b", [3])]  # both groups delivered, in CQ order
    assert calls == {"_on_readable": 1, "_poll": 1, "_dispatch": 1}
    assert h.d.statistics()["dispatched"] == 3
