"""Fingerprints of code: what a step body or a task function does, as a short digest.

A fingerprint is taken from the syntax tree without positions or comments, so moving or
reindenting code keeps it, and changing what the code does changes it. Recorded with
each step and each run, and compared on a replay (``duraflow_on_code_change``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import textwrap
import threading
import types
from typing import Any

# CPython 3.11 (3.11.7 here, at least) keeps one counter for every thread's AST
# construction, so two threads parsing at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython#106905; seen in this project's test suite).
# Worker threads fingerprint code while the main thread prepares tasks: every parse here
# goes through this lock.
_PARSE_LOCK = threading.Lock()


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    with _PARSE_LOCK:
        try:
            return ast.parse(source, filename=filename)
        except SystemError:
            # Someone else's parse (not under this lock) ran at the same moment: once more.
            return ast.parse(source, filename=filename)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_nodes(nodes: list[ast.stmt]) -> str:
    """A fingerprint of some code: its syntax tree without positions or comments.

    Moving code to other lines, reindenting it or editing comments keeps the
    fingerprint; changing what it does (or its docstrings) changes it.
    """
    module = ast.Module(body=nodes, type_ignores=[])
    return _digest(ast.dump(module, annotate_fields=False, include_attributes=False))


@functools.lru_cache(maxsize=2048)
def _code_fingerprint(code: types.CodeType) -> str:
    try:
        tree = parse_source(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        # No source: the bytecode and constants stand in for it.
        return _bytecode_fingerprint(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            node.decorator_list = []  # retry options and the like are not the code
    return fingerprint_nodes(tree.body)


def _bytecode_fingerprint(code: types.CodeType) -> str:
    # Nested code objects by their own fingerprint: their repr holds a memory address.
    consts = [_bytecode_fingerprint(c) if isinstance(c, types.CodeType) else repr(c)
              for c in code.co_consts]
    return _digest(code.co_code.hex() + repr(consts) + repr(code.co_names))


def code_fingerprint(fn: Any) -> str | None:
    """A fingerprint of a function's code, or None for callables without Python code."""
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    if code is not None and getattr(target, "__wrapped__", None) is None:
        # A plain function (most tasks and step functions): no unwrapping to do.
        return _code_fingerprint(code) if isinstance(code, types.CodeType) else None
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__
        target = inspect.unwrap(target)
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType):
        # A callable object: the code of its class's __call__.
        code = getattr(inspect.getattr_static(type(target), "__call__", None), "__code__", None)
    return _code_fingerprint(code) if isinstance(code, types.CodeType) else None
