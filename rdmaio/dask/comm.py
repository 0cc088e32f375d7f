"""The ``rdma://`` comm backend of ``distributed``: Comm, Connector, Listener and Backend over rdmaio.

One Dask comm is one rdmaio connection (one reliable-connected queue pair). Messages are serialised with
``distributed.comm.utils.to_frames``/``from_frames`` (which honour ``distributed.comm.offload``; frames are
split at ``distributed.comm.shard``) and moved with :mod:`rdmaio.dask.framing`.

``write()`` hands its message to the comm's :class:`SendQueue` and returns, as distributed's TCP comm
appends its frames to tornado's write buffer and returns: a large frame goes by rendezvous, whose
``send()`` returns only once the peer has pulled it, so a write that waited for it would need the peer
to be inside ``read()`` at the same moment (two peers that both write before they read would wait for
each other). The queue sends in order in a background task; a failure aborts the comm and is raised
by the next ``write()`` (or ``close()``).
"""

from __future__ import annotations

import asyncio
import collections
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
from rdmaio.dask.config import PREFIX as CONFIG_PREFIX
from rdmaio.dask.config import byte_size
from rdmaio.dask.framing import (
    DEFAULT_CHUNK_SIZE,
    FrameLimits,
    FramingError,
    OutgoingMessage,
    encode_message,
    read_frames,
)

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener", "SendQueue", "frame_limits"]

log = logging.getLogger("rdmaio.dask")

PREFIX = "rdma://"
_EXTRA_KEYS = ("device", "port", "qp_num", "mtu", "max_inline", "peer_max_message_size")
# Errors of the data path that mean "this comm is gone" (rdmaio's errors are OSErrors or RdmaErrors);
# a MemoryError is a frame we could not allocate: the stream position is lost with it.
_COMM_ERRORS = (rdmaio.RdmaError, OSError, FramingError, EOFError, MemoryError)


def comm_options() -> rdmaio.Options:
    """rdmaio options for Dask comms: ``distributed.comm.rdma.options`` (a dict of Options fields)."""
    overrides = dict(dask.config.get("distributed.comm.rdma.options", None) or {})
    return rdmaio.Options.coerce(overrides)


def chunk_size(peer_max_message_size: int | None = None) -> int:
    """Largest rdmaio message a frame is cut into: ``distributed.comm.rdma.chunk-size``, and never more
    than the peer accepts (its ``max_message_size``, from ``Endpoint.get_extra_info``)."""
    size = (
        byte_size("chunk-size") if dask.config.get(CONFIG_PREFIX + "chunk-size", None) else DEFAULT_CHUNK_SIZE
    )
    return min(size, peer_max_message_size) if peer_max_message_size else size


def frame_limits() -> FrameLimits:
    """What a peer may declare in one message: ``distributed.comm.rdma.max-frame-size`` and
    ``max-message-size``, checked before the comm allocates anything for it."""
    return FrameLimits(
        max_frame_size=byte_size("max-frame-size"),
        max_message_size=byte_size("max-message-size"),
        frame_size_name=CONFIG_PREFIX + "max-frame-size",
        message_size_name=CONFIG_PREFIX + "max-message-size",
    )


class SendQueue:
    """The messages a comm's ``write()`` accepted, sent in order to the endpoint by one background task.

    A message is referenced, not copied (its frames are the caller's objects, as in tornado's write
    buffer), until its last piece was handed to rdmaio (for a rendezvous piece: pulled by the peer).
    ``put()`` waits while more than ``limit`` bytes are queued, unless the queue is empty, so one
    message of any size is accepted and a writer that outpaces its peer is held back. The first failure
    aborts the endpoint (part of a message may have gone), drops the queue and is kept in ``error``.
    The task exists only while something is queued.
    """

    def __init__(self, endpoint: rdmaio.Endpoint, chunk_size: int, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the write queue limit must be positive, not {limit}")
        self._endpoint = endpoint
        self._chunk_size = chunk_size
        self.limit = limit
        self._messages: collections.deque[OutgoingMessage] = collections.deque()
        self.queued_bytes = 0
        """Bytes of the messages accepted and not completely sent (the one being sent included)."""
        self.pieces_sent = 0
        """rdmaio messages (headers and frame chunks) sent so far: the queue's progress."""
        self.error: BaseException | None = None
        """Why sending stopped (the queue accepts nothing once it is set)."""
        self.dropped = 0
        """Messages accepted and never completely sent (dropped by a failure or by ``abort()``)."""
        self._task: asyncio.Task[None] | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._room = asyncio.Lock()  # writers waiting for room are served in arrival order

    def __len__(self) -> int:
        return len(self._messages)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _changed(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def put(self, message: OutgoingMessage) -> None:
        """Queue ``message`` for sending, waiting for room first (see the class docstring).

        Raises ``error`` once sending failed. A cancelled call queues nothing.
        """
        async with self._room:
            while (
                self.error is None and self.queued_bytes and self.queued_bytes + message.nbytes > self.limit
            ):
                await self._changed()
            if self.error is not None:
                raise self.error
            self._messages.append(message)
            self.queued_bytes += message.nbytes
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._messages:
                message = self._messages[0]
                for piece in message.pieces(self._chunk_size):
                    await self._endpoint.send(piece)
                    self.pieces_sent += 1
                    self._wake()
                self._messages.popleft()
                self.queued_bytes -= message.nbytes
                self._wake()
        except BaseException as exc:  # cancelled by abort(), or the connection failed
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._task = None
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.dropped += len(self._messages)
        self._messages.clear()
        self.queued_bytes = 0
        self._endpoint.abort()
        self._wake()

    async def flush(self, stall_timeout: float) -> None:
        """Wait until everything queued is sent or sending failed.

        Raises ``TimeoutError`` when no piece was sent for ``stall_timeout`` seconds (a peer that does
        not read): a large queue may take long, but only while it moves.
        """
        while self._task is not None and self.error is None:
            before = self.pieces_sent
            try:
                await asyncio.wait_for(self._changed(), stall_timeout)
            except TimeoutError:
                if self.pieces_sent == before:
                    raise

    def abort(self, exc: BaseException) -> None:
        """Drop the queue and stop the task; ``exc`` becomes ``error`` unless sending failed before."""
        task = self._task
        self._fail(exc)
        if task is not None:
            task.cancel()


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
    (its ``__cause__`` is rdmaio's error), and ``read()`` raises it, closing the comm, when the peer
    declares more than ``distributed.comm.rdma.max-frame-size``/``max-message-size`` (checked before
    anything is allocated), sends a malformed header, or a frame cannot be allocated. A ``read()``
    interrupted by cancellation aborts the comm, since part of a message may have been consumed.

    ``write()`` returns once its message is queued (see :class:`SendQueue`): the message's frames are
    referenced until sent, so they must not be modified after ``write()`` (as with distributed's TCP
    comm). A failure of the background send aborts the comm and is raised by the next ``write()`` or by
    ``close()``. ``close()`` sends what is queued first.
    """

    def __init__(
        self, endpoint: rdmaio.Endpoint, local_addr: str, peer_addr: str, deserialize: bool = True
    ) -> None:
        self._closed = False  # read by repr(), which Comm.__init__ may use
        super().__init__(deserialize=deserialize)
        self._endpoint: rdmaio.Endpoint | None = endpoint
        self._local_addr = local_addr  # distributed.comm.core.connect() reads these two
        self._peer_addr = peer_addr
        self._limits = frame_limits()
        self._shard_size = int(parse_bytes(dask.config.get("distributed.comm.shard")))
        self._send_queue = SendQueue(
            endpoint,
            chunk_size(endpoint.get_extra_info("peer_max_message_size")),
            byte_size("write-queue-limit"),
        )
        self._send_error_reported = False
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

    @property
    def limits(self) -> FrameLimits:
        """What the peer may declare in one message (read from the config when the comm was made)."""
        return self._limits

    def write_queue_statistics(self) -> dict[str, int]:
        """The write queue: ``messages`` and ``bytes`` accepted by ``write()`` and not yet sent, its
        ``limit`` (``distributed.comm.rdma.write-queue-limit``) and ``pieces_sent`` (rdmaio messages)."""
        queue = self._send_queue
        return {
            "messages": len(queue),
            "bytes": queue.queued_bytes,
            "limit": queue.limit,
            "pieces_sent": queue.pieces_sent,
        }

    def _gone(self, exc: BaseException) -> CommClosedError:
        """The connection failed or ended: release it and describe it as Dask expects."""
        self.abort()
        return CommClosedError(f"in {self}: {type(exc).__name__}: {exc}")

    def _send_failure(self) -> CommClosedError | None:
        """The background send's failure, as ``CommClosedError``, the first time it is asked for."""
        error = self._send_queue.error
        if error is None or self._send_error_reported or not self._send_queue.dropped:
            return None
        self._send_error_reported = True
        closed = CommClosedError(f"in {self}: a queued message was not sent: {type(error).__name__}: {error}")
        closed.__cause__ = error
        return closed

    async def read(self, deserializers: Any = None) -> Any:
        """Receive and deserialise one message."""
        endpoint = self._endpoint
        if endpoint is None:
            raise CommClosedError(f"in {self}: the comm is closed")
        try:
            frames = await read_frames(endpoint, host_array, self._limits)
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
        """Serialise one message and queue it for sending; return its bytes on the wire.

        Returns once the message is queued (waiting only while more than ``write-queue-limit`` bytes
        are), not once the peer has it. A cancelled call queues nothing and leaves the comm usable.
        """
        if self._endpoint is None:
            raise self._send_failure() or CommClosedError(f"in {self}: the comm is closed")
        frames = await to_frames(  # type: ignore[no-untyped-call]
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
            frame_split_size=self._shard_size,
        )
        message = encode_message(frames)
        if self._endpoint is None:
            raise self._send_failure() or CommClosedError(f"in {self}: the comm is closed")
        try:
            await self._send_queue.put(message)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            failure = self._send_failure()
            self.abort()
            raise (failure or CommClosedError(f"in {self}: {type(exc).__name__}: {exc}")) from exc
        return message.nbytes

    async def close(self) -> None:
        """Close gracefully: the queued messages are sent, then the peer reads end of stream.

        Waits for the queue while it makes progress; when nothing is sent for the endpoint's
        ``close_timeout`` (a peer that does not read), the comm is aborted instead. Raises
        ``CommClosedError`` if a message accepted by ``write()`` was not sent and no ``write()`` said so.
        """
        endpoint, self._endpoint = self._endpoint, None
        self._closed = True
        if endpoint is None:
            failure = self._send_failure()
            if failure is not None:
                raise failure
            return
        self._finalizer.detach()
        try:
            await self._send_queue.flush(endpoint.options.close_timeout)
            await endpoint.aclose()
        except TimeoutError:
            log.info(
                "rdmaio.dask: %s: the peer took nothing for %s s; aborting",
                self,
                endpoint.options.close_timeout,
            )
            self._send_queue.abort(
                CommClosedError(f"in {self}: closed before the peer read the queued messages")
            )
            endpoint.abort()
        except _COMM_ERRORS as exc:  # the peer went first; nothing is left to flush
            log.debug("rdmaio.dask: %s closed with %r", self, exc)
        except BaseException:
            self._send_queue.abort(CommClosedError(f"in {self}: close() was interrupted"))
            endpoint.abort()
            raise
        failure = self._send_failure()
        if failure is not None:
            raise failure

    def abort(self) -> None:
        """Close at once, dropping queued data."""
        endpoint, self._endpoint = self._endpoint, None
        self._closed = True
        if endpoint is not None:
            self._finalizer.detach()
            self._send_error_reported = True  # dropping the queue is what abort() means
            self._send_queue.abort(CommClosedError(f"in {self}: the comm was aborted"))
            endpoint.abort()

    def closed(self) -> bool:
        """True once closed or aborted here, once a queued message could not be sent, or once the peer
        has gone and nothing is left to read."""
        if self._closed or self._send_queue.error is not None:
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
            return RDMAComm(endpoint, local, PREFIX + address, deserialize)
        except BaseException:  # including a bad distributed.comm.rdma.* setting: no connection is left open
            endpoint.abort()
            raise


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
        try:
            comm = RDMAComm(endpoint, local, peer, self.deserialize)
        except BaseException:  # a bad distributed.comm.rdma.* setting: no connection is left open
            endpoint.abort()
            raise
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
