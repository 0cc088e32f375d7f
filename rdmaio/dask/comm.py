"""The ``rdma://`` comm backend of ``distributed``: Comm, Connector, Listener and Backend over rdmaio.

One Dask comm is one rdmaio connection (one reliable-connected queue pair). Messages are serialised with
``distributed.comm.utils.to_frames``/``from_frames`` (which honour ``distributed.comm.offload``; frames are
split at ``distributed.comm.shard``) and moved with :mod:`rdmaio.dask.framing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import dask.config
from dask.utils import parse_bytes
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.registry import Backend
from distributed.comm.utils import from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, get_ip

import rdmaio
from rdmaio.dask.addressing import is_loopback, is_wildcard, rdma_host
from rdmaio.dask.framing import DEFAULT_CHUNK_SIZE, FramingError, read_frames, write_frames

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener"]

log = logging.getLogger("rdmaio.dask")

PREFIX = "rdma://"
_EXTRA_KEYS = ("device", "port", "qp_num", "mtu", "max_inline", "peer_max_message_size")
# Errors of the data path that mean "this comm is gone" (rdmaio's errors are OSErrors or RdmaErrors).
_COMM_ERRORS = (rdmaio.RdmaError, OSError, FramingError, EOFError)


def comm_options() -> rdmaio.Options:
    """rdmaio options for Dask comms: ``distributed.comm.rdma.options`` (a dict of Options fields)."""
    overrides = dict(dask.config.get("distributed.comm.rdma.options", None) or {})
    return rdmaio.Options.coerce(overrides)


def chunk_size(peer_max_message_size: int | None = None) -> int:
    """Largest rdmaio message a frame is cut into: ``distributed.comm.rdma.chunk-size``, and never more
    than the peer accepts (its ``max_message_size``, from ``Endpoint.get_extra_info``)."""
    value = dask.config.get("distributed.comm.rdma.chunk-size", None)
    size = int(parse_bytes(value)) if value else DEFAULT_CHUNK_SIZE
    if size < 1:
        raise ValueError(f"distributed.comm.rdma.chunk-size must be positive, not {value!r}")
    return min(size, peer_max_message_size) if peer_max_message_size else size


def _listen_host(host: str) -> str:
    # rdma_cm cannot listen on loopback: it stands for this machine's RDMA address on this scheme.
    return rdma_host() if is_loopback(host) else host


def _address(pair: tuple[str, int] | None) -> str:
    if pair is None:
        raise CommClosedError("the connection has no address (it is already closed)")
    return PREFIX + unparse_host_port(pair[0], pair[1])


def _abort_dangling(endpoint: rdmaio.Endpoint, loop: asyncio.AbstractEventLoop, name: str) -> None:
    """Finalizer of a comm dropped without close(): abort its connection on the loop that owns it."""
    if endpoint.is_closing():
        return
    log.warning("rdmaio.dask: aborting the connection of a comm that was never closed: %s", name)
    with contextlib.suppress(RuntimeError):  # the loop is already closed: its resources went with it
        loop.call_soon_threadsafe(endpoint.abort)


class RDMAComm(Comm):
    """An established ``rdma://`` comm: one rdmaio :class:`~rdmaio.Endpoint`.

    ``read()`` and ``write()`` raise ``CommClosedError`` once the connection is closed, reset or aborted
    (its ``__cause__`` is rdmaio's error). A ``read()`` or ``write()`` interrupted by cancellation aborts
    the comm, since part of a message may have been exchanged.
    """

    def __init__(
        self, endpoint: rdmaio.Endpoint, local_addr: str, peer_addr: str, deserialize: bool = True
    ) -> None:
        self._closed = False  # read by repr(), which Comm.__init__ may use
        super().__init__(deserialize=deserialize)
        self._endpoint: rdmaio.Endpoint | None = endpoint
        self._local_addr = local_addr  # distributed.comm.core.connect() reads these two
        self._peer_addr = peer_addr
        self._chunk_size = chunk_size(endpoint.get_extra_info("peer_max_message_size"))
        self._shard_size = int(parse_bytes(dask.config.get("distributed.comm.shard")))
        self._write_lock = asyncio.Lock()
        self._extra = {key: endpoint.get_extra_info(key) for key in _EXTRA_KEYS}
        self._finalizer = weakref.finalize(
            self, _abort_dangling, endpoint, asyncio.get_running_loop(), f"{local_addr} -> {peer_addr}"
        )
        self._finalizer.atexit = False

    @property
    def local_address(self) -> str:
        """``rdma://host:port`` of this side."""
        return self._local_addr

    @property
    def peer_address(self) -> str:
        """``rdma://host:port`` of the peer."""
        return self._peer_addr

    @property
    def extra_info(self) -> dict[str, Any]:
        """The RDMA device, its port, the queue pair number, the path MTU, the inline limit and the largest
        message the peer accepts."""
        return self._extra

    @property
    def endpoint(self) -> rdmaio.Endpoint | None:
        """The rdmaio endpoint (``None`` once closed), e.g. for ``statistics()``."""
        return self._endpoint

    def _gone(self, exc: BaseException) -> CommClosedError:
        """The connection failed or ended: release it and describe it as Dask expects."""
        self.abort()
        return CommClosedError(f"in {self}: {type(exc).__name__}: {exc}")

    async def read(self, deserializers: Any = None) -> Any:
        """Receive and deserialise one message."""
        endpoint = self._endpoint
        if endpoint is None:
            raise CommClosedError(f"in {self}: the comm is closed")
        try:
            frames = await read_frames(endpoint, host_array)
        except _COMM_ERRORS as exc:
            raise self._gone(exc) from exc
        except BaseException:
            self.abort()  # cancelled mid-message: the stream position is lost
            raise
        if frames is None:
            self.abort()
            raise CommClosedError(f"in {self}: the peer closed the connection")
        try:
            return await from_frames(  # type: ignore[no-untyped-call]
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError as exc:
            raise self._gone(exc) from exc

    async def write(self, msg: Any, serializers: Any = None, on_error: str | None = "message") -> int:
        """Serialise and send one message; return the bytes sent."""
        if self._endpoint is None:
            raise CommClosedError(f"in {self}: the comm is closed")
        frames = await to_frames(  # type: ignore[no-untyped-call]
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
            frame_split_size=self._shard_size,
        )
        # Frames of one message are several rdmaio messages: two writers must not interleave them.
        async with self._write_lock:
            endpoint = self._endpoint
            if endpoint is None:
                raise CommClosedError(f"in {self}: the comm is closed")
            try:
                return await write_frames(endpoint, frames, self._chunk_size)
            except _COMM_ERRORS as exc:
                raise self._gone(exc) from exc
            except BaseException:
                self.abort()
                raise

    async def close(self) -> None:
        """Close gracefully: queued data is sent, then the peer reads end of stream."""
        endpoint, self._endpoint = self._endpoint, None
        self._closed = True
        if endpoint is None:
            return
        self._finalizer.detach()
        try:
            await endpoint.aclose()
        except _COMM_ERRORS as exc:  # the peer went first; nothing is left to flush
            log.debug("rdmaio.dask: %s closed with %r", self, exc)
        except BaseException:
            endpoint.abort()
            raise

    def abort(self) -> None:
        """Close at once, dropping queued data."""
        endpoint, self._endpoint = self._endpoint, None
        self._closed = True
        if endpoint is not None:
            self._finalizer.detach()
            endpoint.abort()

    def closed(self) -> bool:
        """True once closed or aborted here, or once the peer has gone and nothing is left to read."""
        if self._closed:
            return True
        endpoint = self._endpoint
        return endpoint is None or endpoint.at_eof()


def _check_encryption(address: str, connection_args: dict[str, Any]) -> None:
    if connection_args.get("require_encryption"):
        raise RuntimeError(
            "encryption required by Dask configuration, refusing communication "
            f"from/to {PREFIX + address!r} (rdma:// is not encrypted)"
        )


class RDMAConnector(Connector):
    """Opens ``rdma://`` comms. Failures are ``OSError``s (``CommClosedError``), which Dask retries."""

    async def connect(self, address: str, deserialize: bool = True, **connection_args: Any) -> RDMAComm:
        """Connect to ``host:port`` (a loopback host stands for this machine's RDMA address)."""
        _check_encryption(address, connection_args)
        host, port = parse_host_port(address)
        try:
            endpoint = await rdmaio.connect(_listen_host(host), port, options=comm_options())
        except rdmaio.HandshakeError as exc:  # not an rdmaio peer: retrying cannot help
            raise FatalCommClosedError(f"{PREFIX}{address}: {exc}") from exc
        except OSError as exc:
            raise CommClosedError(f"cannot connect to {PREFIX}{address}: {exc}") from exc
        try:
            local = _address(endpoint.get_extra_info("sockname"))
        except BaseException:
            endpoint.abort()
            raise
        return RDMAComm(endpoint, local, PREFIX + address, deserialize)


class RDMAListener(BaseListener):
    """Accepts ``rdma://`` comms; each goes through Dask's handshake (``on_connection``) before the
    handler sees it. ``stop()`` stops listening; established comms stay open."""

    prefix = PREFIX

    def __init__(
        self,
        address: str,
        comm_handler: Callable[[Comm], Awaitable[None]],
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ) -> None:
        super().__init__()
        _check_encryption(address, connection_args)
        host, port = parse_host_port(address, default_port)
        self.ip = host
        self.port = port
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.server: rdmaio.StreamServer | None = None
        self._bound: tuple[str, int] | None = None

    async def start(self) -> None:
        """Start listening."""
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        self.server = await rdmaio.serve(
            self._on_endpoint, _listen_host(self.ip), self.port, backlog=backlog, options=comm_options()
        )
        self._bound = self.server.addresses[0]

    def stop(self) -> None:
        """Stop listening; comms already accepted are not affected."""
        server, self.server = self.server, None
        if server is not None:
            server.close()

    async def _on_endpoint(self, endpoint: rdmaio.Endpoint) -> None:
        if self.server is None:
            # Stopped after rdma_cm established it: abort_handshaking_comms() has run already, and a
            # client left waiting would hang in the handshake, which has no timeout.
            endpoint.abort()
            return
        try:
            local = _address(endpoint.get_extra_info("sockname"))
            peer = _address(endpoint.get_extra_info("peername"))
        except CommClosedError:
            endpoint.abort()
            return
        comm = RDMAComm(endpoint, local, peer, self.deserialize)
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            log.info("rdmaio.dask: connection from %s closed before the handshake completed", peer)
            return
        await self.comm_handler(comm)

    def get_host_port(self) -> tuple[str, int]:
        """The bound ``(host, port)``."""
        if self._bound is None:
            raise ValueError("invalid operation on a listener that was not started")
        return self._bound

    @property
    def listen_address(self) -> str:
        """``rdma://host:port`` as bound (the host may be a wildcard)."""
        return PREFIX + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        """``rdma://host:port`` that peers can connect to."""
        host, port = self.get_host_port()
        if is_wildcard(host):
            host = self.default_host or rdma_host()
        return PREFIX + unparse_host_port(host, port)


class RDMABackend(Backend):
    """The ``rdma`` scheme, registered through the entry point group ``distributed.comm.backends``."""

    def get_connector(self) -> RDMAConnector:
        """A connector for ``rdma://`` addresses."""
        return RDMAConnector()

    def get_listener(
        self,
        loc: str,
        handle_comm: Callable[[Comm], Awaitable[None]],
        deserialize: bool,
        **connection_args: Any,
    ) -> RDMAListener:
        """A listener on the scheme-less address ``loc``."""
        return RDMAListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        """The host part of ``loc``."""
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> tuple[str, int]:
        """``(host, port)`` of ``loc``."""
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        """``loc`` with its host name resolved to an IP address."""
        host, port = parse_host_port(loc)
        return unparse_host_port(str(ensure_ip(host)), port)

    def get_local_address_for(self, loc: str) -> str:
        """The local address (host only) from which ``loc`` is reached: the interface routing to it."""
        host = str(ensure_ip(parse_host_port(loc)[0]))
        local = str(get_ip(host))  # type: ignore[no-untyped-call]
        return unparse_host_port(_listen_host(local), None)
