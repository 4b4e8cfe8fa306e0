"""Benchmarks of celery-duraflow, each against a baseline taken in the same run.

Run them from the repository root::

    make bench                                   # installs the ``bench`` extra, full run
    python -m benchmarks                         # full run (about 5 minutes on 2 cores)
    python -m benchmarks --quick                 # tiny sizes, seconds
    python -m benchmarks --only fresh,replay     # a selection
    python -m benchmarks --profile               # ... and the per-attempt profile
    python -m benchmarks.profile --steps 100     # pyinstrument profile of fresh runs
    python -m benchmarks.profile --attempt       # where one attempt's time goes

Modules:

* :mod:`benchmarks.harness`: the command line, the benchmarks and the targets table;
* :mod:`benchmarks.common`: settings, statistics, the raw-commit floor, round-trip counting;
* :mod:`benchmarks.workload`: the measured work (N trivial steps), the same for every system,
  and the same run written to PostgreSQL by hand;
* :mod:`benchmarks.dbos_side`: the same workflow in DBOS Transact;
* :mod:`benchmarks.workers`: ``celery worker`` subprocesses for the end-to-end and memory runs;
* :mod:`benchmarks.celery_app`: the Celery app those workers load (configured from the
  environment);
* :mod:`benchmarks.profile`: a pyinstrument profile of fresh or replayed runs, and the
  per-attempt breakdown.

See BENCHMARKS.md for what each number means and the results of a full run.
"""
