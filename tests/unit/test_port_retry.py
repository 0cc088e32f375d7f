"""The rule the dialer and the acceptor share for a port Soft-iWARP's TCP still holds."""

from __future__ import annotations

import errno

from rdmaio.core.port_retry import PORT_ATTEMPTS, try_another_port


def test_a_taken_port_rdma_cm_picked_is_tried_again_a_bounded_number_of_times() -> None:
    tried = [try_another_port(errno.EADDRINUSE, 0, attempt) for attempt in range(1, PORT_ATTEMPTS + 2)]
    assert tried == [True] * (PORT_ATTEMPTS - 1) + [False, False]


def test_a_port_the_caller_chose_or_another_error_is_raised_at_once() -> None:
    assert not try_another_port(errno.EADDRINUSE, 7471, 1)
    for error in (errno.EADDRNOTAVAIL, errno.ECONNREFUSED, 0, None):
        assert not try_another_port(error, 0, 1)
