"""The Django application of celery-duraflow."""

from __future__ import annotations

from django.apps import AppConfig


class DuraflowConfig(AppConfig):
    name = "celery_duraflow.contrib.django"
    label = "duraflow"
    verbose_name = "Durable runs"
    default_auto_field = "django.db.models.BigAutoField"
