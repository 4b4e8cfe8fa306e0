"""The store's schema version 14: the tables of flow control.

Concurrency slots and their queues, rate windows and dedupe keys, and the runs'
priority. Applies the
library's own migration on the store's alias.
"""

from django.db import migrations, models

from celery_duraflow.contrib.django._migrate import schema_operation


class Migration(migrations.Migration):
    # As in 0001: the library's migrations take their own lock and transactions.
    atomic = False

    dependencies = [
        ('duraflow', '0003_schema_v13'),
    ]

    operations = [
        schema_operation(14),
        # The runs table's new column, in the unmanaged model's state (no SQL of its own).
        migrations.AddField(model_name="run", name="priority",
                            field=models.SmallIntegerField(null=True)),
    ]
