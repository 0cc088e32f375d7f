"""A connected pair of real :class:`rdmaio.Endpoint` objects over a null device: no RDMA hardware, no wire.

:func:`null_pair` builds two real connections (the real :class:`~rdmaio.core.connection.Connection`,
sender, receiver, session and one-sided engine) on the shared fake verbs objects of
:mod:`rdmaio.testing.fakes`, wired back to back by the *null device*, which does what a NIC does and
nothing else:

* A chain of SENDs posted by one side lands in the peer's posted receive slots and completes there one loop
  iteration later (:func:`~rdmaio.testing.fakes.wire`); signalled sends complete on the sender then too.
* One-sided requests (RDMA READ and WRITE, fetch-and-add, compare-and-swap) are executed on real memory when
  they are posted (the remote address is a real address of the process: the peer exported it). A serial
  call's request (the core posts it through the connection's serial port) completes *at its post*, as rxe
  completes a loopback READ inside ``ibv_post_send``, when ``onesided_at_post`` is True (the default);
  otherwise, and for every request posted without a poll (doorbells, ``fetch_add_many`` waves), its
  completion arrives one loop iteration later through the connection's completion handler.
* A ``disconnect()`` reaches the peer as a DISCONNECTED event one loop iteration later.

:func:`null_connect` (and :class:`NullListener`, for many connections in turn) makes the pair through
the server's real accept path instead: the :class:`~rdmaio.core.acceptor.Acceptor` admits a connect
request carrying the client's handshake, creates the transport, accepts with its own handshake and starts
the connection on ESTABLISHED; the client decodes that handshake, picks its session and starts its
connection as :func:`~rdmaio.core.dial.dial` does once ESTABLISHED arrives. Not modelled: address and
route resolution, the rdma_cm event channel and the reactor's event dispatch (the events are handed to
the acceptor's handlers directly), ``dial()`` itself and the real verbs resources.

What is fake: the verbs resources (:class:`~rdmaio.testing.fakes.FakeTransport`), memory registration
(:class:`~rdmaio.testing.fakes.FakeRegion`: real addresses, made-up keys), no memory windows (export with
``scope="domain"``), no rendezvous (``rndv_threshold`` is 0), no keepalive. The one-sided engine is the
real one, wired by :meth:`OneSidedEngine.for_connection <rdmaio.core.onesided.OneSidedEngine.for_connection>`
as for any connection (on its first use, as there). To get there without a device, two module globals are
replaced while they are used and restored right after: ``rdmaio.core.onesided``'s registrar factories while
a connection's engine is built, and ``rdmaio.core.acceptor``'s ``Transport`` and ``rd_atomic_depth`` while a
request is accepted.

:class:`DeviceMeter` measures what the null device itself costs (thread CPU time inside it, exclusive of
the rdmaio code it calls back), so that a benchmark (``python -m bench --overhead``) can take it off.

Use it inside a running event loop (asyncio or uvloop). It touches the fakes only through their public
interface.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from rdmaio import verbs
from rdmaio._ffi import ffi, lib
from rdmaio.core import acceptor as acceptor_module
from rdmaio.core import onesided as onesided_module
from rdmaio.core.acceptor import Acceptor
from rdmaio.core.connection import Connection
from rdmaio.core.negotiation import local_handshake
from rdmaio.core.shared_receive import new_session
from rdmaio.endpoint import Endpoint
from rdmaio.options import Options
from rdmaio.protocol import Handshake, Session
from rdmaio.testing import fakes as fakes_module
from rdmaio.testing.fakes import (
    FakeCMId,
    FakeReactor,
    FakeRegion,
    FakeRegistration,
    FakeTransport,
    fake_completion,
    wire,
)
from rdmaio.verbs import CMEventType
from rdmaio.verbs.device import OneSidedCaps

__all__ = ["NULL_OPTIONS", "DeviceMeter", "NullDevice", "NullListener", "null_connect", "null_pair"]

#: Options of the pairs made here by default: 4 KiB slots, 8 deep, no keepalive, no rendezvous.
NULL_OPTIONS = Options(
    slot_size=4096,
    recv_depth=8,
    send_depth=8,
    initial_depth=8,
    batch_limit=1024,
    keepalive_interval=None,
    rndv_threshold=0,
)

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")

_WR_READ = int(lib.IBV_WR_RDMA_READ)
_WR_WRITE = int(lib.IBV_WR_RDMA_WRITE)
_WR_FADD = int(lib.IBV_WR_ATOMIC_FETCH_AND_ADD)
_WR_CSWAP = int(lib.IBV_WR_ATOMIC_CMP_AND_SWP)
_WC_OPCODE = {
    _WR_READ: int(lib.IBV_WC_RDMA_READ),
    _WR_WRITE: int(lib.IBV_WC_RDMA_WRITE),
    _WR_FADD: int(lib.IBV_WC_FETCH_ADD),
    _WR_CSWAP: int(lib.IBV_WC_COMP_SWAP),
}
_SIGNALED = int(lib.IBV_SEND_SIGNALED)
_DEVICE_HANDLE = 0x4E55  # 'NU'
_MASK64 = (1 << 64) - 1

#: The methods by which the core calls into a queue pair and a transport (wrapped when metered).
_QP_CALLS = ("post_sends", "post_rdma", "post_batch", "post_empty_write", "post_empty_read")
_TRANSPORT_CALLS = ("post_receives", "grow_receives", "poll_completions", "close")


class DeviceMeter:
    """Thread CPU time spent inside the null device (:func:`time.thread_time`), exclusive of the rdmaio
    code the device calls back (completion handlers, the peer's DISCONNECTED).

    :meth:`device` wraps a way into the device (a post, a delivery the loop runs), :meth:`callback` a way
    out of it back into rdmaio. Each crossing costs the meter a clock read; :meth:`calibrate` measures what
    an empty crossing leaves inside the device's brackets, and :attr:`corrected` takes that off.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        """Raw device time measured so far."""
        self.entries = 0
        """Times the device was entered from outside."""
        self.callbacks = 0
        """Times the device called back into rdmaio."""
        self.entry_cost = 0.0
        """Device seconds an empty entry leaves (:meth:`calibrate`)."""
        self.callback_cost = 0.0
        """Device seconds an empty callback leaves (:meth:`calibrate`)."""
        self._inside = False
        self._since = 0.0

    def reset(self) -> None:
        """Start counting from zero (calibration kept)."""
        self.seconds = 0.0
        self.entries = self.callbacks = 0

    @property
    def corrected(self) -> float:
        """Device seconds, without what the meter's own crossings left inside them."""
        return max(0.0, self.seconds - self.entries * self.entry_cost - self.callbacks * self.callback_cost)

    def device(self, fn: _F) -> _F:
        """``fn`` (a way into the device), its time counted as the device's."""

        @functools.wraps(fn)
        def enter(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return fn(*args, **kwargs)
            self.entries += 1
            self._inside = True
            self._since = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - self._since
                self._inside = False

        return enter  # type: ignore[return-value]

    def callback(self, fn: _F) -> _F:
        """``fn`` (rdmaio code the device calls), its time not counted as the device's."""

        @functools.wraps(fn)
        def leave(*args: Any, **kwargs: Any) -> Any:
            if not self._inside:
                return fn(*args, **kwargs)
            self.callbacks += 1
            self.seconds += time.thread_time() - self._since
            self._inside = False
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = True
                self._since = time.thread_time()

        return leave  # type: ignore[return-value]

    def calibrate(self, rounds: int = 20000) -> None:
        """Measure the device time an empty entry and an empty callback leave (minimum of 5 runs)."""

        def nothing() -> None:
            return None

        empty_entry = self.device(nothing)
        inner = self.callback(nothing)
        entry_with_callback = self.device(inner)
        entry_costs, callback_costs = [], []
        for _ in range(5):
            self.reset()
            for _ in range(rounds):
                empty_entry()
            entry_costs.append(self.seconds / rounds)
            self.reset()
            for _ in range(rounds):
                entry_with_callback()
            callback_costs.append(self.seconds / rounds)
        self.entry_cost = min(entry_costs)
        self.callback_cost = max(0.0, min(callback_costs) - self.entry_cost)
        self.reset()


@dataclasses.dataclass
class _Side:
    """One transport of the device: the fake's own post of one-sided requests (it records them)."""

    transport: FakeTransport
    raw_post_rdma: Callable[[int], None]


class NullDevice:
    """The null device under one pair: executes one-sided requests on real memory and completes them (see
    the module docstring). ``onesided_at_post`` chooses when a serial call's request completes;
    ``meter``: a :class:`DeviceMeter` that every way into and out of the device goes through."""

    def __init__(self, *, onesided_at_post: bool = True, meter: DeviceMeter | None = None) -> None:
        self.onesided_at_post = onesided_at_post
        self.meter = meter
        self.executed = 0
        """One-sided requests executed."""
        self._sides: dict[int, _Side] = {}  # by id() of the transport, until start()

    # --- building --------------------------------------------------------------------------------------

    def _device(self, fn: _F) -> _F:
        return fn if self.meter is None else self.meter.device(fn)

    def _callback(self, fn: _F) -> _F:
        return fn if self.meter is None else self.meter.callback(fn)

    def transport(self, qp_num: int, tag: int, options: Options, initial: int | None = None) -> FakeTransport:
        """A transport of this device (a :class:`~rdmaio.testing.fakes.FakeTransport` whose queue pair
        carries one-sided requests here); its making is the device's time when metered."""
        return self._device(self._make_transport)(qp_num, tag, options, initial)

    def _make_transport(self, qp_num: int, tag: int, options: Options, initial: int | None) -> FakeTransport:
        depth = options.recv_depth if initial is None else initial
        transport = FakeTransport(qp_num, tag, slot_size=options.slot_size, depth=depth)
        caps = OneSidedCaps("HCA", 16, 16, max_mw=0, mw_type1=False, mw_type2=False)
        # The fakes' device name; a handle of its own, so the process-wide capability cache keeps these
        # capabilities apart from other fake devices'.
        transport.device = SimpleNamespace(
            name=transport.device.name,
            handle=_DEVICE_HANDLE,
            query_onesided_caps=lambda: caps,
            capabilities=transport.device.capabilities,  # the framing negotiation's (immediate data)
        )
        qp = transport.qp
        transport.domain = SimpleNamespace(registrations=_RegistrationCache())
        side = _Side(transport, qp.post_rdma)
        self._sides[id(transport)] = side
        qp.post_rdma = functools.partial(self._post_rdma, side)  # type: ignore[method-assign]
        qp.post_batch = functools.partial(self._post_batch, side)  # type: ignore[method-assign]
        # Serial one-sided requests go through the connection's port (post and poll in one C call): the
        # device answers the port's call.
        setattr(transport, "onesided_port", functools.partial(self._serial_port, side))  # noqa: B010
        if self.meter is not None:
            for name in _QP_CALLS:
                if hasattr(qp, name):
                    setattr(qp, name, self.meter.device(getattr(qp, name)))
            for name in _TRANSPORT_CALLS:
                setattr(transport, name, self.meter.device(getattr(transport, name)))
            set_handler = transport.set_completion_handler
            meter = self.meter

            def set_completion_handler(handler: Callable[[Any, int, int], None]) -> None:
                set_handler(meter.callback(handler))

            transport.set_completion_handler = set_completion_handler  # type: ignore[method-assign]
        return transport

    def connect_wires(self, a: FakeTransport, b: FakeTransport) -> None:
        """Make each transport's sends land in the other's receive slots."""
        a.qp.wire = self._device(wire(a, b))
        b.qp.wire = self._device(wire(b, a))

    def start(self, conn: Connection) -> Endpoint:
        """The Endpoint of ``conn``, a connection on one of this device's transports."""
        del self._sides[id(conn.transport)]
        _build_with_fake_registrars(conn)
        return Endpoint(conn)

    def link_disconnects(self, reactor: FakeReactor, a: FakeCMId, b: FakeCMId) -> None:
        """A disconnect of either id (of two connections registered with ``reactor``) reaches the other's
        connection as DISCONNECTED one loop iteration later."""
        event: Any = SimpleNamespace(event=CMEventType.DISCONNECTED)
        for ours, theirs in ((a, b), (b, a)):
            handler = functools.partial(reactor.cm_handlers[theirs], event)
            ours.on_disconnect = self._device(self._callback(handler))

    # --- one-sided requests ----------------------------------------------------------------------------

    def _execute(self, side: _Side) -> list[tuple[int, int]]:
        """Carry out what was posted on ``side``'s queue pair; (wr_id, completion opcode) of its signalled
        requests."""
        qp: Any = side.transport.qp
        signalled = []
        for wr in qp.posted:
            opcode, length = wr["opcode"], wr["length"]
            local, remote = wr["local_addr"], wr["remote_addr"]
            if opcode == _WR_READ:
                ffi.memmove(ffi.cast("void *", local), ffi.cast("void *", remote), length)
            elif opcode == _WR_WRITE:
                ffi.memmove(ffi.cast("void *", remote), ffi.cast("void *", local), length)
            elif opcode in (_WR_FADD, _WR_CSWAP):
                target = ffi.cast("uint64_t *", remote)
                old = int(target[0])
                ffi.cast("uint64_t *", local)[0] = old
                if opcode == _WR_FADD:
                    target[0] = (old + wr["compare_add"]) & _MASK64
                elif old == wr["compare_add"]:
                    target[0] = wr["swap"]
            else:
                raise AssertionError(f"the null device carries no one-sided opcode {opcode}")
            self.executed += 1
            if wr["send_flags"] & _SIGNALED:
                signalled.append((wr["wr_id"], _WC_OPCODE[opcode]))
        qp.posted.clear()
        qp.calls.clear()
        return signalled

    def _complete_later(self, side: _Side, done: list[tuple[int, int]]) -> None:
        if done:
            asyncio.get_running_loop().call_soon(self._device(self._deliver), side, done)

    def _deliver(self, side: _Side, done: list[tuple[int, int]]) -> None:
        transport = side.transport
        if transport.closed or transport.handler is None:
            return
        records = [fake_completion(wr_id, opcode) for wr_id, opcode in done]
        transport.handler(records, 0, len(records))

    def _post_rdma(self, side: _Side, count: int) -> None:
        side.raw_post_rdma(count)
        self._complete_later(side, self._execute(side))

    def _post_batch(self, side: _Side, *args: Any, **kwargs: Any) -> None:
        qp: Any = side.transport.qp
        type(qp).post_batch(qp, *args, **kwargs)
        self._complete_later(side, self._execute(side))

    def _serial_port(self, side: _Side, wr_base: int) -> Any:
        """The fakes' serial port (``FakeSerialPort``) of ``side``'s queue pair, answered by this device."""
        port = getattr(fakes_module, "FakeSerialPort")(side.transport.qp)  # noqa: B009 (newer fakes only)
        port.wr_base = wr_base
        port.at_post = functools.partial(self._port_outcome, side)
        if self.meter is not None:
            for name in ("post_poll", "post_batch_poll", "after_poll", "poll"):
                setattr(port, name, self.meter.device(getattr(port, name)))
        return port

    def _port_outcome(self, side: _Side, request: dict[str, int]) -> int:
        """What the port's poll finds after ``request`` (the last one the port recorded) was posted."""
        done = self._execute(side)
        if self.onesided_at_post and len(done) == 1 and done[0][0] == request["wr_id"]:
            return int(getattr(verbs, "POSTED_DONE"))  # noqa: B009 (newer verbs only)
        self._complete_later(side, done)
        return int(getattr(verbs, "POSTED"))  # noqa: B009


class _RegistrationCache:
    """The Domain's registration cache, for ``rdma_read_into``'s caller buffers: a fresh fake registration
    each time."""

    def get(self, view: Any, access: int) -> FakeRegistration:
        return FakeRegistration(view)


def _local_and_grant_registrars(pd: Any) -> tuple[Callable[[Any], Any], Callable[[memoryview, int], Any]]:
    def register_grant(view: memoryview, bits: int) -> FakeRegion:
        return FakeRegion(view, bits)

    return FakeRegion, register_grant


def _bindable_registrar(pd: Any) -> Callable[[memoryview, bool], Any]:
    def register_bindable(view: memoryview, readonly: bool) -> FakeRegion:
        return FakeRegion(view, access=-1, readonly=readonly)  # -1: MW_BIND only, no remote flags

    return register_bindable


#: What the one-sided engine's wiring (OneSidedEngine.for_connection) registers memory with, while a
#: connection of the null device is made: fake registrations (real addresses) instead of the device's.
_FAKE_REGISTRARS = {
    "local_and_grant_registrars": _local_and_grant_registrars,
    "bindable_registrar": _bindable_registrar,
}


def _with(module: Any, replacements: dict[str, Any], fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with the names of ``replacements`` replaced in ``module`` meanwhile (each must exist
    there: a renamed one fails loudly instead of being added unused)."""
    saved = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        return fn(*args)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _build_with_fake_registrars(conn: Connection) -> None:
    """Build ``conn``'s one-sided engine (on its first use) with the fake registrars: its own
    ``_build_onesided``, replaced on this connection only (weakly: no reference cycle)."""
    build = Connection._build_onesided
    ref = weakref.ref(conn)

    def build_with_fakes() -> Any:
        return _with(onesided_module, _FAKE_REGISTRARS, build, ref())

    conn._build_onesided = build_with_fakes  # type: ignore[method-assign]


def _connection(reactor: Any, cm_id: Any, transport: Any, session: Session, options: Options) -> Connection:
    """A real Connection on a null device's transport (its one-sided engine wired as usual)."""
    return _with(onesided_module, _FAKE_REGISTRARS, Connection, reactor, cm_id, transport, session, options)


def _null_options(options: Options | None, keepalive: bool = False) -> Options:
    # Rendezvous needs memory windows and keepalive a probe the fake queue pair refuses unless allowed:
    # neither is carried by default.
    options = options or NULL_OPTIONS
    return dataclasses.replace(
        options, rndv_threshold=0, keepalive_interval=options.keepalive_interval if keepalive else None
    )


def null_pair(
    options: Options | None = None,
    handshake: Handshake | None = None,
    *,
    onesided_at_post: bool = True,
    meter: DeviceMeter | None = None,
    keepalive: bool = False,
) -> tuple[Endpoint, Endpoint, NullDevice]:
    """Two connected Endpoints over a new :class:`NullDevice` and the device (call inside a running loop).

    ``options`` (default :data:`NULL_OPTIONS`; rendezvous and keepalive are turned off) apply to both
    sides; ``handshake`` is what each side announces and reads from the other (default: the local
    handshake of ``options``, without a growing window). ``keepalive``: keep ``options.keepalive_interval``
    and let the queue pairs take probes (recorded in ``empty_writes`` / ``empty_reads``, never completed:
    a peer that stopped answering)."""
    options = _null_options(options, keepalive)
    hs = handshake or local_handshake(options, grow=False)
    device = NullDevice(onesided_at_post=onesided_at_post, meter=meter)
    transports = [device.transport(10, 1, options), device.transport(11, 2, options)]
    device.connect_wires(*transports)
    for transport in transports:
        transport.qp.allow_empty_writes = keepalive
    ids = [FakeCMId(local_address=("198.18.0.1", 2)), FakeCMId(local_address=("198.18.0.2", 2))]
    reactor: Any = FakeReactor()
    # The session as connection setup picks it (new_session), each side reading its own handshake back.
    sessions = [new_session(hs, hs, transport) for transport in transports]
    a, b = (device.start(_connection(reactor, ids[i], transports[i], sessions[i], options)) for i in (0, 1))
    device.link_disconnects(reactor, ids[0], ids[1])
    return a, b, device


class _AcceptingId(FakeCMId):
    """The server's id of a connect request: keeps the handshake it accepts with (the client reads it)."""

    private_data = b""

    def accept(self, private_data: bytes, **params: int) -> None:
        """Accept, keeping ``private_data``."""
        super().accept(private_data, **params)
        self.private_data = private_data


class _NullReactor(FakeReactor):
    def adopt_id(self, event: Any, handler: Callable[[Any], None]) -> FakeCMId:
        adopted = super().adopt_id(event, handler)
        cm_id = _AcceptingId(adopted.handle, peer_address=adopted.peer_address)
        return cm_id


def _rd_atomic_depth(device: Any, wanted: int) -> int:
    return min(wanted, 16)  # the null device's max_qp_rd_atom


class NullListener:
    """A server's accept path on a null device: one real :class:`~rdmaio.core.acceptor.Acceptor` (made once,
    as a server makes it), and a client side that connects to it; each :meth:`connect` sets up one
    connection (see :func:`null_connect`)."""

    def __init__(self, device: NullDevice, options: Options | None = None) -> None:
        self.device = device
        self.options = _null_options(options)
        reactor: Any = _NullReactor()
        self.reactor = reactor
        """The reactor both sides register with (a :class:`~rdmaio.testing.fakes.FakeReactor`)."""
        self._started: list[Connection] = []
        self.acceptor = Acceptor(
            reactor,
            self.options,
            16,
            queued=(),
            on_connection=self._started.append,
            on_device_removal=lambda: None,
            on_timed_out=lambda: None,
        )
        # listen() needs a real cm id: each request is handed to the acceptor as its event instead
        self.acceptor.listening = True
        self._handles = itertools.count(1)

    async def connect(self) -> tuple[Endpoint, Endpoint]:
        """Set up one connection: (client, server) Endpoints."""
        device, options, reactor = self.device, self.options, self.reactor
        client_hs = local_handshake(options)
        client_transport = device.transport(10, 1, options, client_hs.initial_depth)
        handle = next(self._handles)
        request = SimpleNamespace(
            event=CMEventType.CONNECT_REQUEST,
            id_handle=handle,
            source="198.18.0.1",
            private_data=client_hs.encode(),
            responder_resources=16,
            initiator_depth=16,
        )
        made: list[FakeTransport] = []

        def transport(
            reactor: Any, cm_id: Any, options: Options, initial: int | None = None
        ) -> FakeTransport:
            made.append(device.transport(11, 2, options, initial))
            made[-1].cm_id = cm_id
            return made[-1]

        # The acceptor's verbs constructors are the null device's for this request (the reactor hands a
        # request to the listener's handler as below).
        verbs_calls = {"Transport": transport, "rd_atomic_depth": _rd_atomic_depth}
        _with(acceptor_module, verbs_calls, self.acceptor._on_listener_event, request)
        if not made:
            raise ConnectionRefusedError("the acceptor refused the connect request")
        server_transport = made[0]
        device.connect_wires(client_transport, server_transport)
        server_id: Any = server_transport.cm_id
        await asyncio.sleep(0)  # the ESTABLISHED event comes on a later loop iteration
        established = SimpleNamespace(event=CMEventType.ESTABLISHED, id_handle=handle)
        _with(onesided_module, _FAKE_REGISTRARS, reactor.handlers.pop(handle), established)
        client_id = FakeCMId(handle, local_address=("198.18.0.1", 2), peer_address=("198.18.0.2", 1))
        peer = Handshake.decode(server_id.private_data)
        session = new_session(client_hs, peer, client_transport)
        a = device.start(_connection(reactor, client_id, client_transport, session, options))
        b = device.start(self._started.pop())
        device.link_disconnects(reactor, client_id, server_id)
        return a, b

    def forget_closed(self) -> None:
        """Drop the reactor's records of connections that are closed (its handlers by id would keep them
        alive): call between connections when many are set up in turn."""
        reactor = self.reactor
        for cm_id in [cm_id for cm_id in reactor.cm_handlers if cm_id in reactor.released]:
            del reactor.cm_handlers[cm_id]
        reactor.released.clear()


async def null_connect(
    options: Options | None = None, *, onesided_at_post: bool = True, meter: DeviceMeter | None = None
) -> tuple[Endpoint, Endpoint, NullDevice]:
    """Like :func:`null_pair`, but through connection setup (a :class:`NullListener` of its own): the
    server's real :class:`~rdmaio.core.acceptor.Acceptor` admits a connect request with the client's
    handshake (:func:`~rdmaio.core.negotiation.local_handshake`), makes its transport, accepts with its
    handshake, and starts its Connection on ESTABLISHED; the client decodes that handshake, picks its
    session (:func:`~rdmaio.core.shared_receive.new_session`) and starts its Connection. Returns (client,
    server, device)."""
    device = NullDevice(onesided_at_post=onesided_at_post, meter=meter)
    a, b = await NullListener(device, options).connect()
    return a, b, device
