"""The close state of one connection (sans-IO): :class:`CloseState`, an object its
:class:`~rdmaio.protocol.session.Session` holds, and the tables it answers from.

As in h11 (a connection holds its state as an object, with the rules as tables in ``_state.py``), the
rules are data: the connection's condition is a set of facts (``aborted``, ``local_closed``,
``eof_requested``, ``peer_eof``, ``transport_lost``, ``torn_down``), each set by one event
(:meth:`CloseState.close`, :meth:`~CloseState.write_eof`, :meth:`~CloseState.abort`,
:meth:`~CloseState.on_disconnected`, :meth:`~CloseState.on_transport_error`,
:meth:`~CloseState.mark_closed`, :meth:`~CloseState.on_peer_eof`), and each question the I/O layer asks
(the :class:`State`, what a send, a drain or a read must raise) is answered by the first row of its table
whose fact holds. The order of the rows is the priority of the causes: an abort wins over everything, a
local close over a lost transport, the peer's EOF over a later disconnect.

The close state knows nothing of frames or credits; the Session tells it the events and copies the one
fact its per-frame path reads (:attr:`CloseState.wire_down`) into a plain attribute of its own.
"""

from __future__ import annotations

import enum
import weakref
from typing import Final, Protocol

from rdmaio.errors import ConnectionAbortedError, ConnectionResetError, EndpointClosedError

__all__ = ["EOF", "CloseState", "ClosingWatcher", "EOFType", "State"]


class EOFType(enum.Enum):
    """Type of the :data:`EOF` sentinel returned by :meth:`Session.recv_outcome`."""

    EOF = "EOF"

    def __repr__(self) -> str:
        return "EOF"


EOF: Final = EOFType.EOF
"""Clean end of stream: the peer sent an EOF frame."""


class State(enum.Enum):
    """Life cycle of a connection as seen by this side."""

    OPEN = "open"  # transport up, not closed locally (half-close is tracked separately)
    CLOSING = "closing"  # close() called; the I/O layer flushes and tears down
    DISCONNECTED = "disconnected"  # transport gone (peer disconnect or transport error), not closed locally
    ABORTED = "aborted"  # abort() called or the peer violated the protocol
    CLOSED = "closed"  # the I/O layer finished teardown (mark_closed())


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _chained(err: BaseException, cause: BaseException) -> BaseException:
    err.__cause__ = cause
    err.__suppress_context__ = True
    return err


# What each answer stands for (see CloseState._answer).
_ABORT = ("abort", "")
_CLOSED = ("closed", "endpoint is closed")
_AFTER_EOF = ("closed", "cannot send after write_eof() was called")
_PEER_CLOSED = ("reset", "peer closed the connection")
_RESET_NO_EOF = ("reset", "connection reset: the peer disconnected without sending EOF")
_EOF_OUTCOME = ("eof", "")

Row = tuple[str, tuple[str, str]]

STATE_TABLE: Final[tuple[tuple[str, State], ...]] = (
    ("torn_down", State.CLOSED),
    ("aborted", State.ABORTED),
    ("local_closed", State.CLOSING),
    ("transport_lost", State.DISCONNECTED),
)
"""The :class:`State` of the first fact that holds (none: OPEN)."""

SEND_ERROR: Final[tuple[Row, ...]] = (
    ("aborted", _ABORT),
    ("local_closed", _CLOSED),
    ("eof_requested", _AFTER_EOF),
    ("transport_lost", _PEER_CLOSED),
    ("torn_down", _CLOSED),
)
"""What a send/write must raise (:meth:`CloseState.send_error`)."""

FLUSH_ERROR: Final[tuple[Row, ...]] = (
    ("aborted", _ABORT),
    ("local_closed", _CLOSED),
    ("transport_lost", _PEER_CLOSED),
    ("torn_down", _CLOSED),
)
"""What a wait for data already accepted must raise (:meth:`CloseState.flush_error`): a requested EOF is
no error here."""

RECV_OUTCOME: Final[tuple[Row, ...]] = (
    ("aborted", _ABORT),
    ("local_closed", _CLOSED),
    ("peer_eof", _EOF_OUTCOME),
    ("transport_lost", _RESET_NO_EOF),
    ("torn_down", _CLOSED),
)
"""What a read that finds no buffered data gets (:meth:`CloseState.recv_outcome`)."""

WIRE_ERROR: Final[tuple[Row, ...]] = (
    ("aborted", _ABORT),
    ("transport_lost", _PEER_CLOSED),
    ("torn_down", _CLOSED),
)
"""What taking a frame raises once no frame may be sent (:meth:`CloseState.wire_error`)."""


class ClosingWatcher(Protocol):
    """A part of the I/O layer that keeps its own copy of "the connection is usable" (see
    :meth:`CloseState.watch`)."""

    def on_closing(self) -> None:
        """The connection started closing (:attr:`CloseState.closing` became true)."""


class CloseState:
    """The close state of one connection: events in (each sets one fact), answers out (from the tables).

    Every fact is a plain attribute, False until its event; :attr:`wire_down` (aborted, transport lost or
    torn down: no frame may be sent any more) is kept with them because every fast path asks it first, and
    :attr:`clear` (no fact holds yet: every answer is None) because a send and an empty read ask it instead
    of calling :meth:`send_error` and :meth:`recv_outcome`. A part that keeps its own copy of "the
    connection is usable" registers with :meth:`watch` to be told when it stops being so.
    """

    __slots__ = (
        "_watchers",
        "abort_exc",
        "aborted",
        "clear",
        "eof_requested",
        "local_closed",
        "peer_eof",
        "torn_down",
        "transport_error",
        "transport_lost",
        "wire_down",
    )

    def __init__(self) -> None:
        self.local_closed = False  #: close() was called
        self.eof_requested = False  #: write_eof() or close() was called: no new data is accepted
        self.peer_eof = False  #: the peer's EOF frame arrived
        self.aborted = False  #: abort() was called or the peer broke the protocol
        self.abort_exc: BaseException | None = None  #: the first cause of the abort, if any
        self.transport_lost = False  #: the transport reported a disconnect or an error
        self.transport_error: BaseException | None = None  #: the first transport error, if any
        self.torn_down = False  #: the I/O layer finished tearing the connection down
        self.wire_down = False  #: aborted or transport lost or torn down: no frame may be sent
        self.clear = True  #: no fact holds yet (each event clears it): every answer is None
        self._watchers: list[weakref.ref[ClosingWatcher]] = []

    def __repr__(self) -> str:
        facts = [name for name in self.__slots__ if name != "clear" and getattr(self, name) is True]
        return f"<CloseState {self.state.name} {' '.join(facts)}>"

    @property
    def state(self) -> State:
        """The connection's :class:`State`, derived from the events seen so far."""
        for fact, state in STATE_TABLE:
            if getattr(self, fact):
                return state
        return State.OPEN

    @property
    def closing(self) -> bool:
        """The connection is closing or closed (closed locally, aborted, transport lost or torn down): from
        the first of those events on, :meth:`flush_error` is not None."""
        return self.wire_down or self.local_closed

    def watch(self, watcher: ClosingWatcher) -> None:
        """Call ``watcher.on_closing()`` once, when :attr:`closing` becomes true, right after the event
        that set it (at once if it already is); watchers are told in the order they came. Held weakly: a
        watcher usually holds the Session that holds this state, and a strong reference back would make
        the two a reference cycle."""
        if self.wire_down or self.local_closed:
            watcher.on_closing()
        else:
            self._watchers.append(weakref.ref(watcher))

    def _closing_now(self) -> None:
        """Tell the watchers (once: an event after the first finds none left)."""
        watchers, self._watchers = self._watchers, []
        for ref in watchers:
            watcher = ref()
            if watcher is not None:
                watcher.on_closing()

    # -- events ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Graceful local close: implies :meth:`write_eof`; the state becomes CLOSING. Idempotent."""
        self.clear = False
        self.local_closed = True
        self.eof_requested = True
        if self._watchers:
            self._closing_now()

    def write_eof(self) -> None:
        """Half-close: new data is refused from now on (the EOF frame follows the pending data)."""
        self.clear = False
        self.eof_requested = True

    def on_peer_eof(self) -> None:
        """The peer's EOF frame arrived: a read that finds no data gets :data:`EOF`."""
        self.clear = False
        self.peer_eof = True

    def abort(self, exc: BaseException | None = None) -> None:
        """Abort the connection now (state ABORTED); ``exc``, if any, is reported to pending operations.

        Idempotent: the first cause is kept. A no-op once :meth:`mark_closed` was called.
        """
        if self.aborted or self.torn_down:
            return
        self.clear = False
        self.aborted = True
        self.abort_exc = exc
        self.wire_down = True
        if self._watchers:
            self._closing_now()

    def on_disconnected(self) -> None:
        """The transport reported DISCONNECTED (the peer left or our disconnect completed)."""
        self.clear = False
        self.transport_lost = True
        self.wire_down = True
        if self._watchers:
            self._closing_now()

    def on_transport_error(self, exc: BaseException) -> None:
        """A completion or rdma_cm error made the transport unusable.

        Only the first cause is kept: errors after a disconnect (e.g. flushed work requests) are
        consequences, not news.
        """
        if not self.transport_lost:
            self.clear = False
            self.transport_lost = True
            self.transport_error = exc
            self.wire_down = True
            if self._watchers:
                self._closing_now()

    def mark_closed(self) -> None:
        """The I/O layer finished tearing the connection down; the state becomes CLOSED."""
        self.clear = False
        self.torn_down = True
        self.wire_down = True
        if self._watchers:
            self._closing_now()

    # -- answers --------------------------------------------------------------------------------------------

    def send_error(self) -> BaseException | None:
        """The exception a send/write/drain must raise now, or None if the state allows new data.

        Credits are a separate matter (``Session.can_send_data``). A new instance is returned on each call.
        """
        if not (self.wire_down or self.local_closed or self.eof_requested):
            return None  # fast path: wire_down is set with aborted, transport_lost and torn_down
        error = self._answer(SEND_ERROR)
        assert not isinstance(error, EOFType)
        return error

    def flush_error(self) -> BaseException | None:
        """The exception a wait for data already accepted (``drain()``) must raise now, or None.

        Unlike :meth:`send_error`, a requested EOF is no error here: the data written before
        ``write_eof()`` is still sent, and waiting for it is legitimate. A new instance on each call.
        """
        if not (self.wire_down or self.local_closed):
            return None
        error = self._answer(FLUSH_ERROR)
        assert not isinstance(error, EOFType)
        return error

    def recv_outcome(self) -> BaseException | EOFType | None:
        """What a read that finds no buffered data gets.

        None means wait for more, :data:`EOF` is the clean end of stream (the peer's EOF wins over a later
        disconnect or transport error), an exception instance is to be raised.
        """
        if not (self.wire_down or self.local_closed or self.peer_eof):
            return None
        return self._answer(RECV_OUTCOME)

    def wire_error(self) -> BaseException | None:
        """What taking a frame must raise once :attr:`wire_down` is set (a new instance), or None."""
        error = self._answer(WIRE_ERROR)
        assert not isinstance(error, EOFType)
        return error

    def _answer(self, table: tuple[Row, ...]) -> BaseException | EOFType | None:
        """The outcome of the first row of ``table`` whose fact holds (a new exception instance), or None."""
        for fact, (kind, message) in table:
            if getattr(self, fact):
                if kind == "abort":
                    return self._abort_error()
                if kind == "reset":
                    return self._reset_error(message)
                if kind == "eof":
                    return EOF
                return EndpointClosedError(message)
        return None

    def _abort_error(self) -> BaseException:
        exc = self.abort_exc
        if exc is None:
            return EndpointClosedError("endpoint was aborted")
        return _chained(ConnectionAbortedError(f"connection aborted: {_describe(exc)}"), exc)

    def _reset_error(self, message: str) -> BaseException:
        exc = self.transport_error
        if exc is None:
            return ConnectionResetError(message)
        return _chained(ConnectionResetError(f"connection lost: transport error: {_describe(exc)}"), exc)
