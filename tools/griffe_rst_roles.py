"""A griffe extension for the docs site: turn the Sphinx roles in rdmaio's docstrings into Markdown.

The docstrings are written for ``help()`` and IDEs, with Sphinx roles such as ``:class:`~rdmaio.Endpoint```.
mkdocstrings renders Markdown, where those would show up raw. A role naming a public object of
``rdmaio`` or ``rdmaio.anyio`` becomes a link to its entry in the API reference (mkdocs-autorefs); any
other role becomes a code span, so no link can be left dangling (strict mode fails on those).
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
        """Convert the roles in ``obj``'s docstring."""
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value, self._public)
