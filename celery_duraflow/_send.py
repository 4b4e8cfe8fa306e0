"""Sending a recorded run again: to wake it, to recover it, to wake its parent.

The recovery sweep, a signal, a child's end, ``retry_run`` and ``cancel`` all publish
a run's task once more with what the store recorded: its task id, arguments, retry
count and routing. Nothing here decides whether a run should be sent; callers claim
the run in the store first.
"""

from __future__ import annotations

import logging
from typing import Any

from ._config import Config, config_for_app
from ._serialization import decode
from ._store import SUCCEEDED, RunRecord, store_for

logger = logging.getLogger("celery_duraflow.recovery")


# How long a worker may hold an unacknowledged message when broker_transport_options does not
# say: RabbitMQ's default consumer_timeout, 30 minutes (Redis's visibility_timeout is an hour).
DEFAULT_BROKER_HOLD_LIMIT = 1800.0


def eta_limit(task: Any) -> float:
    """The longest broker countdown (ETA) a wait is sent with, in seconds.

    A worker holds a message with a countdown unacknowledged until its time. Held longer
    than the broker allows, it is given to another worker (Redis, SQS:
    ``visibility_timeout``) or the worker's channel is closed (RabbitMQ:
    ``consumer_timeout``, PRECONDITION_FAILED, which stops a Celery worker). So a wait
    is sent with a countdown only under half that limit, read in seconds from
    ``broker_transport_options`` (``consumer_timeout``, else ``visibility_timeout``;
    a limit of 30 minutes when neither is there); a longer one is woken by the sweep alone.
    """
    conf = getattr(getattr(task, "app", None), "conf", None) or {}
    options: Any = conf.get("broker_transport_options") or {}
    for key in ("consumer_timeout", "visibility_timeout"):
        try:
            return float(options[key]) / 2
        except (KeyError, TypeError, ValueError):
            continue
    return DEFAULT_BROKER_HOLD_LIMIT / 2


#: The priorities a broker takes: RabbitMQ's 0 to 255 (Redis maps them onto its steps).
MAX_PRIORITY = 255


def priority_of(value: Any) -> int | None:
    """A message priority as the runs table keeps it: an int of 0 to 255, else None (the
    queue's default; the broker would not take anything else either)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PRIORITY:
        return value
    return None


def routing_of(options: dict[str, Any]) -> dict[str, Any]:
    """What a run sent with ``apply_async(**options)`` records of its routing: its
    exchange, routing key (the queue's name where only ``queue=`` is given) and priority."""
    queue = options.get("queue")
    routing_key = options.get("routing_key") or (queue if isinstance(queue, str) else None)
    exchange = options.get("exchange")
    return {"exchange": exchange if isinstance(exchange, str) else None,
            "routing_key": routing_key if isinstance(routing_key, str) else None,
            "priority": priority_of(options.get("priority"))}


def _route(run: RunRecord) -> dict[str, Any]:
    route: dict[str, Any] = {} if run.priority is None else {"priority": run.priority}
    if run.exchange and run.routing_key:
        route.update(exchange=run.exchange, routing_key=run.routing_key)
    elif run.routing_key:
        # The default exchange routes by queue name.
        route["queue"] = run.routing_key
    return route


#: A header on every message the library sends for a run whose row it has already written
#: (a re-send, a wake-up, a child run its parent recorded): its start need not try the
#: first delivery's insert, which would find the row and write nothing.
RECORDED_HEADER = "duraflow_recorded"


def recorded_headers(headers: Any = None) -> dict[str, Any]:
    """A new dict: ``headers`` (a signature's own, kept) with :data:`RECORDED_HEADER`."""
    return {**(headers if isinstance(headers, dict) else {}), RECORDED_HEADER: True}


def send_recorded(signature: Any) -> Any:
    """``signature.apply_async()`` for a run whose row is written, marked as such."""
    return signature.apply_async(headers=recorded_headers(signature.options.get("headers")))


def is_recorded(request: Any) -> bool:
    """Whether ``request`` came with :data:`RECORDED_HEADER`: a message header reaches a
    worker's request as an attribute, an eager call's ``headers=`` as ``request.headers``."""
    if request.get(RECORDED_HEADER):
        return True
    headers = request.get("headers")
    return isinstance(headers, dict) and bool(headers.get(RECORDED_HEADER))


def recorded_arguments(run: RunRecord, config: Config) -> tuple[list[Any], dict[str, Any]]:
    """The run's recorded positional and keyword arguments; ValueError if it has none."""
    if run.args is None:
        raise ValueError(f"task {run.task_id} ({run.task_name}) has no recorded arguments")
    payload = decode(run.args, config.serializer, config.serializer,
                     task_id=run.task_id, step_key=None)
    args = payload.get("args", []) if isinstance(payload, dict) else None
    kwargs = payload.get("kwargs", {}) if isinstance(payload, dict) else None
    if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
        raise ValueError(f"the recorded arguments of task {run.task_id} ({run.task_name}) are "
                         f"not a list of arguments and a dict of keyword arguments")
    return list(args), dict(kwargs)


def send_run(app: Any, run: RunRecord) -> None:
    """Publish a run's task again, with its task id, arguments, retry count, routing and
    priority.

    In an eager app (``task_always_eager``, as in tests) there is no broker to publish
    to: ``send_task`` would still send a real message (Celery only warns), which any
    worker listening on the broker could take. The run is applied in this process
    instead, as a worker would run it, and nothing is published.
    """
    args, kwargs = recorded_arguments(run, config_for_app(app))
    if app.conf.task_always_eager:
        task = app.tasks.get(run.task_name)
        if task is None:
            raise ValueError(f"task {run.task_id} is a run of {run.task_name}, which this "
                             "app does not register, so it cannot be run in this process")
        logger.debug("eager app: running task %s (%s) in this process", run.task_id,
                     run.task_name)
        task.apply(args=args, kwargs=kwargs, task_id=run.task_id, retries=run.retries,
                   headers=recorded_headers())
        return
    app.send_task(run.task_name, args=args, kwargs=kwargs, task_id=run.task_id,
                  retries=run.retries, headers=recorded_headers(), **_route(run))


def wake_parent(app: Any, run: RunRecord) -> None:
    """A child run ended: send its parent again if it waits for it."""
    if run.parent_id is None:
        return
    config = config_for_app(app)
    store = store_for(config)
    if run.join_key is not None:
        # One of a join's children: the parent is woken by the end that leaves none open.
        woken = store.wake_join(run.parent_id, run.join_key, grace=config.lease_seconds)
    else:
        woken = store.wake(run.parent_id, kind="child", waiting_for=run.task_id,
                           grace=config.lease_seconds)
    if woken is not None:
        send_run(app, woken)
        logger.info("child %s (%s) woke its parent %s", run.task_id,
                    "succeeded" if run.status == SUCCEEDED else run.status, run.parent_id)
