"""The public API: what celery_duraflow exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import celery_duraflow

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, and every name in it exists."""
    names = celery_duraflow.__all__
    assert names == sorted(names)
    for name in names:
        assert hasattr(celery_duraflow, name), name


def test_contract_names_are_exported() -> None:
    """The names of the public contract are importable from the package."""
    for name in ("DurableTask", "step", "StepContext", "durable", "get_run", "DuraflowError",
                 "StepOutputNotSerializable", "NotInDurableTask", "StepNotPrepared",
                 "StoreUnavailable"):
        assert name in celery_duraflow.__all__, name


def test_import_does_no_work(tmp_path: Path) -> None:
    """Importing the package and defining tasks makes no engine, no store, no thread and no file."""
    # A worker, a web process or a script importing a tasks module must not reach the store
    # before a run asks for it: settings are read at first use, and an engine made at import
    # would be shared across a prefork fork. A fresh interpreter, in an empty directory and
    # with no duraflow settings (so the default store would be a SQLite file right there),
    # records every engine SQLAlchemy is asked for from before the first import.
    env = {k: v for k, v in os.environ.items() if "DURAFLOW" not in k.upper()}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # The probe imported this checkout (not some installed copy).
    assert Path(report["package"]).resolve().is_relative_to(REPO_ROOT / "celery_duraflow")
    assert report["engines_created"] == [], report
    assert report["engines_alive"] == 0, report
    assert report["stores_registered"] == 0, report
    assert report["stores_alive"] == 0, report
    assert report["threads"] == ["MainThread"], report
    assert report["files"] == [], report
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the probe left files behind"


#: Run by ``python -c`` in an empty directory: patch SQLAlchemy's engine factory, import the
#: package, define tasks the documented ways, and print what was done as one line of JSON.
_IMPORT_PROBE = r"""
import gc, json, os, sys, threading

import sqlalchemy
import sqlalchemy.engine
import sqlalchemy.engine.create

created = []
real_create_engine = sqlalchemy.create_engine


def recording_create_engine(*args, **kwargs):
    created.append(repr(args[0]) if args else repr(kwargs.get("url")))
    return real_create_engine(*args, **kwargs)


sqlalchemy.create_engine = recording_create_engine
sqlalchemy.engine.create_engine = recording_create_engine
sqlalchemy.engine.create.create_engine = recording_create_engine

import celery_duraflow
import celery_duraflow.errors
import celery_duraflow.signals
from celery import Celery

app = Celery("probe", set_as_current=False)


@app.task(base=celery_duraflow.DurableTask, name="probe.book")
def book(n):
    with celery_duraflow.step("charge") as s:
        s.result = n
    return s.result


class Refund(celery_duraflow.DurableTask):
    name = "probe.refund"

    def run(self, n):
        with celery_duraflow.step("refund") as s:
            s.result = n
        return s.result


app.register_task(Refund())
app.finalize()
assert book.name == "probe.book" and "probe.refund" in app.tasks

registries = sorted(name for name, module in list(sys.modules.items())
                    if name.split(".")[0] == "celery_duraflow"
                    and callable(getattr(module, "all_stores", None)))
objects = gc.get_objects()
print(json.dumps({
    "package": celery_duraflow.__file__,
    "engines_created": created,
    "engines_alive": sum(1 for o in objects if isinstance(o, sqlalchemy.engine.Engine)),
    "registries": registries,
    "stores_registered": len({id(store) for name in registries
                              for store in sys.modules[name].all_stores()}),
    "stores_alive": sum(1 for o in objects if type(o).__name__ == "Store"
                        and type(o).__module__.split(".")[0] == "celery_duraflow"),
    "threads": sorted(t.name for t in threading.enumerate()),
    "files": sorted(os.listdir(".")),
}))
"""
