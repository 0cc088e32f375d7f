"""When a connect or a listen may draw another local port and try again.

Soft-iWARP binds a kernel TCP socket to the port rdma_cm picked for a cm id, and rdma_cm knows nothing of
TCP's ports: a port TCP still holds (an earlier connection's, in TIME_WAIT) fails ``rdma_connect`` or
``rdma_listen`` with ``EADDRINUSE``. A new cm id draws another port, so the dialer and the acceptor try again
with one, a bounded number of times, where rdma_cm picked the port. A port the caller chose is theirs: the
error is raised at once.
"""

from __future__ import annotations

import errno

__all__ = ["PORT_ATTEMPTS", "try_another_port"]

PORT_ATTEMPTS = 8
"""Attempts of a connect or a listen, each on a new port, while the picked port is taken; the last attempt's
error is raised."""


def try_another_port(error: int | None, chosen_port: int, attempt: int) -> bool:
    """Whether attempt number ``attempt`` (from 1), which failed with ``error``, is followed by another on a
    new port: the port was taken (``EADDRINUSE``), rdma_cm picked it (``chosen_port`` is 0), and fewer than
    :data:`PORT_ATTEMPTS` were made."""
    return error == errno.EADDRINUSE and not chosen_port and attempt < PORT_ATTEMPTS
