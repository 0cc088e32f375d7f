"""rdmaio: asyncio networking over RDMA.

``ep = await rdmaio.connect(host, port)`` and ``server = await rdmaio.serve(handler, host, port)`` give
asyncio-streams-like endpoints backed by RDMA (rdma_cm + verbs), with credit-based flow control and a C
helper that drains completion queues in batches.

Packages and modules (layers, bottom up; docs/architecture.md draws them): :mod:`rdmaio._ffi` (cffi
bindings and the C helper), :mod:`rdmaio.verbs` (verbs objects), :mod:`rdmaio.protocol` (the sans-IO
protocol), :mod:`rdmaio.core` (loop backends, devices, connection setup, one connection's sender, receiver
and engines); the public API: :mod:`rdmaio.endpoint`, :mod:`rdmaio.client` (``connect``),
:mod:`rdmaio.server` (``serve``, ``listen``), :mod:`rdmaio.options`, :mod:`rdmaio.errors`,
:mod:`rdmaio.path` (the path record of a connection); compatibility:
:mod:`rdmaio.streams` (asyncio streams), :mod:`rdmaio.anyio` (anyio streams), :mod:`rdmaio.dask` (Dask's
``rdma://``); tools: :mod:`rdmaio.cli` (``doctor``, ``ping``), :mod:`rdmaio.testing` (the test host, fakes);
observability: :mod:`rdmaio.metrics` (process-wide metrics, the Prometheus exporter).
"""

# Before the imports: connection setup (rdmaio.core.negotiation) announces it in the handshake, and imports
# it while this package is still being imported. setuptools reads it from here (pyproject.toml).
__version__ = "0.1.0"

# First, before anything loads the compiled extension: when this process is rdmaio's command line and the
# extension cannot load, this runs `doctor` (which reports it, with the fix) and exits; else it does nothing.
from rdmaio.cli import startup as _startup  # noqa: F401
from rdmaio.client import connect
from rdmaio.core.onesided import RemoteKey, WriteNotice
from rdmaio.endpoint import Endpoint
from rdmaio.errors import (
    AddressError,
    BindQueueFullError,
    ConnectionAbortedError,
    ConnectionRefusedError,
    ConnectionResetError,
    DeviceError,
    EndpointClosedError,
    FeatureNotSupportedError,
    ForkError,
    FrameError,
    HandshakeError,
    InvalidRemoteKeyError,
    MemoryRegistrationError,
    MessageTooLargeError,
    ProtocolError,
    ProviderError,
    RdmaError,
    RemoteAccessError,
    RemoteAccessRefusedError,
    RemoteKeyRevokedError,
    RendezvousTimeoutError,
    ReplyQueueFullError,
    TimeoutError,
    UnreachableError,
    VerbsError,
)
from rdmaio.options import Options
from rdmaio.path import PathInfo
from rdmaio.server import StreamServer, listen, serve
from rdmaio.streams import open_connection, start_server

__all__ = [
    "AddressError",
    "BindQueueFullError",
    "ConnectionAbortedError",
    "ConnectionRefusedError",
    "ConnectionResetError",
    "DeviceError",
    "Endpoint",
    "EndpointClosedError",
    "FeatureNotSupportedError",
    "ForkError",
    "FrameError",
    "HandshakeError",
    "InvalidRemoteKeyError",
    "MemoryRegistrationError",
    "MessageTooLargeError",
    "Options",
    "PathInfo",
    "ProtocolError",
    "ProviderError",
    "RdmaError",
    "RemoteAccessError",
    "RemoteAccessRefusedError",
    "RemoteKey",
    "RemoteKeyRevokedError",
    "RendezvousTimeoutError",
    "ReplyQueueFullError",
    "StreamServer",
    "TimeoutError",
    "UnreachableError",
    "VerbsError",
    "WriteNotice",
    "__version__",
    "connect",
    "listen",
    "open_connection",
    "serve",
    "start_server",
]
