"""The admin's read-only models of runs, steps and signals: Django state only.

The models are unmanaged (the library owns these tables, which 0001 and the
library's own migrations create), so this migration changes nothing in any
database; it tells Django the models exist, so that ``makemigrations`` has nothing
to write for them and ``migrate`` creates their content types and permissions.
Their tables follow the store's table prefix (``DURAFLOW_TABLE_PREFIX``).
"""

import django.db.models.deletion
from django.db import migrations, models

from celery_duraflow.contrib.django.conf import table_prefix


class Migration(migrations.Migration):

    dependencies = [
        ('duraflow', '0001_schema_v12'),
    ]

    operations = [
        migrations.CreateModel(
            name='Run',
            fields=[
                ('task_id', models.CharField(max_length=255, primary_key=True, serialize=False)),
                ('task_name', models.CharField(max_length=255)),
                ('status', models.CharField(choices=[('running', 'running'), ('sleeping', 'sleeping'), ('waiting', 'waiting'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('compensated', 'compensated'), ('cancelled', 'cancelled'), ('ignored', 'ignored'), ('rejected', 'rejected'), ('replaced', 'replaced')], max_length=16)),
                ('attempts', models.IntegerField()),
                ('result', models.TextField(null=True)),
                ('serializer', models.CharField(max_length=100, null=True)),
                ('error', models.TextField(null=True)),
                ('created_at', models.DateTimeField()),
                ('updated_at', models.DateTimeField()),
                ('finished_at', models.DateTimeField(null=True)),
                ('lease_owner', models.CharField(max_length=200, null=True)),
                ('lease_expires_at', models.DateTimeField(null=True)),
                ('args', models.TextField(null=True)),
                ('args_fingerprint', models.CharField(max_length=64, null=True)),
                ('exchange', models.CharField(max_length=255, null=True)),
                ('routing_key', models.CharField(max_length=255, null=True)),
                ('retries', models.IntegerField()),
                ('recoveries', models.IntegerField()),
                ('interrupted', models.BooleanField()),
                ('wait_kind', models.CharField(choices=[('sleep', 'sleep'), ('signal', 'signal'), ('child', 'child')], max_length=16, null=True)),
                ('waiting_for', models.CharField(max_length=1024, null=True)),
                ('wake_at', models.DateTimeField(null=True)),
                ('parent_id', models.CharField(max_length=255, null=True)),
                ('code_fingerprint', models.CharField(max_length=64, null=True)),
                ('unwinding', models.CharField(max_length=16, null=True)),
                ('pruned_at', models.DateTimeField(null=True)),
                ('replaced_by', models.CharField(max_length=255, null=True)),
            ],
            options={
                'verbose_name': 'run',
                'verbose_name_plural': 'runs',
                'db_table': f'{table_prefix()}runs',
                'ordering': ('-created_at', '-task_id'),
                'permissions': (('approve_run', 'Can approve or reject a run that waits for a signal'), ('cancel_run', 'Can cancel a run'), ('retry_run', 'Can retry a run that ended')),
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='Signal',
            fields=[
                ('pk', models.CompositePrimaryKey('run_id', 'name', blank=True, editable=False, primary_key=True, serialize=False)),
                ('run', models.ForeignKey(db_column='task_id', db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='signals', to='duraflow.run')),
                ('name', models.CharField(max_length=1024)),
                ('payload', models.TextField(null=True)),
                ('serializer', models.CharField(max_length=100, null=True)),
                ('sent_at', models.DateTimeField()),
            ],
            options={
                'verbose_name': 'signal',
                'verbose_name_plural': 'signals',
                'db_table': f'{table_prefix()}signals',
                'ordering': ('sent_at', 'name'),
                'managed': False,
                'default_permissions': (),
            },
        ),
        migrations.CreateModel(
            name='Step',
            fields=[
                ('pk', models.CompositePrimaryKey('run_id', 'step_key', blank=True, editable=False, primary_key=True, serialize=False)),
                ('run', models.ForeignKey(db_column='task_id', db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='steps', to='duraflow.run')),
                ('step_key', models.CharField(max_length=1024)),
                ('status', models.CharField(choices=[('running', 'running'), ('completed', 'completed'), ('failed', 'failed'), ('waiting', 'waiting')], max_length=16)),
                ('attempts', models.IntegerField()),
                ('output', models.TextField(null=True)),
                ('serializer', models.CharField(max_length=100, null=True)),
                ('error', models.TextField(null=True)),
                ('started_at', models.DateTimeField()),
                ('completed_at', models.DateTimeField(null=True)),
                ('position', models.IntegerField(null=True)),
                ('input_fingerprint', models.CharField(max_length=64, null=True)),
                ('code_fingerprint', models.CharField(max_length=64, null=True)),
                ('body_exit', models.CharField(max_length=16, null=True)),
                ('returned', models.TextField(null=True)),
            ],
            options={
                'verbose_name': 'step',
                'verbose_name_plural': 'steps',
                'db_table': f'{table_prefix()}steps',
                'ordering': ('started_at', 'step_key'),
                'managed': False,
                'default_permissions': (),
            },
        ),
    ]
