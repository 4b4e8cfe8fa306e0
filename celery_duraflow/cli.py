"""``celery -A proj duraflow ...``: commands to see and steer durable runs.

Registered under Celery's ``celery.commands`` entry point, so the commands run
with the user's app and configuration. Each command is a thin wrapper around a
library function that can be called from Python too.

Every command prints errors as one line, ``error: ...``, on stderr and exits
with status 1; a bad option or argument exits with status 2 (click's usage
error). Times are printed in UTC.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from kombu.exceptions import OperationalError as BrokerError

from . import _admin, _clock, _history, _replay
from ._config import config_for_app
from ._format import (
    catchup_note,
    clip,
    join_summary,
    json_default,
    json_text,
    next_slot,
    queue_note,
    run_note,
    schedule_state,
    span,
    step_duration,
    unwinding_note,
    waits_for,
    wall_time,
    when,
)
from ._operations import cancel as cancel_run
from ._operations import retry_run
from ._patched import MARKER_PREFIX
from ._recovery import recover_forever, sweep
from ._schedules import (
    Schedule,
    backfill_schedule,
    get_schedule,
    list_schedules,
    next_fire_times,
    pause_schedule,
    remove_schedule,
    resume_schedule,
)
from ._schema import LATEST_VERSION
from ._serialization import Unreadable, visible
from ._store import (
    RUN_STATUSES,
    STEP_COMPLETED,
    STEP_FAILED,
    STEP_WAITING,
    RunRecord,
    Store,
    store_for,
)
from ._view import RunView, StepView, get_run
from ._waits import send_signal
from .errors import DuraflowError


@click.group(name="duraflow")
def duraflow() -> None:
    """Inspect and steer celery-duraflow runs."""


def _sweep_options(fn: Any) -> Any:
    fn = click.option("--limit", type=int, default=100, show_default=True, cls=CeleryOption,
                      help_group="Sweep Options", help="Most runs sent per sweep.")(fn)
    fn = click.option("--interval", type=float, default=10.0, show_default=True,
                      cls=CeleryOption, help_group="Sweep Options",
                      help="Seconds between sweeps.")(fn)
    return click.option("--once", is_flag=True, cls=CeleryOption, help_group="Sweep Options",
                        help="Sweep once and exit (for cron); by default sweep forever.")(fn)


def _sweep(ctx: click.Context, once: bool, interval: float, limit: int) -> None:
    app: Any = ctx.obj.app
    if once:
        done = sweep(app, limit=limit)
        sent, failed = done.sent, done.failed
        _echo(ctx, f"sent {len(sent)} run(s)" + (": " + " ".join(sent) if sent else ""))
        if failed:
            _echo(ctx, f"marked {len(failed)} run(s) failed that cannot be sent (see their "
                       "error with duraflow show): " + " ".join(failed))
        return
    _echo(ctx, f"waking due runs and re-sending lost ones every {interval:g}s "
               "(Ctrl-C to stop)")
    recover_forever(app, interval=interval, limit=limit)


@duraflow.command(cls=CeleryCommand)
@_sweep_options
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def recover(ctx: click.Context, once: bool, interval: float, limit: int) -> None:
    """Send runs that need it: lost runs (lease expired) and due sleeps and waits.

    A run that cannot be sent (no recorded arguments, arguments that cannot
    be decoded, a task the app does not know) is marked failed, with the
    reason in its error, so that it does not hold up the others: run this
    command with the workers' app.
    """
    _sweep(ctx, once, interval, limit)


@duraflow.command(cls=CeleryCommand)
@_sweep_options
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def wake(ctx: click.Context, once: bool, interval: float, limit: int) -> None:
    """Wake sleeping and waiting runs whose time is up (the same sweep as recover).

    Like recover, it marks failed the runs it cannot send.
    """
    _sweep(ctx, once, interval, limit)


def _echo(ctx: click.Context, text: str) -> None:
    """Print ``text`` with what could mislead or break a terminal escaped (see
    :func:`~celery_duraflow._serialization.visible`): a stored name or value may hold a
    bidi override, a control character or a lone surrogate."""
    ctx.obj.echo(visible(text, lines=True))


def _one_line(text: str) -> str:
    """``text`` escaped (see :func:`_echo`) and on one line: runs of whitespace become one
    space."""
    return " ".join(visible(text, lines=True).split())


def _fail(message: str) -> NoReturn:
    """Print ``error: message`` on one line on stderr and exit with status 1."""
    click.echo("error: " + _one_line(message), err=True)
    sys.exit(1)


@duraflow.command(cls=CeleryCommand)
@click.argument("task_id")
@click.argument("name")
@click.argument("payload", required=False)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def signal(ctx: click.Context, task_id: str, name: str, payload: str | None) -> None:
    """Send signal NAME to run TASK_ID, with an optional JSON PAYLOAD.

    Exit status 0 when the signal was stored or one of that name already was
    (the first payload is kept), 1 when the run is unknown or the store fails.
    """
    try:
        value = json.loads(payload) if payload is not None else None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="PAYLOAD") from None
    try:
        stored = send_signal(task_id, name, value, app=ctx.obj.app)
    except DuraflowError as exc:
        _fail(str(exc))
    if stored:
        _echo(ctx, f"signal {name!r} stored for {task_id}")
    else:
        _echo(ctx, f"signal {name!r} was already stored for {task_id}; this payload "
                   "was ignored (the first one is kept)")


@duraflow.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--task", "task_name", default=None, cls=CeleryOption, help_group="Patch Options",
              help="Only runs of this task name.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=20, show_default=True,
              cls=CeleryOption, help_group="Patch Options", help="Most runs listed.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def patch(ctx: click.Context, name: str, task_name: str | None, limit: int) -> None:
    """Show which unfinished runs may still take the old branch of patched(NAME).

    Those are the runs that started before any run recorded the patch and
    have not recorded it themselves. When none is left, the patch can be
    retired (keep the new branch, delete the patched() call and the old one).
    The count of runs that recorded it stops at 1,000 (printed 1000+), and
    the oldest --limit runs are listed (the line above them says when there are
    more). Exit status 0 when none is left, 3 when some are.
    """
    try:
        store = store_for(config_for_app(ctx.obj.app))
        # One more than shown: whether the list stopped at the limit.
        first, count, old = _admin.patch_progress(store, MARKER_PREFIX + name, task_name,
                                                  limit + 1, cap=_admin.COUNT_CAP)
    except DuraflowError as exc:
        _fail(str(exc))
    if first is None:
        _echo(ctx, f"patch {name!r}: no run has recorded it yet")
    else:
        _echo(ctx, f"patch {name!r}: recorded by {_at_least(count)} run(s), first at "
                   f"{when(first)} UTC")
    if not old:
        _echo(ctx, "no unfinished run started before it without it: the old branch can go")
        return
    if len(old) > limit:
        _echo(ctx, f"more than {limit} unfinished runs may still take the old branch; the "
                   f"oldest {limit} (--limit shows more):")
    else:
        _echo(ctx, f"{len(old)} unfinished run(s) may still take the old branch:")
    for run in old[:limit]:
        _echo(ctx, f"  {_one_line(run.task_id)}  {_one_line(run.task_name)}  {run.status}  "
                   f"started {when(run.created_at)} UTC")
    sys.exit(3)


# -- shared helpers of the commands below --------------------------------------------------

OUTPUT_WIDTH = 60


def _duration(ctx: click.Context, param: click.Parameter,
              value: str | None) -> timedelta | None:
    """Read ``30s``, ``15m``, ``2h``, ``30d`` (see :func:`_admin.parse_duration`)."""
    if value is None:
        return None
    try:
        return _admin.parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _split_statuses(values: Sequence[str]) -> list[str]:
    return [part.strip().lower() for value in values for part in value.split(",")
            if part.strip()]


def _run_statuses(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> list[str]:
    try:
        return _admin.check_statuses(_split_statuses(values))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _prunable_statuses(ctx: click.Context, param: click.Parameter,
                       values: Sequence[str]) -> list[str]:
    chosen = _split_statuses(values)
    unfinished = [status for status in chosen if status in _admin.UNFINISHED]
    if unfinished:
        raise click.BadParameter(
            f"{', '.join(unfinished)}: prune only deletes runs that have ended "
            f"({', '.join(_admin.PRUNABLE)})", ctx=ctx, param=param)
    try:
        return _admin.check_statuses(chosen, _admin.PRUNABLE)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _store(ctx: click.Context) -> Store:
    """The store of the app the command runs with (``celery -A proj``)."""
    return store_for(config_for_app(ctx.obj.app))


def _age(moment: datetime, now: datetime) -> str:
    """How long ago, in the largest whole unit: ``12s ago``, ``5m ago``, ``3d ago``."""
    seconds = int((now - moment).total_seconds())
    if seconds < 1:
        return "just now"
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def _duration_text(duration: timedelta) -> str:
    """A duration as the options take it: ``30d``, ``1h30m``, ``0s``."""
    seconds = int(duration.total_seconds())
    parts = []
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"


def _print_json(ctx: click.Context, data: Any) -> None:
    _echo(ctx, json.dumps(data, indent=2, default=json_default))


def _clip(text: str, width: int | None) -> str:
    """``text`` escaped and on one line (:func:`_one_line`), cut to ``width`` characters
    with ``...`` when longer; whole when ``width`` is None."""
    line = _one_line(text)
    return line if width is None else clip(line, width)


def _terminal_width() -> int | None:
    """The width output must fit: ``$COLUMNS`` when it is set, else the terminal's when
    standard output is a terminal; None in a pipe or a file, where nothing is cut."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout
    if stream is None or not stream.isatty():
        return None
    return shutil.get_terminal_size((0, 0)).columns or None


def _fit(widths: list[int], limit: int, shrink: Sequence[int]) -> tuple[list[int], bool]:
    """Narrow the ``shrink`` columns (to 10 at least) towards ``limit``; and do they fit?"""
    fitted = list(widths)
    excess = sum(fitted) + 2 * (len(fitted) - 1) - limit
    for i in shrink:
        cut = max(0, min(excess, fitted[i] - min(fitted[i], 10)))
        fitted[i] -= cut
        excess -= cut
    return fitted, excess <= 0


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *,
           shrink: Sequence[int] = (), drop: Sequence[int] = ()) -> list[str]:
    """Aligned columns that fit the terminal.

    When the columns are too wide, the ``shrink`` columns are cut first, then
    the ``drop`` columns are left out, in that order, until the rest fits (or
    nothing more can be left out).
    """
    # Escaped and on one line first, so that the widths are those printed.
    rows = [[_one_line(cell) for cell in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in rows)])
              for i, header in enumerate(headers)]
    keep = list(range(len(headers)))
    limit = _terminal_width()
    if limit is not None:
        for dropped in range(len(drop) + 1):
            keep = [i for i in range(len(headers)) if i not in drop[:dropped]]
            fitted, fits = _fit([widths[i] for i in keep], limit,
                                [keep.index(i) for i in shrink if i in keep])
            if fits:
                break
        for i, width in zip(keep, fitted, strict=True):
            widths[i] = width
    lines = []
    for row in [headers, *rows]:
        cells = [clip(row[i], widths[i]).ljust(widths[i]) for i in keep]
        lines.append("  ".join(cells).rstrip())
    return lines


def _run_json(run: RunRecord, **extra: Any) -> dict[str, Any]:
    """A run's row as JSON, without its stored arguments and result."""
    data = {field.name: getattr(run, field.name) for field in dataclasses.fields(run)
            if field.name not in ("args", "args_fingerprint", "result", "serializer")}
    data.update(extra)
    return data


# -- runs ----------------------------------------------------------------------------------


@duraflow.command(cls=CeleryCommand)
@click.option("--status", "statuses", multiple=True, callback=_run_statuses, metavar="STATUS",
              cls=CeleryOption, help_group="Filter Options",
              help="Only runs in this status; repeat the option or separate statuses with "
                   f"commas ({', '.join(RUN_STATUSES)}).")
@click.option("--task", "task_name", default=None, metavar="NAME", cls=CeleryOption,
              help_group="Filter Options", help="Only runs of this task name.")
@click.option("--older-than", callback=_duration, metavar="DURATION", default=None,
              cls=CeleryOption, help_group="Filter Options",
              help="Only runs created more than this long ago (30s, 15m, 2h, 30d).")
@click.option("--newer-than", callback=_duration, metavar="DURATION", default=None,
              cls=CeleryOption, help_group="Filter Options",
              help="Only runs created less than this long ago (30s, 15m, 2h, 30d).")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              cls=CeleryOption, help_group="Output Options", help="Most runs listed.")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption,
              help_group="Output Options",
              help="Print a JSON array, one object per run, with ISO 8601 times.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def runs(ctx: click.Context, statuses: list[str], task_name: str | None,
         older_than: timedelta | None, newer_than: timedelta | None, limit: int,
         as_json: bool) -> None:
    """List runs, newest first, with how many match per status.

    For each run: its task id and name, status, attempts, steps completed
    out of those recorded, when it was created and last updated, and what a
    sleeping or waiting run waits for. The counts per status stop at 1,000
    (printed 1,000+), so that they cost the same on a store of millions of
    runs. Exit status 0, also when no run matches; 1 when the store cannot be
    read; 2 for a bad option.
    """
    filters: dict[str, Any] = {"statuses": statuses, "task_name": task_name,
                               "older_than": older_than, "newer_than": newer_than}
    try:
        store = _store(ctx)
        found = _admin.summarize_runs(store, limit=limit, **filters)
        counts = None if as_json else _admin.count_by_status_bounded(store, **filters)
    except DuraflowError as exc:
        _fail(str(exc))
    if as_json:
        _print_json(ctx, [_run_json(s.run, steps_completed=s.steps_completed,
                                    steps_total=s.steps_total) for s in found])
        return
    if not found:
        filtered = any(value for value in filters.values())
        _echo(ctx, "no runs match these filters" if filtered else "no runs are recorded")
        return
    now = _clock.now()
    rows = [[s.run.task_id, s.run.task_name, s.run.status, str(s.run.attempts),
             f"{s.steps_completed}/{s.steps_total}", when(s.run.created_at),
             _age(s.run.updated_at, now), run_note(s.run, say_no_timeout=False)]
            for s in found]
    headers = ["TASK ID", "TASK", "STATUS", "TRIES", "STEPS", "CREATED (UTC)", "UPDATED",
               "WAITS FOR"]
    for line in _table(headers, rows, shrink=(7, 1), drop=(6, 3, 4, 5)):
        _echo(ctx, line)
    if counts is None:  # pragma: no cover - --json returned above
        return
    total = counts.total
    shown = "all shown" if total <= len(found) and not counts.bounded else (
        f"newest {len(found)} shown; --limit shows more")
    by_status = ", ".join(f"{status} {counts.text(count)}"
                          for status, count in counts.counts.items())
    bound = (f"; counted up to {counts.cap:,} per status, so '+' means at least"
             if counts.bounded else "")
    _echo(ctx, f"{total:,}{'+' if counts.bounded else ''} run(s) match: {by_status} "
               f"({shown}{bound})")


# -- show ----------------------------------------------------------------------------------


def _step_output(view: StepView, width: int | None) -> str:
    """A step's output (or error) on one line, cut to ``width`` characters unless None."""
    if view.status == STEP_FAILED:
        return _clip(f"error: {view.error or ''}", width)
    if view.status not in (STEP_COMPLETED, STEP_WAITING):
        return "-"
    return _value_line(view.result, width)


def _value_line(value: Any, width: int | None) -> str:
    """A stored value as one-line JSON (its ``repr`` if JSON cannot hold it), escaped,
    cut to ``width`` characters unless None."""
    if isinstance(value, Unreadable):
        # Its row names a serializer that is not accepted: the placeholder, whole (the
        # name in it is cut short already; the table cuts it to fit the terminal).
        return str(value)
    return _clip(json_text(value), width)


def _show_json(run: RunView, record: RunRecord | None,
               joins: dict[str, dict[str, int]]) -> dict[str, Any]:
    data = dataclasses.asdict(run)
    data["steps"] = [
        {**dataclasses.asdict(view),
         "duration_seconds": (None if (took := step_duration(view)) is None
                              else took.total_seconds())}
        for view in run.steps
    ]
    if record is not None:
        # Whether the latest attempt's worker was lost: on the row, not in the view.
        data["interrupted"] = record.interrupted
    # The children of each children() join, counted by status, by the join's step key.
    data["joins"] = joins
    return data


def _show_header(run: RunView, cut: bool,
                 joins: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    status = run.status
    waits = waits_for(run.wait_kind, run.waiting_for, run.wake_at)
    if waits:
        status += f": waits for {waits}"
    if unwinding := unwinding_note(run):
        status += f", {unwinding}"
    attempts = f"{run.attempts} (retries {run.retries}, recoveries {run.recoveries})"
    lines = [("task id", run.task_id), ("task", run.task_name), ("status", status),
             ("attempts", attempts), ("created", when(run.created_at)),
             ("updated", when(run.updated_at)), ("finished", when(run.finished_at))]
    if run.queue:
        lines.append(("queue", queue_note(run.queue)))
    if run.lease_owner:
        lines.append(("lease", f"{run.lease_owner} until {when(run.lease_expires_at)}"))
    if run.status == "succeeded":
        lines.append(("result", _value_line(run.result, OUTPUT_WIDTH if cut else None)))
    lines += [("error", _clip(run.error, 200 if cut else None) if run.error else "-"),
              ("parent", run.parent_id or "-"),
              *[("children", join_summary(key, counts)) for key, counts in joins.items()],
              ("code", run.code_fingerprint[:16] if run.code_fingerprint else "-")]
    return lines


@duraflow.command(cls=CeleryCommand)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption,
              help_group="Output Options",
              help="Print the run and all its steps, with their outputs, as JSON.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show run TASK_ID and its steps in the order they first started.

    The timeline includes compensation records (compensate:KEY) and patch
    markers (patched:NAME). Each step's output is printed on one line: on a
    terminal (or with $COLUMNS set) cut short to fit its width, into a pipe
    or a file whole; --json prints them as stored. Outputs may hold personal
    data. Characters that could garble the terminal or make a name look like
    another (control characters, bidi overrides, lone surrogates) are printed
    as escapes such as \u202e. Exit status 0; 1 when no run has that task
    id or the store cannot be read.
    """
    app = ctx.obj.app
    try:
        run = get_run(task_id, app=app)
        record = _store(ctx).get_run(task_id) if run is not None else None
        joins = _store(ctx).join_progress(task_id) if run is not None else {}
    except DuraflowError as exc:
        _fail(str(exc))
    if run is None:
        _fail(f"no run with task id {task_id} is recorded")
    if as_json:
        _print_json(ctx, _show_json(run, record, joins))
        return
    # On a terminal outputs are cut short, and the table is fitted to its width; into a
    # pipe or a file nothing is cut.
    cut = _terminal_width() is not None
    header = _show_header(run, cut, joins)
    label_width = max(len(label) for label, _ in header)
    for label, value in header:
        _echo(ctx, f"{label.ljust(label_width)}  {_one_line(value)}")
    _echo(ctx, "")
    if not run.steps:
        _echo(ctx, "no steps recorded")
        return
    _echo(ctx, f"{len(run.steps)} step(s), in the order they first started (times UTC):")
    rows = [[view.key, view.status, str(view.attempts), span(step_duration(view)),
             when(view.started_at), when(view.completed_at),
             _step_output(view, OUTPUT_WIDTH if cut else None)]
            for view in run.steps]
    headers = ["KEY", "STATUS", "TRIES", "DURATION", "STARTED", "COMPLETED", "OUTPUT"]
    for line in _table(headers, rows, shrink=(6, 0), drop=(5, 2, 4)):
        _echo(ctx, line)


# -- histories and the replay check ------------------------------------------------------


@duraflow.command(cls=CeleryCommand)
@click.argument("task_id")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def export(ctx: click.Context, task_id: str) -> None:
    """Print run TASK_ID with its steps, waits and signals as a history file (JSON).

    The format is versioned ("format": "celery-duraflow/run-history",
    "version": 1); `replay --history FILE` and the pytest plugin read it, so a
    recorded run can be replayed against new code without a database. Stored
    values are kept as the store holds them: they may hold personal data.
    Exit status 0; 1 when no run has that task id or the store cannot be read.
    """
    try:
        text = _history.dumps(_history.history_of(_store(ctx), task_id))
    except DuraflowError as exc:
        _fail(str(exc))
    # Escaped as JSON escapes: what a reader cannot print (a lone surrogate, a bidi
    # control) only ever sits in a string, so the file reads back the same values.
    click.echo(visible(text, lines=True), nl=False)


def _replay_line(result: _replay.ReplayResult) -> str:
    head = f"{result.task_id}  {result.task_name}  {result.run_status}  {result.verdict}"
    if result.verdict == "divergent":
        detail = (f"at position {result.position}: recorded {result.recorded_key!r}, "
                  f"reached {result.reached_key!r}")
    elif result.verdict == "compatible":
        detail = (f"carries on at {result.stopped_at!r}" if result.stopped_at
                  else "runs to its end")
    else:
        detail = result.message
    return f"{head}  {detail}"


@duraflow.command(cls=CeleryCommand)
@click.argument("task_ids", nargs=-1, metavar="[TASK_ID]...")
@click.option("--status", "statuses", multiple=True, callback=_run_statuses, metavar="STATUS",
              cls=CeleryOption, help_group="Replay Options",
              help="Without TASK_IDs, check the runs with this status (repeatable, or "
                   "comma-separated; default: sleeping,waiting,running).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
              cls=CeleryOption, help_group="Replay Options",
              help="Without TASK_IDs, check at most this many runs (the newest).")
@click.option("--history", "histories", multiple=True, metavar="FILE",
              type=click.Path(dir_okay=False), cls=CeleryOption, help_group="Replay Options",
              help="Check a run exported with `export` instead of the store's (repeatable).")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption,
              help_group="Output Options", help="Print one result per run as JSON.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def replay(ctx: click.Context, task_ids: tuple[str, ...], statuses: list[str], limit: int,
           histories: tuple[str, ...], as_json: bool) -> None:
    """Check that the current code carries on runs in flight as they were recorded.

    Re-executes each run's task, as deployed now, against the run's recorded
    steps: recorded bodies are skipped, nothing is written and nothing is
    sent, and each run stops where a live attempt would run or record
    something for real. Prints, per run, compatible (and where it would carry
    on) or the first divergence (position, recorded and reached step). Run it
    in CI before a deploy. Exit status 0 when every run is compatible; 1 when
    one diverges or cannot be replayed (its task is not registered, a history
    file of another format), or a task id is unknown.
    """
    app = ctx.obj.app
    try:
        results = [_replay.check_history(path, app=app) for path in histories]
        if task_ids or not histories:
            results += _replay.check_replay(task_ids, app=app,
                                            statuses=statuses or _replay.IN_FLIGHT,
                                            limit=limit)
    except DuraflowError as exc:
        _fail(str(exc))
    if as_json:
        _print_json(ctx, [dataclasses.asdict(result) for result in results])
    else:
        for result in results:
            _echo(ctx, _replay_line(result))
            for note in result.notes:
                _echo(ctx, f"    note: {' '.join(note.split())}")
        bad = sum(not result.compatible for result in results)
        _echo(ctx, f"{len(results)} run(s) checked: {len(results) - bad} compatible, "
                   f"{bad} not")
    if any(not result.compatible for result in results):
        sys.exit(1)


# -- cancel and retry ----------------------------------------------------------------------


@duraflow.command(cls=CeleryCommand)
@click.argument("task_id")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def cancel(ctx: click.Context, task_id: str) -> None:
    """Ask run TASK_ID to stop.

    A running run stops before its next step (its worker learns of it when
    it renews its lease); a sleeping or waiting run is sent at once. Either
    way the compensations of its completed steps run and it ends cancelled.
    Exit status 0 when the cancellation was requested, and also when the run
    had already ended (nothing is changed then); 1 when no run has that task
    id or the store or the broker cannot be reached.
    """
    app = ctx.obj.app
    try:
        requested = cancel_run(task_id, app=app)
        record = None if requested else _store(ctx).get_run(task_id)
    except DuraflowError as exc:
        _fail(str(exc))
    except BrokerError as exc:
        _fail(f"cancellation of {task_id} is recorded, but the broker could not be reached to "
              f"send the run ({exc}); the recovery sweep (duraflow recover) sends it")
    if requested:
        _echo(ctx, f"cancellation requested for {task_id}: it stops before its next step, "
                   "its completed steps are compensated and it ends cancelled")
    else:
        status = record.status if record is not None else "unknown"
        _echo(ctx, f"run {task_id} already ended ({status}); nothing was cancelled")


@duraflow.command(cls=CeleryCommand)
@click.argument("task_id")
@click.option("--from-step", "from_step", metavar="KEY", default=None, cls=CeleryOption,
              help_group="Retry Options",
              help="Run this step, the steps nested in it and every later step again "
                   "(their recorded outcomes are discarded).")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def retry(ctx: click.Context, task_id: str, from_step: str | None) -> None:
    """Send the ended run TASK_ID again, under the same task id.

    Its completed steps are answered from the store and not run again,
    unless --from-step names the first one that must run again. A
    compensated or succeeded run needs --from-step. Exit status 0 when the run was sent;
    1 when it is unknown, has not ended, has no step KEY, or the store or the
    broker cannot be reached.
    """
    app = ctx.obj.app
    try:
        run = retry_run(task_id, from_step=from_step, app=app)
    except (DuraflowError, ValueError) as exc:
        _fail(str(exc))
    except BrokerError as exc:
        _fail(f"run {task_id} was reset for a retry, but the broker could not be reached to "
              f"send it ({exc}); the recovery sweep (duraflow recover) sends it")
    if from_step is None:
        _echo(ctx, f"run {task_id} ({run.task_name}) sent again; its completed steps will "
                   "not run again")
    else:
        _echo(ctx, f"run {task_id} ({run.task_name}) sent again from step {from_step!r}: "
                   "that step and every later one run again")


# -- schedules -----------------------------------------------------------------------------


@duraflow.group(invoke_without_command=True)
@click.pass_context
def schedules(ctx: click.Context) -> None:
    """List durable schedules, or show, pause, resume, backfill or remove one.

    Without a subcommand, lists them (as `schedules list` does). The
    schedules of beat_schedule are stored by the durable beat scheduler when
    it starts; the others by add_schedule(). Times are printed in UTC, with
    the wall-clock time of a cron schedule's own time zone beside them.
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(schedule_list)


def _schedule_json(schedule: Schedule, **extra: Any) -> dict[str, Any]:
    """A schedule's row as JSON, without its recorded arguments, with its timing in words."""
    data = {field.name: getattr(schedule, field.name)
            for field in dataclasses.fields(schedule) if field.name != "args"}
    data["timing"] = schedule.describe()
    data.update(extra)
    return data


def _origin(schedule: Schedule) -> str:
    return "beat_schedule" if schedule.origin == "code" else "added at run time"


@schedules.command(name="list", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption,
              help_group="Output Options",
              help="Print a JSON array, one object per schedule, with ISO 8601 times.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def schedule_list(ctx: click.Context, as_json: bool = False) -> None:
    """List the stored schedules by name.

    For each: its task, when it fires, its catch-up and overlap policies,
    whether it is paused, its next slot (the slot kept back by the buffer_one
    policy first), its last slot fired, and how many slots it fired and
    skipped. Exit status 0, also when none is stored; 1 when the store cannot
    be read.
    """
    try:
        found = list_schedules(app=ctx.obj.app)
    except DuraflowError as exc:
        _fail(str(exc))
    if as_json:
        _print_json(ctx, [_schedule_json(schedule) for schedule in found])
        return
    if not found:
        _echo(ctx, "no schedules are stored (add one with add_schedule() or a durable entry "
                   "of beat_schedule)")
        return
    rows = [[s.name, s.task_name, s.describe(), catchup_note(s), s.overlap,
             "paused" if s.paused else "active", when(next_slot(s)), when(s.last_slot_at),
             str(s.fired), str(s.skipped)] for s in found]
    headers = ["NAME", "TASK", "TIMING", "CATCH-UP", "OVERLAP", "STATE", "NEXT (UTC)",
               "LAST SLOT (UTC)", "FIRED", "SKIPPED"]
    for line in _table(headers, rows, shrink=(2, 1, 0), drop=(9, 8, 7, 3, 4)):
        _echo(ctx, line)
    paused = sum(s.paused for s in found)
    _echo(ctx, f"{len(found)} schedule(s), {paused} paused")


@schedules.command(name="show", cls=CeleryCommand)
@click.argument("name")
@click.option("--count", type=click.IntRange(1, 100), default=5, show_default=True,
              cls=CeleryOption, help_group="Output Options",
              help="How many of the next fire times to print.")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption,
              help_group="Output Options",
              help="Print the schedule and its next fire times as JSON.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def schedule_show(ctx: click.Context, name: str, count: int, as_json: bool) -> None:
    """Show schedule NAME and its next --count fire times.

    A paused schedule has none: it fires from its first slot after it is
    resumed. Exit status 0; 1 when no schedule has that name or the store
    cannot be read.
    """
    app = ctx.obj.app
    try:
        schedule = get_schedule(name, app=app)
        upcoming = next_fire_times(name, count, app=app)
        last = (_store(ctx).get_run(schedule.last_run_id)
                if schedule.last_run_id is not None else None)
    except DuraflowError as exc:
        _fail(str(exc))
    if as_json:
        _print_json(ctx, _schedule_json(schedule, next_fire_times=upcoming,
                                        last_run_status=last.status if last else None))
        return
    routing = ", ".join(f"{label} {value}" for label, value in (
        ("routing key", schedule.routing_key), ("exchange", schedule.exchange),
        ("priority", schedule.priority)) if value is not None)
    last_run = "-"
    if schedule.last_run_id is not None:
        last_run = f"{schedule.last_run_id} ({last.status if last else 'not recorded'})"
    header = [("name", schedule.name), ("task", schedule.task_name),
              ("origin", _origin(schedule)), ("timing", schedule.describe()),
              ("catch-up", catchup_note(schedule)), ("overlap", schedule.overlap),
              ("state", schedule_state(schedule)), ("routing", routing or "-"),
              ("kept back", when(schedule.buffered_at)),
              ("last slot", when(schedule.last_slot_at)), ("last run", last_run),
              ("fired", str(schedule.fired)), ("skipped", str(schedule.skipped)),
              ("created", when(schedule.created_at)), ("updated", when(schedule.updated_at))]
    width = max(len(label) for label, _ in header)
    for label, value in header:
        _echo(ctx, f"{label.ljust(width)}  {_one_line(value)}")
    _echo(ctx, "")
    if schedule.paused:
        _echo(ctx, f"paused: no slot fires until it is resumed (duraflow schedules resume "
                   f"{name})")
        return
    zone = schedule.timezone if schedule.cron is not None else None
    _echo(ctx, f"next {len(upcoming)} fire time(s) (UTC):")
    for moment in upcoming:
        local = wall_time(moment, zone)
        _echo(ctx, f"  {when(moment)}" + (f"  {local}" if local else ""))


@schedules.command(name="pause", cls=CeleryCommand)
@click.argument("name")
@click.option("--note", default=None, metavar="TEXT", cls=CeleryOption,
              help_group="Pause Options", help="Why it is paused (shown with it).")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def schedule_pause(ctx: click.Context, name: str, note: str | None) -> None:
    """Stop schedule NAME from firing until it is resumed.

    Runs already fired go on. Pausing a paused schedule replaces its note.
    Exit status 0; 1 when no schedule has that name or the store cannot be
    reached.
    """
    app = ctx.obj.app
    try:
        before = get_schedule(name, app=app)
        pause_schedule(name, note=note, app=app)
    except DuraflowError as exc:
        _fail(str(exc))
    again = " (it was paused already)" if before.paused else ""
    _echo(ctx, f"schedule {name!r} paused{again}: no slot fires until `duraflow schedules "
               f"resume {name}`")


@schedules.command(name="resume", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def schedule_resume(ctx: click.Context, name: str) -> None:
    """Let schedule NAME fire again, from its first slot after now.

    The slots it was paused over do not fire; `schedules backfill` fires
    them. Exit status 0, also when it was not paused (nothing changes then);
    1 when no schedule has that name or the store cannot be reached.
    """
    app = ctx.obj.app
    try:
        before = get_schedule(name, app=app)
        if not before.paused:
            _echo(ctx, f"schedule {name!r} is not paused; nothing changed")
            return
        after = resume_schedule(name, app=app)
    except DuraflowError as exc:
        _fail(str(exc))
    _echo(ctx, f"schedule {name!r} resumed: its next slot is {when(next_slot(after))} UTC; "
               "the slots it was paused over stay unfired (backfill them to run them)")


def _aware(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """Read an ISO 8601 date and time that names its offset (``Z``, ``+02:00``)."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 date and time; give one such as "
            "2026-06-01T00:00:00Z or 2026-06-01T02:00:00+02:00", ctx=ctx, param=param) from None
    if moment.tzinfo is None:
        raise click.BadParameter(
            f"{value!r} has no time zone, so the moment it means is unknown; add its "
            f"offset, such as {value.strip()}Z for UTC or {value.strip()}+02:00", ctx=ctx,
            param=param)
    return moment


@schedules.command(name="backfill", cls=CeleryCommand)
@click.argument("name")
@click.option("--from", "start", callback=_aware, required=True, metavar="ISO",
              cls=CeleryOption, help_group="Backfill Options",
              help="First moment of the range, with its offset (2026-06-01T00:00:00Z).")
@click.option("--to", "end", callback=_aware, required=True, metavar="ISO",
              cls=CeleryOption, help_group="Backfill Options",
              help="Last moment of the range (in the past), with its offset.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def schedule_backfill(ctx: click.Context, name: str, start: datetime, end: datetime) -> None:
    """Fire every slot of schedule NAME from --from to --to that has no run yet.

    Both ends are included and must be in the past; the schedule's catch-up
    and overlap policies do not apply, and a paused schedule is backfilled
    too. A slot that has a run keeps it, so running the same backfill again
    sends nothing. Prints how many runs were sent, then their task ids, one
    a line. Exit status 0; 1 when no schedule has that name, the range is
    refused (in the future, reversed, more than 10,000 slots) or the store
    cannot be reached; 2 for a time without an offset.
    """
    try:
        sent = backfill_schedule(name, start, end, app=ctx.obj.app)
    except DuraflowError as exc:
        _fail(str(exc))
    span_text = f"from {when(start.astimezone(UTC))} to {when(end.astimezone(UTC))} UTC"
    if not sent:
        _echo(ctx, f"schedule {name!r} {span_text}: every slot had a run already (or there "
                   "is none in the range); nothing was sent")
        return
    _echo(ctx, f"schedule {name!r} {span_text}: sent {len(sent)} run(s) for the slots that "
               "had none:")
    for task_id in sent:
        _echo(ctx, task_id)


@schedules.command(name="remove", cls=CeleryCommand)
@click.argument("name")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def schedule_remove(ctx: click.Context, name: str) -> None:
    """Delete schedule NAME; the runs it fired stay.

    A schedule declared in beat_schedule is stored again when the durable
    beat scheduler next starts: take it out of beat_schedule too. Exit status
    0; 1 when no schedule has that name or the store cannot be reached.
    """
    app = ctx.obj.app
    try:
        schedule = get_schedule(name, app=app)
        removed = remove_schedule(name, app=app)
    except DuraflowError as exc:
        _fail(str(exc))
    if not removed:  # removed by someone else in between
        _fail(f"schedule {name!r} was removed meanwhile by another process; nothing to do")
    _echo(ctx, f"schedule {name!r} removed; the runs it fired stay")
    if schedule.origin == "code":
        _echo(ctx, f"note: {name!r} is declared in beat_schedule, so the durable beat "
                   "scheduler stores it again when it starts: remove it there too")


# -- prune and migrate ---------------------------------------------------------------------


@duraflow.command(cls=CeleryCommand)
@click.option("--older-than", callback=_duration, metavar="DURATION", required=True,
              cls=CeleryOption, help_group="Prune Options",
              help="Delete runs last updated more than this long ago (30s, 15m, 2h, 30d).")
@click.option("--status", "statuses", multiple=True, callback=_prunable_statuses,
              metavar="STATUS", cls=CeleryOption, help_group="Prune Options",
              help="Only runs in this status; repeat the option or separate statuses with "
                   f"commas ({', '.join(_admin.PRUNABLE)}; default: all of them).")
@click.option("--tombstones-older-than", "tombstones_older_than", callback=_duration,
              metavar="DURATION",
              default=_duration_text(_admin.TOMBSTONE_RETENTION), show_default=True,
              cls=CeleryOption, help_group="Prune Options",
              help="Delete the tombstones of runs pruned more than this long ago; keep it "
                   "longer than the broker may take to deliver a message again.")
@click.option("--batch-size", type=click.IntRange(1, _admin.MAX_BATCH_SIZE), default=1000,
              show_default=True, cls=CeleryOption, help_group="Prune Options",
              help="Runs pruned per transaction.")
@click.option("--dry-run", is_flag=True, cls=CeleryOption, help_group="Prune Options",
              help="Count what would be deleted and delete nothing.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def prune(ctx: click.Context, older_than: timedelta, statuses: list[str],
          tombstones_older_than: timedelta, batch_size: int, dry_run: bool) -> None:
    """Delete the steps, signals, arguments and results of ended runs last updated
    before --older-than, leaving a tombstone of each.

    Only runs that ended (succeeded, failed, compensated, cancelled, ignored,
    rejected or replaced) are pruned; a run that is running, sleeping or waiting
    never is, however old, nor a child run whose parent has not ended. A pruned
    run's tombstone (its task id, task name and final status) makes a late
    redelivery of its task id run nothing; it is no longer listed or shown, and
    it is deleted by a prune once it is older than --tombstones-older-than. Each
    batch is one short transaction, reported on stderr as it commits; an
    interrupted prune keeps the batches it committed, and running it again goes
    on from there. --dry-run counts up to 1,000 runs (printed 1,000+), and the
    steps of the runs it counted when there are fewer. Exit
    status 0; 1 when the store cannot be reached; 2 for a bad option (such as a
    status of a run that has not ended).
    """
    chosen = statuses or list(_admin.PRUNABLE)
    try:
        store = _store(ctx)
        if dry_run:
            run_count, dry_steps = _admin.count_prunable(store, older_than=older_than,
                                                         statuses=chosen, cap=_admin.COUNT_CAP)
            tombstones = _admin.count_tombstones(store, older_than=tombstones_older_than,
                                                 cap=_admin.COUNT_CAP)
        else:
            run_count, step_count = _admin.prune(store, older_than=older_than,
                                                 statuses=chosen, batch_size=batch_size,
                                                 tombstones_older_than=None,
                                                 progress=_prune_progress)
            tombstones = _admin.delete_tombstones(store, older_than=tombstones_older_than,
                                                  batch_size=batch_size)
    except DuraflowError as exc:
        _fail(str(exc))
    scope = f"{', '.join(chosen)} runs last updated more than {_duration_text(older_than)} ago"
    graves = (f"{tombstones} tombstone(s) of runs pruned more than "
              f"{_duration_text(tombstones_older_than)} ago")
    if dry_run:
        graves = (f"{_at_least(tombstones)} tombstone(s) of runs pruned more than "
                  f"{_duration_text(tombstones_older_than)} ago")
        steps = ("their steps not counted" if dry_steps is None
                 else f"{dry_steps} steps")
        bound = (f"; counted up to {_admin.COUNT_CAP:,}, so '+' means at least"
                 if max(run_count, tombstones) >= _admin.COUNT_CAP else "")
        _echo(ctx, f"would prune {_at_least(run_count)} run(s) ({steps}): {scope}; "
                   f"would delete {graves}; nothing was deleted (--dry-run{bound})")
    else:
        _echo(ctx, f"pruned {run_count} run(s) ({step_count} steps): {scope}; "
                   f"deleted {graves}")


def _at_least(count: int) -> str:
    """A count of at most :data:`_admin.COUNT_CAP`: ``1000+`` when it stopped there."""
    return f"{count}+" if count >= _admin.COUNT_CAP else str(count)


def _prune_progress(batch: _admin.PruneBatch) -> None:
    # On stderr, so that the summary line stays the output a script reads.
    click.echo(f"pruned {batch.runs} {batch.status} run(s) ({batch.steps} steps) in "
               f"{batch.seconds:.2f}s; {batch.runs_total} run(s) ({batch.steps_total} steps) "
               "so far", err=True)


@duraflow.command(cls=CeleryCommand)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def migrate(ctx: click.Context) -> None:
    """Apply the pending schema migrations now.

    For deployments that set duraflow_auto_migrate = False and migrate as a
    deployment step. Safe to run from several processes at once. Exit status
    0 when the schema is up to date afterwards; 1 when the store cannot be
    reached.
    """
    try:
        store = _store(ctx)
        applied = store.migrate()
    except DuraflowError as exc:
        _fail(str(exc))
    prefix = store.config.table_prefix
    if applied:
        _echo(ctx, f"applied schema migration(s) {', '.join(map(str, applied))} to the "
                   f"{prefix}* tables; the schema is at version {LATEST_VERSION}")
    else:
        _echo(ctx, f"schema is up to date (version {LATEST_VERSION})")


@duraflow.command(cls=CeleryCommand)
@click.option("--host", default="127.0.0.1", show_default=True, cls=CeleryOption,
              help_group="Web Options",
              help="Interface to listen on; anything but loopback needs a proxy with TLS.")
@click.option("--port", type=int, default=8765, show_default=True, cls=CeleryOption,
              help_group="Web Options", help="Port to listen on.")
@click.option("--token", envvar="DURAFLOW_WEB_TOKEN", default=None, cls=CeleryOption,
              help_group="Web Options",
              help="Secret that visitors type to log in and act (approve, reject, cancel, "
                   "retry); also read from DURAFLOW_WEB_TOKEN. At least 16 characters, "
                   "not a placeholder. Without it the view is read-only.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              cls=CeleryOption, help_group="Web Options",
              help="Another Host name to answer besides localhost, 127.0.0.1, [::1] and "
                   "--host (repeatable; .example.com allows a domain and its subdomains). "
                   "Requests for any other name get 400.")
@click.option("--url-prefix", default="", metavar="PATH", cls=CeleryOption,
              help_group="Web Options",
              help="Serve every page under this path (such as /duraflow), for a reverse "
                   "proxy that forwards the prefix unchanged.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def web(ctx: click.Context, host: str, port: int, token: str | None,
        allowed_hosts: tuple[str, ...], url_prefix: str) -> None:
    """Serve a web view of the runs (needs the 'web' extra).

    Runs page, run pages with the step timeline, and Approve / Reject buttons
    for runs waiting for a signal; a schedules page with Pause, Resume and
    Backfill. Exit status 1 when the extra is missing, or
    when the token is empty, a placeholder or shorter than 16 characters, an
    allowed host or the URL prefix is not valid.
    """
    import os

    try:
        from .web import serve
        from .web._app import check_options
    except ImportError as exc:
        _fail(str(exc))
    if token is None and os.environ.get("DURAFLOW_WEB_TOKEN") == "":
        # Click reads an empty variable as no token; a deployment that forgot to set it
        # must not fall back to a read-only view that shows every run to anyone.
        _fail("DURAFLOW_WEB_TOKEN is set but empty: set it to a long random token, or unset "
              "it for a read-only view")
    hosts = (host, *allowed_hosts) if host else allowed_hosts
    try:
        _, prefix = check_options(token=token, allowed_hosts=hosts, url_prefix=url_prefix)
    except ValueError as exc:
        _fail(str(exc))
    mode = "actions need the token" if token else "read-only (no --token)"
    _echo(ctx, f"serving the runs on http://{host}:{port}{prefix}/ ({mode}); Ctrl-C to stop")
    serve(ctx.obj.app, host=host, port=port, token=token, allowed_hosts=allowed_hosts,
          url_prefix=prefix)
