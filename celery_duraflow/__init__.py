"""Durable steps for Celery tasks: a retry skips the side effects that already happened.

::

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=True)
    def book_trip(user_id, query):
        with step("book-flight") as s:
            s.result = airline.book(query, idempotency_key=s.idempotency_key)
        ...
"""

from ._fanout import children
from ._flow import Concurrency, Debounce, Dedupe, RateLimit
from ._flow_store import QueuePlace
from ._history import export_history
from ._operations import cancel, retry_run
from ._parallel import aparallel, parallel
from ._patched import patched
from ._recovery import recover, recovery_beat_entry
from ._replay import ReplayResult, check_history, check_replay
from ._rewrite import durable
from ._schedules import (
    FirePass,
    Schedule,
    add_schedule,
    backfill_schedule,
    fire_schedules,
    get_schedule,
    list_schedules,
    next_fire_times,
    pause_schedule,
    remove_schedule,
    resume_schedule,
    schedule_run_id,
)
from ._step import StepContext, step
from ._task import DurableTask
from ._view import RunView, StepView, get_run
from ._waits import child, send_signal, sleep, wait_for_signal
from .errors import (
    AtomicStepError,
    ChildFailed,
    ChildTimeout,
    ConfigurationError,
    DuraflowError,
    FlowKeyError,
    InvalidDuration,
    InvalidSchedule,
    InvalidStepName,
    InvalidTaskId,
    LeaseLost,
    NonDeterministicReplay,
    NotInDurableTask,
    RunArgumentsMismatch,
    RunArgumentsNotSerializable,
    RunCancelled,
    RunNotFound,
    RunStateError,
    ScheduleNotFound,
    SignalTimeout,
    StepCodeChanged,
    StepConflict,
    StepInDoubt,
    StepInputChanged,
    StepNotPrepared,
    StepOutputNotSerializable,
    StoreMisconfigured,
    StoreUnavailable,
    UnsupportedCode,
)

__version__ = "0.1.0"

__all__ = [
    "AtomicStepError",
    "ChildFailed",
    "ChildTimeout",
    "Concurrency",
    "ConfigurationError",
    "Debounce",
    "Dedupe",
    "DurableTask",
    "DuraflowError",
    "FirePass",
    "FlowKeyError",
    "InvalidDuration",
    "InvalidSchedule",
    "InvalidStepName",
    "InvalidTaskId",
    "LeaseLost",
    "NonDeterministicReplay",
    "NotInDurableTask",
    "QueuePlace",
    "RateLimit",
    "ReplayResult",
    "RunArgumentsMismatch",
    "RunArgumentsNotSerializable",
    "RunCancelled",
    "RunNotFound",
    "RunStateError",
    "RunView",
    "Schedule",
    "ScheduleNotFound",
    "SignalTimeout",
    "StepCodeChanged",
    "StepConflict",
    "StepContext",
    "StepInDoubt",
    "StepInputChanged",
    "StepNotPrepared",
    "StepOutputNotSerializable",
    "StepView",
    "StoreMisconfigured",
    "StoreUnavailable",
    "UnsupportedCode",
    "__version__",
    "add_schedule",
    "aparallel",
    "backfill_schedule",
    "cancel",
    "check_history",
    "check_replay",
    "child",
    "children",
    "durable",
    "export_history",
    "fire_schedules",
    "get_run",
    "get_schedule",
    "list_schedules",
    "next_fire_times",
    "parallel",
    "patched",
    "pause_schedule",
    "recover",
    "recovery_beat_entry",
    "remove_schedule",
    "resume_schedule",
    "retry_run",
    "schedule_run_id",
    "send_signal",
    "sleep",
    "step",
    "wait_for_signal",
]
