"""Print the import cycles among rdmaio's modules (strongly connected components of the import graph).

Usage: python tools/import_cycles.py [--all]

Reads the sources with ``ast`` (nothing is imported). By default imports under ``if TYPE_CHECKING:`` are left
out, since they never run; ``--all`` counts them too. Exit status 0 always: this is a report, the layer rules
are enforced by tests/unit/test_layers.py.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rdmaio"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str], include_typing: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node) and not include_typing:
                visit(node.orelse)
                continue
            for child in ast.walk(node):
                names: list[str] = []
                if isinstance(child, ast.Import):
                    names = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join([*anchor, base] if base else anchor)
                    names = [base] + [f"{base}.{alias.name}" for alias in child.names]
                for name in names:
                    while name and name not in modules:
                        name = name.rpartition(".")[0]
                    if name and name != own:
                        found.add(name)

    visit(tree.body)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    counter = 0

    def strongconnect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return result


def main() -> None:
    include_typing = "--all" in sys.argv[1:]
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in files}
    # A package's __init__ importing its own submodules is how packages re-export; it is not a cycle.
    graph = {
        module_name(path): {
            dep
            for dep in imports_of(path, modules, include_typing)
            if not (path.name == "__init__.py" and dep.startswith(module_name(path) + "."))
        }
        for path in files
    }
    found = cycles(graph)
    for component in found:
        print(" <-> ".join(component))
    print(f"{len(found)} import cycle(s) among {len(modules)} modules")


if __name__ == "__main__":
    main()
