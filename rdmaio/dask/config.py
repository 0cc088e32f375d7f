"""The ``distributed.comm.rdma.*`` configuration: defaults registered with dask, and typed accessors.

The defaults live in ``rdma.yaml`` next to this module and are merged into dask's configuration with
``dask.config.update_defaults`` when :mod:`rdmaio.dask` is imported (as distributed's own extensions do),
so ``dask.config.get("distributed.comm.rdma.max-frame-size")`` has a value and user settings win.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

import dask.config
import yaml  # type: ignore[import-untyped]  # no stubs in the environment; dask depends on it
from dask.utils import parse_bytes

__all__ = ["PREFIX", "byte_size", "load_defaults"]

PREFIX = "distributed.comm.rdma."


def load_defaults() -> dict[str, Any]:
    """Read ``rdma.yaml`` and register it as dask defaults (idempotent); return what was read."""
    text = importlib.resources.files("rdmaio.dask").joinpath("rdma.yaml").read_text(encoding="utf-8")
    defaults: dict[str, Any] = yaml.safe_load(text)
    dask.config.update_defaults(defaults)
    return defaults


def byte_size(name: str) -> int:
    """The byte count configured at ``distributed.comm.rdma.<name>`` (``"1GiB"``, ``2**30``, ...).

    Raises ``ValueError`` for anything that is not a positive size.
    """
    value = dask.config.get(PREFIX + name)
    try:
        size = int(parse_bytes(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{PREFIX}{name} must be a byte size, not {value!r}") from exc
    if size < 1:
        raise ValueError(f"{PREFIX}{name} must be positive, not {value!r}")
    return size
