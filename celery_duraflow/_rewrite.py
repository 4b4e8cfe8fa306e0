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
import functools
import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

from ._fingerprint import fingerprint_nodes, parse_source
from ._step import BROKE, CONTINUED, FELL, GUARD_NAME, LEAVE_NAME, RETURNED, guard, leave
from .errors import UnsupportedCode

logger = logging.getLogger("celery_duraflow.rewrite")

_PREPARED_ATTR = "__duraflow_prepared__"
_FACTORY_NAME = "__duraflow_factory__"

F = TypeVar("F", bound=Callable[..., Any])


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


def _suspends(body: list[ast.stmt]) -> ast.Yield | ast.YieldFrom | ast.Await | None:
    """The first yield, yield from or await in ``body`` that suspends this function."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Yield | ast.YieldFrom | ast.Await):
            return node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))
    return None


def _looks_like_step(node: ast.With) -> bool:
    """``with step(...)`` (or ``x.step(...)``): a step beyond doubt."""
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call):
            func = call.func
            name = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else None)
            if name == "step":
                return True
    return False


def _at_line_of(new: ast.expr | ast.stmt, where: ast.AST) -> None:
    """Place a node the rewrite added on the first line of ``where``."""
    ast.copy_location(new, where)
    new.end_lineno, new.end_col_offset = new.lineno, new.col_offset


class _GuardWithBodies(ast.NodeTransformer):
    """Guard every ``with`` body, and record how control leaves it.

    ``with ITEMS: BODY`` becomes::

        with ITEMS:
            __duraflow_wN__ = __duraflow_guard__(fingerprint, in_loop, suspends)
            if __duraflow_wN__.run:
                BODY         # return/break/continue leaving it tell __duraflow_leave__
                __duraflow_wN__.left = 0
            else:            # replayed: leave the way the recorded run left
                if __duraflow_wN__.left == 1:
                    return __duraflow_leave__((<enclosing blocks>, __duraflow_wN__), 1,
                                              __duraflow_wN__.value)
                elif __duraflow_wN__.left == 2: __duraflow_leave__(...); break
                elif __duraflow_wN__.left == 3: __duraflow_leave__(...); continue

    The ``break``/``continue`` arms exist only where the ``with`` sits in a
    loop of its own function; in a class body only the guard is added.
    """

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.count = 0
        # The block variables of the `with` statements around the current node, in the
        # current function, outermost first; and how many of them are outside the
        # innermost loop (None: not in a loop).
        self.blocks: list[str] = []
        self.loop_start: int | None = None
        self.in_class = False

    def _scope(self, node: ast.AST, *, in_class: bool) -> ast.AST:
        saved = self.blocks, self.loop_start, self.in_class
        self.blocks, self.loop_start, self.in_class = [], None, in_class
        try:
            return self.generic_visit(node)
        finally:
            self.blocks, self.loop_start, self.in_class = saved

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return self._scope(node, in_class=False)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        return self._scope(node, in_class=False)

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return self._scope(node, in_class=False)

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return self._scope(node, in_class=True)

    def _loop(self, node: ast.For | ast.AsyncFor | ast.While) -> ast.AST:
        saved = self.loop_start
        self.loop_start = len(self.blocks)
        node.body = self._statements(node.body)
        self.loop_start = saved
        # `else:` runs after the loop: a break in it belongs to an outer loop.
        node.orelse = self._statements(node.orelse)
        return node

    visit_For = visit_AsyncFor = visit_While = _loop

    def _statements(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            new = self.visit(stmt)
            out.extend(new if isinstance(new, list) else [new])
        return out

    def _leave(self, blocks: list[str], code: int, value: ast.expr | None,
               where: ast.AST) -> ast.Call:
        call = _call(LEAVE_NAME,
                     ast.Tuple(elts=[ast.Name(id=b, ctx=ast.Load()) for b in blocks],
                               ctx=ast.Load()),
                     ast.Constant(value=code), value or ast.Constant(value=None))
        for new in ast.walk(call):
            if isinstance(new, ast.expr):
                _at_line_of(new, where)
        return call

    def visit_Return(self, node: ast.Return) -> ast.AST:
        self.generic_visit(node)
        if not self.blocks:
            return node
        node.value = self._leave(self.blocks, RETURNED, node.value, node)
        return node

    def _jump(self, node: ast.Break | ast.Continue, code: int) -> ast.AST | list[ast.stmt]:
        if self.loop_start is None or len(self.blocks) == self.loop_start:
            return node
        call = ast.Expr(value=self._leave(self.blocks[self.loop_start:], code, None, node))
        ast.copy_location(call, node)
        return [call, node]

    def visit_Break(self, node: ast.Break) -> ast.AST | list[ast.stmt]:
        return self._jump(node, BROKE)

    def visit_Continue(self, node: ast.Continue) -> ast.AST | list[ast.stmt]:
        return self._jump(node, CONTINUED)

    def visit_With(self, node: ast.With) -> ast.With:
        # The body as written, before the guards of the `with` blocks inside it.
        fingerprint = ast.Constant(value=fingerprint_nodes(node.body))
        suspends = _suspends(node.body)
        if suspends is not None and _looks_like_step(node):
            what = {ast.Yield: "yield", ast.YieldFrom: "yield from", ast.Await: "await"}[
                type(suspends)]
            raise UnsupportedCode(
                f"`{what}` inside the body of `with step(...)` at {self.filename}:"
                f"{suspends.lineno} would suspend the step half-way, and a replay could not "
                "resume it there. Compute the value inside the step and yield or await "
                "outside it, or split the work into two steps.")
        node.items = [self.visit(item) for item in node.items]
        in_loop = self.loop_start is not None
        guard = _call(GUARD_NAME, fingerprint, ast.Constant(value=in_loop),
                      ast.Constant(value=suspends is not None))
        if self.in_class:
            node.body = self._statements(node.body)
            test: ast.stmt = ast.If(test=ast.Attribute(value=guard, attr="run",
                                                       ctx=ast.Load()),
                                    body=node.body, orelse=[])
            new_body = [test]
        else:
            name = f"__duraflow_w{self.count}__"
            self.count += 1
            self.blocks.append(name)
            body = self._statements(node.body)
            self.blocks.pop()
            block = ast.Name(id=name, ctx=ast.Load())
            fell = ast.Assign(
                targets=[ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="left",
                                       ctx=ast.Store())],
                value=ast.Constant(value=FELL))
            replay: list[ast.stmt] = [ast.If(
                test=ast.Compare(left=ast.Attribute(value=block, attr="left", ctx=ast.Load()),
                                 ops=[ast.Eq()], comparators=[ast.Constant(value=RETURNED)]),
                body=[ast.Return(value=self._leave(
                    [*self.blocks, name], RETURNED,
                    ast.Attribute(value=block, attr="value", ctx=ast.Load()), node))],
                orelse=[])]
            if in_loop:
                assert self.loop_start is not None
                for code, jump in ((BROKE, ast.Break()), (CONTINUED, ast.Continue())):
                    replay.append(ast.If(
                        test=ast.Compare(left=ast.Attribute(value=block, attr="left",
                                                            ctx=ast.Load()),
                                         ops=[ast.Eq()], comparators=[ast.Constant(value=code)]),
                        body=[ast.Expr(value=self._leave([*self.blocks[self.loop_start:], name],
                                                         code, None, node)), jump],
                        orelse=[]))
            test = ast.If(test=ast.Attribute(value=block, attr="run", ctx=ast.Load()),
                          body=[*body, fell], orelse=replay)
            new_body = [ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=guard),
                        test]
        # What was added belongs to the `with` line, so a skipped body marks none of its
        # lines run (nor do the lines that re-enact a recorded return, break or continue).
        for stmt in new_body:
            for new in ast.walk(stmt):
                if isinstance(new, ast.expr | ast.stmt) and not hasattr(new, "lineno"):
                    _at_line_of(new, node)
        node.body = new_body
        return node


# What the prepared code calls, passed in through closure cells, never through globals.
_RUNTIME: dict[str, Callable[..., Any]] = {GUARD_NAME: guard, LEAVE_NAME: leave}


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


def _enclosing_class(qualname: str) -> str | None:
    # "Outer.<locals>.Cls.method" -> "Cls": needed so that self.__x is mangled as before.
    parts = qualname.split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>":
        return parts[-2]
    return None


@functools.lru_cache(maxsize=1024)
def _rewritten_code(code: types.CodeType, qualname: str) -> types.CodeType | None:
    """The code of the prepared twin of a function with this code, or None.

    Once per code object: a task defined again (one per app, a test suite's
    fixtures) has the same code, and reading, parsing and compiling its source
    again would cost milliseconds each time. A refusal (UnsupportedCode) is
    raised every time, never remembered.
    """
    try:
        lines, first_line = inspect.getsourcelines(code)
        filename = inspect.getsourcefile(code) or code.co_filename
    except (OSError, TypeError):
        logger.debug("no source for %s; it stays unprepared", qualname)
        return None
    source = "".join(lines)
    indented = bool(lines) and lines[0][:1] in (" ", "\t")
    try:
        # Parse indented source inside "if 1:" rather than dedenting it: column offsets
        # and multi-line strings stay exactly as written.
        tree = parse_source("if 1:\n" + source if indented else source, filename=filename)
    except SyntaxError:
        logger.debug("source of %s does not parse on its own; it stays unprepared",
                     qualname)
        return None
    body = tree.body[0].body if indented and isinstance(tree.body[0], ast.If) else tree.body
    func = body[0] if body else None
    if not isinstance(func, ast.FunctionDef) or func.name != code.co_name:
        return None
    if not _has_with(func):
        return None
    func.decorator_list = []
    ast.increment_lineno(func, first_line - (2 if indented else 1))
    _GuardWithBodies(filename).visit(func)

    # Compile inside a factory whose parameters are the function's free variables
    # (plus the guard), so that the compiler gives the new code the same closure
    # layout. The def sits in a class body, whose names no function sees: a function
    # that calls itself by its (global) name keeps finding it among the globals. The
    # class has the method's class name, for name mangling, or "_", which mangles nothing.
    holder = ast.ClassDef(name=_enclosing_class(qualname) or "_", bases=[], keywords=[],
                          body=[func], decorator_list=[])
    freevars = [name for name in code.co_freevars if name not in _RUNTIME]
    factory = ast.FunctionDef(
        name=_FACTORY_NAME,
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in [*freevars, *_RUNTIME]],
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
    new_code = _find_code(compiled, code.co_name, func.lineno)
    if new_code is None or GUARD_NAME not in new_code.co_freevars:
        return None
    return new_code



def _rewrite(fn: types.FunctionType) -> types.FunctionType | None:
    """The prepared twin of ``fn``, or None when it has nothing to rewrite."""
    new_code = _rewritten_code(fn.__code__, fn.__qualname__)
    if new_code is None:
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    cells.update((name, types.CellType(runtime)) for name, runtime in _RUNTIME.items())
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
    refuse_async(fn, "@durable")
    return prepare(fn)


def refuse_async(fn: Callable[..., Any], what: str) -> None:
    """Refuse a coroutine function (or async generator) where it is defined.

    Celery calls a task's ``run`` and waits for what it returns, so an
    ``async def`` body would only hand back a coroutine that nothing runs;
    and a step's run context does not follow an event loop's tasks.
    """
    target = inspect.unwrap(fn)
    if inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
        code = getattr(target, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise UnsupportedCode(
            f"{what} on async def {fn.__qualname__}(){where}: Celery calls tasks "
            "synchronously, so its body would never run. Write the task as a plain def and "
            "run the async code inside it with asyncio.run(...), or put each side effect "
            "in a step(...).run(fn) of a plain function.")
