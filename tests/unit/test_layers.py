"""The layering of docs/architecture.md, checked: each layer imports only what the table says it may.

The rules: the FFI imports nothing of rdmaio; the verbs layer the FFI and ``errors``; the protocol only
``errors``; the core the verbs layer, the protocol, ``options`` and ``errors``, and reaches C only through
the verbs layer (``ffi``/``lib`` from the one gateway, :data:`GATEWAY`; :data:`FFI_ALLOWLIST`, empty, may
only shrink); the public modules (``endpoint``, ``client``, ``server``) only the core,
each other, ``options`` and ``errors``; the compatibility layers only the public API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rdmaio"

PUBLIC = {"rdmaio.endpoint", "rdmaio.client", "rdmaio.server", "rdmaio.path"}
COMPAT = {"rdmaio.streams", "rdmaio.anyio", "rdmaio.dask"}
SHARED = {"rdmaio.errors", "rdmaio.options"}
# The top-level modules outside the layers: the package's facade (it re-exports the public API and the
# asyncio-streams functions) and the command line (it lists devices through the verbs layer).
UNLAYERED_TOP = {"rdmaio", "rdmaio.__main__"}

GATEWAY = "rdmaio.verbs.native"
"""The one module through which the core reaches C (``ffi``/``lib``); its docstring says why there."""

# Core modules allowed to import rdmaio._ffi directly: none (the list may only shrink; a module listed
# here that no longer imports rdmaio._ffi fails test_the_ffi_allowlist_is_not_stale).
FFI_ALLOWLIST: set[str] = set()

# layer (a package or a set of modules) -> what its modules may import from rdmaio
ALLOWED: dict[str, set[str]] = {
    "rdmaio._ffi": {"rdmaio._ffi", "rdmaio._rdmaio_cffi"},  # the compiled extension
    "rdmaio.verbs": {"rdmaio._ffi", "rdmaio.errors", "rdmaio.verbs"},
    "rdmaio.protocol": {"rdmaio.errors", "rdmaio.protocol"},
    # C only through the verbs layer (its objects, or the gateway for ffi/lib): never rdmaio._ffi
    "rdmaio.core": {"rdmaio.verbs", "rdmaio.protocol", "rdmaio.core", *SHARED},
    # The public modules build on the core alone: what they need of the verbs layer or the protocol
    # (types, events, handshakes) is the core's business, re-exported by it where a type is needed.
    "public": {"rdmaio.core", *PUBLIC, *SHARED},
    # The compatibility layers use only the public API: rdmaio's top-level names and its public modules.
    "compat": {"rdmaio", *PUBLIC, *SHARED},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str | None:
    for package in ("rdmaio._ffi", "rdmaio.verbs", "rdmaio.protocol", "rdmaio.core"):
        if module == package or module.startswith(package + "."):
            return package
    if module in PUBLIC:
        return "public"
    if any(module == c or module.startswith(c + ".") for c in COMPAT):
        return "compat"
    return None


def _imports(path: Path) -> set[str]:
    """The rdmaio modules ``path`` imports (``from rdmaio import verbs`` counts as ``rdmaio.verbs``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "rdmaio")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rdmaio":
            if node.module == "rdmaio":
                for alias in node.names:
                    sub = ROOT / alias.name
                    is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                    found.add(f"rdmaio.{alias.name}" if is_module else "rdmaio")
            else:
                found.add(node.module)
    return found


def _allowed(imported: str, allowed: set[str]) -> bool:
    return any(imported == a or imported.startswith(a + ".") for a in allowed) or (
        imported == "rdmaio" and "rdmaio" in allowed
    )


LAYERED = sorted(
    (path, layer) for path in ROOT.rglob("*.py") if (layer := _layer(_module_name(path))) is not None
)


def test_every_layer_has_modules() -> None:
    assert {layer for _path, layer in LAYERED} == set(ALLOWED)


@pytest.mark.parametrize(("path", "layer"), LAYERED, ids=[str(p.relative_to(ROOT)) for p, _ in LAYERED])
def test_a_module_imports_only_what_its_layer_may(path: Path, layer: str) -> None:
    module = _module_name(path)
    own_package = ".".join(module.split(".")[:2])  # rdmaio.dask may import rdmaio.dask.*
    allowed = ALLOWED[layer] | ({own_package} if layer == "compat" else set())
    if module in FFI_ALLOWLIST:
        allowed = allowed | {"rdmaio._ffi"}
    bad = sorted(imported for imported in _imports(path) if not _allowed(imported, allowed))
    assert not bad, f"{path.relative_to(ROOT)} ({layer}) imports {bad}"


def test_every_top_level_module_has_a_layer() -> None:
    """rdmaio/*.py: each is public, compatibility, shared, or one of the named unlayered modules."""
    top = {_module_name(path) for path in ROOT.glob("*.py")}
    unplaced = sorted(m for m in top if _layer(m) is None and m not in SHARED | UNLAYERED_TOP)
    assert not unplaced, f"modules outside every layer: {unplaced}"


def _names_from(path: Path) -> dict[str, set[str]]:
    """The names ``path`` takes with ``from rdmaio.x import name``, by module."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rdmaio"):
            found.setdefault(node.module, set()).update(a.name for a in node.names)
    return found


CORE = [path for path, layer in LAYERED if layer == "rdmaio.core"]


@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(ROOT)) for p in CORE])
def test_the_core_takes_ffi_and_lib_from_the_gateway_only(path: Path) -> None:
    """Raw C access in the core is greppable: ``ffi``/``lib`` come from the gateway, not from the verbs
    package's re-exports (nor, outside the allowlist, from rdmaio._ffi: the layer test)."""
    taken = {
        module: names & {"ffi", "lib"}
        for module, names in _names_from(path).items()
        if module not in (GATEWAY, "rdmaio._ffi")
    }
    bad = {module: names for module, names in taken.items() if names}
    assert not bad, f"{path.relative_to(ROOT)} takes {bad}: use {GATEWAY}"


def test_the_ffi_allowlist_is_not_stale() -> None:
    """Every module on the allowlist exists and still imports rdmaio._ffi: once switched, it leaves it."""
    core = {_module_name(path): path for path in CORE}
    stale = sorted(m for m in FFI_ALLOWLIST if m not in core or "rdmaio._ffi" not in _imports(core[m]))
    assert not stale, f"remove from FFI_ALLOWLIST: {stale}"


def test_the_gateway_is_the_verbs_layers_and_exposes_ffi_and_lib() -> None:
    import importlib

    gateway = importlib.import_module(GATEWAY)
    assert _layer(GATEWAY) == "rdmaio.verbs"
    assert set(gateway.__all__) == {"ffi", "lib"}
    assert gateway.__doc__ and "core" in gateway.__doc__


# Within a layer, the parts of a split class import only what their job needs (docs/architecture.md):
# the close state machine knows nothing of frames or credits, an endpoint's read and write sides only its
# connection, the remote keys nothing of the engine.
NARROW: dict[str, set[str]] = {
    "rdmaio.protocol.closestate": {"rdmaio.errors"},
    # the per-device ledger and the session on a shared queue know the reclaim protocol, not each other
    "rdmaio.protocol.credit_ledger": {"rdmaio.protocol.reclaim"},
    "rdmaio.protocol.shared_session": {
        "rdmaio.protocol.frames",
        "rdmaio.protocol.handshake",
        "rdmaio.protocol.reclaim",
        "rdmaio.protocol.sessionstate",
    },
    # the sender and the receiver get the connection's parts injected: neither imports the connection
    "rdmaio.core.send": {
        "rdmaio.verbs.native",
        "rdmaio.verbs",
        "rdmaio.core.backend",
        "rdmaio.errors",
        "rdmaio.options",
        "rdmaio.protocol",
        "rdmaio.protocol.frames",
        "rdmaio.protocol.sendqueue",
        "rdmaio.protocol.reclaim",
    },
    "rdmaio.core.receive": {
        "rdmaio.verbs.native",
        "rdmaio.verbs",
        "rdmaio.core.backend",
        "rdmaio.core.send",
        "rdmaio.errors",
        "rdmaio.options",
        "rdmaio.protocol",
        "rdmaio.protocol.rxbuffer",
    },
    "rdmaio.core.onesided.keys": {"rdmaio.errors"},
    # connection setup: the public modules reach it through these two, which share the negotiation
    "rdmaio.core.negotiation": {"rdmaio.options", "rdmaio.protocol", "rdmaio.protocol.reclaim"},
    "rdmaio.core.resolver": {"rdmaio.core.reactor", "rdmaio.errors"},
    # batches are built on the op life cycle alone (and the checks of the keys)
    "rdmaio.core.onesided.batches": {
        "rdmaio.core.onesided.keys",
        "rdmaio.core.onesided.operations",
        "rdmaio.errors",
    },
}


@pytest.mark.parametrize("module", sorted(NARROW))
def test_the_parts_of_a_split_class_import_only_what_their_job_needs(module: str) -> None:
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    imported = _imports(path)
    assert imported, f"{module} imports nothing of rdmaio: the table is out of date"
    bad = sorted(imported - NARROW[module])
    assert not bad, f"{module} imports {bad}"
