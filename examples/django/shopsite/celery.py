"""The shop's Celery app, as Celery's "First steps with Django" guide lays it out.

Run a worker from the folder that holds ``manage.py``::

    celery -A shopsite worker --loglevel=INFO
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")

app = Celery("shopsite")
# Every CELERY_* Django setting configures Celery, celery-duraflow's own included
# (CELERY_DURAFLOW_DATABASE in settings.py).
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
