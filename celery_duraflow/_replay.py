"""The replay check: will the current code carry on the runs that are in flight?

For each run, the task's *current* code is executed against the run's recorded
steps, the way the next attempt would execute it, with three differences: every
recorded step hands back its stored output without its body running (as on any
replay), nothing is written, and the check stops for that run at the first thing a
live attempt would do for real (run a step's body, wait, or record anything). That is
where the run would carry on; everything before it was compared with the record.

A run is *compatible* when the code reached that point (or its end) the way the run
recorded it, and *divergent* at the first step the code reaches in another place
than the record (a step renamed, inserted or removed before that point, a changed
``input=``, or, with ``duraflow_on_code_change = "fail"``, a completed step's changed
code). Code changes a live attempt would only warn about are listed as notes. The
code between steps does run, as on every attempt: it should be free of side effects
anyway.

Nothing here changes a row or sends a message: the run context is a dry one
(:attr:`RunContext.dry`), whose only store access is the read of the run's history.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._admin import list_runs
from ._config import Config, app_and_config
from ._context import ReplayStop, RunContext, enter_run, leave_run
from ._fingerprint import code_fingerprint
from ._history import History, history_of, load
from ._records import RUNNING, SLEEPING, WAITING
from ._send import recorded_arguments
from ._serialization import get_serializer
from ._store import Store, store_for
from ._task import DurableTask
from .errors import DuraflowError, NonDeterministicReplay

logger = logging.getLogger("celery_duraflow.replay")

#: The runs the check looks at by default: those a new deployment would carry on.
IN_FLIGHT = (SLEEPING, WAITING, RUNNING)
# The owner a dry run context says it is: it holds no lease, and never writes.
_DRY_OWNER = "replay-check"

Verdict = Literal["compatible", "divergent", "error"]


@dataclass(frozen=True)
class ReplayResult:
    """What the replay check found for one run.

    ``verdict`` is ``"compatible"``, ``"divergent"`` or ``"error"`` (the check
    could not replay the run: its task is not registered, its arguments cannot
    be read, or the code raised before reaching anything a live attempt would
    do). ``stopped_at`` is the key of the step or wait where a live attempt
    would carry on (None when the code ran to its end). For a divergence,
    ``step_key``, ``position``, ``recorded_key`` and ``reached_key`` say where.
    ``recorded_code`` and ``current_code`` are the fingerprints of the task's
    code when the run started and now; ``notes`` lists what a live attempt
    would only warn about.
    """

    task_id: str
    task_name: str
    run_status: str
    verdict: Verdict
    message: str
    stopped_at: str | None = None
    step_key: str | None = None
    position: int | None = None
    recorded_key: str | None = None
    reached_key: str | None = None
    recorded_code: str | None = None
    current_code: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def compatible(self) -> bool:
        return self.verdict == "compatible"


def check_replay(task_ids: Sequence[str] = (), *, app: Any = None,
                 statuses: Iterable[str] = IN_FLIGHT, limit: int = 100) -> list[ReplayResult]:
    """Replay-check runs of the store of ``app`` (Celery's current app by default).

    With ``task_ids``, those runs (:class:`~celery_duraflow.RunNotFound` for an
    unknown one, before any is checked); otherwise the newest ``limit`` runs whose
    status is in ``statuses``, oldest of them first. Writes nothing, sends nothing.
    """
    app, config = app_and_config(app)
    store = store_for(config)
    if task_ids:
        histories = [history_of(store, task_id) for task_id in task_ids]
    else:
        histories = [history_of(store, task_id)
                     for task_id in _in_flight(store, tuple(statuses), limit)]
    return [replay_history(history, app=app, config=config, store=store)
            for history in histories]


def check_history(history: History | str | Path, *, app: Any = None) -> ReplayResult:
    """Replay-check one exported run (a history file's path, or a loaded history)
    against the current code of ``app``'s task, without a database."""
    app, config = app_and_config(app)
    loaded = history if isinstance(history, History) else load(history)
    return replay_history(loaded, app=app, config=config, store=store_for(config))


def _in_flight(store: Store, statuses: tuple[str, ...], limit: int) -> list[str]:
    return [run.task_id for run in
            reversed(list_runs(store, statuses=list(statuses), limit=limit, brief=True))]


def replay_history(history: History, *, app: Any, config: Config,
                   store: Store) -> ReplayResult:
    """Replay one run's history against the current code; see the module docstring."""
    run = history.run
    base: dict[str, Any] = {"task_id": run.task_id, "task_name": run.task_name,
                            "run_status": run.status, "recorded_code": run.code_fingerprint}
    task = app.tasks.get(run.task_name)
    if task is None:
        # The modules a worker imports at start (``include``, ``imports``): a command
        # line or a CI job has not imported them yet.
        app.loader.import_default_modules()
        task = app.tasks.get(run.task_name)
    if task is None or not isinstance(task, DurableTask):
        what = "does not register" if task is None else "registers without base=DurableTask"
        return ReplayResult(**base, verdict="error", message=(
            f"task {run.task_id} is a run of {run.task_name}, which this app {what}: there "
            "is no code to replay it with. Import the module that defines the task (or "
            "check its name)."))
    current = code_fingerprint(task.run)
    base["current_code"] = current
    try:
        args, kwargs = recorded_arguments(run, config)
    except (ValueError, DuraflowError) as exc:
        return ReplayResult(**base, verdict="error",
                            message=f"task {run.task_id}: its arguments cannot be read ({exc})")
    ctx = RunContext(task_id=run.task_id, task_name=task.name, owner=_DRY_OWNER, store=store,
                     serializer=get_serializer(config.serializer),
                     serializer_name=config.serializer, recorded=dict(history.steps),
                     task=task, config=config, celery_id=run.task_id, dry=True)
    token = enter_run(ctx)
    task.push_request(id=run.task_id, retries=run.retries, args=args, kwargs=kwargs,
                      is_eager=True, delivery_info={})
    try:
        task.run(*args, **kwargs)
    except ReplayStop as stop:
        return ReplayResult(**base, verdict="compatible", stopped_at=stop.key,
                            notes=tuple(ctx.notes), message=(
                                f"task {run.task_id} replays as recorded up to "
                                f"{stop.what}, where a live attempt would carry on"))
    except NonDeterministicReplay as exc:
        recorded = history.steps.get(exc.recorded_key or "")
        return ReplayResult(
            **base, verdict="divergent",
            message=str(exc), step_key=exc.step_key, position=exc.position,
            recorded_key=exc.recorded_key, reached_key=exc.reached_key,
            notes=tuple(ctx.notes) + ((
                f"step {exc.recorded_key!r} was recorded by code "
                f"{recorded.code_fingerprint}",) if recorded is not None
                and recorded.code_fingerprint else ()))
    except Exception as exc:
        return ReplayResult(**base, verdict="error", notes=tuple(ctx.notes), message=(
            f"task {run.task_id}: the current code raised {type(exc).__name__}: {exc} before "
            "reaching anything a live attempt would run or record"))
    finally:
        task.pop_request()
        leave_run(token)
    return ReplayResult(**base, verdict="compatible", notes=tuple(ctx.notes), message=(
        f"task {run.task_id} replays as recorded to the end of its code: a live attempt "
        "would finish the run"))
