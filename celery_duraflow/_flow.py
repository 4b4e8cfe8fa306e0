"""Flow control across every worker: concurrency per key, rate limits, dedupe of sends.

Declared on a durable task::

    @app.task(base=DurableTask, duraflow_limits=[
        Concurrency(2, key="tenant_id"),           # 2 runs per tenant at once
        RateLimit(100, per=60, scope="maps-api"),  # 100 attempts a minute, all tasks
    ], duraflow_dedupe=Dedupe(key="order_id", window=3600))
    def charge(order_id, tenant_id): ...

A key is a parameter name of the task (its value must be a string or an
integer), a function called with the task's arguments that returns a string,
or None (one key for the whole scope). The scope is the task's name unless
given; limits of several tasks with one scope share their slots.

Everything is decided in the store, before the task's body runs:

- **Concurrency**: an attempt takes a slot of its key, or the run is queued and
  waits as a durable wait does (``waiting``, no lease, no worker, no retry
  spent) until a slot is handed to it, oldest first. The slot is the
  attempt's: it stops being held the moment the attempt's lease ends (the run
  finished, failed, retried, suspended, or its worker died and the lease
  expired), and the next run in the queue is sent at once, or by the sweep.
- **RateLimit**: each attempt that gets past the concurrency limits uses one of
  ``limit`` calls per ``per`` seconds of the store's clock; over it, the run
  sleeps until the oldest use leaves the window.
- **Dedupe**: a send whose key was sent within ``window`` seconds does not send
  anything; it returns the result handle of the run that was sent.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import shared_task
from celery.utils import uuid

from . import _clock
from ._config import config_for_app
from ._context import RunContext, Suspended
from ._flow_schema import FLOW_KEY_LENGTH, SCOPE_LENGTH
from ._flow_store import DEBOUNCE_WAIT, RATE_WAIT, slot_label
from ._limits import shown
from ._records import SLEEPING, WAITING
from ._send import eta_limit, recorded_headers, routing_of, send_run
from ._serialization import encode_arguments, get_serializer
from ._store import Store, store_for
from .errors import ConfigurationError, FlowKeyError, LeaseLost, StoreUnavailable
from .signals import limit_waited, slot_taken

logger = logging.getLogger("celery_duraflow.flow")

#: What a key may be: a parameter name, a function of the task's arguments, or None.
KeySpec = str | Callable[..., str] | None


def _check_key_spec(key: object, what: str) -> None:
    if key is None or callable(key):
        return
    if not isinstance(key, str) or not key.isidentifier():
        raise ConfigurationError(
            f"{what}: key={shown(key)} is neither a parameter name of the task, a function "
            "of the task's arguments returning a string, nor None (one key for all runs).")


def _check_limit(limit: object, what: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(
            f"{what}: the limit is {shown(limit)}; it must be a whole number of at least 1.")
    return limit


def _check_scope(scope: object, what: str) -> None:
    if scope is None:
        return
    if not isinstance(scope, str) or not scope or len(scope) > SCOPE_LENGTH \
            or "\x00" in scope or "/" in scope:
        raise ConfigurationError(
            f"{what}: scope={shown(scope)} must be a non-empty string of at most "
            f"{SCOPE_LENGTH} characters with no '/' or NUL in it.")


def _check_seconds(value: object, what: str, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not math.isfinite(seconds) or seconds <= 0 or seconds > 100 * 365 * 86400:
        raise ConfigurationError(
            f"{what}: {name}={shown(value)} must be a finite number of seconds (or a "
            "timedelta) above 0 and at most 100 years.")
    return float(seconds)


@dataclass(frozen=True)
class Concurrency:
    """At most ``limit`` attempts of runs with the same key run at once, on every worker."""

    limit: int
    key: KeySpec = None
    scope: str | None = None

    def __post_init__(self) -> None:
        what = f"Concurrency({self.limit!r})"
        _check_limit(self.limit, what)
        _check_key_spec(self.key, what)
        _check_scope(self.scope, what)


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` attempts per ``per`` seconds with the same key, on every worker."""

    limit: int
    per: float | timedelta
    key: KeySpec = None
    scope: str | None = None

    def __post_init__(self) -> None:
        what = f"RateLimit({self.limit!r}, per={self.per!r})"
        _check_limit(self.limit, what)
        _check_seconds(self.per, what, "per")
        _check_key_spec(self.key, what)
        _check_scope(self.scope, what)

    @property
    def seconds(self) -> float:
        return _check_seconds(self.per, "RateLimit", "per")


@dataclass(frozen=True)
class Dedupe:
    """A send whose key was sent in the last ``window`` seconds returns that run's handle."""

    key: KeySpec
    window: float | timedelta
    scope: str | None = None

    def __post_init__(self) -> None:
        what = f"Dedupe(key={self.key!r})"
        if self.key is None:
            raise ConfigurationError(f"{what}: a dedupe needs a key.")
        _check_key_spec(self.key, what)
        _check_seconds(self.window, what, "window")
        _check_scope(self.scope, what)

    @property
    def seconds(self) -> float:
        return _check_seconds(self.window, "Dedupe", "window")


@dataclass(frozen=True)
class Debounce:
    """Sends of one key close together make one run.

    ``mode="trailing"`` (the default): the run starts ``delay`` seconds after the
    last send of the burst (no later than ``max_delay`` after its first), with
    the last send's arguments. ``mode="leading"``: the first send runs at once;
    sends within ``delay`` of the one before join it.
    """

    key: KeySpec
    delay: float | timedelta
    max_delay: float | timedelta | None = None
    mode: str = "trailing"
    scope: str | None = None

    def __post_init__(self) -> None:
        what = f"Debounce(key={self.key!r})"
        if self.key is None:
            raise ConfigurationError(f"{what}: a debounce needs a key.")
        _check_key_spec(self.key, what)
        delay = _check_seconds(self.delay, what, "delay")
        if self.max_delay is not None and _check_seconds(self.max_delay, what,
                                                         "max_delay") < delay:
            raise ConfigurationError(f"{what}: max_delay={self.max_delay!r} is shorter than "
                                     f"delay={self.delay!r}.")
        if self.mode not in ("trailing", "leading"):
            raise ConfigurationError(f"{what}: mode={self.mode!r} must be 'trailing' or "
                                     "'leading'.")
        _check_scope(self.scope, what)

    @property
    def seconds(self) -> float:
        return _check_seconds(self.delay, "Debounce", "delay")

    @property
    def max_seconds(self) -> float | None:
        return (None if self.max_delay is None
                else _check_seconds(self.max_delay, "Debounce", "max_delay"))


Limit = Concurrency | RateLimit


def check_declaration(name: str, run: Any, limits: object, dedupe: object,
                      debounce: object = None) -> None:
    """Refuse, when the task is defined, flow control that could not be applied."""
    what = f"task {name}"
    if debounce is not None and not isinstance(debounce, Debounce):
        raise ConfigurationError(
            f"{what}: duraflow_debounce={shown(debounce)} must be a Debounce or None.")
    if debounce is not None and dedupe is not None:
        raise ConfigurationError(
            f"{what}: duraflow_dedupe and duraflow_debounce both decide what a send does; "
            "keep one (a leading Debounce is a Dedupe whose window each send extends).")
    if not isinstance(limits, list | tuple):
        raise ConfigurationError(
            f"{what}: duraflow_limits={shown(limits)} must be a list of Concurrency and "
            "RateLimit.")
    seen: set[tuple[str, str | None, int]] = set()
    for limit in limits:
        if not isinstance(limit, Concurrency | RateLimit):
            raise ConfigurationError(
                f"{what}: duraflow_limits holds {shown(limit)}, which is neither a Concurrency "
                "nor a RateLimit.")
        mark = (type(limit).__name__, limit.scope, id(limit.key) if callable(limit.key)
                else hash(limit.key))
        if mark in seen:
            raise ConfigurationError(
                f"{what}: duraflow_limits holds two {type(limit).__name__} limits of the same "
                "scope and key; keep one.")
        seen.add(mark)
    if dedupe is not None and not isinstance(dedupe, Dedupe):
        raise ConfigurationError(
            f"{what}: duraflow_dedupe={shown(dedupe)} must be a Dedupe or None.")
    for spec in [*(limit.key for limit in limits),
                 *([dedupe.key] if isinstance(dedupe, Dedupe) else []),
                 *([debounce.key] if isinstance(debounce, Debounce) else [])]:
        if isinstance(spec, str) and callable(run):
            _check_parameter(what, run, spec)


@functools.lru_cache(maxsize=512)
def _parameters(run: Any) -> inspect.Signature | None:
    """The signature of a task's ``run`` (read once: each attempt of a keyed limit binds
    its arguments to it)."""
    try:
        return inspect.signature(run)
    except (TypeError, ValueError):
        return None


def _check_parameter(what: str, run: Any, name: str) -> None:
    signature = _parameters(run)
    if signature is None:
        return
    params = signature.parameters
    if name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    raise ConfigurationError(
        f"{what}: key={name!r} names no parameter of the task (it takes "
        f"{', '.join(params) or 'no arguments'}). Name one, or give a function.")


def key_of(spec: KeySpec, task: Any, args: Sequence[Any], kwargs: dict[str, Any], *,
           task_id: str | None, what: str) -> str:
    """The key ``spec`` gives the run with these arguments; FlowKeyError if it has none."""
    where = f"{what} of task {task_id or '(not sent yet)'} ({task.name})"
    if spec is None:
        return ""
    if callable(spec):
        try:
            value: object = spec(*args, **kwargs)
        except Exception as error:
            raise FlowKeyError(
                f"the key function of {where} raised {type(error).__name__}: {error}. Nothing "
                "ran; fix the function so that it returns a string for these arguments.",
                task_id=task_id) from error
        if not isinstance(value, str):
            raise FlowKeyError(
                f"the key function of {where} returned {shown(value)} "
                f"({type(value).__name__}), not a string. Nothing ran; return a string.",
                task_id=task_id)
    else:
        signature = _parameters(task.run)
        try:
            bound = signature.bind(*args, **kwargs) if signature is not None else None
        except TypeError as error:
            raise FlowKeyError(
                f"the arguments of {where} do not fit the task ({error}), so key {spec!r} "
                "has no value. Nothing ran.", task_id=task_id) from error
        if bound is not None:
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            for param in signature.parameters.values() if signature is not None else ():
                if param.kind is inspect.Parameter.VAR_KEYWORD:
                    arguments.update(arguments.pop(param.name, {}) or {})
        else:
            arguments = dict(kwargs)
        if spec not in arguments:
            raise FlowKeyError(
                f"{where} was sent without argument {spec!r}, its key. Nothing ran; send it "
                f"with {spec}=... .", task_id=task_id)
        value = arguments[spec]
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise FlowKeyError(
                f"argument {spec!r} of {where} is {shown(value)} ({type(value).__name__}); a "
                "key argument must be a string or an integer. Nothing ran; give a function "
                "as the key to turn it into a string.", task_id=task_id)
        value = str(value)
    problem = None
    if len(value) > FLOW_KEY_LENGTH:
        problem = f"is longer than the {FLOW_KEY_LENGTH} characters the store holds"
    elif "\x00" in value:
        problem = "contains NUL"
    else:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            problem = "contains a lone surrogate"
    if problem is not None:
        raise FlowKeyError(f"the key {shown(value)} of {where} {problem}. Nothing ran; use a "
                           "shorter, plain key (a hash of a long one).", task_id=task_id)
    return value


def _scope(limit: Limit | Dedupe | Debounce, task: Any) -> str:
    return limit.scope or str(task.name)[:SCOPE_LENGTH]


def _label(limit: Limit, task: Any) -> str:
    kind = "Concurrency" if isinstance(limit, Concurrency) else "RateLimit"
    return f"{kind}({limit.limit}) of scope {_scope(limit, task)!r}"


# -- in an attempt ----------------------------------------------------------------------------


def single_slot(task: Any, args: Sequence[Any], kwargs: dict[str, Any],
                task_id: str) -> tuple[str, str, int] | None:
    """For a task whose only limit is one :class:`Concurrency`: the scope, key and limit
    a new run may take its slot under as it starts (``Store.begin_holding``).

    None for any other task, and where the key cannot be computed: :func:`enter`
    then fails the run before its body, as for every limited task.
    """
    limits: Sequence[Limit] = getattr(task, "duraflow_limits", ()) or ()
    if len(limits) != 1 or not isinstance(limits[0], Concurrency):
        return None
    limit = limits[0]
    try:
        key = key_of(limit.key, task, args, kwargs, task_id=task_id, what=_label(limit, task))
    except FlowKeyError:
        return None
    return _scope(limit, task), key, limit.limit


def enter(ctx: RunContext, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          taken: tuple[str, str] | None = None) -> None:
    """Take what the task's limits ask for before its body runs, or suspend the run.

    Every key is computed first, so a key that cannot be computed fails the run
    before anything is taken. Concurrency slots are taken in one order (scope,
    then key) on every worker, so two runs never each hold what the other waits
    for; a run that must wait holds nothing while it waits. ``taken`` is the
    slot (scope and key) of a task's only limit, already taken as the run
    started.
    """
    limits: Sequence[Limit] = getattr(task, "duraflow_limits", ()) or ()
    if not limits or ctx.unwinding is not None or ctx.dry:
        return
    if taken is not None:
        if slot_taken.receivers:
            slot_taken.send(sender=task, task_id=ctx.task_id, scope=taken[0], key=taken[1],
                            waited=0.0)
        return
    keyed = [(limit, _scope(limit, task), key_of(limit.key, task, args, kwargs,
                                                 task_id=ctx.task_id,
                                                 what=_label(limit, task)))
             for limit in limits]
    config = ctx.config
    assert config is not None
    store = ctx.store
    for limit, scope, key in sorted((item for item in keyed
                                     if isinstance(item[0], Concurrency)),
                                    key=lambda item: (item[1], item[2])):
        answer = store.acquire_slot(ctx.task_id, ctx.owner, scope=scope, key=key,
                                    limit=limit.limit, grace=config.lease_seconds,
                                    sweep_after=None)
        send_woken(task.app, answer.woken)
        if answer.state == "lost":
            raise LeaseLost(
                f"task {ctx.task_id} lost its lease while queueing for {_label(limit, task)} "
                f"key {key!r}; another attempt has the run. Nothing needs to be done.",
                task_id=ctx.task_id)
        if answer.state == "waiting":
            logger.info("task %s waits for %s key %r: %d of %d taken, place %d in the queue",
                        ctx.task_id, _label(limit, task), key, answer.live, limit.limit,
                        answer.position)
            if limit_waited.receivers:
                limit_waited.send(sender=task, task_id=ctx.task_id, kind="slot", scope=scope,
                                  key=key, position=answer.position, limit=limit.limit,
                                  wake_at=None)
            # A holder that let go while this run queued may not have seen it queued:
            # look once more, now that the run waits (it may be handed the slot itself).
            send_woken(task.app, store.settle_key(scope, key, grace=config.lease_seconds,
                                                  task_id=ctx.task_id))
            raise Suspended(ctx.task_id, slot_label(scope, key), WAITING, None)
        if slot_taken.receivers:
            slot_taken.send(sender=task, task_id=ctx.task_id, scope=scope, key=key,
                            waited=answer.waited)
    for limit, scope, key in keyed:
        if not isinstance(limit, RateLimit):
            continue
        free_at = store.take_rate(ctx.task_id, scope=scope, key=key, limit=limit.limit,
                                  per=limit.seconds)
        if free_at is not None:
            _wait_for_rate(ctx, task, limit, scope, key, free_at)


def _wait_for_rate(ctx: RunContext, task: Any, limit: RateLimit, scope: str, key: str,
                   free_at: Any) -> None:
    config = ctx.config
    assert config is not None
    remaining = max(0.0, (free_at - _clock.now()).total_seconds())
    countdown = None
    sweep_at = free_at
    if remaining < min(config.eta_threshold, eta_limit(task)) and not task.request.is_eager:
        countdown = remaining
        sweep_at = free_at + timedelta(seconds=config.lease_seconds)
    label = slot_label(scope, key)
    if not ctx.store.suspend(ctx.task_id, ctx.owner, status=WAITING, kind=RATE_WAIT,
                             waiting_for=label, wake_at=free_at, sweep_at=sweep_at):
        raise LeaseLost(f"task {ctx.task_id} lost its lease while waiting for "
                        f"{_label(limit, task)} key {key!r}. Nothing needs to be done.",
                        task_id=ctx.task_id)
    logger.info("task %s is over %s key %r; it waits until %s", ctx.task_id,
                _label(limit, task), key, free_at.isoformat())
    if limit_waited.receivers:
        limit_waited.send(sender=task, task_id=ctx.task_id, kind="rate", scope=scope, key=key,
                          position=0, limit=limit.limit, wake_at=free_at)
    raise Suspended(ctx.task_id, label, WAITING, countdown)


def holds_slots(task: Any) -> bool:
    return any(isinstance(limit, Concurrency)
               for limit in getattr(task, "duraflow_limits", ()) or ())


@dataclass
class Freed:
    """An attempt's concurrency slots: ``queued`` is None until they are freed, then the
    keys they were freed from that have runs queued for them. ``taken`` is the slot
    (scope and key) taken as the run started, if it was."""

    queued: set[tuple[str, str]] | None = None
    taken: tuple[str, str] | None = None


def leave(task: Any, store: Store, run_key: str, owner: str, grace: float,
          freed: Freed) -> None:
    """After an attempt of a task with concurrency limits: hand on what it held (freed
    already where the statement that recorded the run's success freed it)."""
    try:
        if freed.queued is None:
            woken = store.release_slots(run_key, owner, grace=grace)
        else:
            woken = store.settle_keys(freed.queued, grace=grace, task_id=run_key)
    except StoreUnavailable:
        logger.warning("task %s: could not free its concurrency slots; they are free once "
                       "its lease ends, and the sweep hands them on", run_key, exc_info=True)
        return
    send_woken(task.app, woken)


def send_woken(app: Any, woken: Sequence[Any]) -> None:
    for run in woken:
        try:
            send_run(app, run)
        except Exception:
            # The woken run is running with a short lease: the sweep sends it.
            logger.warning("could not send task %s, handed a concurrency slot; the sweep "
                           "will", run.task_id, exc_info=True)
        else:
            logger.info("task %s was handed a concurrency slot", run.task_id)


# -- when sent --------------------------------------------------------------------------------


def dedupe_send(task: Any, args: Any, kwargs: Any, task_id: str | None,
                options: dict[str, Any], send: Callable[..., Any]) -> Any:
    """``apply_async`` of a task with ``duraflow_dedupe``: one run per key and window."""
    dedupe: Dedupe = task.duraflow_dedupe
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    key = key_of(dedupe.key, task, args, kwargs, task_id=task_id,
                 what=f"Dedupe of scope {_scope(dedupe, task)!r}")
    config = config_for_app(task._get_app())
    serializer = get_serializer(config.serializer)
    task_id = task_id or uuid()
    blob, fingerprint = encode_arguments(args, kwargs, serializer, task_id=task_id,
                                         task_name=task.name,
                                         serializer_name=config.serializer)
    owner = store_for(config).claim_dedupe(
        scope=_scope(dedupe, task), key=key, task_id=task_id, window=dedupe.seconds,
        run={"task_name": task.name, "args": blob, "args_fingerprint": fingerprint,
             **routing_of(options)})
    if owner != task_id:
        logger.info("task %s: dedupe key %r was sent as run %s within its window; nothing "
                    "more is sent", task.name, key, owner)
        return task.AsyncResult(owner)
    options["headers"] = recorded_headers(options.get("headers"))
    return send(args, kwargs, task_id=task_id, **options)


def debounce_send(task: Any, args: Any, kwargs: Any, task_id: str | None,
                  options: dict[str, Any], send: Callable[..., Any]) -> Any:
    """``apply_async`` of a task with ``duraflow_debounce``: one run per burst of sends."""
    debounce: Debounce = task.duraflow_debounce
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    scope = _scope(debounce, task)
    key = key_of(debounce.key, task, args, kwargs, task_id=task_id,
                 what=f"Debounce of scope {scope!r}")
    app = task._get_app()
    config = config_for_app(app)
    serializer = get_serializer(config.serializer)
    task_id = task_id or uuid()
    blob, fingerprint = encode_arguments(args, kwargs, serializer, task_id=task_id,
                                         task_name=task.name,
                                         serializer_name=config.serializer)
    trailing = debounce.mode == "trailing"
    owner, fire_at = store_for(config).debounce(
        scope=scope, key=key, task_id=task_id, delay=debounce.seconds,
        max_delay=debounce.max_seconds, trailing=trailing,
        run={"task_name": task.name, "args": blob, "args_fingerprint": fingerprint,
             **routing_of(options)})
    if not trailing:
        if owner != task_id:
            return task.AsyncResult(owner)
        options["headers"] = recorded_headers(options.get("headers"))
        return send(args, kwargs, task_id=task_id, **options)
    if owner == task_id and fire_at is not None and not app.conf.task_always_eager:
        _send_fire(app, owner, fire_at)
    return task.AsyncResult(owner)


def _send_fire(app: Any, task_id: str, fire_at: Any) -> None:
    """Have a worker send the burst's run at ``fire_at``; the sweep does if this is lost."""
    remaining = max(0.0, (fire_at - _clock.now()).total_seconds())
    if remaining >= eta_limit(app.tasks.get(FIRE_TASK_NAME)):
        return  # too long for a broker countdown: the sweep sends it
    try:
        app.send_task(FIRE_TASK_NAME, args=(task_id,), countdown=remaining)
    except Exception:
        logger.warning("could not send the fire message of debounced run %s; the sweep will "
                       "send it", task_id, exc_info=True)


FIRE_TASK_NAME = "celery_duraflow.fire_debounce"


@shared_task(name=FIRE_TASK_NAME, bind=True, ignore_result=True)  # type: ignore[untyped-decorator]
def fire_debounce(self: Any, task_id: str) -> bool:
    """Send the debounced run ``task_id`` once its burst is over; True if this sent it.

    A send that came meanwhile moved the burst's end: the message is sent again for
    the new end. The run carries the last send's arguments, as the store recorded.
    """
    config = config_for_app(self.app)
    store = store_for(config)
    run = store.get_run(task_id)
    if run is None or run.status != SLEEPING or run.wait_kind != DEBOUNCE_WAIT \
            or run.lease_expires_at is None:
        return False
    if run.lease_expires_at > _clock.now():
        _send_fire(self.app, task_id, run.lease_expires_at)
        return False
    claimed = store.claim_to_send(run, grace=config.lease_seconds)
    if claimed is None:
        return False
    # The arguments as claimed: a send of the burst may have changed them since the read.
    send_run(self.app, claimed)
    logger.info("debounced run %s (%s) sent", task_id, run.task_name)
    return True
