"""``rdma://``: a comm backend for Dask ``distributed`` over rdmaio (install ``rdmaio[dask]``).

The backend is registered through the entry point group ``distributed.comm.backends`` under the name
``rdma``, so ``distributed`` finds it without any import by the user::

    LocalCluster(protocol="rdma")            # or: dask scheduler --protocol rdma
    Client("rdma://198.18.0.1:8786")         #     dask worker rdma://198.18.0.1:8786

See docs/dask.md for configuration (``distributed.comm.rdma.*``) and limits.

Modules:

* :mod:`rdmaio.dask.comm`: the backend, listener, connector and ``Comm`` (messages over one endpoint).
* :mod:`rdmaio.dask.framing`: Dask messages as frames on the wire, with the frame and message limits.
* :mod:`rdmaio.dask.addressing`: ``rdma://`` addresses: which local IP address an RDMA listener uses.
* :mod:`rdmaio.dask.config`: the ``distributed.comm.rdma.*`` settings and their defaults (``rdma.yaml``).
"""

from __future__ import annotations

from rdmaio.dask.config import load_defaults

load_defaults()  # before the comm module reads any distributed.comm.rdma.* key

from rdmaio.dask.comm import RDMABackend, RDMAComm, RDMAConnector, RDMAListener  # noqa: E402

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener"]
