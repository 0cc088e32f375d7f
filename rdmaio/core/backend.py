"""Event-loop backends: what the reactor and the endpoints need from asyncio (and uvloop) or trio.

The data path is written once against :class:`Backend`: one-shot waiters, a cancellation-safe event,
``call_soon`` with a cancellable handle, background tasks, a timeout scope, fd readiness callbacks and
``getaddrinfo``. :class:`AsyncioBackend` maps these onto the running loop (``add_reader``,
``call_soon``, futures), so uvloop and anyio's asyncio backend get the same fast path.
:class:`TrioBackend` maps them onto trio: fds are watched with ``anyio.wait_readable`` in one system
task per fd and released with ``anyio.notify_closing`` before the fd is closed; ``call_soon`` callbacks
run in one parked system task, so a burst of calls costs one reschedule, not one wake-up write each.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from contextlib import asynccontextmanager
from typing import Any, Protocol

__all__ = [
    "AsyncioBackend",
    "Backend",
    "Event",
    "Handle",
    "OneShot",
    "TrioBackend",
    "Waiter",
    "current_backend",
    "trio_run_key",
]

log = logging.getLogger("rdmaio")


class Handle(Protocol):
    """A scheduled callback that can still be cancelled."""

    def cancel(self) -> None:
        """Do not run the callback (no effect once it ran)."""


class Waiter(Protocol):
    """A one-shot wake-up for one task: ``set()`` wakes it; cancelling the waiting task is harmless."""

    def set(self) -> None:
        """Wake the waiting task (idempotent)."""

    def is_set(self) -> bool:
        """True once set (or, on asyncio, once its waiting task was cancelled)."""

    def wait(self) -> Awaitable[Any]:
        """The awaitable to wait on (once)."""


class OneShot(Protocol):
    """A one-shot wake-up for one task, shaped like an ``asyncio.Future``: await it; ``done()`` is True once
    it was woken (on asyncio also once its waiting task was cancelled); ``set_result(None)`` wakes it and
    may be called only while not ``done()``. On asyncio it is an ``asyncio.Future``, so the hot read path
    (:class:`rdmaio.core.receive.Receiver`) makes, wakes and tests it with no Python call but
    :meth:`Backend.one_shot`."""

    def done(self) -> bool:
        """True once woken (or, on asyncio, once its waiting task was cancelled)."""

    def set_result(self, result: None) -> None:
        """Wake the waiting task (only while not :meth:`done`)."""

    def __await__(self) -> Generator[Any, None, Any]:
        """Wait until woken."""


class Event(Protocol):
    """A level-triggered event any number of tasks may wait on; a cancelled wait leaves it intact."""

    def set(self) -> None:
        """Set the event and wake every waiter."""

    def is_set(self) -> bool:
        """True once set."""

    async def wait(self) -> Any:
        """Wait until set."""


class Backend(Protocol):
    """The operations rdmaio's reactor and endpoints need from an event loop."""

    name: str

    def waiter(self) -> Waiter:
        """A new one-shot waiter."""

    def one_shot(self) -> OneShot:
        """A new :class:`OneShot` (a future-like one-shot wake-up)."""

    def one_shot_factory(self) -> Callable[[], OneShot]:
        """What makes a :meth:`one_shot` with the fewest Python calls, for a caller that makes one per wait
        in the loop's own thread while the loop runs."""

    def event(self) -> Event:
        """A new cancellation-safe event."""

    def call_soon(self, callback: Callable[[], None]) -> Handle:
        """Run ``callback`` soon on the loop, after the currently runnable tasks."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        """Run ``callback`` on the loop after ``delay`` seconds (cancellable)."""

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` in the background; an exception is logged (it is a bug)."""

    def timeout(self, seconds: float | None) -> Any:
        """``async with`` scope raising builtin ``TimeoutError`` when ``seconds`` pass (None: never)."""

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever ``fd`` is readable (level-triggered: it must drain)."""

    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd``; must be called before the fd is closed."""

    async def getaddrinfo(self, host: str, port: int, *, type: int, flags: int) -> list[Any]:
        """``socket.getaddrinfo`` without blocking the loop."""

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``."""

    def current_task(self) -> object:
        """An object identifying the running task (compared by identity only)."""


# --- asyncio (and uvloop, and anyio on asyncio) -------------------------------------------------------


class _FutureWaiter:
    """A one-shot waiter on an asyncio future (:meth:`AsyncioBackend.waiter` makes them)."""

    __slots__ = ("_fut",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fut: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        if not self._fut.done():
            self._fut.set_result(None)

    def is_set(self) -> bool:
        return self._fut.done()

    def wait(self) -> asyncio.Future[None]:
        # The future itself: awaiting an exact asyncio.Future takes the C task's fast path.
        return self._fut


_new_future_waiter = object.__new__  # a _FutureWaiter without the Python call of __init__


class _LaterHandle:
    """A cancellable callback for ``loop.call_later`` that holds no reference to the loop.

    The loop's own timer handle (which refers to the loop) is held weakly: cancelling cancels it too, so
    a cancelled timer leaves the loop's timer heap (asyncio) or stops (uvloop) instead of lingering until
    its expiry - every graceful close arms and cancels one.
    """

    __slots__ = ("_callback", "_timer")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback: Callable[[], None] | None = callback
        self._timer: weakref.ref[asyncio.TimerHandle] | None = None

    def run(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()

    def cancel(self) -> None:
        self._callback = None
        timer = self._timer() if self._timer is not None else None
        if timer is not None:
            timer.cancel()


class AsyncioBackend:
    """The running asyncio loop (any implementation: the default loop, uvloop)."""

    name = "asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: the per-loop registry (Reactor._by_loop) is keyed weakly by the loop, and a strong
        # reference from its value would keep every loop that ever touched rdmaio alive.
        self._loop_ref = weakref.ref(loop)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (``RuntimeError`` once it was garbage-collected)."""
        loop = self._loop_ref()
        if loop is None:
            raise RuntimeError("the event loop of this rdmaio backend no longer exists")
        return loop

    def waiter(self) -> Waiter:
        """A future-backed one-shot waiter."""
        # One Python call per wait (every read that waits makes one): the loop is read inline, not through
        # the property, and the waiter is made without running its __init__.
        loop = self._loop_ref()
        if loop is None:
            raise RuntimeError("the event loop of this rdmaio backend no longer exists")
        waiter = _new_future_waiter(_FutureWaiter)
        waiter._fut = loop.create_future()
        return waiter

    def one_shot(self) -> OneShot:
        """A future of the loop (the loop read inline: one Python call per wait of a reader)."""
        loop = self._loop_ref()
        if loop is None:
            raise RuntimeError("the event loop of this rdmaio backend no longer exists")
        return loop.create_future()

    def one_shot_factory(self) -> Callable[[], OneShot]:
        """``asyncio.Future`` itself when the loop's ``create_future`` makes a plain future (the default
        loop's and uvloop's do): called in the running loop with no argument it is that loop's future, and
        it is no Python call. Otherwise :meth:`one_shot`. Holds no reference to the loop."""
        create = type(self.loop).create_future
        uvloop = sys.modules.get("uvloop")
        if create is asyncio.BaseEventLoop.create_future or (
            uvloop is not None and create is getattr(uvloop.Loop, "create_future", None)
        ):
            return asyncio.Future
        return self.one_shot

    def event(self) -> Event:
        """An ``asyncio.Event``."""
        return asyncio.Event()

    def call_soon(self, callback: Callable[[], None]) -> Handle:
        """``loop.call_soon``."""
        # The live loop without the property's call (it raises only when the loop is gone).
        return (self._loop_ref() or self.loop).call_soon(callback)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        """``loop.call_later``, through a handle that does not refer to the loop: whoever keeps the handle
        (a Domain's ring pool, held by the per-loop registry) must not keep the loop alive, or the loop
        would never be collected and its reactor never closed."""
        handle = _LaterHandle(callback)
        handle._timer = weakref.ref((self._loop_ref() or self.loop).call_later(delay, handle.run))
        return handle

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """A task the backend keeps a reference to until it ends."""
        task = self.loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("rdmaio: background task %s failed", task.get_name(), exc_info=task.exception())

    def timeout(self, seconds: float | None) -> Any:
        """``asyncio.timeout``."""
        return asyncio.timeout(seconds)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """``loop.add_reader``."""
        self.loop.add_reader(fd, callback)

    def remove_reader(self, fd: int) -> None:
        """``loop.remove_reader``."""
        self.loop.remove_reader(fd)

    async def getaddrinfo(self, host: str, port: int, *, type: int, flags: int) -> list[Any]:
        """``loop.getaddrinfo``."""
        return await self.loop.getaddrinfo(host, port, type=type, flags=flags)

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep``."""
        await asyncio.sleep(seconds)

    def current_task(self) -> object:
        """``asyncio.current_task()`` (of the running loop, which is this backend's)."""
        return asyncio.current_task()


# --- trio ---------------------------------------------------------------------------------------------


class _TrioHandle:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _TrioWatch:
    __slots__ = ("callback", "removed")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.removed = False


class _TrioOneShot:
    """:class:`OneShot` on trio: a ``trio.Event`` with a future's names."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.is_set())

    def set_result(self, result: None) -> None:
        self._event.set()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._event.wait().__await__()  # type: ignore[no-any-return]


class TrioBackend:
    """The running trio run (used directly, or through anyio's trio backend)."""

    name = "trio"

    def __init__(self) -> None:
        import trio

        self._trio = trio
        self._soon: collections.deque[_TrioHandle] = collections.deque()
        self._soon_task: Any = None
        self._soon_parked = False
        self._watches: dict[int, _TrioWatch] = {}
        self._at_run_end: list[Callable[[], None]] = []
        trio.lowlevel.spawn_system_task(self._run_soon, name="rdmaio call_soon")

    def at_run_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the trio run ends (its system tasks are cancelled)."""
        self._at_run_end.append(callback)

    def waiter(self) -> Waiter:
        """A ``trio.Event`` (a cancelled wait leaves it untouched)."""
        event: Waiter = self._trio.Event()
        return event

    def one_shot(self) -> OneShot:
        """A future-like one-shot over a ``trio.Event`` (a cancelled wait leaves it untouched)."""
        return _TrioOneShot(self._trio.Event())

    def one_shot_factory(self) -> Callable[[], OneShot]:
        """:meth:`one_shot`."""
        return self.one_shot

    def event(self) -> Event:
        """A ``trio.Event``."""
        event: Event = self._trio.Event()
        return event

    # call_soon: one system task runs queued callbacks and parks when the queue is empty.

    async def _run_soon(self) -> None:
        lowlevel = self._trio.lowlevel
        self._soon_task = lowlevel.current_task()
        queue = self._soon
        try:
            while True:
                while queue:
                    handle = queue.popleft()
                    if handle.cancelled:
                        continue
                    try:
                        handle.callback()
                    except Exception:
                        log.exception("rdmaio: callback %r failed", handle.callback)
                self._soon_parked = True
                await lowlevel.wait_task_rescheduled(lambda _: lowlevel.Abort.SUCCEEDED)
        finally:
            # The task refers to the run and so to its token, the key of this backend's registry entry:
            # dropped here (the run is ending), the entry can go with the run.
            self._soon_task = None
            self._soon_parked = False
            callbacks, self._at_run_end = self._at_run_end, []
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    log.exception("rdmaio: end-of-run callback %r failed", callback)

    def call_soon(self, callback: Callable[[], None]) -> Handle:
        """Queue ``callback`` for the call_soon system task."""
        handle = _TrioHandle(callback)
        self._soon.append(handle)
        if self._soon_parked:
            self._soon_parked = False
            self._trio.lowlevel.reschedule(self._soon_task)
        return handle

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        """A system task that sleeps ``delay`` seconds, then queues ``callback`` with :meth:`call_soon`
        unless the handle was cancelled (the run's end cancels the sleep)."""
        handle = _TrioHandle(callback)

        async def later() -> None:
            await self._trio.sleep(delay)
            if not handle.cancelled:
                self.call_soon(callback)

        self.spawn(later(), name="rdmaio call_later")
        return handle

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """A trio system task (cancelled when the run ends); exceptions are logged, not propagated."""

        async def guarded() -> None:
            try:
                await coro
            except Exception:
                log.exception("rdmaio: background task %s failed", name)

        self._trio.lowlevel.spawn_system_task(guarded, name=name)

    @asynccontextmanager
    async def timeout(self, seconds: float | None) -> AsyncIterator[None]:
        """``trio.fail_after``, raising builtin ``TimeoutError``."""
        if seconds is None:
            yield
            return
        try:
            with self._trio.fail_after(seconds):
                yield
        except self._trio.TooSlowError as exc:
            raise TimeoutError(f"timed out after {seconds} s") from exc

    # fds: one system task per fd waits with anyio.wait_readable and runs the callback.

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Start a system task that calls ``callback`` each time ``fd`` becomes readable."""
        if fd in self._watches:
            self._watches[fd].callback = callback
            return
        watch = self._watches[fd] = _TrioWatch(callback)
        self._trio.lowlevel.spawn_system_task(self._watch_fd, fd, watch, name=f"rdmaio fd {fd}")

    async def _watch_fd(self, fd: int, watch: _TrioWatch) -> None:
        import anyio

        while not watch.removed:
            try:
                await anyio.wait_readable(fd)
            except (anyio.ClosedResourceError, OSError):
                return  # notify_closing() from remove_reader, or the fd is gone
            if watch.removed:
                return
            try:
                watch.callback()
            except Exception:
                log.exception("rdmaio: readiness callback of fd %d failed", fd)

    def remove_reader(self, fd: int) -> None:
        """Stop the fd's task: ``anyio.notify_closing`` wakes a pending wait before the fd is closed."""
        import anyio

        watch = self._watches.pop(fd, None)
        if watch is None:
            return
        watch.removed = True
        anyio.notify_closing(fd)

    async def getaddrinfo(self, host: str, port: int, *, type: int, flags: int) -> list[Any]:
        """``trio.socket.getaddrinfo``."""
        result: list[Any] = await self._trio.socket.getaddrinfo(host, port, type=type, flags=flags)
        return result

    async def sleep(self, seconds: float) -> None:
        """``trio.sleep``."""
        await self._trio.sleep(seconds)

    def current_task(self) -> object:
        """``trio.lowlevel.current_task()``."""
        return self._trio.lowlevel.current_task()


def trio_run_key() -> object:
    """The trio token of the current run (what a per-run registry is keyed by)."""
    import trio

    return trio.lowlevel.current_trio_token()


def _running_trio() -> bool:
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def current_backend() -> str:
    """``"asyncio"`` or ``"trio"``: the async library running the current task.

    Raises ``RuntimeError`` outside of both.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if _running_trio():
            return "trio"
        raise RuntimeError("rdmaio needs a running asyncio loop or trio run") from None
    return "asyncio"
