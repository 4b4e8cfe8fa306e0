"""``DurableTask``: the Celery task base class that gives a run its memory."""

from __future__ import annotations

import logging
import types
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from ._config import config_for_app
from ._context import RunContext, current_run, describe
from ._rewrite import prepare
from ._serialization import decode, get_serializer
from ._signals import install_signal_handlers
from ._store import FAILED, SUCCEEDED, store_for
from .errors import StepOutputNotSerializable, StoreUnavailable

logger = logging.getLogger("celery_duraflow.task")

# Exceptions that end an attempt without ending the run: Celery will deliver it again.
_NOT_THE_END = (Retry, Ignore, Reject)


class DurableTask(Task):  # type: ignore[misc]
    """Base class for Celery tasks whose steps survive retries.

    Use it as ``@app.task(base=DurableTask)`` (with or without ``bind=True``)
    or subclass it and define ``run``. The Celery task id identifies the run;
    Celery keeps it across ``retry()``, autoretry and redelivery, so every
    attempt of a run finds the steps its predecessors recorded.

    ``run`` is prepared when the class is created, so ``with step(...)``
    blocks directly in it can be skipped on a replay.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if isinstance(run, staticmethod):
            cls.run = staticmethod(prepare(run.__func__))
        elif isinstance(run, types.FunctionType):
            cls.run = prepare(run)
        install_signal_handlers()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id is None:
            # Called like a function (task(...)): no id, so no run of its own. Inside a
            # durable run its steps join that run, like a @durable helper's would.
            return super().__call__(*args, **kwargs)

        config = config_for_app(self._get_app())
        store = store_for(config)
        run = store.begin_attempt(task_id, self.name)
        if run.status == SUCCEEDED:
            logger.info("task %s (%s) already succeeded; returning its recorded result",
                        task_id, self.name)
            return decode(run.result, run.serializer, config.serializer,
                          task_id=task_id, step_key=None)

        ctx = RunContext(
            task_id=task_id,
            task_name=self.name,
            attempt=run.attempts,
            store=store,
            serializer=get_serializer(config.serializer),
            serializer_name=config.serializer,
            recorded=store.load_steps(task_id),
        )
        token = current_run.set(ctx)
        try:
            result = super().__call__(*args, **kwargs)
        except _NOT_THE_END:
            raise
        except BaseException as exc:
            self._record_failure(ctx, exc)
            raise
        finally:
            current_run.reset(token)

        try:
            data = ctx.serializer.dumps(result)
        except Exception as error:
            refused = StepOutputNotSerializable(
                f"task {task_id} ({self.name}) returned {describe(result)}, which the "
                f"{config.serializer!r} serializer cannot store ({error}). Return plain data, or "
                "configure duraflow_serializer.",
                task_id=task_id,
            )
            self._record_failure(ctx, refused)
            raise refused from error
        store.finish_run(task_id, SUCCEEDED, result=data, serializer=config.serializer)
        return result

    def _record_failure(self, ctx: RunContext, exc: BaseException) -> None:
        try:
            ctx.store.finish_run(ctx.task_id, FAILED,
                                 error=f"{type(exc).__qualname__}: {exc}"[:4000])
        except StoreUnavailable:
            logger.warning("could not record the failure of task %s", ctx.task_id, exc_info=True)
