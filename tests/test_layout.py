"""The shape of the package: no import cycles between aifs modules (imports
under ``if TYPE_CHECKING:`` are for type hints only and do not count), every
control xattr name comes from the one table in aifs/xattrs.py, no module
over 600 lines, and a ``core`` facade of at most 300."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "aifs"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """Import nodes, leaving out the bodies of ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for node in sorted(graph):
        if node not in index:
            strong(node)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "aifs.core" in graph and graph["aifs.core"]  # the check sees imports
    assert cycles(graph) == []


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_control_xattr_names_come_from_the_table():
    literal = re.compile(r"""b?["']user\.aifs\.""")
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{number}"
                 for path in PACKAGE.rglob("*.py") if path.name != "xattrs.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if literal.search(line)]
    assert offenders == []


def test_no_module_is_over_600_lines():
    """One responsibility a module: past 600 lines a module holds several."""
    sizes = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
             for path in PACKAGE.rglob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > 600} == {}


def test_the_facade_holds_no_logic():
    """``core.py`` hands each call to the part of ``aifs.posix`` that owns it."""
    assert len((PACKAGE / "core.py").read_text().splitlines()) <= 300
