"""Settings of the example shop.

Three environment variables choose the services (``python -m examples.django``
sets them from its options):

* ``EXAMPLE_DATABASE_URL``: the database, as a URL: ``sqlite:///path/to/db.sqlite3``
  or ``postgresql://user:password@host:5432/name``. Default: ``db.sqlite3`` next
  to ``manage.py``. The durable steps are stored in this same database.
* ``EXAMPLE_BROKER_URL``: Celery's broker (``redis://localhost:6379/0``). Default
  ``memory://``, which only a worker inside the same process can read.
* ``EXAMPLE_QUEUE``: the queue the tasks are sent to (default ``shopsite``).
"""

import os
from pathlib import Path
from typing import Any

import django
from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-shop-not-a-secret"
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "shopsite.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # celery-duraflow's Django app: `manage.py migrate` creates the step store's tables
    # in the store's database, and the admin lists the durable runs.
    "celery_duraflow.contrib.django",
    "orders",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]

STATIC_URL = "static/"


def database_from_url(url: str) -> dict[str, Any]:
    """A ``DATABASES`` entry for a SQLite or PostgreSQL URL."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise ValueError(f"{url}: give the SQLite database a file, such as "
                             "sqlite:///shop.sqlite3")
        entry: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": parsed.database}
        if django.VERSION >= (5, 1):
            # Django's transactions on SQLite begin DEFERRED: one that reads, then writes
            # (get_or_create) fails at once with "database is locked" when another
            # connection (the store's lease heartbeat, say) wrote in between. IMMEDIATE
            # takes the write lock first and waits for it instead.
            entry["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
        return entry
    if backend == "postgresql":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parsed.database or "",
            "USER": parsed.username or "",
            "PASSWORD": parsed.password or "",
            "HOST": parsed.host or "",
            "PORT": str(parsed.port or ""),
        }
    raise ValueError(f"{url}: this example runs on SQLite or PostgreSQL only")


DATABASES = {
    "default": database_from_url(
        os.environ.get("EXAMPLE_DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
}

# Celery, read by shopsite/celery.py under the CELERY namespace.
CELERY_BROKER_URL = os.environ.get("EXAMPLE_BROKER_URL") or "memory://"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("EXAMPLE_QUEUE") or "shopsite"
if CELERY_BROKER_URL.startswith("memory://"):
    # The in-memory transport polls for messages, once a second unless told otherwise.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"polling_interval": 0.1}

# celery-duraflow: the durable steps are stored in the `default` database, next to the
# orders. That makes `atomic=True` steps possible: their ORM writes on this alias commit
# in the same transaction as the step's record. (With celery_duraflow.contrib.django
# installed, `default` is the store even without this line.)
CELERY_DURAFLOW_DATABASE = "default"
