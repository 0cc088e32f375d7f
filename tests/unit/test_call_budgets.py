"""Python-call budgets: rdmaio's own Python calls per operation, over the null device, on asyncio and uvloop.

``sys.setprofile`` ``call`` events (function calls and coroutine resumptions) in rdmaio's own code
(``rdmaio/`` except ``rdmaio/testing/``) per operation of each case of ``python -m bench --overhead``
(:mod:`bench.overhead`), counted by :func:`bench.overhead.count_calls`. The counts are deterministic (no
clock, no device, the cyclic GC off while counting), so each is held to a budget: the count of the code the
budget was set on plus :data:`MARGIN`, less than one call. A change that adds one Python call per message
(per round trip, per call, per connection) fails here; a change that removes calls should lower the budget
in the same commit. No time is asserted anywhere.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import rdmaio.endpoint
from bench.overhead import CASES, LOOPS, Case, Plan, count_calls
from rdmaio.endpoint import Endpoint

#: Below one call per operation: one more Python call per operation exceeds the budget.
MARGIN = 0.5

#: Operations counted (per case, times its weight: fewer connection setups than messages) after a warm-up.
PLAN = Plan(call_ops=200, warmup=50)

#: rdmaio's Python calls per operation at the budget's last setting (after the message path's structure cut,
#: the send ring in C, one C call per idle send, a one-message receive batch's buffer step inline and the
#: batched message path; the null device), per case and loop, before :data:`MARGIN`.
MEASURED: dict[str, dict[str, float]] = {
    # one coroutine per send and per recv: a batched send appends its record inline, and a received
    # batch is checked and split in C (rdmaio_session_on_batch, then one struct.unpack_from)
    "message": {"asyncio": 2.1225, "uvloop": 2.1225},
    # per side: the send coroutine (one C call and the post), the recv coroutine (started and resumed, its
    # wait on one future), the completion handler and the receive batch (a batch of one message adds it to
    # the buffer inline)
    "echo": {"asyncio": 10.5, "uvloop": 10.5},
    # the send ring in C; write, drain and readexactly are the core's own (one call each, no front)
    "stream": {"asyncio": 5.1375, "uvloop": 5.1375},
    # a serial one-sided call is checked, then posted and polled in one C call (the connection's port); the
    # Endpoint's fork check inline (no call)
    "rdma_read_at_post": {"asyncio": 2.25, "uvloop": 2.25},
    "rdma_read_next": {"asyncio": 9.0, "uvloop": 9.0},
    "fetch_add_at_post": {"asyncio": 2.25, "uvloop": 2.25},
    "fetch_add_next": {"asyncio": 9.0, "uvloop": 9.0},
    "fetch_add_many": {"asyncio": 45.0, "uvloop": 45.0},
    # 16 tasks calling at once: each request goes through the doorbell (about 8 per post and per batch of
    # completions) and its completion through the connection's handler, one loop iteration later; the
    # concurrent path: the call (two: started and resumed, and the Endpoint's), one to make, track and
    # queue its op (_queue: the Op made without __init__), its completion (on_completion)
    "rdma_write_64k_x16": {"asyncio": 6.46, "uvloop": 6.46},
    "rdma_read_64k_x16": {"asyncio": 6.46, "uvloop": 6.46},
    "fetch_add_x16": {"asyncio": 6.42, "uvloop": 6.42},
    # no batch-end call, the reader woken inline at the close; +6 for the process metrics
    # (rdmaio.core.metrics): per Connection (two per case: both ends) one call to register it at setup, and
    # at teardown the fold and its read of the counters; nothing per message. +2: the accepting side
    # announces its device's capabilities (the framing negotiation), known only once its transport exists
    # (one Handshake rebuilt: __post_init__; its range check inline); the dialing side and the framing test
    # add none. -28: the fork generation and the options read inline, one weak fail callback per
    # connection, the backend's loop taken without its property, the handshake's range check called only
    # to raise. -34: the one-sided engine built on first use (this case never uses it: no construction,
    # close or statistics of one).
    "setup": {"asyncio": 183.0, "uvloop": 183.0},
}
BUDGETS = {case: {loop: count + MARGIN for loop, count in loops.items()} for case, loops in MEASURED.items()}


def counted(case: Case, loop: str) -> Any:
    _ops, call_ops, warmup = PLAN.scaled(case.weight)
    return count_calls(case, loop, call_ops, warmup)


def test_every_case_has_a_budget_on_every_loop() -> None:
    assert sorted(BUDGETS) == sorted(case.name for case in CASES)
    assert all(sorted(loops) == sorted(LOOPS) for loops in BUDGETS.values())


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_rdmaio_python_calls_per_operation_stay_within_the_budget(case: Case, loop: str) -> None:
    counts = counted(case, loop)
    assert counts.device > 0, "the null device carried nothing: the case did not run"
    assert counts.rdmaio <= BUDGETS[case.name][loop], (
        f"{case.label} on {loop}: {counts.rdmaio:.3f} rdmaio Python calls per {case.unit}, budget "
        f"{BUDGETS[case.name][loop]:.3f} (measured {MEASURED[case.name][loop]}); if the increase is meant, "
        f"say why in the commit and raise MEASURED in tests/unit/test_call_budgets.py"
    )


@pytest.mark.parametrize("name", ["message", "rdma_read_at_post", "fetch_add_x16", "setup"])
def test_the_counts_are_deterministic(name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    assert counted(case, "asyncio") == counted(case, "asyncio")


def _one_more_call_in_rdmaio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoint.send with one more Python function of rdmaio's (compiled as rdmaio/endpoint.py's code)
    called per message."""
    source = "def extra(data):\n    return data\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, rdmaio.endpoint.__file__, "exec"), namespace)
    extra = namespace["extra"]
    original = Endpoint.send

    @functools.wraps(original)
    async def send(self: Endpoint, data: Any) -> None:
        await original(self, extra(data))

    monkeypatch.setattr(Endpoint, "send", send)


@pytest.mark.parametrize("name", ["message", "echo"])
def test_one_more_python_call_per_message_breaks_the_budget(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """What the budgets are for: one function call more in rdmaio's code per message sent adds a whole
    call per operation, more than the margin a budget leaves above its measured count."""
    case = next(c for c in CASES if c.name == name)
    before = counted(case, "uvloop").rdmaio
    _one_more_call_in_rdmaio(monkeypatch)
    after = counted(case, "uvloop").rdmaio
    assert after >= before + 1 - 1e-9  # one call per message more (counts per message are fractions)
    assert after > before + MARGIN  # so it exceeds a budget set on the code before it
    if before == MEASURED[name]["uvloop"]:  # the code the budget was set on
        assert after > BUDGETS[name]["uvloop"]
