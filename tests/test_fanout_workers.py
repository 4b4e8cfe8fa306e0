"""A thousand children fanned out and joined on real worker processes, under SIGKILLs.

Two parents (:func:`tests.proj.fanout.fanout_parent`) each start 500 children and
join them, on two prefork workers of one process each: two worker slots in all, so
a parent that held its slot while it waits would leave the children none, and the
test would never end. Every pool process is killed while the parents are recording
and sending their children (the fan-out), and pool processes are killed at random
while the children run (the join). Then:

* both parents succeeded, with the sum of their own children's results;
* each parent's join recorded all 500 results, in order, once;
* exactly 1,000 child runs exist, each succeeded, none started twice;
* no child's body ran again after it completed unless flagged in doubt, and no body
  ran at the same time as another execution of itself.

On PostgreSQL and on SQLite (a file the worker processes share). In ``make chaos``.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from contextlib import suppress
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.test_chaos import (
    Cluster,
    check_executions,
    client_app,
    cluster,
    read_events,
    wait_for_runs,
)

pytestmark = [pytest.mark.redis, pytest.mark.subprocess, pytest.mark.chaos, pytest.mark.long]

PARENTS, CHILDREN = 2, 500


def _start(c: Cluster) -> None:
    """Two workers of one pool process each, and the sweep every second. The parents send
    their children without naming a queue: the workers' queue is the default one."""
    c.env["PROJ_DEFAULT_QUEUE"] = c.queue
    c.start_with_sweeper(concurrency=1)


def _kill_every_child(c: Cluster) -> int:
    killed = 0
    for pid in c.children():
        if pid in c.kills:
            continue
        at = time.time()
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            c.kills[pid] = at
            killed += 1
    return killed


def _count(c: Cluster, where: str) -> int:
    """Runs matching ``where``; 0 until a worker has created the tables."""
    try:
        return int(str(c.sql(f'SELECT count(*) FROM "{c.prefix}runs" WHERE {where}')[0][0]))
    except Exception:
        return 0


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_a_thousand_children_join_once_through_kills(
        store: str, pg_url: str, redis_url: str, tmp_path: Path) -> None:
    """Two parents of 500 children each on two worker slots, every pool process killed
    during the fan-out and more during the join: every child runs once, each join sees
    every result once, in order, and both parents succeed."""
    url = pg_url if store == "postgres" else f"sqlite:///{tmp_path / 'store.sqlite3'}"
    broker = Broker("redis", redis_url, redis_url)
    with cluster(url, broker, tmp_path, lease_seconds=3) as c:
        _start(c)
        app = client_app(c, broker)
        parents = [str(uuid.uuid4()) for _ in range(PARENTS)]
        for n, task_id in enumerate(parents):
            app.send_task("proj.fanout_parent", args=(n, CHILDREN), task_id=task_id,
                          queue=c.queue)
        # The fan-out: once some children are recorded and before all are, kill every
        # pool process (a parent's attempt is then recording or sending its children).
        deadline = time.monotonic() + 60
        during_fanout = 0
        while time.monotonic() < deadline and not during_fanout:
            recorded = _count(c, "parent_id IS NOT NULL")
            if 0 < recorded < PARENTS * CHILDREN:
                during_fanout = _kill_every_child(c)
            elif recorded >= PARENTS * CHILDREN:
                break
            time.sleep(0.01)
        # The join: a pool process killed every second or so while children run.
        joins = 0
        while time.monotonic() < deadline and joins < 8:
            time.sleep(1.0)
            if _count(c, "parent_id IS NOT NULL AND status <> 'succeeded'") == 0:
                break
            joins += c.kill_random_child()
        statuses = wait_for_runs(c, PARENTS + PARENTS * CHILDREN, timeout=240)
        assert statuses.get("succeeded") == PARENTS + PARENTS * CHILDREN, (
            f"{statuses}\n{c.log_tail()}")

        for n, task_id in enumerate(parents):
            [(result,)] = c.sql(f'SELECT result FROM "{c.prefix}runs" '
                                f"WHERE task_id = '{task_id}'")
            assert result == str(sum(n * 10_000 + i for i in range(CHILDREN)))
            [(outcome,)] = c.sql(f'SELECT output FROM "{c.prefix}steps" '
                                 f"WHERE task_id = '{task_id}' AND step_key = 'fan'")
            joined = json.loads(str(outcome))
            assert joined["results"] == [n * 10_000 + i for i in range(CHILDREN)]
            assert joined["failed"] == []
        assert _count(c, "parent_id IS NOT NULL") == PARENTS * CHILDREN
        assert _count(c, "join_key = 'fan'") == PARENTS * CHILDREN

        executions, deliveries = read_events(c)
        problems, duplicates, in_doubt = check_executions(c, executions)
        works = [key for key in executions if key[1] == "work"]
        parent_deliveries = sum(1 for task_id, _ in deliveries if task_id in parents)
        print(f"\nfan-out ({store}): parents={PARENTS} children={PARENTS * CHILDREN} "
              f"kills during the fan-out={during_fanout} during the join={joins} "
              f"child bodies={sum(len(executions[key]) for key in works)} "
              f"in-doubt re-runs={in_doubt} duplicates={duplicates} "
              f"parent deliveries={parent_deliveries}")
        assert problems == [], "\n".join(problems[:20])
        assert duplicates == 0
        assert len(works) == PARENTS * CHILDREN
        assert during_fanout >= 1 and joins >= 1
