"""A small, real Celery project for the tests that start ``celery worker`` processes.

It plays the part of a user's project, in the spirit of django-celery-results'
``t/proj``: a worker is started on it with ``celery -A tests.proj worker``, and
every setting it needs comes from the environment (see :mod:`tests.proj.app`),
so each test points its own worker at its own queue and tables.
"""

from .app import app

__all__ = ["app"]
