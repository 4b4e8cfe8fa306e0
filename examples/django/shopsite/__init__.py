"""The example shop's Django project.

The Celery app is imported here so that it is set up whenever Django starts,
and ``@shared_task`` uses it (Celery's "First steps with Django" guide).
"""

from .celery import app as celery_app

__all__ = ("celery_app",)
