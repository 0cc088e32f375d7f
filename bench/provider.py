"""The device the benchmark runs on: its provider and transport, what the native tools need there, and
what cannot run on it.

The harness finds the device (``--device``, else the one whose netdev holds the benchmark address, else
the only one), reads its transport from sysfs (``node_type`` ``RNIC`` is iWARP; on Ethernet the GID types
tell RoCE v1 from v2) and its capabilities from ``ibv_devinfo -v``, and then:

- builds perftest's command lines for that transport (:func:`perftest_transport_args`): rdma_cm (``-R``)
  on every transport, and on iWARP it cannot be left out (an iWARP queue pair is connected over TCP by
  the iWARP connection manager; perftest's own Ethernet exchange leaves it unconnected and the run stops
  at "Failed to modify QP to RTS");
- leaves out the measurements the device cannot make (:func:`unsupported`), each with the reason printed
  once and kept in the JSON report, instead of a failure or a made-up figure: no atomics
  (``ATOMIC_NONE``: Soft-iWARP, every iWARP device known) means no ``ib_atomic_bw`` and no
  ``fetch_add``/``fetch_add_many`` for rdmaio, which raises ``FeatureNotSupportedError`` up front there.

Immediate data needs nothing here: rdmaio picks its header framing on a device without it by itself
(the report's ``provider.framing`` says which framing rdmaio uses), and none of the perftest runs use
immediate data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.model import Workload
from rdmaio.cli.system import DeviceCaps, System

__all__ = [
    "ATOMIC_WORKLOADS",
    "SOFTWARE_PROVIDERS",
    "Provider",
    "Skip",
    "detect_provider",
    "perftest_transport_args",
    "plan_skips",
    "unsupported",
]

ATOMIC_WORKLOADS: tuple[Workload, ...] = (Workload.FETCH_ADD, Workload.FETCH_ADD_MANY)
"""The workloads that need the device's atomics (``ib_atomic_bw`` and rdmaio's ``fetch_add*``)."""

SOFTWARE_PROVIDERS: tuple[str, ...] = ("rxe", "siw")
"""Software providers whose devices carry the driver's name (``rdma link add NAME type rxe|siw``): the
sysfs of such a device has no parent device whose driver could be read."""


@dataclass(frozen=True, slots=True)
class Provider:
    """The RDMA device the benchmark runs on, as far as it could be found out."""

    device: str | None
    """The device's name (``rxe0``, ``siw0``), or None when none was found."""
    provider: str
    """The provider: ``rxe`` or ``siw`` (software), the kernel driver of a hardware device, or
    ``unknown``."""
    transport: str
    """``iWARP``, ``RoCE v2``, ``RoCE v1``, ``RoCE v1/v2``, ``RoCE``, ``InfiniBand`` or ``unknown``."""
    atomics: bool | None
    """Whether the device performs RDMA atomics (None: ``ibv_devinfo`` could not say)."""
    immediate_data: bool
    """Whether SEND and RDMA WRITE carry immediate data (not on iWARP)."""
    memory_windows: bool | None
    """Whether the device offers memory windows (None: unknown)."""
    source: str
    """How the device was chosen (``--device``, ``address 198.18.0.1 on dum0``, ``only device``, or why
    none was)."""

    @property
    def iwarp(self) -> bool:
        """An iWARP device: rdma_cm is the only way to connect it, there is no immediate data."""
        return self.transport == "iWARP"

    @property
    def framing(self) -> str:
        """The framing rdmaio picks on this device by default: ``header`` without immediate data."""
        return "immediate" if self.immediate_data else "header"

    def describe(self) -> str:
        """One line for the progress output."""
        if self.device is None:
            return f"no RDMA device found ({self.source}): the RDMA contenders will fail"
        atomics = {True: "atomics", False: "no atomics", None: "atomics unknown"}[self.atomics]
        immediate = "immediate data" if self.immediate_data else "no immediate data"
        return (
            f"device {self.device} ({self.source}): provider {self.provider}, transport {self.transport}, "
            f"{atomics}, {immediate} (rdmaio uses the {self.framing} framing)"
        )

    def to_json(self) -> dict[str, Any]:
        """The report's ``meta.provider`` (with the derived ``framing``)."""
        return {**asdict(self), "framing": self.framing}


@dataclass(frozen=True, slots=True)
class Skip:
    """Measurements left out because the device cannot make them."""

    contender: str
    workloads: tuple[Workload, ...]
    reason: str

    def line(self) -> str:
        """The line printed for it."""
        kinds = ", ".join(str(w) for w in self.workloads)
        return f"not run: {self.contender} {kinds}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        """One entry of the report's ``meta.skipped``."""
        return {
            "contender": self.contender,
            "workloads": [str(w) for w in self.workloads],
            "reason": self.reason,
        }


def _provider_name(system: System, device: str) -> str:
    """The software provider a device's name gives, else its parent's kernel driver, else ``unknown``."""
    match = re.fullmatch(r"([a-z]+)\d+", device)
    if match and match.group(1) in SOFTWARE_PROVIDERS:
        return match.group(1)
    try:
        driver = os.readlink(system.path(f"/sys/class/infiniband/{device}/device/driver"))
    except OSError:
        return "unknown"
    return os.path.basename(driver) or "unknown"


def detect_provider(host: str, device: str | None = None, system: System | None = None) -> Provider:
    """The device the benchmark at ``host`` runs on and what it offers.

    ``device`` (``--device``) wins; otherwise the device whose port's netdev holds ``host``; otherwise
    the only device there is. Transport from sysfs, capabilities from ``ibv_devinfo -v``: both are read,
    nothing is opened, so this works whatever the device's state.
    """
    system = system or System()
    devices = {d.name: d for d in system.sysfs_devices()}
    chosen: str | None = None
    source = ""
    if device:
        chosen, source = device, "--device"
        if device not in devices:
            source = "--device, not in /sys/class/infiniband"
    else:
        for dev in devices.values():
            for port in dev.ports:
                netdev = port.netdev
                if netdev and host in system.ipv4_addresses(netdev):
                    chosen, source = dev.name, f"address {host} on {netdev}"
                    break
            if chosen:
                break
        if chosen is None and len(devices) == 1:
            chosen, source = next(iter(devices)), "the only device"
        if chosen is None:
            source = "no device in /sys/class/infiniband" if not devices else f"none holds {host}"
    if chosen is None:
        return Provider(None, "unknown", "unknown", None, True, None, source)
    found = devices.get(chosen)
    transport = found.ports[0].transport if found is not None and found.ports else "unknown"
    caps: DeviceCaps | None = system.device_caps().get(chosen)
    if transport == "unknown" and caps is not None and caps.transport == "iWARP":
        transport = "iWARP"
    return Provider(
        device=chosen,
        provider=_provider_name(system, chosen),
        transport=transport,
        atomics=None if caps is None else caps.atomics,
        immediate_data=transport != "iWARP",
        memory_windows=None if caps is None else caps.max_mw > 0,
        source=source,
    )


def perftest_transport_args(provider: Provider | None) -> list[str]:
    """perftest's connection arguments on ``provider``'s transport.

    ``-R`` (rdma_cm) everywhere: on RoCE and InfiniBand it is the harness's choice, so that perftest
    connects the way rdmaio does; on iWARP it is the only way (without it perftest exchanges queue pair
    numbers over its own TCP socket and cannot bring an iWARP queue pair to RTS). perftest sets its
    inline size to 0 on iWARP by itself, so no other flag differs.
    """
    del provider  # the same on every transport known today; kept so that callers pass it
    return ["-R"]


def unsupported(provider: Provider | None, contender: str, workload: Workload) -> str | None:
    """Why ``contender`` cannot run ``workload`` on ``provider``'s device, or None when it can."""
    if provider is None or provider.device is None:
        return None
    if workload in ATOMIC_WORKLOADS and provider.atomics is False:
        where = (
            f"{provider.device} ({provider.provider}, {provider.transport}) has no RDMA atomics (ATOMIC_NONE)"
        )
        if contender == "ib_atomic_bw":
            return f"{where}: ib_atomic_bw's fetch-and-add cannot be posted"
        if contender.startswith("rdmaio-"):
            return f"{where}: rdmaio's fetch_add and fetch_add_many raise FeatureNotSupportedError up front"
    return None


def plan_skips(
    provider: Provider | None,
    contenders: Sequence[str],
    workloads: Iterable[Workload],
    offered: Mapping[str, Iterable[Workload]],
) -> list[Skip]:
    """The measurements of ``contenders`` x ``workloads`` the device cannot make, one :class:`Skip` per
    contender and reason (``offered`` maps a contender to the workloads it measures at all)."""
    wanted = list(workloads)
    skips: list[Skip] = []
    for name in contenders:
        by_reason: dict[str, list[Workload]] = {}
        own = set(offered.get(name, ()))
        for workload in wanted:
            if workload not in own:
                continue
            reason = unsupported(provider, name, workload)
            if reason is not None:
                by_reason.setdefault(reason, []).append(workload)
        skips.extend(Skip(name, tuple(kinds), reason) for reason, kinds in by_reason.items())
    return skips
