"""How the test host reports: its own exit statuses, the error for a missing prerequisite, its messages.

A run's exit status is CMD's own, except for the three statuses here, which say CMD did not run (or did
not finish); every message of the test host goes to stderr with a ``testhost:`` prefix.
"""

from __future__ import annotations

import sys

EXIT_PREFLIGHT = 2
"""A prerequisite is missing and could not be installed, or the options are wrong."""
EXIT_HOST_FAILED = 3
"""The VM failed to boot or to set up RDMA: CMD did not run."""
EXIT_TIMEOUT = 124
"""The whole run took longer than ``--timeout``."""


class PreflightError(Exception):
    """Something the test host needs is missing, cannot be installed, or an option is wrong."""


def log(message: str) -> None:
    """Print a test host message on stderr."""
    print(f"testhost: {message}", file=sys.stderr, flush=True)
