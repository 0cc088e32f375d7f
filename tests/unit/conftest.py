"""Fixtures shared by the unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

T = TypeVar("T")


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    """``arun(coro)`` runs ``coro`` (bounded to 30 s) on a fresh asyncio or uvloop loop."""
    factory = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop

    def run(coro: Coroutine[Any, Any, T]) -> T:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(asyncio.wait_for(coro, 30))

    return run
