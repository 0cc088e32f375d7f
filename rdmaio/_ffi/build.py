"""cffi build script (API mode, out-of-line) for ``rdmaio._rdmaio_cffi``.

Compiles the declarations in ``cdefs.h`` against the rdma-core headers and links ``helper.c`` (and
``onesided.c``, ``txring.c``) into the same extension. Used by setuptools through ``cffi_modules`` (see
``setup.py``); run directly to build in place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
REQUIRED_HEADERS = {
    "infiniband/verbs.h": "libibverbs-dev",
    "rdma/rdma_cma.h": "librdmacm-dev",
}
INCLUDE_DIRS = [d for d in os.environ.get("RDMAIO_INCLUDE_DIRS", "").split(os.pathsep) if d]
# RDMAIO_SYSTEM_INCLUDE_DIRS replaces the system directories searched for the headers (for cross builds,
# and for the test that a machine without the headers gets the one-line message below).
SYSTEM_DIRS = os.environ.get("RDMAIO_SYSTEM_INCLUDE_DIRS", "/usr/include:/usr/local/include")
SEARCH_DIRS = [*INCLUDE_DIRS, *(d for d in SYSTEM_DIRS.split(os.pathsep) if d)]


def check_headers(search_dirs: list[str] = SEARCH_DIRS) -> None:
    """Stop the build with one clear line when the rdma-core development headers are missing."""
    missing = [
        package
        for header, package in REQUIRED_HEADERS.items()
        if not any((Path(d) / header).exists() for d in search_dirs)
    ]
    if missing:
        packages = " ".join(sorted(set(REQUIRED_HEADERS.values())))
        sys.exit(
            f"rdmaio: rdma-core headers not found; install them with: apt-get install {packages}"
            " (Fedora/RHEL: dnf install rdma-core-devel)"
        )


def make_ffi() -> FFI:
    """Create the FFI builder for the extension module."""
    check_headers()
    ffibuilder = FFI()
    ffibuilder.cdef((HERE / "cdefs.h").read_text())
    ffibuilder.set_source(
        "rdmaio._rdmaio_cffi",
        '#include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\n#include "helper.h"\n'
        # session rules (session.c)
        '#include "session.h"\n'
        # the send ring (txring.c)
        '#include "txring.h"\n'
        # the path of a connection (path.c)
        '#include "path.h"\n'
        # connection setup (setup.c)
        '#include "setup.h"\n',
        # setuptools wants source paths relative to the project root (the cwd during the build).
        sources=[
            os.path.relpath(HERE / "helper.c"),
            os.path.relpath(HERE / "onesided.c"),
            # session rules
            os.path.relpath(HERE / "session.c"),
            # the send ring
            os.path.relpath(HERE / "txring.c"),
            # the path of a connection
            os.path.relpath(HERE / "path.c"),
            # connection setup
            os.path.relpath(HERE / "setup.c"),
        ],
        include_dirs=[str(HERE), *INCLUDE_DIRS],
        libraries=["rdmacm", "ibverbs"],
        extra_compile_args=["-O2", "-Wall", "-std=gnu11"],
    )
    return ffibuilder


ffibuilder = make_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
