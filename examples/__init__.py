"""Examples of celery-duraflow in other frameworks' projects (``python -m examples.django``)."""
