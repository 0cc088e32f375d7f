"""The path record of a connection, :class:`PathInfo`: what ``ep.get_extra_info("rdma")`` returns.

It names the device and port, the transport (InfiniBand, RoCE v1 or v2, iWARP), the local and remote GID
with the local entry's type and index, the MTUs, the inline limit, the credit window and receive depth, the
rendezvous threshold, the shared receive queue, the negotiated features and the peer's rdmaio version;
:meth:`PathInfo.describe` prints it for people, :meth:`PathInfo.as_dict` for programs. The record is built
in :mod:`rdmaio.core.path`; docs/monitoring.md shows how to use it.
"""

from __future__ import annotations

from rdmaio.core.path import FEATURE_NAMES, PathInfo, format_gid

__all__ = ["FEATURE_NAMES", "PathInfo", "format_gid"]
