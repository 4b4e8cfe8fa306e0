"""Every test says, in its docstring's first line, the behaviour it pins.

A reader of a failing test, or of the suite, learns what a user relies on from
that line ("A retry never charges the card twice") without reading the body.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions pytest collects: ``test*`` at module level and in ``Test*`` classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("test"):
                yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for member in node.body:
                if (isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef)
                        and member.name.startswith("test")):
                    yield member


def test_every_test_has_a_one_line_summary() -> None:
    """Every test function has a docstring whose first line states what it pins."""
    files = sorted(TESTS.rglob("*.py"))
    assert TESTS / "test_test_docstrings.py" in files
    missing: list[str] = []
    checked = 0
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for function in _test_functions(tree):
            checked += 1
            docstring = ast.get_docstring(function, clean=False)
            where = f"{path.relative_to(TESTS.parent)}:{function.lineno} {function.name}"
            if docstring is None:
                missing.append(f"{where}: no docstring")
            elif not docstring.split("\n", 1)[0].strip():
                missing.append(f"{where}: the docstring's first line is empty")
    assert checked > 100, f"only {checked} tests found under {TESTS}"
    assert not missing, "tests without a one-line summary:\n" + "\n".join(missing)
