"""The documentation site: the API reference lists every public name, the site is built in strict mode,
and the griffe extension turns the docstrings' Sphinx roles into links or code spans."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import rdmaio
import rdmaio.anyio

REPO = Path(__file__).resolve().parents[2]


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def documented() -> set[str]:
    return set(re.findall(r"^::: (\S+)$", (REPO / "docs/api.md").read_text(), re.MULTILINE))


def test_api_reference_covers_every_public_name() -> None:
    names = documented()
    missing = [f"rdmaio.{n}" for n in rdmaio.__all__ if n != "__version__" and f"rdmaio.{n}" not in names]
    missing += [f"rdmaio.anyio.{n}" for n in rdmaio.anyio.__all__ if f"rdmaio.anyio.{n}" not in names]
    assert missing == []
    assert "`rdmaio.__version__`" in (REPO / "docs/api.md").read_text()


def test_site_is_strict_and_lists_every_page() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^strict: true$", config, re.MULTILINE)
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    in_nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", config, re.MULTILINE))
    assert pages == in_nav


def test_roles_become_links_or_code() -> None:
    roles = load_tool("griffe_rst_roles")
    public = {"rdmaio.Endpoint", "rdmaio.connect", "rdmaio.anyio.RdmaListener"}
    text = (
        "Returns an :class:`~rdmaio.Endpoint`; see :func:`rdmaio.connect`, :meth:`close`, "
        ":exc:`anyio.EndOfStream` and :class:`rdmaio.anyio.RdmaListener`."
    )
    assert roles.convert(text, public) == (
        "Returns an [`Endpoint`][rdmaio.Endpoint]; see [`rdmaio.connect()`][rdmaio.connect], `close()`, "
        "`anyio.EndOfStream` and [`rdmaio.anyio.RdmaListener`][rdmaio.anyio.RdmaListener]."
    )


def test_roles_extension_reads_all_without_importing() -> None:
    roles = load_tool("griffe_rst_roles")
    assert roles.module_all(REPO / "rdmaio/__init__.py") == rdmaio.__all__
    assert roles.module_all(REPO / "rdmaio/anyio.py") == rdmaio.anyio.__all__


def test_attribute_comments_become_docstrings() -> None:
    import griffe

    roles = load_tool("griffe_rst_roles")
    package = griffe.load(
        "rdmaio", search_paths=[str(REPO)], extensions=griffe.load_extensions(roles.RstRoles())
    )
    device = package["anyio"]["RdmaAttribute"]["device"]
    assert device.docstring is not None
    assert device.docstring.value.startswith("name of the RDMA device carrying the connection")
    endpoint = package["anyio"]["RdmaAttribute"]["endpoint"]  # a two-line comment with a role in it
    assert endpoint.docstring.value.startswith("the [`rdmaio.Endpoint`][rdmaio.Endpoint] under the stream")


def test_every_package_maps_its_modules() -> None:
    """Each package's docstring names every module and subpackage in it (its module map stays true)."""
    import ast

    missing: list[str] = []
    for init in sorted((REPO / "rdmaio").rglob("__init__.py")):
        package_dir = init.parent
        dotted = ".".join(package_dir.relative_to(REPO).parts)
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        members = [p.stem for p in package_dir.glob("*.py") if p.stem not in ("__init__", "__main__")]
        members += [p.parent.name for p in package_dir.glob("*/__init__.py")]
        missing += [f"{dotted}.{name}" for name in sorted(members) if f"{dotted}.{name}" not in doc]
    assert missing == [], f"not in their package's module map: {missing}"
