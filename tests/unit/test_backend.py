"""rdmaio.core.backend on asyncio, uvloop and trio (native: fd watching is tested with a pipe)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import trio
import uvloop

import rdmaio
from rdmaio.core.backend import AsyncioBackend, Backend, TrioBackend, current_backend

Runner = Callable[[Callable[[Backend], Coroutine[Any, Any, None]]], None]


def _run_asyncio(factory: Callable[[], asyncio.AbstractEventLoop]) -> Runner:
    def run(test: Callable[[Backend], Coroutine[Any, Any, None]]) -> None:
        async def main() -> None:
            assert current_backend() == "asyncio"
            await test(AsyncioBackend(asyncio.get_running_loop()))

        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())

    return run


def _run_trio(test: Callable[[Backend], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        assert current_backend() == "trio"
        await test(TrioBackend())

    trio.run(main)


RUNNERS: dict[str, Runner] = {
    "asyncio": _run_asyncio(asyncio.new_event_loop),
    "uvloop": _run_asyncio(uvloop.new_event_loop),
    "trio": _run_trio,
}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]


def test_current_backend_outside_a_loop() -> None:
    with pytest.raises(RuntimeError, match="running asyncio loop or trio run"):
        current_backend()


def test_call_soon_runs_in_order_and_cancel_skips(run: Runner) -> None:
    async def test(io: Backend) -> None:
        seen: list[int] = []
        io.call_soon(lambda: seen.append(1))
        cancelled = io.call_soon(lambda: seen.append(2))
        io.call_soon(lambda: seen.append(3))
        cancelled.cancel()
        assert seen == []  # not run synchronously
        await io.sleep(0.01)
        assert seen == [1, 3]
        # A burst after the runner parked again is served too.
        for i in range(100):
            io.call_soon(lambda i=i: seen.append(i))
        await io.sleep(0.01)
        assert seen == [1, 3, *range(100)]

    run(test)


def test_call_later_runs_after_the_delay_and_cancel_skips(run: Runner) -> None:
    async def test(io: Backend) -> None:
        seen: list[str] = []
        io.call_later(0.05, lambda: seen.append("later"))
        io.call_later(0.02, lambda: seen.append("sooner"))
        io.call_later(0.01, lambda: seen.append("cancelled")).cancel()
        assert seen == []  # never synchronously
        for _ in range(2000):  # a loaded machine may run the timers late: wait for them, not a fixed time
            if "later" in seen:
                break
            await io.sleep(0.005)
        assert seen == ["sooner", "later"]

    run(test)


@pytest.mark.parametrize("factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_pending_call_later_handle_does_not_keep_its_loop_alive(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """The per-loop registry holds domains whose ring pool holds a call_later handle: a handle that referred
    to the loop would keep the registry's weak key alive for ever (the loop's reactor never closed)."""
    import gc
    import weakref

    handles: list[Any] = []

    async def main() -> None:
        handles.append(AsyncioBackend(asyncio.get_running_loop()).call_later(3600, lambda: None))

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
        loop_ref = weakref.ref(runner.get_loop())
    gc.collect()
    assert handles and loop_ref() is None


def test_call_soon_callback_error_is_logged_not_fatal(run: Runner, caplog: pytest.LogCaptureFixture) -> None:
    async def test(io: Backend) -> None:
        seen: list[str] = []

        def boom() -> None:
            raise ValueError("boom")

        io.call_soon(boom)
        io.call_soon(lambda: seen.append("after"))
        await io.sleep(0.01)
        assert seen == ["after"]

    with caplog.at_level(logging.ERROR):
        run(test)  # nothing escapes: asyncio's exception handler and the trio runner both log it
    assert "boom" in caplog.text


def test_waiter_wakes_one_task_and_survives_cancellation(run: Runner) -> None:
    async def test(io: Backend) -> None:
        waiter = io.waiter()
        assert not waiter.is_set()
        io.call_soon(waiter.set)
        await waiter.wait()
        assert waiter.is_set()
        waiter.set()  # idempotent
        # A waiter whose waiting task was cancelled can still be set without error.
        lonely = io.waiter()
        with pytest.raises(TimeoutError):
            async with io.timeout(0.01):
                await lonely.wait()
        lonely.set()

    run(test)


def test_one_shot_wakes_one_task_and_says_when_it_is_done(run: Runner) -> None:
    # What a read call waits on: awaited directly, woken with set_result(None) only while not done().
    async def test(io: Backend) -> None:
        # The same from io.one_shot() and from the factory a reader binds once (io.one_shot_factory()).
        for make in (io.one_shot, io.one_shot_factory()):
            one = make()
            assert not one.done()
            io.call_soon(lambda one=one: one.set_result(None))  # type: ignore[misc]
            await one
            assert one.done()
            # A wait that times out: on asyncio the future is cancelled (done, never to be set); on trio the
            # event is left alone (not done, may still be set). Either way the guarded wake-up is harmless.
            lonely = make()
            with pytest.raises(TimeoutError):
                async with io.timeout(0.01):
                    await lonely
            if not lonely.done():
                lonely.set_result(None)
            assert lonely.done()

    run(test)


def test_the_one_shot_factory_is_the_future_class_only_where_the_loop_makes_plain_futures() -> None:
    # The default loop's and uvloop's create_future make a plain asyncio.Future of the loop: the factory
    # is the class itself (no Python call), and what it makes in the running loop is that loop's future.
    class OwnFutures(asyncio.SelectorEventLoop):
        def create_future(self) -> asyncio.Future[Any]:
            return super().create_future()

    for make_loop, plain in (
        (asyncio.new_event_loop, True),
        (uvloop.new_event_loop, True),
        (OwnFutures, False),
    ):
        loop = make_loop()
        try:
            io = AsyncioBackend(loop)
            factory = io.one_shot_factory()
            assert (factory is asyncio.Future) is plain
            if not plain:
                assert factory == io.one_shot  # the loop's own create_future, through one_shot()

            async def made(factory: Callable[[], Any] = factory) -> Any:
                return factory()

            future = loop.run_until_complete(made())
            assert future.get_loop() is loop and not future.done()
        finally:
            loop.close()


def test_event_is_level_triggered_and_cancel_safe(run: Runner) -> None:
    async def test(io: Backend) -> None:
        event = io.event()
        with pytest.raises(TimeoutError):
            async with io.timeout(0.01):
                await event.wait()
        assert not event.is_set()  # the cancelled wait left it alone
        io.call_soon(event.set)
        await event.wait()
        await event.wait()  # stays set
        assert event.is_set()

    run(test)


def test_timeout_none_never_fires_and_raises_builtin_timeout(run: Runner) -> None:
    async def test(io: Backend) -> None:
        async with io.timeout(None):
            await io.sleep(0.01)
        with pytest.raises(TimeoutError):
            async with io.timeout(0.02):
                await io.sleep(5)

    run(test)


def test_spawn_runs_in_background_and_logs_failures(run: Runner, caplog: pytest.LogCaptureFixture) -> None:
    async def test(io: Backend) -> None:
        done = io.event()

        async def work() -> None:
            await io.sleep(0)
            done.set()

        async def fail() -> None:
            raise KeyError("background failure")

        io.spawn(work(), name="work")
        io.spawn(fail(), name="fail")
        async with io.timeout(5):
            await done.wait()
        await io.sleep(0.01)

    with caplog.at_level(logging.ERROR):
        run(test)
    assert "background failure" in caplog.text


def test_add_reader_calls_back_until_removed(run: Runner) -> None:
    """Readiness callbacks drain a pipe; after remove_reader the fd can be closed and nothing runs."""

    async def test(io: Backend) -> None:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        received: list[bytes] = []
        got = io.event()

        def on_readable() -> None:
            while True:
                try:
                    chunk = os.read(rfd, 4096)
                except BlockingIOError:
                    return
                received.append(chunk)
                if b"".join(received).endswith(b"3"):
                    got.set()

        try:
            io.add_reader(rfd, on_readable)
            for part in (b"1", b"2", b"3"):
                os.write(wfd, part)
                await io.sleep(0.01)
            async with io.timeout(5):
                await got.wait()
            assert b"".join(received) == b"123"
            io.remove_reader(rfd)
            io.remove_reader(rfd)  # idempotent
            os.write(wfd, b"4")
            await io.sleep(0.05)
            assert b"".join(received) == b"123"  # no callback after remove_reader
        finally:
            os.close(rfd)
            os.close(wfd)
        await io.sleep(0.01)  # the fd's task (trio) ends without touching the closed fd

    run(test)


def test_getaddrinfo_numeric(run: Runner) -> None:
    import socket

    async def test(io: Backend) -> None:
        infos = await io.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM, flags=0)
        assert infos[0][4][0] == "127.0.0.1"

    run(test)


def test_the_tcp_probe_connects_and_closes_or_raises_what_the_kernel_says(run: Runner) -> None:
    """What dialing a device whose rdma_connect blocks (Soft-iWARP) asks first: a listener answers and the
    probe's connection is closed at once; a closed port raises the builtin refusal; an address that is not
    this machine's cannot be the probe's source. rdmaio.core.dial.probe_listener types the errors."""
    import socket

    from rdmaio.core.dial import probe_listener

    async def test(io: Backend) -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            await io.tcp_probe("127.0.0.1", port, None)
            await probe_listener(io, "127.0.0.1", port, "127.0.0.1", "the listener")
            accepted, _ = listener.accept()
            with accepted:
                accepted.settimeout(10)
                assert accepted.recv(1) == b""  # the probe sent nothing and closed
        # The listener is closed: nothing listens on the port any more.
        with pytest.raises(ConnectionRefusedError):
            await io.tcp_probe("127.0.0.1", port, None)
        with pytest.raises(rdmaio.ConnectionRefusedError, match="by the peer: no listener") as refused:
            await probe_listener(io, "127.0.0.1", port, None, "the peer")
        assert refused.value.call == "connect" and refused.value.errno == errno.ECONNREFUSED
        # 192.0.2.1 (TEST-NET-1) is no address of this machine: the probe's socket cannot bind to it.
        with pytest.raises(rdmaio.AddressError, match=r"from 192\.0\.2\.1") as local:
            await probe_listener(io, "127.0.0.1", port, "192.0.2.1", "the peer")
        assert local.value.errno == errno.EADDRNOTAVAIL

    run(test)
