"""DBOS Transact side by side: the same N-step workflow on the same PostgreSQL server.

DBOS keeps its system tables in a schema of this run's own (``<prefix>dbos``) in the
benchmark database; :meth:`DbosBench.close` shuts DBOS down and drops that schema.

What is measured, and how it maps to celery-duraflow's numbers:

* fresh: the workflow called in this thread under a new workflow id
  (``SetWorkflowID``), ``n`` steps, minus the same workflow with no step;
* re-delivery of a finished workflow: the same call with the same id again. DBOS returns
  the recorded result without running the body (like celery-duraflow's succeeded-run
  short cut);
* resume from checkpoints: DBOS does not re-execute a PENDING workflow when it is called
  again with its id (it waits for the owner instead); a crashed workflow is resumed by
  recovery, through DBOS's internal queue. The public way to re-run a workflow whose
  steps are all recorded is ``DBOS.fork_workflow(id, start_step=n + 1)``: a new workflow
  whose ``n`` steps are answered from the copied checkpoints. Its body time (first line to
  last, in DBOS's executor thread) is the replay cost; the wall time around it is
  dominated by the queue's dispatch and is reported apart.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import Engine

from . import workload
from .common import RoundTrips, count_round_trips


def unavailable_reason() -> str | None:
    """Why DBOS cannot be compared here, or None when it can."""
    try:
        import dbos  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError as exc:
        return (f"DBOS cannot be imported ({type(exc).__name__}: {exc}); install the bench "
                "extra (pip install -e '.[bench]', or make bench)")
    return None


@dataclass
class ForkReplay:
    wall: float
    body: float
    statements: int
    wire: int | None


class DbosBench:
    """DBOS configured on the benchmark database, launched in this process."""

    def __init__(self, conninfo: str, schema: str) -> None:
        from dbos import DBOS

        self.conninfo = conninfo
        self.schema = schema
        DBOS(config={
            "name": "duraflow-bench",
            "system_database_url": conninfo,
            "dbos_system_schema": schema,
            "log_level": "WARNING",
        })
        from . import _dbos_workflows

        self._workflows = _dbos_workflows
        DBOS.launch()
        self.version = _dbos_version()
        self.engine = _system_engine()

    def run(self, n: int, workflow_id: str | None = None) -> str:
        from dbos import SetWorkflowID

        workflow_id = workflow_id or f"bench-{uuid.uuid4()}"
        with SetWorkflowID(workflow_id):
            result = self._workflows.dbos_steps(n)
        if result != workload.expected_result(n):
            raise RuntimeError(f"DBOS workflow {workflow_id} returned {result!r}")
        return workflow_id

    def round_trips(self, n: int, workflow_id: str | None = None) -> tuple[int, int | None]:
        """Statements and wire round trips of one call in this thread."""
        if self.engine is None:
            return (0, None)
        return count_round_trips(self.engine, lambda: self.run(n, workflow_id))

    def fork_replay(self, workflow_id: str, n: int) -> ForkReplay:
        """Re-run a finished workflow from its checkpoints (``fork_workflow``)."""
        from dbos import DBOS

        bodies_before = workload.BODIES_RUN[0]
        counter = RoundTrips(self.engine) if self.engine is not None else None
        start = time.perf_counter()
        if counter is not None:
            with counter.counting():
                handle = DBOS.fork_workflow(workflow_id, n + 1)
                result = handle.get_result(polling_interval_sec=0.005)
        else:
            handle = DBOS.fork_workflow(workflow_id, n + 1)
            result = handle.get_result(polling_interval_sec=0.005)
        wall = time.perf_counter() - start
        if result != workload.expected_result(n):
            raise RuntimeError(f"forked DBOS workflow returned {result!r}")
        if workload.BODIES_RUN[0] != bodies_before:
            raise RuntimeError("a DBOS replay ran step bodies again")
        body_start, body_end, thread = self._workflows.BODY_TIMES[handle.get_workflow_id()]
        statements, wire = counter.of(thread) if counter is not None else (0, None)
        return ForkReplay(wall=wall, body=body_end - body_start, statements=statements,
                          wire=wire)

    def close(self) -> None:
        from dbos import DBOS

        try:
            DBOS.destroy()
        finally:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def _dbos_version() -> str:
    from importlib.metadata import version

    return version("dbos")


def _system_engine() -> Engine | None:
    """DBOS's own SQLAlchemy engine (internal attribute), to count its round trips."""
    try:
        from dbos._dbos import _get_dbos_instance  # type: ignore[import-not-found, unused-ignore]

        engine: Any = _get_dbos_instance()._sys_db.engine
    except Exception:
        return None
    return engine if isinstance(engine, Engine) else None


__all__ = ["DbosBench", "ForkReplay", "unavailable_reason"]
