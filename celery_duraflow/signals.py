"""Celery signals sent for every step, for metrics, tracing and audit logs.

Connect to them like to Celery's own signals::

    from celery_duraflow.signals import step_failed

    @step_failed.connect
    def count_failure(sender, task_id, step_key, attempt, exception, **kwargs):
        metrics.increment("steps.failed", tags={"task": sender.name, "step": step_key})

``sender`` is the task object. Every signal has ``task_id`` and ``step_key``;
none carries a step's output (it may hold personal data). A signal with no
receiver costs next to nothing.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["run_unwound", "step_failed", "step_replayed", "step_started", "step_succeeded"]

#: A step's body is about to run (``attempt``: which attempt of this step it is).
step_started = Signal(name="duraflow_step_started", providing_args={"task_id", "step_key",
                                                                   "attempt"})
#: A step's body ended and its output was recorded (``duration`` in seconds).
step_succeeded = Signal(name="duraflow_step_succeeded",
                        providing_args={"task_id", "step_key", "attempt", "duration"})
#: A step's body raised ``exception`` (recorded as a failed step).
step_failed = Signal(name="duraflow_step_failed",
                     providing_args={"task_id", "step_key", "attempt", "exception"})
#: A completed step was reached again and answered from the store (its body skipped).
step_replayed = Signal(name="duraflow_step_replayed", providing_args={"task_id", "step_key"})
#: A run's compensations ran (``reason``: "failure" or "cancel"; ``status``: how it ended).
run_unwound = Signal(name="duraflow_run_unwound", providing_args={"task_id", "reason",
                                                                 "status"})
