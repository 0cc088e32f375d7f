"""What a device offers one-sided RDMA: atomics, READ/atomic depth, memory windows (``ibv_query_device``).

Queried once per device and process (:func:`cached_caps`): the engine asks whether it can bind windows and
grant atomics, connection setup asks for the RDMA READ / atomic depth to negotiate (:func:`rd_atomic_depth`).
"""

from __future__ import annotations

from rdmaio import verbs
from rdmaio.errors import VerbsError
from rdmaio.verbs.device import OneSidedCaps

__all__ = ["OneSidedCaps", "cached_caps", "query_caps", "rd_atomic_depth"]


def query_caps(device: verbs.DeviceContext) -> OneSidedCaps:
    """Query the one-sided capabilities of a device (the verbs layer's query; tests replace this)."""
    return device.query_onesided_caps()


_CAPS: dict[tuple[int, str], OneSidedCaps] = {}
"""Per device (context handle, name): its capabilities, queried once per process (device attributes do not
change, and ``ibv_query_device`` is a system call in every connection's setup path, on both sides)."""


def cached_caps(device: verbs.DeviceContext) -> OneSidedCaps:
    """:func:`query_caps` of ``device``, queried once per process."""
    key = (device.handle, device.name)
    caps = _CAPS.get(key)
    if caps is None:
        caps = _CAPS[key] = query_caps(device)
    return caps


def rd_atomic_depth(device: verbs.DeviceContext, wanted: int) -> int:
    """The READ/atomic depth to negotiate (``responder_resources``/``initiator_depth``): ``wanted``, capped
    by the device's limits. rdma_cm grants the QP remote READ/atomic access only when it is above 0."""
    try:
        caps = cached_caps(device)
    except VerbsError:
        return 1
    limit = min(caps.max_qp_rd_atom, caps.max_qp_init_rd_atom, 255)
    return max(1, min(wanted, limit))
