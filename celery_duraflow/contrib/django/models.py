"""Read-only Django models over the store's own tables, for the admin.

The library creates and upgrades these tables itself (see
``celery_duraflow._schema``), so every model here is unmanaged: Django never
creates, alters or drops them, and ``makemigrations`` only records that they
exist. Nothing is written through these models either; the runs are changed
by the library's operations (``send_signal``, ``cancel``, ``retry_run``),
which the admin calls. The table names follow ``conf.table_prefix()``.

What the schema holds, and how it is mapped:

* runs: one row per run, keyed by its Celery task id. What a sleeping or
  waiting run waits for is kept on its row (``wait_kind``, ``waiting_for``,
  ``wake_at``); there is no separate table of waits. A child run names its
  parent in ``parent_id``.
* steps: keyed by ``(task_id, step_key)``; a wait that was reached is a step
  row too (status ``waiting`` until it ends).
* signals: keyed by ``(task_id, name)``; the first signal of a name is kept.
* schedules: one row per durable schedule, keyed by its name. It is changed by
  ``pause_schedule``, ``resume_schedule``, ``backfill_schedule`` and
  ``remove_schedule`` (and the scheduler, as it fires slots), never here.

Steps and signals have composite primary keys, declared with Django's
``CompositePrimaryKey``. Their ``run`` is a foreign key without a database
constraint (the schema has none: a step row is written under the run's lease).
"""

from __future__ import annotations

from typing import Any, get_args

from django.db import models

from ..._records import RUN_STATUSES, StepStatus, WaitKind
from ..._schedule_schema import SCHEDULE_NAME_LENGTH
from ..._schedule_spec import CATCHUP_POLICIES, OVERLAP_POLICIES
from ..._schema import STEP_KEY_LENGTH, TASK_ID_LENGTH
from . import conf

RUN_STATUS_CHOICES = tuple((status, status) for status in RUN_STATUSES)
STEP_STATUS_CHOICES = tuple((status, status) for status in get_args(StepStatus))
WAIT_KIND_CHOICES = tuple((kind, kind) for kind in get_args(WaitKind))
CATCHUP_CHOICES = tuple((policy, policy) for policy in CATCHUP_POLICIES)
OVERLAP_CHOICES = tuple((policy, policy) for policy in OVERLAP_POLICIES)
ORIGIN_CHOICES = (("code", "beat_schedule"), ("api", "added at run time"))


_REFUSAL = ("rows of celery-duraflow's tables are written by the library only: use "
            "send_signal, cancel or retry_run to change a run, `celery duraflow prune` to "
            "delete old ones; pause_schedule, resume_schedule, backfill_schedule or "
            "remove_schedule to change a schedule.")


class ReadOnlyQuerySet(models.QuerySet):
    """A queryset of rows the library owns: bulk writes through Django are refused."""

    def update(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.model.__name__}: {_REFUSAL}")

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.model.__name__}: {_REFUSAL}")

    def bulk_create(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.model.__name__}: {_REFUSAL}")

    def bulk_update(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.model.__name__}: {_REFUSAL}")


class ReadOnlyModel(models.Model):
    """A row the library owns: saving or deleting it through Django is refused."""

    objects = ReadOnlyQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} rows are written by celery-duraflow only: use "
                        "send_signal, cancel or retry_run to change a run.")

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} rows are deleted by `celery duraflow prune` "
                        "only.")


class Run(ReadOnlyModel):
    """One durable run (a row of ``<prefix>runs``)."""

    task_id = models.CharField(max_length=TASK_ID_LENGTH, primary_key=True)
    task_name = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=RUN_STATUS_CHOICES)
    attempts = models.IntegerField()
    result = models.TextField(null=True)
    serializer = models.CharField(max_length=100, null=True)
    error = models.TextField(null=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    lease_owner = models.CharField(max_length=200, null=True)
    lease_expires_at = models.DateTimeField(null=True)
    args = models.TextField(null=True)
    args_fingerprint = models.CharField(max_length=64, null=True)
    exchange = models.CharField(max_length=255, null=True)
    routing_key = models.CharField(max_length=255, null=True)
    retries = models.IntegerField()
    recoveries = models.IntegerField()
    interrupted = models.BooleanField()
    wait_kind = models.CharField(max_length=16, null=True, choices=WAIT_KIND_CHOICES)
    waiting_for = models.CharField(max_length=STEP_KEY_LENGTH, null=True)
    wake_at = models.DateTimeField(null=True)
    parent_id = models.CharField(max_length=TASK_ID_LENGTH, null=True)
    code_fingerprint = models.CharField(max_length=64, null=True)
    unwinding = models.CharField(max_length=16, null=True)
    pruned_at = models.DateTimeField(null=True)
    replaced_by = models.CharField(max_length=TASK_ID_LENGTH, null=True)
    priority = models.SmallIntegerField(null=True)
    join_key = models.CharField(max_length=STEP_KEY_LENGTH, null=True)

    class Meta:
        managed = False
        db_table = f"{conf.table_prefix()}runs"
        verbose_name = "run"
        verbose_name_plural = "runs"
        ordering = ("-created_at", "-task_id")
        # Runs are only read here: no add, change or delete permission exists. What
        # an operator may do to a run is one permission per kind of decision.
        default_permissions = ("view",)
        permissions = (
            ("approve_run", "Can approve or reject a run that waits for a signal"),
            ("cancel_run", "Can cancel a run"),
            ("retry_run", "Can retry a run that ended"),
        )

    def __str__(self) -> str:
        return str(self.task_id)


class Step(ReadOnlyModel):
    """One recorded step of a run (a row of ``<prefix>steps``)."""

    pk = models.CompositePrimaryKey("run_id", "step_key")
    run = models.ForeignKey(Run, on_delete=models.DO_NOTHING, db_column="task_id",
                            db_constraint=False, related_name="steps")
    step_key = models.CharField(max_length=STEP_KEY_LENGTH)
    status = models.CharField(max_length=16, choices=STEP_STATUS_CHOICES)
    attempts = models.IntegerField()
    output = models.TextField(null=True)
    serializer = models.CharField(max_length=100, null=True)
    error = models.TextField(null=True)
    started_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True)
    position = models.IntegerField(null=True)
    input_fingerprint = models.CharField(max_length=64, null=True)
    code_fingerprint = models.CharField(max_length=64, null=True)
    body_exit = models.CharField(max_length=16, null=True)
    returned = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = f"{conf.table_prefix()}steps"
        verbose_name = "step"
        verbose_name_plural = "steps"
        ordering = ("started_at", "step_key")
        # Shown on the run's page, under the run's own view permission.
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.run_id} {self.step_key}"


class Signal(ReadOnlyModel):
    """One signal stored for a run (a row of ``<prefix>signals``)."""

    pk = models.CompositePrimaryKey("run_id", "name")
    run = models.ForeignKey(Run, on_delete=models.DO_NOTHING, db_column="task_id",
                            db_constraint=False, related_name="signals")
    name = models.CharField(max_length=STEP_KEY_LENGTH)
    payload = models.TextField(null=True)
    serializer = models.CharField(max_length=100, null=True)
    sent_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = f"{conf.table_prefix()}signals"
        verbose_name = "signal"
        verbose_name_plural = "signals"
        ordering = ("sent_at", "name")
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.run_id} {self.name}"


class Schedule(ReadOnlyModel):
    """One durable schedule (a row of ``<prefix>schedules``)."""

    name = models.CharField(max_length=SCHEDULE_NAME_LENGTH, primary_key=True)
    task_name = models.CharField(max_length=255)
    origin = models.CharField(max_length=8, choices=ORIGIN_CHOICES)
    cron = models.CharField(max_length=255, null=True)
    timezone = models.CharField(max_length=64)
    every = models.FloatField(null=True)
    anchor_at = models.DateTimeField(null=True)
    args = models.TextField(null=True)
    exchange = models.CharField(max_length=255, null=True)
    routing_key = models.CharField(max_length=255, null=True)
    priority = models.IntegerField(null=True)
    catchup = models.CharField(max_length=16, choices=CATCHUP_CHOICES)
    catchup_window = models.FloatField(null=True)
    overlap = models.CharField(max_length=16, choices=OVERLAP_CHOICES)
    paused = models.BooleanField()
    note = models.TextField(null=True)
    next_fire_at = models.DateTimeField()
    buffered_at = models.DateTimeField(null=True)
    last_slot_at = models.DateTimeField(null=True)
    last_run_id = models.CharField(max_length=TASK_ID_LENGTH, null=True)
    fired = models.IntegerField()
    skipped = models.IntegerField()
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = f"{conf.table_prefix()}schedules"
        verbose_name = "schedule"
        verbose_name_plural = "schedules"
        ordering = ("name",)
        # As for runs: seen here, changed by the library's functions, one permission per
        # kind of decision (stopping and starting a schedule, firing its past slots).
        default_permissions = ("view",)
        permissions = (
            ("pause_schedule", "Can pause or resume a schedule"),
            ("backfill_schedule", "Can backfill the past slots of a schedule"),
        )

    def __str__(self) -> str:
        return str(self.name)

    def save(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Schedule rows are written by celery-duraflow only: use add_schedule, "
                        "pause_schedule, resume_schedule or backfill_schedule to change one.")

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Schedule rows are deleted by celery-duraflow only: use "
                        "remove_schedule (or `celery duraflow schedules remove NAME`).")
