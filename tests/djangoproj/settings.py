"""Django settings of the test project.

Two real databases: ``default`` is PostgreSQL (``DURAFLOW_TEST_DATABASE_URL``) and
``lite`` is a SQLite file. pytest-django creates a test database for each; its name
carries this process's id (or ``DURAFLOW_TEST_DJANGO_DB``, which worker subprocesses
inherit), so that two test sessions on one server never share one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from sqlalchemy.engine import make_url

_pg = make_url(os.environ.get("DURAFLOW_TEST_DATABASE_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
_suffix = os.environ.setdefault("DURAFLOW_TEST_DJANGO_DB", f"dj{os.getpid()}")
_lite = Path(tempfile.gettempdir()) / f"duraflow_test_{_suffix}.sqlite3"

SECRET_KEY = "duraflow-tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
ROOT_URLCONF = "tests.djangoproj.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_duraflow.contrib.django",
    "tests.djangoproj.shop",
]

MIDDLEWARE = [
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

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _pg.database or "test",
        "USER": _pg.username or "postgres",
        "PASSWORD": _pg.password or "",
        "HOST": _pg.host or "127.0.0.1",
        "PORT": str(_pg.port or 5432),
        "TEST": {"NAME": f"test_duraflow_{_suffix}"},
    },
    "lite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(_lite),
        "TEST": {"NAME": str(_lite.with_name(f"test_{_lite.name}"))},
    },
}

# Celery, read by celery_app.py with the CELERY namespace.
CELERY_BROKER_URL = os.environ.get("DURAFLOW_TEST_BROKER_URL", "redis://127.0.0.1:6379/9")
CELERY_TASK_ALWAYS_EAGER = False

# A real `celery worker` the tests start (test_django_on_commit.py) runs on the test
# databases pytest-django created for this session, whose names it inherits through
# DURAFLOW_TEST_DJANGO_DB.
if os.environ.get("DURAFLOW_TEST_DJANGO_WORKER") == "1":
    for _database in DATABASES.values():
        _database["NAME"] = _database["TEST"]["NAME"]

# This session's tasks go to a queue of its own on the shared Redis server.
CELERY_TASK_DEFAULT_QUEUE = f"duraflow-django-{_suffix}"
