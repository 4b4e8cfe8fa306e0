"""Integrations with frameworks around Celery; each is an optional extra."""
