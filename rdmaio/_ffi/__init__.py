"""FFI layer: the compiled cffi extension ``rdmaio._rdmaio_cffi`` (librdmacm, libibverbs, C helper).

``ffi`` and ``lib`` are re-exported from here so that no other module imports the extension directly.

Modules: :mod:`rdmaio._ffi.build` (the cffi build script: ``cdefs.h`` declarations, ``helper.c``,
``onesided.c`` and ``txring.c`` (a sender's send ring) compiled into the extension).
"""

from __future__ import annotations

from typing import Any

try:
    from rdmaio._rdmaio_cffi import ffi as _ffi
    from rdmaio._rdmaio_cffi import lib as _lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "rdmaio's compiled extension is missing or broken; reinstall with `pip install -e .` "
        "after `apt-get install libibverbs-dev librdmacm-dev` "
        f"({exc})"
    ) from exc

ffi: Any = _ffi
lib: Any = _lib

__all__ = ["ffi", "lib"]
