"""``celery -A proj duraflow ...``: commands to see and steer durable runs.

Registered under Celery's ``celery.commands`` entry point, so the commands run
with the user's app and configuration. Each command is a thin wrapper around a
library function that can be called from Python too.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from ._config import config_for_app
from ._patched import MARKER_PREFIX
from ._recovery import recover as recover_runs
from ._recovery import recover_forever
from ._store import store_for
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
        sent = recover_runs(app, limit=limit)
        ctx.obj.echo(f"sent {len(sent)} run(s)" + (": " + " ".join(sent) if sent else ""))
        return
    ctx.obj.echo(f"waking due runs and re-sending lost ones every {interval:g}s "
                 "(Ctrl-C to stop)")
    recover_forever(app, interval=interval, limit=limit)


@duraflow.command(cls=CeleryCommand)
@_sweep_options
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def recover(ctx: click.Context, once: bool, interval: float, limit: int) -> None:
    """Send runs that need it: lost runs (lease expired) and due sleeps and waits."""
    _sweep(ctx, once, interval, limit)


@duraflow.command(cls=CeleryCommand)
@_sweep_options
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def wake(ctx: click.Context, once: bool, interval: float, limit: int) -> None:
    """Wake sleeping and waiting runs whose time is up (the same sweep as recover)."""
    _sweep(ctx, once, interval, limit)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
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
        ctx.obj.echo(f"signal {name!r} stored for {task_id}")
    else:
        ctx.obj.echo(f"signal {name!r} was already stored for {task_id}; this payload "
                     "was ignored (the first one is kept)")


@duraflow.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--task", "task_name", default=None, cls=CeleryOption, help_group="Patch Options",
              help="Only runs of this task name.")
@click.option("--limit", type=int, default=100, show_default=True, cls=CeleryOption,
              help_group="Patch Options", help="Most runs listed.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def patch(ctx: click.Context, name: str, task_name: str | None, limit: int) -> None:
    """Show which unfinished runs may still take the old branch of patched(NAME).

    Those are the runs that started before any run recorded the patch and
    have not recorded it themselves. When none is left, the patch can be
    retired (keep the new branch, delete the patched() call and the old one).
    Exit status 0 when none is left, 3 when some are.
    """
    try:
        store = store_for(config_for_app(ctx.obj.app))
        first, count, old = store.patch_status(MARKER_PREFIX + name, task_name, limit)
    except DuraflowError as exc:
        _fail(str(exc))
    if first is None:
        ctx.obj.echo(f"patch {name!r}: no run has recorded it yet")
    else:
        ctx.obj.echo(f"patch {name!r}: recorded by {count} run(s), first at "
                     f"{first:%Y-%m-%d %H:%M:%S} UTC")
    if not old:
        ctx.obj.echo("no unfinished run started before it without it: the old branch can go")
        return
    ctx.obj.echo(f"{len(old)} unfinished run(s) may still take the old branch:")
    for run in old:
        ctx.obj.echo(f"  {run.task_id}  {run.task_name}  {run.status}  "
                     f"started {run.created_at:%Y-%m-%d %H:%M:%S} UTC")
    sys.exit(3)
