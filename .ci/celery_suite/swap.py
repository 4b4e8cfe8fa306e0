"""Pytest plugin: run Celery's own tests with DurableTask as every app's task class.

Loaded with ``-p swap`` (this folder on ``PYTHONPATH``). With DURAFLOW_TEST_TASK_CLS=durable,
every Celery app the tests create (the ``celery_app`` fixture, the session app the
integration worker runs, and the apps tests build themselves) defaults to
``celery_duraflow:DurableTask``. With DURAFLOW_TEST_TASK_CLS=plain nothing changes, which
gives the baseline the comparison needs under the same pytest options.

The store:

* by default each test gets one of its own (a SQLite file in its temporary folder), so no
  run recorded by one test is seen by the next (Celery's unit tests reuse task ids);
* with DURAFLOW_TEST_SHARED_STORE=1 the ``DURAFLOW_DATABASE_URL`` given by the caller is
  left alone for the whole session. The integration tests need that: their worker is
  started once per session (its pool processes are forked then), so a store that changed
  from test to test would not be the one the worker writes to.

DURAFLOW_TEST_TIMEOUT_CAP=SECONDS lowers every ``@pytest.mark.timeout`` above it (Celery's
integration tests mark theirs 300 s) so that one hanging test cannot eat the CI budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

VARIANT = os.environ.get("DURAFLOW_TEST_TASK_CLS", "plain")
if VARIANT not in ("plain", "durable"):
    raise SystemExit(f"DURAFLOW_TEST_TASK_CLS must be 'plain' or 'durable', not {VARIANT!r}")
DURABLE = VARIANT == "durable"
SHARED_STORE = os.environ.get("DURAFLOW_TEST_SHARED_STORE", "") not in ("", "0")
TIMEOUT_CAP = float(os.environ.get("DURAFLOW_TEST_TIMEOUT_CAP") or 0)
DURABLE_CLS = "celery_duraflow:DurableTask"


def pytest_configure(config: pytest.Config) -> None:
    if not DURABLE:
        return
    from celery import Celery

    Celery.task_cls = DURABLE_CLS
    # The swap must really take: a check here rather than 1300 quietly plain passes.
    from celery_duraflow import DurableTask

    probe = Celery("duraflow-swap-probe", set_as_current=False)
    if not issubclass(probe.Task, DurableTask):
        raise pytest.UsageError(f"the task class swap did not take: {probe.Task.__mro__}")
    if SHARED_STORE and not os.environ.get("DURAFLOW_DATABASE_URL"):
        raise pytest.UsageError("DURAFLOW_TEST_SHARED_STORE=1 needs DURAFLOW_DATABASE_URL")
    # The process's one lease-renewing thread starts before Celery's conftest records
    # the threads alive at startup; otherwise every test that runs a durable task
    # would fail its "no thread left lingering" check because of it.
    try:
        from celery_duraflow._lease import keeper

        keeper()._ensure_thread()
    except (ImportError, AttributeError) as exc:  # the package's internals moved
        import warnings

        warnings.warn(f"could not start the lease thread early ({exc!r}); Celery's "
                      "thread-leak checks may report it", stacklevel=1)


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not DURABLE:
        return ["duraflow swap: plain (celery.app.task:Task)"]
    store = ("shared: " + os.environ.get("DURAFLOW_DATABASE_URL", "")) if SHARED_STORE \
        else "one SQLite file per test"
    return [f"duraflow swap: durable ({DURABLE_CLS}), store {store}"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not TIMEOUT_CAP:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is None:
            continue
        seconds = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        if seconds is None or float(seconds) > TIMEOUT_CAP:
            # Added in front, so it is the closest marker pytest-timeout finds.
            item.add_marker(pytest.mark.timeout(timeout=TIMEOUT_CAP), append=False)


@pytest.fixture(autouse=True)
def _duraflow_store_per_test(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Give each test a store of its own (only when DurableTask is swapped in).

    Its own folder, not the test's ``tmp_path``: some tests list what is in theirs.
    """
    if not DURABLE or SHARED_STORE:
        yield
        return
    folder: Path = tmp_path_factory.mktemp("duraflow", numbered=True)
    old = os.environ.get("DURAFLOW_DATABASE_URL")
    os.environ["DURAFLOW_DATABASE_URL"] = f"sqlite:///{folder}/duraflow.db"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DURAFLOW_DATABASE_URL", None)
        else:
            os.environ["DURAFLOW_DATABASE_URL"] = old
        # The test's store is never used again: let it go, as a process that ends would,
        # rather than keep hundreds of engines and their caches alive to the end.
        from celery_duraflow._store import close_all_stores

        close_all_stores()
