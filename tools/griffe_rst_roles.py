"""A griffe extension for the docs site: read rdmaio's docstrings the way Sphinx would, as Markdown.

The docstrings are written for ``help()`` and IDEs, with Sphinx roles such as ``:class:`~rdmaio.Endpoint```.
mkdocstrings renders Markdown, where those would show up raw. A role naming a public object of
``rdmaio`` or ``rdmaio.anyio`` becomes a link to its entry in the API reference (mkdocs-autorefs); any
other role becomes a code span, so no link can be left dangling (strict mode fails on those). An
attribute documented with ``#:`` comments (Sphinx's convention) gets them as its docstring.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

PACKAGE = Path(__file__).resolve().parents[1] / "rdmaio"
_ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|exc|data|mod|obj|const):`(~?)([^`]+)`")


def module_all(path: Path) -> list[str]:
    """A module's ``__all__``, read from its source (importing rdmaio would need the compiled extension)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [str(v) for v in ast.literal_eval(node.value)]
    return []


def _public_names() -> set[str]:
    names = {f"rdmaio.{n}" for n in module_all(PACKAGE / "__init__.py") if not n.startswith("_")}
    return names | {f"rdmaio.anyio.{n}" for n in module_all(PACKAGE / "anyio.py")}


def convert(text: str, public: set[str]) -> str:
    """``text`` with every Sphinx role replaced by a link or a code span."""

    def replace(match: re.Match[str]) -> str:
        role, short, target = match.groups()
        shown = target.rsplit(".", 1)[-1] if short else target
        if role in ("func", "meth"):
            shown += "()"
        if target in public:
            return f"[`{shown}`][{target}]"
        return f"`{shown}`"

    return _ROLE.sub(replace, text)


class RstRoles(griffe.Extension):
    """Rewrites the docstring of every object as it is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self._public = _public_names()

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Convert the roles in ``obj``'s docstring (taken from ``#:`` comments for an attribute)."""
        if obj.docstring is None and obj.is_attribute:
            text = sphinx_comment(obj)
            if text:
                obj.docstring = griffe.Docstring(text, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value, self._public)


def sphinx_comment(obj: griffe.Object) -> str:
    """The ``#:`` comment lines right above an attribute: Sphinx's form of an attribute docstring."""
    if obj.lineno is None or obj.filepath is None or isinstance(obj.filepath, list):
        return ""
    try:
        lines = obj.lines_collection[obj.filepath]
    except KeyError:
        return ""
    found: list[str] = []
    index = obj.lineno - 2  # the line above the attribute, 0-based
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(found)
