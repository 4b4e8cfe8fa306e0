"""A store of a test's own, and what a test asks of it.

:func:`isolated_store` points a Celery app at a store nobody else uses (a new
SQLite file, or tables under a new prefix in a database the test suite names)
and makes the app eager, for the length of a ``with`` block; then it puts the
app's settings back as they were. The :class:`DuraflowStore` it yields starts
runs, reads them back, sends signals, and keeps count of which step bodies
really ran, for assertions such as :meth:`DuraflowStore.assert_step_ran_once`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from celery.signals import task_prerun

from .._admin import list_runs
from .._atomic import Engine, UserTables, create_user_tables, drop_user_tables, table_setups
from .._config import _ALIAS_WATCH_ATTR, _CACHE_ATTR, config_for_app
from .._replay import ReplayResult, check_history
from .._store import Store, discard_store, store_for
from .._task import DurableTask
from .._view import RunView, get_run
from .._waits import send_signal
from ..signals import step_replayed, step_started
from ._history import assert_replays

#: What a test names a run with: its task id, its :class:`RunView`, or the Celery
#: result (``EagerResult``/``AsyncResult``) of the task that started it.
RunRef = Any


_MISSING = object()
# The settings isolated_store() writes into the app's configuration, besides eagerness.
_STORE_KEYS = ("duraflow_database_url", "duraflow_table_prefix", "duraflow_auto_migrate")
_EAGER_KEYS = ("task_always_eager", "task_eager_propagates")


def fresh_prefix() -> str:
    """A table prefix no other test uses: ``dft`` and twelve random hex digits."""
    return f"dft{uuid.uuid4().hex[:12]}_"


def task_id_of(run: RunRef) -> str:
    """The task id a test named a run by (see :data:`RunRef`)."""
    if isinstance(run, str):
        return run
    for attribute in ("task_id", "id"):
        value = getattr(run, attribute, None)
        if isinstance(value, str):
            return value
    raise TypeError(f"name a run by its task id, its RunView or its Celery result, not {run!r}")


class _Settings:
    """Some settings of an app, changed for a while and then put back exactly.

    A key the app had not set itself (Celery's default, or not a Celery setting
    at all) is removed again rather than set to the value it had; the
    configuration celery-duraflow parsed and cached on the app comes back too.
    """

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app = app
        changes = app.conf.changes
        self.saved = {key: changes.get(key, _MISSING) for key in keys}
        self.cached = {name: app.__dict__.get(name, _MISSING)
                       for name in (_CACHE_ATTR, _ALIAS_WATCH_ATTR)}

    def change(self, values: dict[str, Any]) -> None:
        self.app.conf.update(values)
        self._forget_parsed()

    def restore(self) -> None:
        conf = self.app.conf
        for key, value in self.saved.items():
            if value is not _MISSING:
                conf[key] = value
            elif key in conf.changes:
                del conf[key]
        self._forget_parsed()
        for name, value in self.cached.items():
            if value is not _MISSING:
                setattr(self.app, name, value)

    def _forget_parsed(self) -> None:
        for name in (_CACHE_ATTR, _ALIAS_WATCH_ATTR):
            self.app.__dict__.pop(name, None)


class _StepLog:
    """The step bodies that started and the steps answered from the store, per attempt.

    Fed by the library's ``step_started`` and ``step_replayed`` signals and by
    Celery's ``task_prerun`` (one per attempt), so it sees what runs in this
    process: eager runs, and runs of a worker started in this process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # task id -> attempts, each a list of (step key, True if its body started)
        self._attempts: dict[str, list[list[tuple[str, bool]]]] = {}
        self._uid = f"celery-duraflow-testing-{uuid.uuid4().hex}"

    def connect(self) -> None:
        step_started.connect(self._started, weak=False, dispatch_uid=self._uid)
        step_replayed.connect(self._replayed, weak=False, dispatch_uid=self._uid)
        task_prerun.connect(self._attempt, weak=False, dispatch_uid=self._uid)

    def disconnect(self) -> None:
        step_started.disconnect(self._started, dispatch_uid=self._uid)
        step_replayed.disconnect(self._replayed, dispatch_uid=self._uid)
        task_prerun.disconnect(self._attempt, dispatch_uid=self._uid)

    def _attempt(self, task_id: str | None = None, **_kwargs: Any) -> None:
        if task_id is not None:
            with self._lock:
                self._attempts.setdefault(task_id, []).append([])

    def _add(self, task_id: str | None, key: str | None, ran: bool) -> None:
        if task_id is None or key is None:
            return
        with self._lock:
            attempts = self._attempts.setdefault(task_id, [])
            if not attempts:
                attempts.append([])
            attempts[-1].append((key, ran))

    def _started(self, task_id: str | None = None, step_key: str | None = None,
                 **_kwargs: Any) -> None:
        self._add(task_id, step_key, True)

    def _replayed(self, task_id: str | None = None, step_key: str | None = None,
                  **_kwargs: Any) -> None:
        self._add(task_id, step_key, False)

    def attempts(self, task_id: str) -> list[list[tuple[str, bool]]]:
        with self._lock:
            return [list(attempt) for attempt in self._attempts.get(task_id, [])]


class DuraflowStore:
    """The store of one test, and the app pointed at it: what ``duraflow_store`` gives.

    Everything it reads and writes goes through the app, so a helper of the
    test and the code under test see the same runs. Runs are named by task id,
    :class:`~celery_duraflow.RunView` or Celery result, whichever is at hand.
    """

    def __init__(self, app: Any, store: Store, *, eager: bool, log: _StepLog) -> None:
        self._app = app
        self._store = store
        self._eager = eager
        self._log = log

    def __repr__(self) -> str:
        return (f"<DuraflowStore {self.database_url} tables {self.table_prefix}* "
                f"of app {self._app.main!r}{' (eager)' if self._eager else ''}>")

    @property
    def app(self) -> Any:
        """The Celery app under test, configured to use this store."""
        return self._app

    @property
    def database_url(self) -> str:
        """The store's database URL (password hidden)."""
        return self._store.config.database_url.render_as_string(hide_password=True)

    @property
    def table_prefix(self) -> str:
        """The prefix of this test's tables (new for every test)."""
        return self._store.config.table_prefix

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine of the store's database, where atomic steps write.

        Read the rows a test's atomic steps committed through it.
        """
        return self._store.engine

    @property
    def eager(self) -> bool:
        """Whether the app runs tasks in this process (``task_always_eager``) for the test."""
        return self._eager

    # -- runs ---------------------------------------------------------------------------

    def start(self, task: Any, /, *args: Any, task_id: str | None = None,
              **kwargs: Any) -> RunView:
        """Run ``task(*args, **kwargs)``'s first attempt here and return its run.

        The attempt runs in this process like ``task.apply()`` (its Celery
        retries too), whether or not the app is eager. The run it returns may
        have ended, or be ``sleeping`` or ``waiting``. ``task_id`` picks the
        run's id (a new one by default).
        """
        if not isinstance(task, DurableTask):
            raise TypeError(f"{task!r} is not a DurableTask: give it base=DurableTask to test "
                            "it as a durable run")
        if task.app is not self._app:
            raise ValueError(
                f"task {task.name} belongs to Celery app {task.app.main!r}, not to the app "
                f"under test ({self._app.main!r}), so its runs would not be stored in this "
                "test's store. Define a duraflow_app fixture that returns the task's app.")
        result = task.apply(args=args, kwargs=kwargs, task_id=task_id)
        run = get_run(result.id, app=self._app)
        if run is None:
            why = f": it raised {result.result!r}" if result.failed() else ""
            raise AssertionError(f"task {task.name} ran as {result.id} ({result.state}) but "
                                 f"recorded no run in the test store{why}")
        return run

    def get_run(self, run: RunRef) -> RunView | None:
        """The run's current record, or None if the store has none under that task id."""
        return get_run(task_id_of(run), app=self._app)

    def run_view(self, run: RunRef) -> RunView:
        """The run's current record, read again; AssertionError if there is none."""
        task_id = task_id_of(run)
        view = get_run(task_id, app=self._app)
        if view is None:
            known = [view.task_id for view in self.runs()]
            raise AssertionError(f"no run {task_id!r} is recorded in this test's store (it "
                                 f"holds {len(known)} run(s){': ' if known else ''}"
                                 f"{', '.join(known[:10])})")
        return view

    def runs(self) -> list[RunView]:
        """Every run recorded in this test's store, newest first."""
        records = list_runs(self._store, limit=10_000, brief=True)
        return [self.run_view(record.task_id) for record in records]

    def send_signal(self, run: RunRef, name: str, payload: Any = None) -> RunView:
        """Send signal ``name`` to the run (as :func:`~celery_duraflow.send_signal`) and
        return the run as it is then.

        On an eager app a waiting run resumes in this process before this
        returns. A second signal of the same name is ignored, as always.
        """
        task_id = task_id_of(run)
        send_signal(task_id, name, payload, app=self._app)
        return self.run_view(task_id)

    def wait_for_status(self, run: RunRef, *statuses: str, timeout: float = 10.0) -> RunView:
        """Poll until the run has one of ``statuses`` (for runs a worker carries on).

        AssertionError after ``timeout`` seconds, with the status it had.
        """
        if not statuses:
            raise TypeError("name at least one status to wait for, such as 'succeeded'")
        task_id = task_id_of(run)
        deadline = time.monotonic() + timeout
        while True:
            view = get_run(task_id, app=self._app)
            if view is not None and view.status in statuses:
                return view
            if time.monotonic() >= deadline:
                status = "not recorded" if view is None else view.status
                raise AssertionError(f"run {task_id} is {status} after {timeout:g}s, not "
                                     f"{' or '.join(statuses)}")
            time.sleep(0.02)

    # -- what ran -----------------------------------------------------------------------

    def step_runs(self, run: RunRef, key: str) -> int:
        """How many times the body of step ``key`` of the run started during this test,
        over all attempts (replays from the store not counted)."""
        task_id = task_id_of(run)
        return sum(1 for attempt in self._log.attempts(task_id)
                   for step, ran in attempt if ran and step == key)

    def assert_step_ran_once(self, run: RunRef, key: str) -> None:
        """Assert that the body of step ``key`` of the run started exactly once in this test.

        However many attempts the run took, a completed step must be replayed
        from the store, never run again; the message says what happened instead.
        """
        task_id = task_id_of(run)
        attempts = self._log.attempts(task_id)
        ran = [number for number, attempt in enumerate(attempts, 1)
               for step, started in attempt if started and step == key]
        if len(ran) == 1:
            return
        replayed = sum(1 for attempt in attempts for step, started in attempt
                       if not started and step == key)
        if not attempts:
            raise AssertionError(f"no attempt of run {task_id} ran in this process during the "
                                 "test, so no step of it ran (was it started on this app?)")
        if len(ran) > 1:
            raise AssertionError(
                f"the body of step {key!r} of run {task_id} ran {len(ran)} times, in attempts "
                f"{', '.join(map(str, ran))} of {len(attempts)}; it should have run once and "
                "been replayed from the store after that")
        reached = sorted({step for attempt in attempts for step, _ in attempt})
        if replayed:
            raise AssertionError(
                f"the body of step {key!r} of run {task_id} never ran during this test: it was "
                f"answered from the store {replayed} time(s) (did it complete before?)")
        raise AssertionError(
            f"run {task_id} never reached a step {key!r} in its {len(attempts)} attempt(s); "
            f"the steps it reached are {reached}")

    def steps_run(self, run: RunRef) -> list[str]:
        """The keys of the steps whose bodies ran in the run's latest attempt, in order."""
        return [step for step, ran in self._latest(run) if ran]

    def steps_replayed(self, run: RunRef) -> list[str]:
        """The keys of the steps answered from the store in the run's latest attempt."""
        return [step for step, ran in self._latest(run) if not ran]

    def check_history(self, history: str | os.PathLike[str]) -> ReplayResult:
        """Replay an exported run (``celery duraflow export``) against this app's current
        code, without any database; see :func:`celery_duraflow.check_history`."""
        return check_history(os.fspath(history), app=self._app)

    def assert_replays(self, history: str | os.PathLike[str]) -> ReplayResult:
        """:meth:`check_history`, failing the test unless the run is compatible."""
        return assert_replays(history, app=self._app)

    def _latest(self, run: RunRef) -> list[tuple[str, bool]]:
        task_id = task_id_of(run)
        attempts = self._log.attempts(task_id)
        if not attempts:
            raise AssertionError(f"no attempt of run {task_id} ran in this process during the "
                                 "test (was it started on this app?)")
        return attempts[-1]


@contextmanager
def isolated_store(app: Any, *, database_url: str | None = None,
                   directory: str | Path | None = None,
                   eager: bool = True, tables: UserTables = None) -> Iterator[DuraflowStore]:
    """Point ``app`` at an empty store of its own for the ``with`` block; then put it back.

    With no ``database_url`` the store is a new SQLite file in ``directory``
    (required then), left there afterwards for a look. With one (PostgreSQL,
    say), the tables get a new prefix in that database and are dropped at the
    end. ``eager`` makes the app run tasks in this process
    (``task_always_eager``, with ``task_eager_propagates`` off so that Celery's
    retries run as on a worker): signals, wake-ups, cancellations and child
    runs then run here too, and nothing is sent to the broker. The app's own
    settings, and the configuration it had parsed, come back when the block ends.

    ``tables`` are the test's own tables (SQLAlchemy ``MetaData``, a function
    taking a ``Connection``, or a list of these), the ones its
    atomic steps write through ``s.connection``: created in the store's database
    once the store's tables are there, in one transaction; MetaData tables are
    dropped again at the end where the store's tables are (a database named by
    ``database_url``).
    """
    setups = table_setups(tables)
    # A proxy such as celery.current_app: the app it stands for now, compared by identity.
    app = getattr(app, "_get_current_object", lambda: app)()
    drop = database_url is not None
    if database_url is None:
        if directory is None:
            raise TypeError("isolated_store() needs a database_url or a directory for the "
                            "SQLite file")
        database_url = f"sqlite:///{Path(directory) / 'duraflow.sqlite3'}"
    values: dict[str, Any] = {"duraflow_database_url": database_url,
                              "duraflow_table_prefix": fresh_prefix(),
                              "duraflow_auto_migrate": True}
    if eager:
        values.update(task_always_eager=True, task_eager_propagates=False)
    settings = _Settings(app, _STORE_KEYS + (_EAGER_KEYS if eager else ()))
    log = _StepLog()
    with ExitStack() as cleanup:
        settings.change(values)
        cleanup.callback(settings.restore)
        store = store_for(config_for_app(app))
        cleanup.callback(discard_store, store)
        if drop:
            cleanup.callback(store.drop_tables)
        store.ensure_schema()
        if setups:
            if drop:
                cleanup.callback(drop_user_tables, store.engine, setups)
            create_user_tables(store.engine, setups)
        log.connect()
        cleanup.callback(log.disconnect)
        yield DuraflowStore(app, store, eager=eager, log=log)
