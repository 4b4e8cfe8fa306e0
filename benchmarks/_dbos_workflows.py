"""The N-step workflow in DBOS Transact. Imported only once DBOS is configured.

``dbos_steps(n)`` is a ``@DBOS.workflow()`` calling a ``@DBOS.step()`` ``n`` times: the
same shape as :func:`benchmarks.workload.durable_steps`. The workflow body notes when it
started and ended, and in which thread, so that a replay that DBOS runs in a thread of its
own (after ``fork_workflow``) can be timed without DBOS's queue dispatch around it.
"""

from __future__ import annotations

import threading
import time

from dbos import DBOS  # type: ignore[import-not-found, unused-ignore]

from . import workload

# workflow id -> (body start, body end, thread ident), perf_counter seconds.
BODY_TIMES: dict[str, tuple[float, float, int]] = {}


@DBOS.step()
def dbos_trivial(i: int) -> int:
    return workload.trivial(i)


@DBOS.workflow()
def dbos_steps(n: int) -> int:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += dbos_trivial(i)
    workflow_id = DBOS.workflow_id
    if workflow_id is not None:
        BODY_TIMES[workflow_id] = (start, time.perf_counter(), threading.get_ident())
    return total
