"""Celery signals sent for every step, attempt and wait, for metrics, tracing and audit logs.

Connect to them like to Celery's own signals::

    from celery_duraflow.signals import step_failed

    @step_failed.connect
    def count_failure(sender, task_id, step_key, attempt, exception, **kwargs):
        metrics.increment("steps.failed", tags={"task": sender.name, "step": step_key})

``sender`` is the task object (the Celery app for :data:`signal_delivered` and
:data:`run_recovered`, which are sent outside any attempt). Every signal has
``task_id``; none carries a step's output or a signal's payload (they may hold
personal data). A signal with no receiver costs next to nothing: each is sent
only when something is connected to it. Receivers run in the attempt's own
thread and context, so they may use the current span of a tracer.
:mod:`celery_duraflow.contrib.opentelemetry` is built on these signals.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "attempt_finished",
    "attempt_started",
    "compensation_ran",
    "limit_waited",
    "run_finished",
    "run_recovered",
    "run_unwound",
    "schedule_fired",
    "schedule_skipped",
    "signal_delivered",
    "slot_taken",
    "step_failed",
    "step_replayed",
    "step_started",
    "step_succeeded",
    "store_unavailable",
    "wait_ended",
    "wait_reached",
]

#: A step's body is about to run (``attempt``: which attempt of this step it is;
#: ``in_doubt``: an earlier attempt may have run it without recording its end).
step_started = Signal(name="duraflow_step_started",
                      providing_args={"task_id", "step_key", "attempt", "in_doubt"})
#: A step's body ended and its output was recorded (``duration`` in seconds).
step_succeeded = Signal(name="duraflow_step_succeeded",
                        providing_args={"task_id", "step_key", "attempt", "duration"})
#: A step's body raised ``exception`` (recorded as a failed step).
step_failed = Signal(name="duraflow_step_failed",
                     providing_args={"task_id", "step_key", "attempt", "exception"})
#: A completed step was reached again and answered from the store (its body skipped;
#: ``attempt``: the attempt of the step that completed it).
step_replayed = Signal(name="duraflow_step_replayed",
                       providing_args={"task_id", "step_key", "attempt"})
#: A run's compensations ran (``reason``: "failure" or "cancel"; ``status``: how it ended).
run_unwound = Signal(name="duraflow_run_unwound", providing_args={"task_id", "reason",
                                                                 "status"})
#: An attempt of a run holds the run's lease and is about to run the task's body
#: (``attempt``: the run's attempt count, this one included). Sent in the attempt's
#: thread and context, as :data:`attempt_finished` is when the attempt ends.
attempt_started = Signal(name="duraflow_attempt_started",
                         providing_args={"task_id", "attempt"})
#: The attempt begun by :data:`attempt_started` ended: ``exception`` is what it raised
#: (None when it returned; Celery's ``Ignore`` when the run suspended at a wait,
#: ``Retry`` when a retry was sent). :data:`run_finished` says whether it ended the run.
attempt_finished = Signal(name="duraflow_attempt_finished",
                          providing_args={"task_id", "attempt", "exception"})
#: The run ended for good in this attempt, with ``status`` ("succeeded", "failed",
#: "compensated", "cancelled", "ignored", "rejected" or "replaced").
run_finished = Signal(name="duraflow_run_finished", providing_args={"task_id", "status"})
#: The run suspends at a wait of ``kind`` "sleep", "signal" or "child" (``step_key``
#: is the wait's key, ``status`` the run's, "sleeping" or "waiting", and ``wake_at``
#: the deadline, a datetime, or None for a wait without a timeout).
wait_reached = Signal(name="duraflow_wait_reached",
                      providing_args={"task_id", "step_key", "kind", "status", "wake_at"})
#: A wait ended and its outcome was recorded (``timed_out``: its time ran out before a
#: signal or the child's end came; a sleep always ends that way).
wait_ended = Signal(name="duraflow_wait_ended",
                    providing_args={"task_id", "step_key", "kind", "timed_out"})
#: :func:`~celery_duraflow.send_signal` delivered the signal ``name`` to run ``task_id``
#: (``stored``: False when an earlier one of that name was kept instead). ``sender`` is
#: the app.
signal_delivered = Signal(name="duraflow_signal_delivered",
                          providing_args={"task_id", "name", "stored"})
#: A compensation ran for the completed step ``step_key`` (``attempt``: which try of it;
#: ``exception``: what it raised, or None when it succeeded).
compensation_ran = Signal(name="duraflow_compensation_ran",
                          providing_args={"task_id", "step_key", "attempt", "exception"})
#: The recovery sweep sent run ``task_id`` (of task ``task_name``) again: ``status``
#: is "running" for a run whose attempt was lost, "sleeping" or "waiting" for a wait
#: it woke. ``sender`` is the app.
run_recovered = Signal(name="duraflow_run_recovered",
                       providing_args={"task_id", "task_name", "status"})
#: A delivery found the store unavailable before its run could start (``exception``:
#: the StoreUnavailable); it comes back later, or fails when ``giving_up`` is True.
store_unavailable = Signal(name="duraflow_store_unavailable",
                           providing_args={"task_id", "exception", "giving_up"})
#: A run is over one of its task's limits and waits without holding a worker. ``kind``
#: is "slot" (a Concurrency limit; ``position`` is its place in the key's queue) or "rate"
#: (a RateLimit; ``wake_at`` is when the window frees), ``scope`` and ``key`` the
#: limit's, ``limit`` its number.
limit_waited = Signal(name="duraflow_limit_waited",
                      providing_args={"task_id", "kind", "scope", "key", "position", "limit",
                                      "wake_at"})
#: An attempt took a concurrency slot of ``scope``/``key`` before its body ran;
#: ``waited`` is how long the run was queued for it, in seconds (0.0 if it was not).
slot_taken = Signal(name="duraflow_slot_taken",
                    providing_args={"task_id", "scope", "key", "waited"})
#: A schedule fired slot ``slot`` (an aware datetime) as run ``task_id`` of task
#: ``task_name`` (a backfill too). ``sender`` is the app.
schedule_fired = Signal(name="duraflow_schedule_fired",
                        providing_args={"schedule", "slot", "task_id", "task_name"})
#: A firing pass passed over ``count`` slots of ``schedule``: ``reason`` is "missed" (the
#: catch-up policy dropped slots found late; ``first`` and ``last`` are the first and last
#: of them) or "overlap" (the overlap policy dropped them while a run was open).
schedule_skipped = Signal(name="duraflow_schedule_skipped",
                          providing_args={"schedule", "count", "reason", "first", "last"})
