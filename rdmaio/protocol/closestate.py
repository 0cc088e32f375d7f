"""The close state machine of a :class:`~rdmaio.protocol.session.Session` (sans-IO), as tables.

As in h11's ``_state.py``, the rules are data: the connection's condition is a set of facts (``_aborted``,
``_local_closed``, ``_eof_requested``, ``_peer_eof``, ``_transport_lost``, ``_torn_down``), set by the
events (:meth:`CloseState.close`, :meth:`~CloseState.abort`, :meth:`~CloseState.on_disconnected`,
:meth:`~CloseState.on_transport_error`, :meth:`~CloseState.mark_closed`, and the EOF frames), and each
question the I/O layer asks (the :class:`State`, what a send, a drain or a read must raise) is answered by
the first row of its table whose fact holds. The order of the rows is the priority of the causes: an abort
wins over everything, a local close over a lost transport, the peer's EOF over a later disconnect.
"""

from __future__ import annotations

import enum
from typing import Final

from rdmaio.errors import ConnectionAbortedError, ConnectionResetError, EndpointClosedError
from rdmaio.protocol.sessionfields import SessionFields

__all__ = ["EOF", "CloseState", "EOFType", "State"]


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


# What each answer stands for (see CloseState._outcome).
_ABORT = ("abort", "")
_CLOSED = ("closed", "endpoint is closed")
_AFTER_EOF = ("closed", "cannot send after write_eof() was called")
_PEER_CLOSED = ("reset", "peer closed the connection")
_RESET_NO_EOF = ("reset", "connection reset: the peer disconnected without sending EOF")
_EOF_OUTCOME = ("eof", "")

Row = tuple[str, tuple[str, str]]

STATE_TABLE: Final[tuple[tuple[str, State], ...]] = (
    ("_torn_down", State.CLOSED),
    ("_aborted", State.ABORTED),
    ("_local_closed", State.CLOSING),
    ("_transport_lost", State.DISCONNECTED),
)
"""The :class:`State` of the first fact that holds (none: OPEN)."""

SEND_ERROR: Final[tuple[Row, ...]] = (
    ("_aborted", _ABORT),
    ("_local_closed", _CLOSED),
    ("_eof_requested", _AFTER_EOF),
    ("_transport_lost", _PEER_CLOSED),
    ("_torn_down", _CLOSED),
)
"""What a send/write must raise (:meth:`CloseState.send_error`)."""

FLUSH_ERROR: Final[tuple[Row, ...]] = (
    ("_aborted", _ABORT),
    ("_local_closed", _CLOSED),
    ("_transport_lost", _PEER_CLOSED),
    ("_torn_down", _CLOSED),
)
"""What a wait for data already accepted must raise (:meth:`CloseState.flush_error`): a requested EOF is
no error here."""

RECV_OUTCOME: Final[tuple[Row, ...]] = (
    ("_aborted", _ABORT),
    ("_local_closed", _CLOSED),
    ("_peer_eof", _EOF_OUTCOME),
    ("_transport_lost", _RESET_NO_EOF),
    ("_torn_down", _CLOSED),
)
"""What a read that finds no buffered data gets (:meth:`CloseState.recv_outcome`)."""

WIRE_ERROR: Final[tuple[Row, ...]] = (
    ("_aborted", _ABORT),
    ("_transport_lost", _PEER_CLOSED),
    ("_torn_down", _CLOSED),
)
"""What taking a frame raises once no frame may be sent (:meth:`CloseState._raise_wire_error`)."""


class CloseState(SessionFields):
    """The close state machine: events in, answers out (a part of the
    :class:`~rdmaio.protocol.session.Session`)."""

    __slots__ = ()

    @property
    def state(self) -> State:
        """The connection's :class:`State`, derived from the events seen so far."""
        for fact, state in STATE_TABLE:
            if getattr(self, fact):
                return state
        return State.OPEN

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

    def close(self) -> None:
        """Graceful local close: implies :meth:`write_eof`; the state becomes CLOSING. Idempotent."""
        self._local_closed = True
        self._eof_requested = True

    def abort(self, exc: BaseException | None = None) -> None:
        """Abort the connection now (state ABORTED); ``exc``, if any, is reported to pending operations.

        Idempotent: the first cause is kept. A no-op once :meth:`mark_closed` was called.
        """
        if self._aborted or self._torn_down:
            return
        self._aborted = True
        self._abort_exc = exc
        self._wire_down = True

    def on_disconnected(self) -> None:
        """The transport reported DISCONNECTED (the peer left or our disconnect completed)."""
        self._transport_lost = True
        self._wire_down = True

    def on_transport_error(self, exc: BaseException) -> None:
        """A completion or rdma_cm error made the transport unusable.

        Only the first cause is kept: errors after a disconnect (e.g. flushed work requests) are
        consequences, not news.
        """
        if not self._transport_lost:
            self._transport_lost = True
            self._transport_error = exc
            self._wire_down = True

    def mark_closed(self) -> None:
        """The I/O layer finished tearing the connection down; the state becomes CLOSED."""
        self._torn_down = True
        self._wire_down = True

    def send_error(self) -> BaseException | None:
        """The exception a send/write/drain must raise now, or None if the state allows new data.

        Credits are a separate matter (:meth:`can_send_data`). A new instance is returned on each call.
        """
        if not (self._wire_down or self._local_closed or self._eof_requested):
            return None  # fast path: _wire_down is set with _aborted, _transport_lost and _torn_down
        error = self._answer(SEND_ERROR)
        assert not isinstance(error, EOFType)
        return error

    def flush_error(self) -> BaseException | None:
        """The exception a wait for data already accepted (``drain()``) must raise now, or None.

        Unlike :meth:`send_error`, a requested EOF is no error here: the data written before
        ``write_eof()`` is still sent, and waiting for it is legitimate. A new instance on each call.
        """
        if not (self._wire_down or self._local_closed):
            return None
        error = self._answer(FLUSH_ERROR)
        assert not isinstance(error, EOFType)
        return error

    def recv_outcome(self) -> BaseException | EOFType | None:
        """What a read that finds no buffered data gets.

        None means wait for more, :data:`EOF` is the clean end of stream (the peer's EOF wins over a later
        disconnect or transport error), an exception instance is to be raised.
        """
        if not (self._wire_down or self._local_closed or self._peer_eof):
            return None
        return self._answer(RECV_OUTCOME)

    def _abort_error(self) -> BaseException:
        exc = self._abort_exc
        if exc is None:
            return EndpointClosedError("endpoint was aborted")
        return _chained(ConnectionAbortedError(f"connection aborted: {_describe(exc)}"), exc)

    def _reset_error(self, message: str) -> BaseException:
        exc = self._transport_error
        if exc is None:
            return ConnectionResetError(message)
        return _chained(ConnectionResetError(f"connection lost: transport error: {_describe(exc)}"), exc)

    def _wire_ok(self) -> bool:
        # A local close() still lets the I/O layer flush data, EOF and credits until teardown.
        return not self._wire_down

    def _raise_wire_error(self) -> None:
        error = self._answer(WIRE_ERROR)
        if error is not None:
            assert not isinstance(error, EOFType)
            raise error
