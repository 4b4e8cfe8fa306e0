"""Preparing functions so that ``with step(...)`` can skip its body.

Python gives a context manager no way to skip the body of its ``with`` block
(PEP 377 was rejected), and tracing tricks break under coverage, debuggers and
one-line bodies. So, like pytest's assertion rewriting, the function's syntax
tree is rewritten once, when it is prepared::

    with step("book") as s:            with step("book") as s:
        s.result = book()       ->         if __duraflow_guard__():
                                               s.result = book()

Every ``with`` statement gets the guard; it is False only right after a step
that completed in an earlier attempt was entered, so other context managers
are unaffected. The code is compiled under the original file name and line
numbers, so tracebacks, coverage and debuggers point at the user's lines.

The guard reaches the function through a closure cell, never through the
module's globals, and its name in ``co_freevars`` is also what marks code as
prepared: :class:`~celery_duraflow.StepContext` refuses to be entered from
any frame whose code lacks it (fail closed).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import logging
import sys
import textwrap
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("celery_duraflow.rewrite")

GUARD_NAME = "__duraflow_guard__"
_PREPARED_ATTR = "__duraflow_prepared__"
_FACTORY_NAME = "__duraflow_factory__"

F = TypeVar("F", bound=Callable[..., Any])


def guard(fingerprint: str | None = None) -> bool:
    """False when the innermost entered step was replayed from the store.

    Called at the top of every ``with`` body with the fingerprint of that
    body's code; the steps entered by that ``with`` statement take it (and a
    replayed one compares it with the fingerprint it recorded).
    """
    from ._context import current_run

    ctx = current_run.get()
    if ctx is None or not ctx.stack:
        return True
    if ctx.entered:
        entered, ctx.entered = ctx.entered, []
        for step in entered:
            step.code_seen(fingerprint)
    return ctx.stack[-1]._should_run


# CPython 3.11 (3.11.7 here, at least) keeps one counter for every thread's AST
# construction, so two threads parsing at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython#106905; seen in this project's test suite).
# Worker threads fingerprint code while the main thread prepares tasks: every parse here
# goes through this lock.
_PARSE_LOCK = threading.Lock()


def _parse(source: str, filename: str = "<unknown>") -> ast.Module:
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
        tree = _parse(textwrap.dedent(inspect.getsource(code)))
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
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__
        target = inspect.unwrap(target)
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType):
        # A callable object: the code of its class's __call__.
        code = getattr(inspect.getattr_static(type(target), "__call__", None), "__code__", None)
    return _code_fingerprint(code) if isinstance(code, types.CodeType) else None


class _GuardWithBodies(ast.NodeTransformer):
    def __init__(self) -> None:
        self.count = 0

    def visit_With(self, node: ast.With) -> ast.With:
        # The body as written, before the guards of the `with` blocks inside it.
        fingerprint = ast.Constant(value=fingerprint_nodes(node.body))
        self.generic_visit(node)
        call = ast.Call(func=ast.Name(id=GUARD_NAME, ctx=ast.Load()), args=[fingerprint],
                        keywords=[])
        test = ast.If(test=call, body=node.body, orelse=[])
        # The guard belongs to the `with` line, so a skipped body marks none of its lines run.
        for new in (test, call, call.func, fingerprint):
            ast.copy_location(new, node)
            new.end_lineno, new.end_col_offset = node.lineno, node.col_offset
        node.body = [test]
        self.count += 1
        return node


def _has_with(node: ast.AST) -> bool:
    return any(isinstance(child, ast.With) for child in ast.walk(node))


def _find_code(code: types.CodeType, name: str, firstlineno: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == firstlineno:
                return const
            found = _find_code(const, name, firstlineno)
            if found is not None:
                return found
    return None


def _enclosing_class(fn: Callable[..., Any]) -> str | None:
    # "Outer.<locals>.Cls.method" -> "Cls": needed so that self.__x is mangled as before.
    parts = fn.__qualname__.split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>":
        return parts[-2]
    return None


def _rewrite(fn: types.FunctionType) -> types.FunctionType | None:
    """The prepared twin of ``fn``, or None when it has nothing to rewrite."""
    try:
        lines, first_line = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError):
        logger.debug("no source for %s; it stays unprepared", fn.__qualname__)
        return None
    source = "".join(lines)
    indented = bool(lines) and lines[0][:1] in (" ", "\t")
    try:
        # Parse indented source inside "if 1:" rather than dedenting it: column offsets
        # and multi-line strings stay exactly as written.
        tree = _parse("if 1:\n" + source if indented else source, filename=filename)
    except SyntaxError:
        logger.debug("source of %s does not parse on its own; it stays unprepared",
                     fn.__qualname__)
        return None
    body = tree.body[0].body if indented and isinstance(tree.body[0], ast.If) else tree.body
    func = body[0] if body else None
    if not isinstance(func, ast.FunctionDef) or func.name != fn.__name__:
        return None
    if not _has_with(func):
        return None
    func.decorator_list = []
    ast.increment_lineno(func, first_line - (2 if indented else 1))
    _GuardWithBodies().visit(func)

    # Compile inside a factory whose parameters are the function's free variables
    # (plus the guard), so that the compiler gives the new code the same closure
    # layout; inside a class of the same name when it is a method, for name mangling.
    holder: ast.stmt = func
    owner = _enclosing_class(fn)
    if owner is not None:
        holder = ast.ClassDef(name=owner, bases=[], keywords=[], body=[func],
                              decorator_list=[])
    freevars = [name for name in fn.__code__.co_freevars if name != GUARD_NAME]
    factory = ast.FunctionDef(
        name=_FACTORY_NAME,
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in [*freevars, GUARD_NAME]],
                           kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[holder],
        decorator_list=[],
        returns=None,
    )
    if sys.version_info >= (3, 12):  # the field exists, and is required, from 3.12 on
        for node in (holder, factory):
            node.type_params = []
    module = ast.Module(body=[factory], type_ignores=[])
    for node in (factory, factory.args, *factory.args.args, holder):
        ast.copy_location(node, func)
    ast.fix_missing_locations(module)
    compiled = compile(module, filename, "exec", dont_inherit=True)
    new_code = _find_code(compiled, fn.__code__.co_name, func.lineno)
    if new_code is None or GUARD_NAME not in new_code.co_freevars:
        return None

    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    cells[GUARD_NAME] = types.CellType(guard)
    try:
        closure = tuple(cells[name] for name in new_code.co_freevars)
    except KeyError:  # pragma: no cover - the compiler found a free name the original did not
        return None
    new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(new, fn, assigned=("__module__", "__name__", "__qualname__",
                                                "__doc__", "__annotations__"), updated=())
    new.__dict__.update(fn.__dict__)
    return new


def prepare(fn: F) -> F:
    """Return ``fn`` prepared for ``with step(...)`` blocks (idempotent).

    Functions without ``with`` statements, and functions whose source cannot
    be read, are returned unchanged: a ``with step`` reached in them raises
    :class:`~celery_duraflow.errors.StepNotPrepared`.
    """
    if not isinstance(fn, types.FunctionType) or getattr(fn, _PREPARED_ATTR, False):
        return fn
    if getattr(fn, "__wrapped__", None) is not None:
        # inspect would read the source of the wrapped function, not of this wrapper.
        return fn
    if fn.__name__ == "<lambda>":
        return fn
    new = _rewrite(fn)
    if new is None:
        return fn
    setattr(new, _PREPARED_ATTR, True)
    result: F = new  # type: ignore[assignment]
    return result


def durable(fn: F) -> F:
    """Prepare a helper function that contains ``with step(...)`` blocks.

    Task functions and ``run`` methods of :class:`~celery_duraflow.DurableTask`
    subclasses are prepared automatically; a helper they call is not, and
    entering a step in it raises ``StepNotPrepared`` until it is decorated::

        @durable
        def charge(order):
            with step("charge") as s:
                s.result = payments.charge(order.total, idempotency_key=s.idempotency_key)
            return s.result

    Put ``@durable`` directly on the ``def`` (innermost, below other decorators).
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"@durable decorates plain functions, got {fn!r}")
    return prepare(fn)
