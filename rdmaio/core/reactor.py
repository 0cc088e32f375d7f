"""Reactor: puts rdma_cm and verbs file descriptors on the running event loop (asyncio, uvloop or trio).

One :class:`Reactor` per event loop owns the shared rdma_cm :class:`~rdmaio.verbs.EventChannel` and
dispatches each CM event to the handler registered for its cm id (a CONNECT_REQUEST goes to its
listener). Completion-channel fds and device async-event fds are watched through the loop's
:class:`~rdmaio.core.backend.Backend` (``loop.add_reader`` on asyncio, ``anyio.wait_readable`` on trio); a
readiness callback drains everything that is pending (the fds are edge-safe: callers drain until empty).
Fds are always removed from the loop before they are closed.

The event channel and the per-device :class:`~rdmaio.core.domain.Domain` (protection domain, registration
cache, and the completion dispatcher whose one completion channel fd serves every connection on the device)
live as long as the loop: opening a channel costs a few hundred milliseconds under emulation, so
connection setup reuses it. They are closed when the loop ends: at the end of the trio run, or when the
asyncio loop is garbage-collected (``asyncio.run`` leaves nothing else referring to it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Callable

from rdmaio import verbs
from rdmaio.core.backend import AsyncioBackend, Backend, TrioBackend, current_backend, trio_run_key
from rdmaio.core.domain import Domain
from rdmaio.verbs import CMEvent, CMEventType, CMId, DeviceContext, EventChannel

__all__ = ["CMHandler", "Reactor"]

log = logging.getLogger("rdmaio")

CMHandler = Callable[[CMEvent], None]
"""Called on the loop for each CM event of one cm id."""

QPEventHandler = Callable[[verbs.AsyncEvent], None]

# QP async events that mean the QP is in the error state. The others (COMM_EST: a receive arrived before
# the connection was marked established; SQ_DRAINED, LAST_WQE_REACHED, PATH_MIG) are informational.
_FATAL_QP_EVENTS = frozenset({verbs.EVENT_QP_FATAL, verbs.EVENT_QP_REQ_ERR, verbs.EVENT_QP_ACCESS_ERR})


class Reactor:
    """Per-loop owner of the CM event channel and the fd watches of completion channels and devices."""

    # Keyed weakly by the asyncio loop or the trio run's token. Nothing a reactor holds refers to its key
    # strongly (AsyncioBackend keeps a weak reference to its loop), or the entry would keep the loop alive.
    _by_loop: weakref.WeakKeyDictionary[object, Reactor] = weakref.WeakKeyDictionary()

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._channel: EventChannel | None = None
        self._handlers: dict[int, CMHandler] = {}
        self._devices: dict[int, DeviceContext] = {}
        self._domains: dict[int, Domain] = {}
        # QP numbers are unique per device only: handlers are keyed by (device handle, QP number).
        self._qp_handlers: dict[tuple[int, int], QPEventHandler] = {}
        self._cq_handlers: dict[int, dict[tuple[int, int], QPEventHandler]] = {}  # by CQ handle
        # Port state changes, by (device handle, port number), then by QP number (rdmaio.core.keepalive).
        self._port_handlers: dict[tuple[int, int], dict[int, QPEventHandler]] = {}
        self.cm_events = 0
        self.async_events = 0

    @classmethod
    def current(cls) -> Reactor:
        """The reactor of the running asyncio loop or trio run (created on first use)."""
        if current_backend() == "asyncio":
            loop = asyncio.get_running_loop()
            reactor = cls._by_loop.get(loop)
            if reactor is None:
                reactor = cls._by_loop[loop] = cls(AsyncioBackend(loop))
                # Holds the reactor (not the loop) until the loop is collected, then releases its fds.
                weakref.finalize(loop, reactor._close_at_loop_end, False)
            return reactor
        key = trio_run_key()
        reactor = cls._by_loop.get(key)
        if reactor is None:
            backend = TrioBackend()
            reactor = cls._by_loop[key] = cls(backend)
            backend.at_run_end(functools.partial(reactor._close_at_loop_end, True))
        return reactor

    def domain(self, device: DeviceContext) -> Domain:
        """The :class:`~rdmaio.core.domain.Domain` of ``device`` on this loop (created on first use)."""
        domain = self._domains.get(device.handle)
        if domain is None or domain.closed:
            domain = self._domains[device.handle] = Domain(
                device, watch=self.watch, unwatch=self.unwatch, call_later=self.backend.call_later
            )
        return domain

    def _close_at_loop_end(self, loop_alive: bool) -> None:
        """Release what lives as long as the loop: the domains (and anything left on them) and the
        channel. With the loop gone there is no reader to remove; with it alive (trio) there is."""
        domains, self._domains = self._domains, {}
        for domain in domains.values():
            try:
                domain.close(unwatch=loop_alive)
            except Exception:
                log.exception("rdmaio: closing %r failed", domain)
        channel, self._channel = self._channel, None
        if channel is not None and not channel.closed:
            if loop_alive:
                try:
                    self.backend.remove_reader(channel.fd)
                except Exception:
                    log.debug("rdmaio: removing the event channel from the loop failed", exc_info=True)
            channel.close()

    # --- cm ids --------------------------------------------------------------------------------------

    @property
    def channel(self) -> EventChannel:
        """The shared event channel (opened and put on the loop on first use)."""
        if self._channel is None or self._channel.closed:
            self._channel = EventChannel()
            self.backend.add_reader(self._channel.fd, self._on_cm_readable)
        return self._channel

    def create_id(self, handler: CMHandler) -> CMId:
        """Create a cm id on the shared channel whose events go to ``handler``."""
        cm_id = CMId(self.channel)
        self._handlers[cm_id.handle] = handler
        return cm_id

    def adopt_id(self, event: CMEvent, handler: CMHandler) -> CMId:
        """Wrap the new cm id of a CONNECT_REQUEST and route its later events to ``handler``."""
        cm_id = CMId.from_event(self.channel, event)
        self._handlers[cm_id.handle] = handler
        return cm_id

    def set_handler(self, cm_id: CMId, handler: CMHandler) -> None:
        """Route the events of ``cm_id`` to a new handler."""
        self._handlers[cm_id.handle] = handler

    def release_id(self, cm_id: CMId) -> None:
        """Destroy ``cm_id`` (and its QP) and forget its handler (the channel stays for the next one)."""
        self._handlers.pop(cm_id.handle, None)
        cm_id.close()

    def _on_cm_readable(self) -> None:
        # One event per wake-up. The channel's fd is watched level-triggered on every backend (epoll
        # without EPOLLET in asyncio's selector and libuv; trio re-arms each wait), so another pending
        # event wakes us again on the next loop iteration, while reading until EAGAIN would cost one
        # empty rdma_get_cm_event (a system call) per wake-up: events come one at a time during a
        # connection's setup, so that was up to half of the calls.
        channel = self._channel
        if channel is None or channel.closed:
            return
        try:
            event = channel.get_event()
        except Exception:
            log.exception("rdmaio: reading the rdma_cm event channel failed")
            return
        if event is None:
            return
        self.cm_events += 1
        key = event.listen_id_handle if event.event == CMEventType.CONNECT_REQUEST else event.id_handle
        handler = self._handlers.get(key)
        if handler is None:
            if event.event == CMEventType.CONNECT_REQUEST:
                # Listener already gone: the new id is ours to dispose of.
                CMId.from_event(channel, event).close()
            return
        try:
            handler(event)
        except Exception:
            log.exception("rdmaio: CM event handler failed for %s", event.event.name)

    # --- completion channels -------------------------------------------------------------------------

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop whenever ``fd`` is readable (a domain's completion channel)."""
        self.backend.add_reader(fd, callback)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``; must happen before the fd is closed."""
        self.backend.remove_reader(fd)

    # --- device async events -------------------------------------------------------------------------

    def watch_device(self, device: DeviceContext) -> None:
        """Put the device's async-event fd on the loop (once per device; kept for the reactor's life)."""
        if device.handle in self._devices:
            return
        self._devices[device.handle] = device
        device.set_async_nonblocking()
        self.backend.add_reader(device.async_fd, functools.partial(self._on_async_readable, device))

    def watch_qp(self, device: int, qp_num: int, cq: int, handler: QPEventHandler) -> None:
        """Send the fatal async events of QP ``qp_num`` on ``device`` (a device handle) to ``handler``:
        its own errors, errors of the CQ it uses (``cq``, a CQ handle) and fatal errors of the device."""
        key = (device, qp_num)
        self._qp_handlers[key] = handler
        self._cq_handlers.setdefault(cq, {})[key] = handler

    def unwatch_qp(self, device: int, qp_num: int, cq: int) -> None:
        """Forget the async-event handler of QP ``qp_num`` on ``device``."""
        key = (device, qp_num)
        self._qp_handlers.pop(key, None)
        handlers = self._cq_handlers.get(cq)
        if handlers is not None:
            handlers.pop(key, None)
            if not handlers:
                del self._cq_handlers[cq]

    def watch_port(self, device: int, port: int, qp_num: int, handler: QPEventHandler) -> None:
        """Send PORT_ERR and PORT_ACTIVE of ``port`` on ``device`` (a device handle) to ``handler``."""
        self._port_handlers.setdefault((device, port), {})[qp_num] = handler

    def unwatch_port(self, device: int, port: int, qp_num: int) -> None:
        """Forget the port-event handler of QP ``qp_num``."""
        handlers = self._port_handlers.get((device, port))
        if handlers is not None:
            handlers.pop(qp_num, None)
            if not handlers:
                del self._port_handlers[(device, port)]

    def _on_async_readable(self, device: DeviceContext) -> None:
        while True:
            try:
                event = device.get_async_event()
            except Exception:
                log.exception("rdmaio: reading async events of %s failed", device.name)
                self.backend.remove_reader(device.async_fd)
                return
            if event is None:
                return
            self.async_events += 1
            self._dispatch_async_event(device, event)

    def _dispatch_async_event(self, device: DeviceContext, event: verbs.AsyncEvent) -> None:
        etype = event.event_type
        if etype in _FATAL_QP_EVENTS:
            handlers = [self._qp_handlers.get((device.handle, event.element))]
        elif etype == verbs.EVENT_CQ_ERR:
            # A shared CQ: every connection on it fails, and its domain reserves nothing more on it.
            handlers = list(self._cq_handlers.get(event.obj, {}).values())
            domain = self._domains.get(device.handle)
            if domain is not None:
                domain.cq_failed(event.obj)
        elif etype == verbs.EVENT_DEVICE_FATAL:
            handlers = [h for (dev, _qp), h in self._qp_handlers.items() if dev == device.handle]
        elif etype in (verbs.EVENT_PORT_ERR, verbs.EVENT_PORT_ACTIVE):
            log.info("rdmaio: device %s port %d: %s", device.name, event.element, event.description)
            for port_handler in list(self._port_handlers.get((device.handle, event.element), {}).values()):
                try:
                    port_handler(event)
                except Exception:
                    log.exception("rdmaio: port event handler failed for %s", event.description)
            return
        else:
            log.debug("rdmaio: device %s async event %s (%d)", device.name, event.description, event.element)
            return
        log.warning("rdmaio: device %s reported %s (%d)", device.name, event.description, event.element)
        for handler in handlers:
            if handler is None:
                continue
            try:
                handler(event)
            except Exception:
                log.exception("rdmaio: async event handler failed for %s", event.description)
