"""rdmaio.Options: defaults, validation, coercion, and what the handshake announces from them."""

from __future__ import annotations

import dataclasses

import pytest

from rdmaio import Options
from rdmaio.core.negotiation import local_handshake
from rdmaio.protocol import FEATURE_BATCH, Handshake, Session


def test_defaults_register_4_mib_and_batch_small_messages() -> None:
    options = Options()
    assert (options.recv_depth + options.send_depth) * options.slot_size == 4 * 1024 * 1024
    assert options.batch_limit == 8 * 1024


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("slot_size", 32),
        ("recv_depth", 2),
        ("send_depth", 1),
        ("max_message_size", 0),
        ("batch_limit", -1),
        ("read_limit", 0),
        ("signal_interval", 0),
        ("rnr_retry_count", 8),
        ("srq_max_buffers", 3),
        ("establish_timeout", 0),
        ("reclaim_timeout", -1.0),
        ("max_pending_per_source", 0),
    ],
)
def test_invalid_values_raise_value_error(field: str, value: int) -> None:
    with pytest.raises(ValueError):
        Options(**{field: value})


def test_low_water_above_high_water_is_refused() -> None:
    with pytest.raises(ValueError, match="write_low_water"):
        Options(write_high_water=10, write_low_water=11)


def test_coerce_accepts_none_options_and_dicts() -> None:
    base = Options(slot_size=4096)
    assert Options.coerce(None) == Options()
    assert Options.coerce(base) is base
    assert Options.coerce({"slot_size": 4096}) == base
    with pytest.raises(TypeError):
        Options.coerce({"no_such_option": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.slot_size = 1  # type: ignore[misc]


def test_batching_is_announced_and_negotiated_from_batch_limit() -> None:
    on, off = local_handshake(Options()), local_handshake(Options(batch_limit=0))
    assert on.features & FEATURE_BATCH
    assert not off.features & FEATURE_BATCH
    assert Session(on, Handshake.decode(on.encode())).batching
    assert not Session(on, Handshake.decode(off.encode())).batching  # one side off: no batches at all
    assert not Session(off, Handshake.decode(on.encode())).batching


def test_shared_receive_queue_is_off_by_default_and_announces_reclaim_when_on() -> None:
    from rdmaio.protocol import FEATURE_RECLAIM

    assert Options().shared_receive_queue is False
    assert Options().rnr_retry_count == 1  # finite: an RNR fails the connection (7 would retry forever)
    assert not local_handshake(Options()).features & FEATURE_RECLAIM
    assert local_handshake(Options(shared_receive_queue=True)).features & FEATURE_RECLAIM


def test_a_client_announces_growing_windows_even_with_fixed_rings() -> None:
    """FEATURE_GROW also says "I accept a growing peer": a client with fixed rings announces it (with
    initial_depth == recv_depth), so a server grants it its usual growing window, not the small fixed one
    it gives a peer without the bit."""
    from rdmaio.protocol import FEATURE_GROW

    fixed = local_handshake(Options(initial_depth=32, recv_depth=32))
    assert fixed.features & FEATURE_GROW and fixed.initial_depth == fixed.recv_depth == 32
    assert Handshake.decode(fixed.encode()) == fixed
    assert not local_handshake(Options(), grow=False).features & FEATURE_GROW
