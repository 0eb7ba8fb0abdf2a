"""The shape of the package: no import cycles between aifs modules (imports
under ``if TYPE_CHECKING:`` are for type hints only and do not count), every
control xattr name comes from the one table in aifs/xattrs.py, no module
over 600 lines, and a ``core`` facade of at most 300."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aifs"


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


def _all_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every import in ``path``, those under ``if
    TYPE_CHECKING:`` included, relative ones made absolute; ``name`` is ""
    for ``import module``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1]  # (of __init__.py as of any module: its own package)
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                if module == "aifs" or (node.level and not node.module):
                    found.append((f"{module}.{alias.name}", ""))  # from aifs import posix
                else:
                    found.append((module, alias.name))
    return found


def _package_of(module: str) -> str:
    """``aifs.posix.files`` -> ``aifs.posix``; ``aifs.core`` -> ``aifs.core``;
    ``trio._core`` -> ``trio``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "aifs" else parts[0]


#: names with a leading underscore that their library documents as public
DOCUMENTED = {"os._exit"}


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports() -> list[str]:
    """Imports of a private name (``_name``, or a module path through one)
    from another package, anywhere in aifs/, and uses of one through an
    imported library module (``lmdb._Database``, ``argparse._SubParsersAction``)."""
    offenders = []
    for name, path in _modules().items():
        libraries: set[str] = set()  # names bound to imported modules of other packages
        for module, imported in _all_imports(path):
            if _package_of(module) == _package_of(name):
                continue  # a package's own private parts are its own
            if any(_private(part) for part in [*module.split("."), imported]):
                offenders.append(f"{name}: {module} {imported}".strip())
            if not imported:
                libraries.add(module.split(".")[0])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id in libraries \
                    and f"{node.value.id}.{node.attr}" not in DOCUMENTED:
                offenders.append(f"{name}: {node.value.id}.{node.attr}")
    return offenders


def test_no_private_name_of_another_package_is_imported():
    """A library's private parts (trio's ``_core``) may change in any release:
    a library upgrade must not be able to break the filesystem silently."""
    assert private_imports() == []


def test_the_private_import_check_finds_one(tmp_path, monkeypatch):
    (tmp_path / "aifs").mkdir()
    (tmp_path / "aifs" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from trio._core._run import GLOBAL_RUN_CONTEXT\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "aifs")
    assert private_imports() == ["aifs.x: trio._core._run GLOBAL_RUN_CONTEXT"]
    (tmp_path / "aifs" / "x.py").write_text("import lmdb\nDB = lmdb._Database\n")
    assert private_imports() == ["aifs.x: lmdb._Database"]


def test_no_c_source_in_the_package():
    """Each operation exists once, in Python (a native fast path enters only
    through the facade, with record layouts generated from one schema)."""
    suffixes = {".c", ".h", ".cc", ".cpp", ".pyx", ".so"}
    assert [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*")
            if p.suffix in suffixes] == []


def test_the_bindings_call_only_the_facade():
    """aifs/fuse/ imports from aifs only the facade (``core``), ``config``,
    ``errors`` and its own modules, under TYPE_CHECKING too: never
    ``aifs.posix`` or anything else below the facade."""
    assert below_the_facade() == []


def below_the_facade() -> list[str]:
    allowed = {"aifs.core", "aifs.config", "aifs.errors", "aifs.fuse"}
    return [f"{name}: {module}" for name, path in _modules().items()
            if name.startswith("aifs.fuse")
            for module, _ in _all_imports(path)
            if module.split(".")[0] == "aifs" and _package_of(module) not in allowed]


def test_the_facade_check_finds_a_binding_reaching_below(tmp_path, monkeypatch):
    (tmp_path / "aifs" / "fuse").mkdir(parents=True)
    (tmp_path / "aifs" / "fuse" / "x.py").write_text(
        "from aifs import errors\nfrom aifs.core import Filesystem\n"
        "from ..posix import files\nfrom aifs import meta\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "aifs")
    assert below_the_facade() == ["aifs.fuse.x: aifs.posix", "aifs.fuse.x: aifs.meta"]


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, those under ``if TYPE_CHECKING:`` too
    (relative imports resolved)."""
    package = path.relative_to(PACKAGE.parent).parent.parts
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_metrics_is_fed_by_the_facade():
    """``aifs.metrics`` renders the figures the facade hands it
    (``Filesystem.figures``): it imports neither the facade nor the parts
    behind it, not even for type hints; nor does the module of the figures."""
    for module in ("metrics.py", "figures.py"):
        imported = _imported(PACKAGE / module)
        assert imported, module  # the check sees imports
        reaching = {name for name in imported
                    for banned in ("aifs.core", "aifs.posix")
                    if name == banned or name.startswith(banned + ".")}
        assert reaching == set(), module
