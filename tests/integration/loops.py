"""Run a coroutine on each loop implementation rdmaio supports (a parametrized fixture)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, T]], T]

LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(params=sorted(LOOP_FACTORIES))
def arun(request: pytest.FixtureRequest) -> Runner[Any]:
    """``arun(coro)`` runs ``coro`` to completion on a fresh loop of the parametrized kind."""

    def run(coro: Coroutine[Any, Any, T]) -> T:
        with asyncio.Runner(loop_factory=LOOP_FACTORIES[request.param]) as runner:
            return runner.run(coro)

    return run
