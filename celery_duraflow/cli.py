"""``celery -A proj duraflow ...``: commands to see and steer durable runs.

Registered under Celery's ``celery.commands`` entry point, so the commands run
with the user's app and configuration. Each command is a thin wrapper around a
library function that can be called from Python too.
"""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from ._recovery import recover as recover_runs
from ._recovery import recover_forever


@click.group(name="duraflow")
def duraflow() -> None:
    """Inspect and steer celery-duraflow runs."""


@duraflow.command(cls=CeleryCommand)
@click.option("--once", is_flag=True, cls=CeleryOption, help_group="Recovery Options",
              help="Sweep once and exit (for cron); by default sweep forever.")
@click.option("--interval", type=float, default=10.0, show_default=True, cls=CeleryOption,
              help_group="Recovery Options", help="Seconds between sweeps.")
@click.option("--limit", type=int, default=100, show_default=True, cls=CeleryOption,
              help_group="Recovery Options", help="Most runs re-sent per sweep.")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def recover(ctx: click.Context, once: bool, interval: float, limit: int) -> None:
    """Re-send runs whose worker died (lease expired while running)."""
    app: Any = ctx.obj.app
    if once:
        sent = recover_runs(app, limit=limit)
        ctx.obj.echo(f"re-sent {len(sent)} run(s)" + (": " + " ".join(sent) if sent else ""))
        return
    ctx.obj.echo(f"sweeping for lost runs every {interval:g}s (Ctrl-C to stop)")
    recover_forever(app, interval=interval, limit=limit)
