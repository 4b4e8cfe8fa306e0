"""The Django admin for durable runs: list them, read one, approve, reject, cancel, retry;
and for durable schedules: list them, read one, pause, resume, backfill.

Everything shown is read from the store's database alias (``conf.store_alias()``)
through the read-only models; nothing can be added, changed or deleted here.
The four actions call the library's own operations, which hold the rules:

* **approve** / **reject**: :func:`celery_duraflow.send_signal` with
  ``{"approved": True}`` / ``{"approved": False}`` under the name of the signal
  the run waits for (as the web view does);
* **cancel**: :func:`celery_duraflow.cancel`;
* **retry**: :func:`celery_duraflow.retry_run` (from a chosen step on the run's page).

Each is an action of the list of runs and a button on a run's page, and each
needs its own permission on the Run model: ``duraflow.approve_run`` (approve
and reject), ``duraflow.cancel_run`` and ``duraflow.retry_run``; seeing runs
needs ``duraflow.view_run``. They are separate from Django's change permission
because none of them edits a row: deciding a payment, stopping work and
starting it again are different decisions, often given to different people.
Every action is a POST that Django's CSRF protection checks; what an operation
refuses (``RunStateError``, ``RunNotFound``...) is shown as a message.

The operations use the Celery app named by the ``DURAFLOW_CELERY_APP`` setting
(the app itself, or its dotted path such as ``"proj.celery.app"`` or
``"proj.celery:app"``), else Celery's current app, which a project laid out as
Celery's Django guide says (``proj/__init__.py`` importing the app) already has.

Schedules are listed with their timing, policies, state and next slot; a
schedule's page adds its next fire times. Their actions call the library too:
**pause** and **resume** (:func:`celery_duraflow.pause_schedule`,
:func:`celery_duraflow.resume_schedule`) need ``duraflow.pause_schedule``, and
**backfill** (:func:`celery_duraflow.backfill_schedule`), which asks for the
range on an intermediate page first, needs ``duraflow.backfill_schedule``;
seeing schedules needs ``duraflow.view_schedule``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial, update_wrapper
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html, format_html_join
from django.utils.module_loading import import_string
from django.utils.safestring import SafeString

from ..._compensation import COMPENSATION_PREFIX
from ..._config import app_and_config
from ..._format import (
    clip,
    join_summary,
    json_text,
    next_slot,
    queue_note,
    run_note,
    schedule_policies,
    schedule_state,
    span,
    step_duration,
    waits_for,
    wall_time,
)
from ..._operations import cancel, retry_run
from ..._records import FINISHED, STEP_RUNNING, STEP_WAITING, SUCCEEDED, WAITING
from ..._schedules import Schedule as StoredSchedule
from ..._schedules import (
    backfill_schedule,
    next_fire_times,
    pause_schedule,
    resume_schedule,
)
from ..._serialization import Unreadable, decode
from ..._store import store_for
from ..._waits import send_signal
from ...errors import DuraflowError
from . import conf
from .models import Run, Schedule, Signal, Step

logger = logging.getLogger("celery_duraflow.contrib.django.admin")

#: Longest text shown for one stored value on a run's page.
MAX_SHOWN = 20_000
#: Longest preview of a step's output or error in the steps table.
PREVIEW = 200
# The most child runs listed on a run's page (a children() join may start thousands).
CHILDREN_SHOWN = 100
#: The buttons of a run's page, each at ``<run>/<action>/``.
RUN_ACTIONS = ("approve", "reject", "cancel", "retry")
#: How many task ids one message names before saying how many more.
NAMED = 10
#: How times are shown: to the second, with the time zone (Django's current one).
TIME_FORMAT = "Y-m-d H:i:s T"
#: How many next fire times a schedule's page shows.
UPCOMING = 5


def celery_app() -> Any:
    """The Celery app the actions use: ``DURAFLOW_CELERY_APP``, else None (Celery's
    current app, which the library falls back to)."""
    chosen = conf._setting("CELERY_APP")
    if chosen is None or not isinstance(chosen, str):
        return chosen
    try:
        return import_string(chosen.replace(":", "."))
    except ImportError as exc:
        raise ImproperlyConfigured(f"DURAFLOW_CELERY_APP = {chosen!r} cannot be imported "
                                   f"({exc}); name the Celery app as 'proj.celery.app'.") from exc


def _names(task_ids: list[str]) -> str:
    shown = ", ".join(task_ids[:NAMED])
    more = len(task_ids) - NAMED
    return f"{shown} and {more} more" if more > 0 else shown


class _Outcome:
    """What one action did to each run, said in as few messages as possible."""

    def __init__(self) -> None:
        self.done: dict[str, list[str]] = {}
        self.problems: list[tuple[int, str]] = []

    def ok(self, summary: str, task_id: str) -> None:
        self.done.setdefault(summary, []).append(task_id)

    def refuse(self, text: str, level: int = messages.ERROR) -> None:
        self.problems.append((level, text))

    def tell(self, request: Any) -> None:
        for summary, task_ids in self.done.items():
            messages.success(request, f"{summary}: {_names(task_ids)}.")
        for level, text in self.problems:
            messages.add_message(request, level, text)


class _SteeredAdmin(admin.ModelAdmin):
    """An admin of rows the library writes: nothing is added, changed or deleted here; the
    operator's decisions are actions, each under a permission of its own."""

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def _may(self, request: Any, codename: str) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.{codename}"))


class RunAdmin(_SteeredAdmin):
    """Runs, newest first; a run's page shows its steps, waits and signals."""

    list_display = ("task_id", "task_name", "status", "waits", "attempts", "created",
                    "finished")
    list_filter = ("status", "task_name")
    # The whole task id: an exact match on the primary key, fast on any number of runs.
    search_fields = ("task_id",)
    search_help_text = "Search by the whole task id."
    ordering = ("-created_at", "-task_id")
    list_per_page = 50
    # The admin would otherwise count every run on each page as well as the matching ones.
    show_full_result_count = False
    actions = ("approve_runs", "reject_runs", "cancel_runs", "retry_runs")
    change_form_template = "admin/duraflow/run/change_form.html"
    fieldsets = (
        (None, {"fields": ("task_id", "task_name", "status", "waits", "attempts", "retries",
                           "recoveries", "created", "updated", "finished")}),
        ("Arguments, result and error", {"fields": ("shown_args", "shown_result", "error")}),
        ("Lease and delivery", {"classes": ("collapse",), "fields": (
            "parent_id", "replaced_by", "unwinding", "interrupted", "lease_owner",
            "lease_expires", "exchange", "routing_key", "priority", "code_fingerprint",
            "args_fingerprint", "serializer")}),
    )
    readonly_fields = ("task_id", "task_name", "status", "waits", "attempts", "retries",
                       "recoveries", "created", "updated", "finished", "shown_args",
                       "shown_result", "error", "parent_id", "replaced_by", "unwinding",
                       "interrupted", "lease_owner", "lease_expires", "exchange",
                       "routing_key", "priority", "code_fingerprint", "args_fingerprint",
                       "serializer")

    # -- reading ---------------------------------------------------------------------------

    def get_queryset(self, request: Any) -> Any:
        # A pruned run's tombstone is not a run to list or show (as in the CLI and web view).
        queryset = (super().get_queryset(request).using(conf.store_alias())
                    .filter(pruned_at__isnull=True))
        match = getattr(request, "resolver_match", None)
        if match is not None and match.url_name == (
                f"{self.opts.app_label}_{self.opts.model_name}_changelist"):
            # The list shows none of a run's stored values, which may be large.
            queryset = queryset.defer("args", "result", "error")
        return queryset

    def get_search_results(self, request: Any, queryset: Any,
                           search_term: str) -> tuple[Any, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(task_id=term), False

    @admin.display(description="waits for")
    def waits(self, run: Run) -> str:
        return run_note(run)

    # Times to the second (the admin's own format for a date and time has no seconds).
    @admin.display(description="created at", ordering="created_at")
    def created(self, run: Run) -> str:
        return shown_time(run.created_at)

    @admin.display(description="updated at", ordering="updated_at")
    def updated(self, run: Run) -> str:
        return shown_time(run.updated_at)

    @admin.display(description="finished at", ordering="finished_at")
    def finished(self, run: Run) -> str:
        return shown_time(run.finished_at)

    @admin.display(description="lease expires at")
    def lease_expires(self, run: Run) -> str:
        return shown_time(run.lease_expires_at)

    @admin.display(description="arguments")
    def shown_args(self, run: Run) -> SafeString | str:
        if run.args is None:
            return "(not recorded)"
        return _pre(_shown(run.args, None, task_id=run.task_id, what="arguments"))

    @admin.display(description="result")
    def shown_result(self, run: Run) -> SafeString | str:
        if run.result is None:
            return "-"
        return _pre(_shown(run.result, run.serializer, task_id=run.task_id, what="result"))

    # -- what an operator may do to a run ---------------------------------------------------

    def has_approve_permission(self, request: Any) -> bool:
        return self._may(request, "approve_run")

    def has_cancel_permission(self, request: Any) -> bool:
        return self._may(request, "cancel_run")

    def has_retry_permission(self, request: Any) -> bool:
        return self._may(request, "retry_run")

    @admin.action(permissions=("approve",),
                  description="Approve the selected runs (signal payload approved: true)")
    def approve_runs(self, request: Any, queryset: Iterable[Run]) -> None:
        self._decide(request, queryset, approved=True)

    @admin.action(permissions=("approve",),
                  description="Reject the selected runs (signal payload approved: false)")
    def reject_runs(self, request: Any, queryset: Iterable[Run]) -> None:
        self._decide(request, queryset, approved=False)

    @admin.action(permissions=("cancel",), description="Cancel the selected runs")
    def cancel_runs(self, request: Any, queryset: Iterable[Run]) -> None:
        self._cancel(request, queryset)

    @admin.action(permissions=("retry",), description="Retry the selected runs")
    def retry_runs(self, request: Any, queryset: Iterable[Run]) -> None:
        self._retry(request, queryset)

    def _decide(self, request: Any, runs: Iterable[Run], *, approved: bool,
                expected: str | None = None) -> None:
        verb = "Approved" if approved else "Rejected"
        payload = {"approved": approved}
        outcome = _Outcome()
        for run in runs:
            waited = run.waiting_for if run.status == WAITING and run.wait_kind == "signal" \
                else None
            if waited is None or (expected is not None and waited != expected):
                what = f"signal {expected!r}" if expected is not None else "a signal"
                now = run_note(run) or run.status
                outcome.refuse(f"Run {run.task_id} was not {verb.lower()}: it does not wait "
                               f"for {what} ({now}).")
                continue
            stored = self._operate(outcome, run, verb, partial(
                send_signal, run.task_id, waited, payload, app=celery_app()))
            if stored is None:
                continue
            if not stored:
                outcome.refuse(f"Run {run.task_id}: signal {waited!r} had already been sent, "
                               "so this one was ignored (a run gets the first payload sent "
                               "under a name).", messages.WARNING)
                continue
            message = f"{verb}: signal {waited!r} sent with payload {json_text(payload)}"
            self.log_change(request, run, message)
            outcome.ok(f"{verb} (signal payload {json_text(payload)})", run.task_id)
        outcome.tell(request)

    def _cancel(self, request: Any, runs: Iterable[Run]) -> None:
        outcome = _Outcome()
        for run in runs:
            requested = self._operate(outcome, run, "Cancel",
                                      partial(cancel, run.task_id, app=celery_app()))
            if requested is None:
                continue
            if not requested:
                outcome.refuse(f"Run {run.task_id} had already ended: nothing to cancel.",
                               messages.WARNING)
                continue
            self.log_change(request, run, "Cancellation requested")
            outcome.ok("Cancellation requested (each stops at its next step, at once if it "
                       "sleeps or waits; its completed steps are compensated)", run.task_id)
        outcome.tell(request)

    def _retry(self, request: Any, runs: Iterable[Run], from_step: str | None = None) -> None:
        outcome = _Outcome()
        start = f"from step {from_step!r}" if from_step else "replaying their recorded steps"
        for run in runs:
            sent = self._operate(outcome, run, "Retry", partial(
                retry_run, run.task_id, from_step=from_step, app=celery_app()))
            if sent is None:
                continue
            self.log_change(request, run, f"Sent again, {start}")
            outcome.ok(f"Sent again under the same task id, {start}", run.task_id)
        outcome.tell(request)

    @staticmethod
    def _operate(outcome: _Outcome, run: Run, what: str,
                 operation: Callable[[], Any]) -> Any:
        """Run one operation; None (and a message) when it refused or failed."""
        try:
            return operation()
        except DuraflowError as exc:
            outcome.refuse(f"{what} of run {run.task_id} refused: {exc}")
        except Exception as exc:
            # A broker or database outage while sending: say so on the page, log the rest.
            logger.exception("%s of run %s failed", what, run.task_id)
            outcome.refuse(f"{what} of run {run.task_id} failed ({type(exc).__name__}: {exc}); "
                           "see the server log.")
        return None

    # -- the run's page ---------------------------------------------------------------------

    def get_urls(self) -> list[Any]:
        def wrap(view: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return self.admin_site.admin_view(view)(*args, **kwargs)

            wrapper.model_admin = self  # type: ignore[attr-defined]
            return update_wrapper(wrapper, view)

        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        own = [path(f"<path:object_id>/{action}/", wrap(self.run_action_view),
                    {"action": action}, name=f"{prefix}_{action}")
               for action in RUN_ACTIONS]
        return [*own, *super().get_urls()]

    def run_action_view(self, request: Any, object_id: str, action: str) -> Any:
        """The buttons of a run's page: one action on this run, then back to its page."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        allowed = {"approve": self.has_approve_permission, "reject": self.has_approve_permission,
                   "cancel": self.has_cancel_permission, "retry": self.has_retry_permission}
        if not allowed[action](request):
            raise PermissionDenied
        run = self.get_object(request, unquote(object_id))
        if run is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if action in ("approve", "reject"):
            self._decide(request, [run], approved=action == "approve",
                         expected=request.POST.get("signal") or None)
        elif action == "cancel":
            self._cancel(request, [run])
        else:
            self._retry(request, [run], from_step=request.POST.get("from_step") or None)
        return HttpResponseRedirect(self._url("change", run.task_id))

    def change_view(self, request: Any, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> Any:
        context = dict(extra_context or {})
        run = self.get_object(request, unquote(object_id))
        if run is not None and self.has_view_permission(request, run):
            context.update(self._run_context(request, run))
        return super().change_view(request, object_id, form_url, extra_context=context)

    def _run_context(self, request: Any, run: Run) -> dict[str, Any]:
        alias = conf.store_alias()
        steps = list(Step.objects.using(alias).filter(run_id=run.task_id))
        signals = list(Signal.objects.using(alias).filter(run_id=run.task_id))
        # The first children only: a children() join may have thousands, which the
        # summaries of the joins count by status.
        children = list(Run.objects.using(alias).filter(parent_id=run.task_id,
                                                        pruned_at__isnull=True)
                        .order_by("created_at", "task_id")
                        .only("task_id", "task_name", "status",
                              "created_at")[:CHILDREN_SHOWN + 1])
        joins = [join_summary(key, counts) for key, counts in
                 store_for(conf.store_config()).join_progress(run.task_id).items()]
        def link(task_id: str) -> str:
            return self._url("change", task_id)

        rows = [{
            "key": s.step_key,
            "status": s.status,
            "attempts": s.attempts,
            "started_at": shown_time(s.started_at),
            "completed_at": shown_time(s.completed_at),
            "duration": span(step_duration(s)),
            "output": (_shown(s.output, s.serializer, task_id=run.task_id, step_key=s.step_key,
                              limit=PREVIEW) if s.output is not None else ""),
            # The whole output, indented, under the preview.
            "output_full": (_shown(s.output, s.serializer, task_id=run.task_id,
                                   step_key=s.step_key) if s.output is not None else ""),
            "error": clip(s.error or "", PREVIEW),
            "exit": s.body_exit or "",
            "in_doubt": s.status == STEP_RUNNING,
            "compensation": s.step_key.startswith(COMPENSATION_PREFIX),
        } for s in steps]
        waiting_signal = (run.waiting_for if run.status == WAITING and run.wait_kind == "signal"
                          else None)
        return {
            "steps": rows,
            "wait_steps": [row for row in rows if row["status"] == STEP_WAITING],
            "waits_for": waits_for(run.wait_kind, run.waiting_for, run.wake_at),
            "queue": (queue_note(_queue_places(run.task_id))
                      if run.status == WAITING and run.wait_kind == "slot" else ""),
            "signals": [{
                "name": sig.name,
                "sent_at": shown_time(sig.sent_at),
                "payload": _shown(sig.payload, sig.serializer, task_id=run.task_id,
                                  step_key=sig.name, what="signal payload"),
            } for sig in signals],
            "children": [{"run": child, "url": link(child.task_id),
                          "created_at": shown_time(child.created_at)}
                         for child in children[:CHILDREN_SHOWN]],
            "more_children": len(children) > CHILDREN_SHOWN,
            "joins": joins,
            "parent_url": link(run.parent_id) if run.parent_id else None,
            "waiting_signal": waiting_signal,
            "retry_steps": [row["key"] for row in rows if not row["compensation"]],
            "can_approve": waiting_signal is not None and self.has_approve_permission(request),
            # Offered where they can apply; the operations still decide.
            "can_cancel": run.status not in FINISHED and self.has_cancel_permission(request),
            "can_retry": run.status in FINISHED and self.has_retry_permission(request),
            # A succeeded run is retried from a step only (replayed whole, it changes nothing).
            "retry_replays": run.status != SUCCEEDED,
            "action_urls": {action: self._url(action, run.task_id) for action in RUN_ACTIONS},
        }

    def _url(self, view: str, task_id: str) -> str:
        """The address of one of this admin's views of run ``task_id``."""
        return str(reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}",
                           args=(quote(task_id),), current_app=self.admin_site.name))


def shown_time(value: Any) -> str:
    """A stored time to the second, in Django's current time zone; ``-`` for none."""
    if value is None:
        return "-"
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return str(formats.date_format(value, TIME_FORMAT))


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate from a JSON ``\\ud800``
    escape in a stored value) written as its escape, so that any stored value can be shown."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _pre(text: str) -> SafeString:
    """Text (JSON, already printable) in a ``<pre>``, escaped, its line breaks kept."""
    return format_html('<pre class="duraflow-json" style="margin: 0; white-space: pre-wrap;">'
                       "{}</pre>", text)


def _queue_places(task_id: str) -> Any:
    """Where a run waiting for a concurrency slot stands, read by the library's store."""
    _app, config = app_and_config(celery_app())
    return store_for(config).queued(task_id)


def _shown(data: str, stored_with: str | None, *, task_id: str, step_key: str | None = None,
           what: str | None = None, limit: int = MAX_SHOWN) -> str:
    """A stored value as JSON text, decoded as the library decodes it (the serializers the
    Celery app's configuration accepts, nothing else), or why it cannot be read."""
    _app, config = app_and_config(celery_app())
    try:
        value = decode(data, stored_with, config.serializer, accept=config.accept_serializers,
                       task_id=task_id, step_key=step_key, what=what, placeholder=True)
    except DuraflowError as exc:
        return printable(f"(unreadable: {exc})")
    if isinstance(value, Unreadable):
        return printable(str(value))
    return printable(clip(json_text(value, 2 if limit == MAX_SHOWN else None), limit))


admin.site.register(Run, RunAdmin)


# -- schedules -------------------------------------------------------------------------------


def _stored(row: Schedule) -> StoredSchedule:
    """The library's own record of a schedule's row, which knows how to read its timing."""
    return StoredSchedule(**{name: getattr(row, name)
                             for name in StoredSchedule.__dataclass_fields__})


class BackfillForm(forms.Form):
    """The range of a backfill: two past moments, read in Django's current time zone unless
    they name their offset."""

    start = forms.DateTimeField(label="From")
    end = forms.DateTimeField(label="To")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        zone = timezone.get_current_timezone_name()
        for field in self.fields.values():
            field.help_text = (f"A date and time such as 2026-06-01 00:00:00, in {zone} (or "
                               "ISO 8601 with its offset, such as 2026-06-01T00:00:00Z).")

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        for key in ("start", "end"):
            value = data.get(key)
            if value is not None and timezone.is_naive(value):
                # USE_TZ = False: the moment is read in the project's time zone.
                data[key] = timezone.make_aware(value)
        start, end = data.get("start"), data.get("end")
        if start is not None and end is not None and end < start:
            raise forms.ValidationError("'To' is before 'From': give the earlier moment first.")
        return data


class ScheduleAdmin(_SteeredAdmin):
    """Durable schedules by name; a schedule's page shows its next fire times."""

    list_display = ("name", "task_name", "timing", "policies", "state", "next_fire",
                    "last_slot", "last_run", "fired", "skipped")
    list_filter = ("paused", "origin", "task_name")
    search_fields = ("name",)
    ordering = ("name",)
    list_per_page = 100
    actions = ("pause_schedules", "resume_schedules", "backfill_schedules")
    fieldsets = (
        (None, {"fields": ("name", "task_name", "origin", "timing", "policies", "state",
                           "upcoming", "kept_back", "last_slot", "last_run", "fired",
                           "skipped")}),
        ("Routing and record", {"classes": ("collapse",), "fields": (
            "routing", "created", "updated")}),
    )
    readonly_fields = ("name", "task_name", "origin", "timing", "policies", "state",
                       "upcoming", "kept_back", "last_slot", "last_run", "fired", "skipped",
                       "routing", "created", "updated")

    # -- reading ---------------------------------------------------------------------------

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).using(conf.store_alias())

    @admin.display(description="timing")
    def timing(self, schedule: Schedule) -> str:
        try:
            return _stored(schedule).describe()
        except ValueError:  # a time zone this machine does not know
            return f"cron {schedule.cron} ({schedule.timezone})" if schedule.cron else "-"

    @admin.display(description="policies")
    def policies(self, schedule: Schedule) -> str:
        return schedule_policies(schedule)

    @admin.display(description="state", ordering="paused")
    def state(self, schedule: Schedule) -> str:
        return schedule_state(schedule)

    @admin.display(description="next fire at", ordering="next_fire_at")
    def next_fire(self, schedule: Schedule) -> str:
        slot = next_slot(schedule)
        return shown_time(slot) if slot is not None else "- (paused)"

    @admin.display(description="last slot", ordering="last_slot_at")
    def last_slot(self, schedule: Schedule) -> str:
        return shown_time(schedule.last_slot_at)

    @admin.display(description="kept back (buffer_one)")
    def kept_back(self, schedule: Schedule) -> str:
        return shown_time(schedule.buffered_at)

    @admin.display(description="created at")
    def created(self, schedule: Schedule) -> str:
        return shown_time(schedule.created_at)

    @admin.display(description="updated at")
    def updated(self, schedule: Schedule) -> str:
        return shown_time(schedule.updated_at)

    @admin.display(description="routing")
    def routing(self, schedule: Schedule) -> str:
        parts = [f"{label} {value}" for label, value in (
            ("routing key", schedule.routing_key), ("exchange", schedule.exchange),
            ("priority", schedule.priority)) if value is not None]
        return ", ".join(parts) or "-"

    @admin.display(description="last run")
    def last_run(self, schedule: Schedule) -> SafeString | str:
        if not schedule.last_run_id:
            return "-"
        url = reverse(f"admin:{self.opts.app_label}_run_change",
                      args=(quote(schedule.last_run_id),), current_app=self.admin_site.name)
        return format_html('<a href="{}">{}</a>', url, schedule.last_run_id)

    @admin.display(description=f"next {UPCOMING} fire times")
    def upcoming(self, schedule: Schedule) -> SafeString | str:
        if schedule.paused:
            return "none while it is paused"
        try:
            moments = next_fire_times(schedule.name, UPCOMING, app=celery_app())
        except DuraflowError as exc:
            return f"(cannot be read: {exc})"
        zone = schedule.timezone if schedule.cron else None
        return format_html_join(
            "", "<div>{}{}</div>",
            ((shown_time(moment), f" ({local})" if (local := wall_time(moment, zone)) else "")
             for moment in moments))


    # -- what an operator may do to a schedule ----------------------------------------------

    def has_pause_permission(self, request: Any) -> bool:
        return self._may(request, "pause_schedule")

    def has_backfill_permission(self, request: Any) -> bool:
        return self._may(request, "backfill_schedule")

    @admin.action(permissions=("pause",), description="Pause the selected schedules")
    def pause_schedules(self, request: Any, queryset: Iterable[Schedule]) -> None:
        outcome = _Outcome()
        for schedule in queryset:
            if schedule.paused:
                outcome.refuse(f"Schedule {schedule.name!r} was paused already: nothing "
                               "changed.", messages.WARNING)
                continue
            done = self._operate(outcome, schedule, "Pause", partial(
                pause_schedule, schedule.name, app=celery_app()))
            if done is None:
                continue
            self.log_change(request, schedule, "Paused")
            outcome.ok("Paused (none of their slots fires until they are resumed)",
                       schedule.name)
        outcome.tell(request)

    @admin.action(permissions=("pause",), description="Resume the selected schedules")
    def resume_schedules(self, request: Any, queryset: Iterable[Schedule]) -> None:
        outcome = _Outcome()
        for schedule in queryset:
            if not schedule.paused:
                outcome.refuse(f"Schedule {schedule.name!r} was not paused: nothing changed.",
                               messages.WARNING)
                continue
            done = self._operate(outcome, schedule, "Resume", partial(
                resume_schedule, schedule.name, app=celery_app()))
            if done is None:
                continue
            self.log_change(request, schedule, "Resumed")
            outcome.ok("Resumed (each fires from its next slot after now; the slots it was "
                       "paused over stay unfired until backfilled)", schedule.name)
        outcome.tell(request)

    @admin.action(permissions=("backfill",),
                  description="Backfill the selected schedules over a past range")
    def backfill_schedules(self, request: Any, queryset: Any) -> TemplateResponse | None:
        """Ask for the range on an intermediate page; once it is given, fire each selected
        schedule's slots of that range that have no run."""
        schedules = list(queryset)
        if "apply" in request.POST:
            form = BackfillForm(request.POST)
            if form.is_valid():
                self._backfill(request, schedules, form.cleaned_data["start"],
                               form.cleaned_data["end"])
                return None  # back to the list, with the messages
        else:
            form = BackfillForm()
        context = {
            **self.admin_site.each_context(request),
            "title": "Backfill schedules",
            "subtitle": None,
            "opts": self.opts,
            "schedules": [(schedule, self.timing(schedule)) for schedule in schedules],
            "form": form,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "action": "backfill_schedules",
            "media": self.media + form.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/duraflow/schedule/backfill.html", context)

    def _backfill(self, request: Any, schedules: list[Schedule], start: Any, end: Any) -> None:
        outcome = _Outcome()
        where = f"from {shown_time(start)} to {shown_time(end)}"
        for schedule in schedules:
            sent = self._operate(outcome, schedule, "Backfill", partial(
                backfill_schedule, schedule.name, start, end, app=celery_app()))
            if sent is None:
                continue
            self.log_change(request, schedule, f"Backfilled {where}: {len(sent)} run(s) sent")
            if sent:
                messages.success(request, f"Backfilled schedule {schedule.name!r} {where}: "
                                          f"{len(sent)} run(s) sent, one for each slot that "
                                          "had none.")
            else:
                outcome.refuse(f"Schedule {schedule.name!r} {where}: every slot had a run "
                               "already (or the range holds none); nothing was sent.",
                               messages.INFO)
        outcome.tell(request)

    @staticmethod
    def _operate(outcome: _Outcome, schedule: Schedule, what: str,
                 operation: Callable[[], Any]) -> Any:
        """Run one operation; None (and a message) when it refused or failed."""
        try:
            return operation()
        except DuraflowError as exc:
            outcome.refuse(f"{what} of schedule {schedule.name!r} refused: {exc}")
        except Exception as exc:
            # A database or broker outage: say so on the page, log the rest.
            logger.exception("%s of schedule %r failed", what, schedule.name)
            outcome.refuse(f"{what} of schedule {schedule.name!r} failed "
                           f"({type(exc).__name__}: {exc}); see the server log.")
        return None


admin.site.register(Schedule, ScheduleAdmin)
