"""The sweep reads due runs on every pass, and looks for arrived signals now and then.

A pass used to read every waiting run to see whether its signal or child end had
arrived without waking it, so its cost grew with the number of waiting runs. Now a
pass reads only due runs (through the lease index), and a sweep looks for such
arrivals on its first pass in a process and then at most every ``ARRIVALS_EVERY``
seconds: the run is still found, a little later at worst. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from celery import Celery

from celery_duraflow import _recovery
from celery_duraflow._config import config_for_app
from celery_duraflow._store import Delivery, Store, store_for

OWNER = "sweep-test-host|x|1|abc"


def _waiting_with_its_signal(store: Store) -> str:
    """A run waiting for signal 'go', whose signal is stored but never woke it."""
    task_id = str(uuid.uuid4())
    store.begin_attempt(task_id, Delivery(task_name="shop.trip", owner=OWNER))
    assert store.suspend(task_id, OWNER, status="waiting", kind="signal", waiting_for="go",
                         wake_at=None, sweep_at=None)
    assert store.put_signal(task_id, "go", "true", "json")
    return task_id


def test_a_pass_without_arrivals_reads_only_due_runs(make_app: Callable[..., Celery]) -> None:
    """The arrived signal is found when arrivals are asked for, and not by a plain pass."""
    store = store_for(config_for_app(make_app()))
    task_id = _waiting_with_its_signal(store)
    assert [run.task_id for run in store.recoverable_runs(10, arrivals=True)] == [task_id]
    assert store.recoverable_runs(10, arrivals=False) == []


def test_a_sweep_looks_for_arrivals_first_and_then_every_interval(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """A store's first sweep looks for arrivals, the next ones only once the interval passed."""
    store = store_for(config_for_app(make_app()))
    assert _recovery._arrivals_due(store)
    assert not _recovery._arrivals_due(store)
    monkeypatch.setattr(_recovery, "ARRIVALS_EVERY", 0.0)
    assert _recovery._arrivals_due(store)
