"""Celery's canvas around durable tasks: eager chains, and canvases sent from inside a run.

**Eager chains give each link its own task id, as a worker does.** Celery's eager
``chain.apply`` passes the chain's options, the chain's frozen task id among them, to
every link, so all links of an eager chain run under one id. For plain
tasks that only makes the intermediate results share an id; for durable tasks one id is
one run, so the second link would find the first one's record (and fail with
RunArgumentsMismatch, or return the first link's result). On a worker each link has an
id of its own and the chain's id belongs to its last task: the wrapper below makes the
eager path do the same, for chains with a durable link.

**A group, chord or chain sent from inside a durable run is a step of that run.** Its
send is recorded like any step's output (the ids Celery gave its tasks, as
``result.as_tuple()``), so a retry of the run hands back the same result handle and
sends nothing again. While it is sent, the ids Celery freezes into its tasks (header,
body, group id, chord callback) are derived from the run's id and the step's key
instead of drawn at random: an attempt that died between the send and its record sends
the canvas again under the same ids, and each durable task in it is the same run as
before, which runs once. A chord's join is then exactly-once when its body is durable
and the result backend counts each header task once however often its result arrives
(Redis keys each part by task id and index; backends that join by polling, such as the
database backend, read each result by id). A chord with a body that is a plain task, or
on a backend that counts parts by incrementing a counter, is refused before anything is
sent or recorded. Plain tasks in a group, a chain or a chord's header are sent as in
plain Celery: a duplicate delivery runs them again.
"""

from __future__ import annotations

import threading
import uuid as _uuidlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from celery.canvas import _chain, _chord, group, maybe_signature
from celery.result import result_from_tuple
from kombu.utils.uuid import uuid as _random_uuid

from ._context import RunContext, current_run
from ._step import step
from .errors import UnsupportedCode

_installed = False
_lock = threading.Lock()

# Celery's own tasks (celery.accumulate, celery.chord_unlock, celery.backend_cleanup...)
# have no steps and no side effects of the user's. An app-wide task_cls of DurableTask
# makes them DurableTask subclasses; they run as plain Celery tasks all the same.
CELERY_BUILTIN_PREFIX = "celery."

# The namespace of the task ids a canvas sent from a durable run is given.
_CANVAS_NAMESPACE = _uuidlib.UUID("6f1f3c52-2f8b-4c8e-9a43-6d2b1f0e5a71")


class _Ids:
    """The task ids of one send, derived from the run's id and the step's key, in the
    order Celery asks for them (the same canvas asks in the same order every time)."""

    __slots__ = ("count", "seed")

    def __init__(self, seed: str) -> None:
        self.seed = seed
        self.count = 0

    def next(self) -> str:
        self.count += 1
        return str(_uuidlib.uuid5(_CANVAS_NAMESPACE, f"{self.seed}/{self.count}"))


# Set while a durable run sends a canvas: where Celery's ids come from, and a guard so
# that the group inside a chord (or a chain) is sent as part of the outer step.
_ids: ContextVar[_Ids | None] = ContextVar("celery_duraflow_canvas_ids", default=None)
# Set while Task.replace sends the replacement: the run records that itself.
_as_celery_does: ContextVar[bool] = ContextVar("celery_duraflow_canvas_plain", default=False)


@contextmanager
def sent_as_celery_does() -> Iterator[None]:
    """Inside this block a canvas is sent as plain Celery sends it, not as a step (the
    send of a replacement, whose run records the replacement itself)."""
    token = _as_celery_does.set(True)
    try:
        yield
    finally:
        _as_celery_does.reset(token)


def canvas_uuid() -> str:
    """Celery's ``uuid()`` for the canvas: derived while a durable run sends one, random
    (kombu's) everywhere else."""
    ids = _ids.get()
    return ids.next() if ids is not None else _random_uuid()


def _has_durable_link(chain: Any, durable: type) -> bool:
    for link in chain.tasks:
        try:
            task = link.type
        except Exception:  # a group, a chord, a signature of an unknown task
            continue
        if isinstance(task, durable):
            return True
    return False


def _parts(sig: Any) -> tuple[str, list[Any]] | None:
    """A canvas's kind and its parts (a chord's: its header group, then its body), or
    None for a single task's signature."""
    if isinstance(sig, _chord):
        header = sig.tasks
        parts = [header if isinstance(header, group) else group(header, app=sig.app)]
        return "chord", parts + ([sig.body] if sig.body is not None else [])
    if isinstance(sig, (group, _chain)):
        return ("group" if isinstance(sig, group) else "chain"), list(sig.tasks)
    return None


def _signatures(sig: Any) -> Iterator[Any]:
    """Every task signature in a canvas, depth first (a dict made a signature)."""
    sig = maybe_signature(sig)
    parts = _parts(sig)
    if parts is None:
        yield sig
        return
    for part in parts[1]:
        yield from _signatures(part)


def _shape(sig: Any) -> Any:
    """What a canvas sends, by task names (the step's input: a retry that would send
    another canvas is refused rather than handed the old one's ids)."""
    sig = maybe_signature(sig)
    parts = _parts(sig)
    if parts is None:
        return sig.get("task") if isinstance(sig, dict) else None
    return [parts[0], [_shape(part) for part in parts[1]]]


def _refuse(ctx: RunContext, name: str, why: str) -> None:
    key = ctx.peek_key(name)[1]
    error = UnsupportedCode(
        f"task {ctx.task_id} sends a chord from inside its run (step {key!r}), {why} "
        "Nothing was sent or recorded.", task_id=ctx.task_id, step_key=key)
    ctx.fatal = error  # every retry would reach the same chord
    raise error


def _check_chord(ctx: RunContext, sig: Any, body: Any, durable: type) -> None:
    """Refuse a chord whose join (``body``: the chord's, or one given when it is called)
    could run twice or miss a result."""
    app = sig.app
    for inner in _signatures(body) if body is not None else ():
        name = getattr(inner, "task", None)
        registered = app.tasks.get(name) if isinstance(name, str) else None
        if (registered is not None and not isinstance(registered, durable)
                and not registered.name.startswith(CELERY_BUILTIN_PREFIX)):
            _refuse(ctx, "celery.chord",
                    f"and its body runs {name}, which is not a DurableTask: a duplicate "
                    "delivery of the body would run the join again. Give it base=DurableTask.")
    from celery.backends.base import BaseKeyValueStoreBackend  # only a chord needs it

    backend = app.backend
    if (getattr(backend, "implements_incr", False) and type(backend).on_chord_part_return
            is BaseKeyValueStoreBackend.on_chord_part_return):
        _refuse(ctx, "celery.chord",
                f"on the result backend {type(backend).__name__}, which counts the header's "
                "results by incrementing a counter: a header task delivered twice would be "
                "counted twice and the join would run before every result arrived. Use the "
                "Redis result backend, or one that joins by reading results (the database "
                "backend), for chords in durable runs.")


def _durable_send(kind: str, original: Callable[..., Any], durable: type,
                  ) -> Callable[..., Any]:
    """``apply_async`` of a canvas class that, inside a durable run, sends as a step."""

    def apply_async(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        ctx = current_run.get()
        if ctx is None or _ids.get() is not None or _as_celery_does.get():
            return original(self, args, kwargs, **options)
        app = self.app
        if app.conf.task_always_eager:
            return original(self, args, kwargs, **options)
        shape = _shape(self)
        if kind == "chord":
            # chord(header)(body) gives the body when the chord is called.
            body = (kwargs or {}).get("body") or self.body
            _check_chord(ctx, self, body, durable)
            shape = [*shape, _shape(body)] if body is not self.body else shape
        sent: list[Any] = []

        def send(seed: str) -> Any:
            token = _ids.set(_Ids(seed))
            try:
                result = original(self, args, kwargs, **options)
            finally:
                _ids.reset(token)
            sent.append(result)
            return result.as_tuple()

        s = step(f"celery.{kind}", input=shape)
        stored = s.run(send, f"{ctx.task_id}/{s.key}")
        return sent[0] if sent else result_from_tuple(stored, app)

    apply_async.__wrapped__ = original  # type: ignore[attr-defined]
    apply_async.__doc__ = original.__doc__
    return apply_async


def install_canvas_fixes(durable: type) -> None:
    """Wrap Celery's eager ``chain.apply``, and the ``apply_async`` of groups, chords and
    chains, once per process; ``durable`` is DurableTask."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        original = _chain.apply

        def apply(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            task_id = options.get("task_id") or self.options.get("task_id")
            if task_id is None or len(self.tasks) < 2 or not _has_durable_link(self, durable):
                return original(self, args, kwargs, **options)
            options = {key: value for key, value in options.items() if key != "task_id"}
            clone = self.clone()
            clone.options.pop("task_id", None)
            links = [link.clone() for link in clone.tasks]
            # The chain's id is its last task's, as when the chain is frozen for a worker;
            # the other links keep the ids they were frozen with, or get new ones.
            links[-1].set(task_id=task_id)
            clone.tasks = links
            return original(clone, args, kwargs, **options)

        apply.__wrapped__ = original  # type: ignore[attr-defined]
        apply.__doc__ = original.__doc__
        _chain.apply = apply

        import celery.app.base
        import celery.backends.base
        import celery.canvas

        for cls, kind in ((group, "group"), (_chord, "chord"), (_chain, "chain")):
            cls.apply_async = _durable_send(kind, cls.apply_async, durable)
        for module in (celery.canvas, celery.app.base, celery.backends.base):
            module.uuid = canvas_uuid
        _installed = True
