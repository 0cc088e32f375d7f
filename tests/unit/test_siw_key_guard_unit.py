"""The Soft-iWARP key guard without a device: a siw device is told by its vendor id, and the completion
dispatcher makes its first CQ (the one it keeps) at least ``first_cq_entries`` large, the later ones not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rdmaio._ffi import ffi
from rdmaio.core.dispatch import CompletionDispatcher
from rdmaio.verbs import siw_key_guard


class _FakeLib:
    def __init__(self, vendor_id: int) -> None:
        self.vendor_id = vendor_id

    def ibv_query_device(self, context: Any, attr: Any) -> int:
        attr.vendor_id = self.vendor_id
        return 0


@pytest.mark.parametrize(("vendor_id", "siw"), [(siw_key_guard.SIW_VENDOR_ID, True), (0x02C9, False)])
def test_a_siw_device_is_told_by_its_vendor_id(
    monkeypatch: pytest.MonkeyPatch, vendor_id: int, siw: bool
) -> None:
    monkeypatch.setattr(siw_key_guard, "lib", _FakeLib(vendor_id))
    assert siw_key_guard.is_siw(SimpleNamespace(_ptr=ffi.NULL)) is siw  # type: ignore[arg-type]


def test_the_guard_covers_page_0x90_from_the_first_page() -> None:
    """32-byte siw CQ entries: the guard's pages reach past page 0x90 even when it starts at page 0."""
    assert siw_key_guard.GUARD_CQE * 32 // 4096 > 0x90


def test_only_the_first_cq_of_the_pool_gets_the_guards_size() -> None:
    sizes: list[int] = []

    def create_cq(channel: Any, cqe: int) -> Any:
        sizes.append(cqe)
        return SimpleNamespace(cqe=cqe, handle=len(sizes), closed=False, close=lambda: None)

    dispatcher = CompletionDispatcher(
        create_channel=lambda: SimpleNamespace(fd=99, close=lambda: None),  # type: ignore[arg-type,return-value]
        create_cq=create_cq,
        watch=lambda fd, callback: None,
        unwatch=lambda fd: None,
        batch=SimpleNamespace(),  # type: ignore[arg-type]
        max_cqe=1 << 20,
        cq_capacity=200,
        first_cq_entries=siw_key_guard.GUARD_CQE,
    )
    first = dispatcher.reserve(40)
    dispatcher.reserve(siw_key_guard.GUARD_CQE - 40)  # the first CQ is full now
    dispatcher.reserve(40)
    assert sizes == [siw_key_guard.GUARD_CQE, 200]
    assert first.cq is dispatcher.cqs[0]
