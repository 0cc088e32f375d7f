"""The C gateway: cffi's ``ffi`` and the compiled ``lib`` (librdmacm, libibverbs, rdmaio's C helper), for
the core.

The verbs objects wrap what a connection sets up once (ids, QPs, CQs, MRs). A few things the core needs
are not objects but raw C access on the data path: cdata arrays the C drain helper reads (a ring's lkeys,
scratch work requests), the address of a Python buffer (``ffi.from_buffer`` / ``ffi.cast``), and the C
helper's post and poll functions called directly (a wrapper method would add a Python call per message).

That access goes through this one module, and it lives in the verbs package rather than in the core
because the verbs layer is the one that owns the C boundary: it knows the extension's types and the
lifetime rules of what it hands out, and rdmaio/_ffi stays imported by the verbs package alone. So the
core reaches C through :mod:`rdmaio.verbs` only (the objects, or this module for ``ffi``/``lib``), which
tests/unit/test_layers.py checks; grepping for ``rdmaio.verbs.native`` lists every raw C use in the core.
"""

from __future__ import annotations

from rdmaio._ffi import ffi, lib

__all__ = ["ffi", "lib"]
