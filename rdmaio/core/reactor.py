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

Device removal (``RDMA_CM_EVENT_DEVICE_REMOVAL`` on any cm id of the device, or
``IBV_EVENT_DEVICE_FATAL``): :meth:`Reactor.device_removed` fails every connection on the device, closes
its Domain (QPs, MRs, PD, CQs, completion channel), takes its async fd off the loop and drops both, so a
connection on a device added later gets a fresh Domain. The kernel's removal then waits until the
process closes the device context, which librdmacm owns: once none of this reactor's cm ids is left on
the device (pending accepts and connects release theirs on their own DEVICE_REMOVAL event), the reactor
lists librdmacm's devices (:func:`rdmaio.verbs.cm_device_handles`), which closes the dead context, and
repeats that for a while if the kernel still reported the device.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import functools
import logging
import weakref
from collections.abc import Callable

from rdmaio import verbs
from rdmaio.core.backend import AsyncioBackend, Backend, TrioBackend, current_backend, trio_run_key
from rdmaio.core.domain import Domain
from rdmaio.core.keepalive import KeepaliveTimers
from rdmaio.errors import DeviceError
from rdmaio.options import Options
from rdmaio.verbs import CMEvent, CMEventType, CMId, DeviceContext, EventChannel

__all__ = ["CMHandler", "Reactor"]

log = logging.getLogger("rdmaio")

CMHandler = Callable[[CMEvent], None]
"""Called on the loop for each CM event of one cm id."""

QPEventHandler = Callable[[verbs.AsyncEvent], None]

# QP async events that mean the QP is in the error state. The others (COMM_EST: a receive arrived before
# the connection was marked established; SQ_DRAINED, LAST_WQE_REACHED, PATH_MIG) are informational.
_FATAL_QP_EVENTS = frozenset({verbs.EVENT_QP_FATAL, verbs.EVENT_QP_REQ_ERR, verbs.EVENT_QP_ACCESS_ERR})
# After a removal, how often and how long librdmacm's device list is checked for the device to be gone.
_REMOVAL_RECHECK = 0.2
_REMOVAL_RECHECKS = 150


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
        # Device removal: the live cm ids (to find an id's device), and removed devices by handle until
        # none of our ids uses them any more.
        self._ids: weakref.WeakValueDictionary[int, CMId] = weakref.WeakValueDictionary()
        self._removed: dict[int, DeviceContext] = {}
        self._removal_check_running = False
        self.keepalive_timers = KeepaliveTimers(backend)
        """The loop's keepalive timers (one per distinct interval, for every connection)."""
        self.cm_events = 0
        self.async_events = 0
        self.devices_removed = 0

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

    def domain(self, device: DeviceContext, options: Options | None = None) -> Domain:
        """The :class:`~rdmaio.core.domain.Domain` of ``device`` on this loop (created on first use).

        The per-device settings of ``options`` (a connection's: ``max_pinned``) are taken when the Domain
        is created; a Domain that exists keeps its own, whatever a later connection asks for (see
        :meth:`Domain.check_max_pinned <rdmaio.core.domain.Domain.check_max_pinned>`)."""
        if device.handle in self._removed:
            raise DeviceError(f"RDMA device {device.name} was removed", errno=errno.ENODEV, call="Domain")
        domain = self._domains.get(device.handle)
        if domain is None or domain.closed:
            domain = self._domains[device.handle] = Domain(
                device,
                max_pinned=None if options is None else options.max_pinned,
                watch=self.watch,
                unwatch=self.unwatch,
                call_later=self.backend.call_later,
            )
        elif options is not None and options.max_pinned is not None:
            domain.check_max_pinned(options.max_pinned)
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
        self._ids[cm_id.handle] = cm_id
        return cm_id

    def adopt_id(self, event: CMEvent, handler: CMHandler) -> CMId:
        """Wrap the new cm id of a CONNECT_REQUEST and route its later events to ``handler``."""
        cm_id = CMId.from_event(self.channel, event)
        self._handlers[cm_id.handle] = handler
        self._ids[cm_id.handle] = cm_id
        return cm_id

    def set_handler(self, cm_id: CMId, handler: CMHandler) -> None:
        """Route the events of ``cm_id`` to a new handler."""
        self._handlers[cm_id.handle] = handler

    def release_id(self, cm_id: CMId) -> None:
        """Destroy ``cm_id`` (and its QP) and forget its handler (the channel stays for the next one)."""
        self._handlers.pop(cm_id.handle, None)
        self._ids.pop(cm_id.handle, None)
        cm_id.close()
        if self._removed:
            self._release_removed()

    def drain_cm_events(self, limit: int = 4096) -> None:
        """Handle every event waiting on the rdma_cm event channel now (at most ``limit``), instead of one
        per loop wake-up: before a deadline concludes that an event did not come, it must not still be
        waiting in the channel behind a busy loop."""
        for _ in range(limit):
            if not self._handle_cm_event():
                return

    def _on_cm_readable(self) -> None:
        self._handle_cm_event()

    def _handle_cm_event(self) -> bool:
        """Handle one event of the rdma_cm event channel; False if there was none."""
        # One event per wake-up. The channel's fd is watched level-triggered on every backend (epoll
        # without EPOLLET in asyncio's selector and libuv; trio re-arms each wait), so another pending
        # event wakes us again on the next loop iteration, while reading until EAGAIN would cost one
        # empty rdma_get_cm_event (a system call) per wake-up: events come one at a time during a
        # connection's setup, so that was up to half of the calls.
        channel = self._channel
        if channel is None or channel.closed:
            return False
        try:
            event = channel.get_event()
        except Exception:
            log.exception("rdmaio: reading the rdma_cm event channel failed")
            return False
        if event is None:
            return False
        self.cm_events += 1
        key = event.listen_id_handle if event.event == CMEventType.CONNECT_REQUEST else event.id_handle
        # Found before the handler runs: it may release the id.
        removed = self._device_of(key) if event.event == CMEventType.DEVICE_REMOVAL else None
        handler = self._handlers.get(key)
        if handler is None:
            if event.event == CMEventType.CONNECT_REQUEST:
                # Listener already gone: the new id is ours to dispose of.
                CMId.from_event(channel, event).close()
        else:
            try:
                handler(event)
            except Exception:
                log.exception("rdmaio: CM event handler failed for %s", event.event.name)
        if removed is not None:
            self.device_removed(removed)
        return True

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
            self.device_removed(device)
            return
        elif etype == verbs.EVENT_SRQ_LIMIT_REACHED:  # shared receive queue: a growth hint
            domain = self._domains.get(device.handle)
            pool = domain.shared_receive if domain is not None else None
            if pool is not None and not pool.closed and pool.srq.handle == event.obj:
                try:
                    pool.on_limit_event()
                except Exception:
                    log.exception("rdmaio: handling %s failed", event.description)
            return
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

    # --- device removal ------------------------------------------------------------------------------

    def _device_of(self, id_handle: int) -> DeviceContext | None:
        cm_id = self._ids.get(id_handle)
        if cm_id is None or cm_id.closed:
            return None
        return cm_id.device()

    def device_removed(self, device: DeviceContext) -> None:
        """``device`` is gone: fail every connection on it (``ConnectionResetError``), close its Domain,
        stop watching it and forget both; then let librdmacm close it once no cm id of ours uses it.
        Idempotent. Connections being accepted or connected fail on their own DEVICE_REMOVAL event."""
        handle = device.handle
        if handle in self._removed:
            return
        self._removed[handle] = device
        self.devices_removed += 1
        log.warning("rdmaio: RDMA device %s removed; failing its connections", device.name)
        fatal = verbs.AsyncEvent(verbs.EVENT_DEVICE_FATAL, f"RDMA device {device.name} removed", "device", 0)
        for (dev, _qp), handler in list(self._qp_handlers.items()):
            if dev == handle:
                try:
                    handler(fatal)
                except Exception:
                    log.exception("rdmaio: failing a connection of removed device %s failed", device.name)
        for key in [k for k in self._port_handlers if k[0] == handle]:
            del self._port_handlers[key]
        if self._devices.pop(handle, None) is not None:
            try:
                self.backend.remove_reader(device.async_fd)
            except Exception:
                log.debug(
                    "rdmaio: removing the async fd of %s from the loop failed", device.name, exc_info=True
                )
        domain = self._domains.pop(handle, None)
        if domain is not None:
            try:
                domain.close()  # QPs left by connections still being set up, MRs, PD, CQs, channel
            except Exception:
                log.exception("rdmaio: closing the domain of removed device %s failed", device.name)
        self._release_removed()

    def _release_removed(self) -> None:
        """Hand the removed devices none of our cm ids uses any more back to librdmacm (which closes
        their context); recheck later while librdmacm still lists one (the kernel was not done yet)."""
        in_use = set()
        for cm_id in list(self._ids.values()):
            if not cm_id.closed and (dev := cm_id.device()) is not None:
                in_use.add(dev.handle)
        # Not while device_removed() is still failing connections (each releases its id) and has not
        # closed the Domain: librdmacm would close the context under the Domain's PD, CQs and channel.
        busy = in_use | self._domains.keys() | self._devices.keys()
        unused = [h for h in self._removed if h not in busy]
        if not unused:
            return
        listed = verbs.cm_device_handles()
        for handle in unused:
            if handle not in listed:
                del self._removed[handle]  # closed by librdmacm: the handle may be reused by a new device
        if any(h in listed for h in unused) and not self._removal_check_running:
            self._removal_check_running = True
            self.backend.spawn(self._recheck_removed(), name="rdmaio device removal")

    async def _recheck_removed(self) -> None:
        try:
            for _ in range(_REMOVAL_RECHECKS):
                try:
                    async with self.backend.timeout(_REMOVAL_RECHECK):
                        await self.backend.waiter().wait()
                except builtins.TimeoutError:
                    pass
                self._release_removed()
                if not self._removed:
                    return
            log.warning("rdmaio: librdmacm still lists removed RDMA devices: %s", self._removed)
        finally:
            self._removal_check_running = False
