"""The package's modules import one another without cycles, and at the top of the file.

Read from the source with ``ast``, nothing imported: every ``import`` and
``from ... import`` of a package module, at module level (except under ``if
TYPE_CHECKING:``, which never runs) and inside function and class bodies, with
relative imports resolved to module names. ``from . import _admin`` imports the
module ``celery_duraflow._admin``; ``from .errors import X`` imports
``celery_duraflow.errors``; a package's ``__init__`` is the module of the
package (``celery_duraflow``, ``celery_duraflow.web``). A call of
``importlib.import_module`` or ``__import__`` with a literal name counts as an
import too.

An import hidden inside a function is how a cycle is usually papered over: it
still couples the two modules, it fails at call time rather than import time,
and it runs the import machinery on a hot path. Only the optional web extra
(``celery_duraflow.web``, which needs Starlette) may be imported that way.
"""

from __future__ import annotations

import ast
import gc
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "celery_duraflow"
#: The optional extra a function may import on demand: the web view and its submodules.
OPTIONAL = f"{PACKAGE}.web"
# The framework integrations, each an optional extra (Django, ...): imported where used.
CONTRIB = f"{PACKAGE}.contrib"


@dataclass(frozen=True)
class Import:
    """One import of a package module, where it is written."""

    source: str  # the importing module
    target: str  # the imported module
    path: str  # the importing file, relative to the repository
    line: int
    local: bool  # inside a function or class body, rather than at module level

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _modules() -> dict[str, Path]:
    """Every module of the package by name; a package's ``__init__`` is the package."""
    found: dict[str, Path] = {}
    for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk(nodes: list[ast.stmt] | list[ast.AST], local: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it is inside a def or class body, skipping TYPE_CHECKING blocks."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.orelse, local)
            continue
        yield node, local
        inner = local or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                                    | ast.Lambda)
        yield from _walk(list(ast.iter_child_nodes(node)), inner)


def _literal_import_call(node: ast.AST) -> str | None:
    """The name given to ``importlib.import_module("...")`` or ``__import__("...")``."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    if name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(
            first.value, str):
        return first.value
    return None


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _imports() -> list[Import]:
    """Every import of a package module written in the package."""
    modules = _modules()
    found: list[Import] = []
    # CPython 3.11 fails a parse with "AST constructor recursion depth mismatch" when a
    # collection inside it finalizes a coroutine an earlier test left behind (an agent
    # run's): collect first, so nothing is left to finalize during the parses.
    gc.collect()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(REPO_ROOT))

        def add(target: str, node: ast.AST, local: bool, module: str = module,
                rel: str = rel) -> None:
            # import a.b.c names a.b.c; a name that is not a module is an attribute of its parent
            while target and target not in modules:
                target = target.rpartition(".")[0]
            imp = Import(module, target, rel, getattr(node, "lineno", 0), local)
            if target and imp not in found:  # from .errors import A, B: one import of .errors
                found.append(imp)

        for node, local in _walk(tree.body, False):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        add(alias.name, node, local)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, _is_package(path), node.level, node.module)
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    # from . import _admin: the module; from .errors import X: .errors
                    add(submodule if submodule in modules else base, node, local)
            else:
                literal = _literal_import_call(node)
                if literal is not None:
                    target = (_resolve(module, _is_package(path), len(literal)
                                       - len(literal.lstrip(".")), literal.lstrip(".") or None)
                              if literal.startswith(".") else literal)
                    if target.split(".")[0] == PACKAGE:
                        add(target, node, local)
    return found


def _graph_edges(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """The edges that can make a cycle, each with the imports that make it."""
    modules = _modules()
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        if imp.target == imp.source or imp.target == PACKAGE:
            continue  # the package's __init__ re-exports everything: every module "imports" it
        if _is_package(modules[imp.source]) and imp.target.startswith(imp.source + "."):
            continue  # a package's __init__ importing its own submodules
        edges[(imp.source, imp.target)].append(imp)
    return edges


def _strongly_connected(nodes: set[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return components


def _elementary_cycles(component: list[str], succ: dict[str, set[str]],
                       limit: int = 200) -> list[list[str]]:
    """The simple cycles inside one component, each starting at its smallest module."""
    members = set(component)
    cycles: list[list[str]] = []
    for start in component:  # sorted: each cycle is found once, from its smallest member

        def extend(path: list[str], start: str = start) -> None:
            for nxt in sorted(succ.get(path[-1], ())):
                if len(cycles) >= limit or nxt not in members or nxt < start:
                    continue
                if nxt == start:
                    cycles.append([*path, start])
                elif nxt not in path:
                    extend([*path, nxt])

        extend([start])
    return cycles


def test_no_import_cycles() -> None:
    """No chain of imports between the package's modules leads back to where it started."""
    edges = _graph_edges(_imports())
    succ: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        succ[source].add(target)
    nodes = set(_modules())
    report: list[str] = []
    for component in _strongly_connected(nodes, succ):
        if len(component) < 2:
            continue
        report.append(f"cycle among {len(component)} modules: {', '.join(component)}")
        for cycle in _elementary_cycles(component, succ):
            report.append("  " + " -> ".join(cycle))
        for (source, target), sites in sorted(edges.items()):
            if source in component and target in component:
                for imp in sites:
                    kind = "in a function" if imp.local else "at module level"
                    report.append(f"    {imp.where()} {source} imports {target} ({kind})")
    assert not report, "import cycles:\n" + "\n".join(report)


def test_function_level_imports_only_load_optional_extras() -> None:
    """Package modules are imported at the top of a file, except the optional extras."""
    offending = [
        f"{imp.where()} {imp.target}" for imp in _imports()
        if imp.local and not any(imp.target == extra or imp.target.startswith(extra + ".")
                                 for extra in (OPTIONAL, CONTRIB))
    ]
    assert not offending, (
        "package modules imported inside a function or class body (import them at module "
        "level):\n" + "\n".join(offending))


def test_the_import_reader_resolves_relative_and_hidden_imports() -> None:
    """The reader resolves relative imports and tells module-level from function-level ones."""
    modules = _modules()
    assert {PACKAGE, f"{PACKAGE}.errors", f"{PACKAGE}._store", OPTIONAL} <= set(modules)
    assert _resolve(f"{PACKAGE}._task", False, 1, None) == PACKAGE
    assert _resolve(f"{PACKAGE}._task", False, 1, "errors") == f"{PACKAGE}.errors"
    assert _resolve(f"{PACKAGE}.web._data", False, 2, "_store") == f"{PACKAGE}._store"
    assert _resolve(f"{PACKAGE}.web", True, 1, "_app") == f"{PACKAGE}.web._app"
    assert _resolve(f"{PACKAGE}.web", True, 2, None) == PACKAGE
    imports = _imports()
    # The package's __init__ imports its submodules at module level, never TYPE_CHECKING ones.
    assert any(imp.source == PACKAGE and imp.target == f"{PACKAGE}.errors" and not imp.local
               for imp in imports)
    code = ("from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import x\n"
            "def f():\n    import y\n"
            "class C:\n    import z\n"
            "import w\n")
    seen = {(getattr(node, "names", [None])[0].name, local)
            for node, local in _walk(ast.parse(code).body, False)
            if isinstance(node, ast.Import) and node.names[0].name != "typing"}
    assert seen == {("y", True), ("z", True), ("w", False)}
    call = ast.parse("importlib.import_module('celery_duraflow.web')").body[0]
    assert isinstance(call, ast.Expr) and _literal_import_call(call.value) == OPTIONAL


# The store layer: the only modules that may speak SQLAlchemy (and so write SQL).
STORE_LAYER = {f"{PACKAGE}.{name}" for name in
               ("_db", "_records", "_schema", "_store", "_waits_store", "_joins_store",
                "_flow_schema", "_flow_store", "_admin", "_atomic",
                # durable schedules: their table and statements
                "_schedule_schema", "_schedules_store",
                # what the store's server says of its standbys (read at a worker's start)
                "_replication",
                # an atomic step's transaction on Django's connection, lent to SQLAlchemy
                "contrib.django._atomic")}


def test_only_the_store_layer_imports_sqlalchemy() -> None:
    """No module outside the store layer (the CLI and the web view included) imports SQLAlchemy."""
    offenders = []
    for module, path in sorted(_modules().items()):
        if module in STORE_LAYER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom)
                     and node.level == 0 else [])
            offenders += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}"
                          for name in names if name.split(".")[0] == "sqlalchemy"]
    assert offenders == [], "\n".join(offenders)
