"""celery-duraflow for Django projects: put ``"celery_duraflow.contrib.django"`` in
``INSTALLED_APPS``.

The store is a Django database alias (``DURAFLOW_DATABASE``), its tables are created
and upgraded by ``manage.py migrate``, ``DurableTask`` keeps Celery's
``delay_on_commit()``, atomic steps on the store's alias run inside
``transaction.atomic()``, and the admin lists runs.
"""
