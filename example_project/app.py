"""The example's Celery app. A worker loads it with ``celery -A example_project.app worker``.

All settings come from the environment, so that the demo, the worker process
it starts and the docker compose services agree without sharing a file:

========================== ===================================================
``CELERY_BROKER_URL``      broker; default ``memory://`` (in-process worker only)
``CELERY_RESULT_BACKEND``  default: the broker URL for Redis, else in-memory
``DURAFLOW_DATABASE_URL``  step store *and* the example's tables
``DURAFLOW_TABLE_PREFIX``  prefix of celery-duraflow's tables (default ``duraflow_``)
``EXAMPLE_TABLE_PREFIX``   prefix of the example's tables (default ``example_``)
``EXAMPLE_QUEUE``          queue the trips go to (default ``example_project``)
========================== ===================================================
"""

from __future__ import annotations

import importlib.util
import os

from celery import Celery

# Where a worker started without DURAFLOW_DATABASE_URL keeps its steps. The demo
# replaces it with a fresh file in a temporary directory.
DEFAULT_DATABASE_URL = "sqlite:///example-demo.sqlite3"


def result_backend_for(broker_url: str) -> str:
    """A result backend that fits the broker when none is configured."""
    if broker_url.startswith(("redis://", "rediss://")):
        return broker_url
    if broker_url.startswith("memory://"):
        return "cache+memory://"
    return "rpc://"


BROKER_URL = os.environ.get("CELERY_BROKER_URL") or "memory://"

# The Pydantic AI variant of the agent (example_project.agent) needs the pydantic-ai
# extra; without it the worker runs the other tasks.
TASK_MODULES = ["example_project.tasks"]
if importlib.util.find_spec("pydantic_ai") is not None:
    TASK_MODULES.append("example_project.agent")

app = Celery(
    "example_project",
    broker=BROKER_URL,
    backend=os.environ.get("CELERY_RESULT_BACKEND") or result_backend_for(BROKER_URL),
    include=TASK_MODULES,
)
app.conf.update(
    task_default_queue=os.environ.get("EXAMPLE_QUEUE") or "example_project",
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Acknowledge after the attempt: if a worker dies mid-trip the message is
    # delivered again, and the steps already recorded are not repeated.
    task_acks_late=True,
    result_expires=3600,
    duraflow_database_url=os.environ.get("DURAFLOW_DATABASE_URL") or DEFAULT_DATABASE_URL,
    example_table_prefix=os.environ.get("EXAMPLE_TABLE_PREFIX") or "example_",
)
if BROKER_URL.startswith("memory://"):
    # The in-memory transport polls; the default second per poll would make the demo drag.
    app.conf.broker_transport_options = {"polling_interval": 0.05}
if os.environ.get("DURAFLOW_TABLE_PREFIX"):
    app.conf.duraflow_table_prefix = os.environ["DURAFLOW_TABLE_PREFIX"]
