"""The layering of docs/index.md, checked: each layer imports only what the table says it may."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rdmaio"

PUBLIC = {"rdmaio.endpoint", "rdmaio.client", "rdmaio.server"}
COMPAT = {"rdmaio.streams", "rdmaio.anyio", "rdmaio.dask"}
SHARED = {"rdmaio.errors", "rdmaio.options"}

# layer (a package or a set of modules) -> what its modules may import from rdmaio
ALLOWED: dict[str, set[str]] = {
    "rdmaio._ffi": {"rdmaio._ffi", "rdmaio._rdmaio_cffi"},  # the compiled extension
    "rdmaio.verbs": {"rdmaio._ffi", "rdmaio.errors", "rdmaio.verbs"},
    "rdmaio.protocol": {"rdmaio.errors", "rdmaio.protocol"},
    "rdmaio.core": {"rdmaio._ffi", "rdmaio.verbs", "rdmaio.protocol", "rdmaio.core", *SHARED},
    "public": {"rdmaio.verbs", "rdmaio.protocol", "rdmaio.core", *PUBLIC, *SHARED},
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
    own_package = ".".join(_module_name(path).split(".")[:2])  # rdmaio.dask may import rdmaio.dask.*
    allowed = ALLOWED[layer] | ({own_package} if layer == "compat" else set())
    bad = sorted(imported for imported in _imports(path) if not _allowed(imported, allowed))
    assert not bad, f"{path.relative_to(ROOT)} ({layer}) imports {bad}"


# Within a layer, the parts of a split class import only what their job needs (docs/index.md):
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
    },
    # the sender and the receiver get the connection's parts injected: neither imports the connection
    "rdmaio.core.send": {
        "rdmaio._ffi",
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
        "rdmaio.verbs",
        "rdmaio.core.backend",
        "rdmaio.core.send",
        "rdmaio.errors",
        "rdmaio.options",
        "rdmaio.protocol",
        "rdmaio.protocol.rxbuffer",
    },
    "rdmaio.core.onesided.keys": {"rdmaio.errors"},
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
