"""A small Django project for the Django app's tests (settings, Celery app)."""
