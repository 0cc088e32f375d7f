"""The verbs objects behind a connection's one-sided engine: how its memory is registered into the
Domain's protection domain (local only, an exported grant, a bindable region) and how a window is bound.

:meth:`OneSidedEngine.for_connection <rdmaio.core.onesided.OneSidedEngine.for_connection>` gives these
callables to the engine's objects, which see only the interfaces of :mod:`~rdmaio.core.onesided.interfaces`
(the unit tests give fakes instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from rdmaio import verbs
from rdmaio.core.onesided.interfaces import BindWindow, Region
from rdmaio.core.onesided.keys import ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE

__all__ = ["bindable_registrar", "local_and_grant_registrars", "read_grant_registrar", "window_binder"]


def local_and_grant_registrars(
    pd: Any,
) -> tuple[Callable[[Any], Region], Callable[[memoryview, int], Region]]:
    """``register_local`` (local access only) and ``register_grant`` (exactly the remote access of the
    access bits) of an engine whose memory goes into ``pd``."""

    def register_local(buffer: Any) -> Region:
        return verbs.MemoryRegion(pd, buffer)

    def register_grant(view: memoryview, bits: int) -> Region:
        return verbs.MemoryRegion(
            pd,
            view,
            remote_read=bool(bits & ACCESS_READ),
            remote_write=bool(bits & ACCESS_WRITE),
            remote_atomic=bool(bits & ACCESS_ATOMIC),
        )

    return register_local, register_grant


def bindable_registrar(pd: Any) -> Callable[[memoryview, bool], Region]:
    """Registration of a connection-scoped grant: ``IBV_ACCESS_MW_BIND`` and no remote flags (its own rkey
    opens nothing); local write unless read-only (a window granting write or atomics needs it)."""

    def register_bindable(view: memoryview, readonly: bool) -> Region:
        return verbs.MemoryRegion(pd, view, readonly=readonly, mw_bind=True)

    return register_bindable


def read_grant_registrar(pd: Any) -> Callable[[memoryview, bool], Region]:
    """Registration of a rendezvous send's buffer for remote READ in a connection's own protection domain
    (a device without memory windows: the region's own rkey reaches that connection only); read-only
    buffers (bytes) are registered without local write."""

    def register_read_grant(view: memoryview, readonly: bool) -> Region:
        return verbs.MemoryRegion(pd, view, readonly=readonly, remote_read=True)

    return register_read_grant


def window_binder(pd: Any, qp: Any) -> BindWindow:
    """Bind a type 2 window over a whole region on ``qp`` (see :class:`rdmaio.verbs.MemoryWindow`)."""

    def bind_window(region: Region, wr_id: int, access: int) -> verbs.MemoryWindow:
        window = verbs.MemoryWindow(pd, cast(verbs.MemoryRegion, region), qp)
        try:
            window.bind(wr_id, access)
        except BaseException:
            window.close()
            raise
        return window

    return bind_window
