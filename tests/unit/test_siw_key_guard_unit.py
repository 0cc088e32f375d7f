"""rdmaio.verbs.siw_key_guard without a device: one guard CQ per siw device context, created by the
first holder and destroyed after the last, and nothing at all on other devices."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rdmaio._ffi import ffi
from rdmaio.verbs import siw_key_guard


class _FakeLib:
    def __init__(self, vendor_id: int) -> None:
        self.vendor_id = vendor_id
        self.created: list[int] = []
        self.destroyed: list[Any] = []

    def ibv_query_device(self, context: Any, attr: Any) -> int:
        attr.vendor_id = self.vendor_id
        return 0

    def ibv_create_cq(self, context: Any, cqe: int, *rest: Any) -> Any:
        self.created.append(cqe)
        return ffi.cast("struct ibv_cq *", 0x1000 * len(self.created))

    def ibv_destroy_cq(self, cq: Any) -> int:
        self.destroyed.append(cq)
        return 0


def _device(handle: int) -> Any:
    return SimpleNamespace(handle=handle, name=f"dev{handle}", _ptr=ffi.NULL)


@pytest.fixture(autouse=True)
def _no_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(siw_key_guard, "_guards", {})


def test_one_guard_per_siw_device_held_while_any_holder_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeLib(siw_key_guard.SIW_VENDOR_ID)
    monkeypatch.setattr(siw_key_guard, "lib", fake)
    device = _device(7)
    siw_key_guard.acquire(device)
    siw_key_guard.acquire(device)
    assert fake.created == [siw_key_guard.GUARD_CQE] and siw_key_guard.guarded(device)
    siw_key_guard.release(device)
    assert fake.destroyed == [] and siw_key_guard.guarded(device)
    siw_key_guard.release(device)
    assert len(fake.destroyed) == 1 and not siw_key_guard.guarded(device)
    siw_key_guard.release(device)  # one release too many: nothing
    assert len(fake.destroyed) == 1


def test_no_guard_on_other_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeLib(0x02C9)  # Mellanox
    monkeypatch.setattr(siw_key_guard, "lib", fake)
    device = _device(8)
    siw_key_guard.acquire(device)
    siw_key_guard.release(device)
    assert fake.created == [] and fake.destroyed == [] and not siw_key_guard.guarded(device)


def test_the_guard_covers_page_0x90_from_the_first_page() -> None:
    """32-byte siw CQ entries: the guard's pages reach past page 0x90 even when it starts at page 0."""
    assert siw_key_guard.GUARD_CQE * 32 // 4096 > 0x90
