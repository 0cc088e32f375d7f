"""``rdma_connect`` off the loop, for iWARP: :class:`ConnectInThread`.

An iWARP device connects over the kernel's TCP inside ``rdma_connect`` itself, and Soft-iWARP does it with
a blocking ``connect()`` (siw_cm.c says so): to an address nobody answers the call returns only when TCP
gives up (``tcp_syn_retries``: about two minutes), and on the loop's thread it would stall every other
connection and every timeout, the caller's own included. So on iWARP the call runs in a thread of its own,
and the loop waits for an eventfd the thread writes when the call returns (any backend can watch an fd).

The call owns the cm id until it returns: a caller that stops waiting (its timeout, a cancellation) hands
the release of what it created to :meth:`ConnectInThread.release_when_done`, which runs it on the loop
once the thread is done, never while the call may still use the id. One thread per connect attempt in
progress on an iWARP device, each ending when the kernel's TCP connect does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from rdmaio.core.backend import Backend

__all__ = ["ConnectInThread"]


class ConnectInThread:
    """Run ``call`` (a blocking ``rdma_connect``) in a thread; :meth:`wait` for it on ``backend``'s loop."""

    def __init__(self, backend: Backend, call: Callable[[], None]) -> None:
        self._backend = backend
        self._call = call
        self._error: BaseException | None = None
        self.done = False
        """The call returned (or raised) and the loop has seen it."""
        self._on_done: Callable[[], None] | None = None
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._waiter = backend.waiter()
        backend.add_reader(self._fd, self._finished)
        self._thread = threading.Thread(target=self._run, name="rdmaio iWARP rdma_connect", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._call()
        except BaseException as exc:  # handed to the loop's side, raised there
            self._error = exc
        finally:
            os.eventfd_write(self._fd, 1)

    def _finished(self) -> None:
        """Reader callback on the loop: the thread is done."""
        if self.done:
            return
        self.done = True
        self._backend.remove_reader(self._fd)
        os.close(self._fd)
        self._thread.join()  # already returned: it wrote the eventfd last
        if self._on_done is not None:
            self._on_done()
        self._waiter.set()

    async def wait(self) -> None:
        """Until the call returns; raise what it raised."""
        if not self.done:
            await self._waiter.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def release_when_done(self, release: Callable[[], None]) -> None:
        """Run ``release`` on the loop once the call has returned (now, if it has)."""
        if self.done:
            release()
        else:
            self._on_done = release
