"""The store's schema version 16: durable schedules.

One row per schedule, keyed by its name: what it fires, when (a cron expression
in a time zone, or an interval), its catch-up and overlap policies, whether it
is paused, and the slot it fires next. Applies the library's own migration on
the store's alias, and adds the admin's read-only model of that table.
"""

from django.db import migrations, models

from celery_duraflow.contrib.django._migrate import schema_operation
from celery_duraflow.contrib.django.conf import table_prefix


class Migration(migrations.Migration):
    # As in 0001: the library's migrations take their own lock and transactions.
    atomic = False

    dependencies = [
        ('duraflow', '0005_schema_v15'),
    ]

    operations = [
        schema_operation(16),
        # The new table, as an unmanaged model's state (no SQL of its own).
        migrations.CreateModel(
            name='Schedule',
            fields=[
                ('name', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('task_name', models.CharField(max_length=255)),
                ('origin', models.CharField(choices=[('code', 'beat_schedule'), ('api', 'added at run time')], max_length=8)),
                ('cron', models.CharField(max_length=255, null=True)),
                ('timezone', models.CharField(max_length=64)),
                ('every', models.FloatField(null=True)),
                ('anchor_at', models.DateTimeField(null=True)),
                ('args', models.TextField(null=True)),
                ('exchange', models.CharField(max_length=255, null=True)),
                ('routing_key', models.CharField(max_length=255, null=True)),
                ('priority', models.IntegerField(null=True)),
                ('catchup', models.CharField(choices=[('skip', 'skip'), ('latest', 'latest'), ('all', 'all')], max_length=16)),
                ('catchup_window', models.FloatField(null=True)),
                ('overlap', models.CharField(choices=[('skip', 'skip'), ('buffer_one', 'buffer_one'), ('allow_all', 'allow_all'), ('cancel_other', 'cancel_other')], max_length=16)),
                ('paused', models.BooleanField()),
                ('note', models.TextField(null=True)),
                ('next_fire_at', models.DateTimeField()),
                ('buffered_at', models.DateTimeField(null=True)),
                ('last_slot_at', models.DateTimeField(null=True)),
                ('last_run_id', models.CharField(max_length=255, null=True)),
                ('fired', models.IntegerField()),
                ('skipped', models.IntegerField()),
                ('created_at', models.DateTimeField()),
                ('updated_at', models.DateTimeField()),
            ],
            options={
                'verbose_name': 'schedule',
                'verbose_name_plural': 'schedules',
                'db_table': f'{table_prefix()}schedules',
                'ordering': ('name',),
                'permissions': (('pause_schedule', 'Can pause or resume a schedule'), ('backfill_schedule', 'Can backfill the past slots of a schedule')),
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
    ]
