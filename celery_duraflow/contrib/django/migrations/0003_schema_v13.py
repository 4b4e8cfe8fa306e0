"""The store's schema version 13: the operator side's indexes on large tables.

The listings by status and by task name, and their bounded counts, read indexes of
the live runs only; ``patch NAME`` finds its marker through an index of the patch
markers (PostgreSQL). Applies the library's own migration on the store's alias.
"""

from django.db import migrations

from celery_duraflow.contrib.django._migrate import schema_operation


class Migration(migrations.Migration):
    # As in 0001: the library's migrations take their own lock and transactions.
    atomic = False

    dependencies = [
        ('duraflow', '0002_run_models'),
    ]

    operations = [
        schema_operation(13),
    ]
