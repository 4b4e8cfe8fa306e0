# Developer entry points. `make test` is the test command the README gives.
#
#   make venv   create .venv (if missing) and install the package with its dev extras
#   make test   run the test suite
#   make chaos  the chaos tests and the long scenarios (DURAFLOW_TEST_LONG=1)
#   make demo   run the example project
#   make lint   ruff and mypy

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Touched after a successful install: a newer pyproject.toml triggers a reinstall.
STAMP := $(VENV)/.installed

.PHONY: venv test chaos demo lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

# Coverage starts before pytest does: pytest loads the package's own plugin (its pytest11
# entry point) before any plugin's hooks run, so a coverage started by a pytest plugin
# would miss every module that import brings in. The report follows a failing run too.
test: venv
	$(BIN)/coverage run -m pytest $(PYTEST_ARGS); status=$$?; \
	$(BIN)/coverage report; exit $$status

# make chaos: the tests marked chaos (killed workers, a stopped PostgreSQL) and those marked
# long (skipped by `make test`), e.g. a rate limit held for a minute. PYTEST_ARGS as for test.
chaos: venv
	DURAFLOW_TEST_LONG=1 $(BIN)/pytest -m "chaos or long" $(PYTEST_ARGS)

demo: venv
	$(BIN)/python -m example_project

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

# make bench: the benchmarks of issue 4 (BENCHMARKS.md), with the `bench` extra (DBOS,
# pyinstrument, py-spy) installed on top of the dev one. BENCH_ARGS=--quick for a smoke run,
# BENCH_ARGS="--only fresh,replay" for a selection; DURAFLOW_BENCH_DATABASE_URL and
# DURAFLOW_BENCH_BROKER_URL choose the servers.
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# make celery-suite: Celery's own tests (t/unit/tasks/ and an integration subset against
# Redis) run with the plain task class and with DurableTask; fails on a test that passes
# only with the plain one (.ci/celery_suite/README.md). CELERY_SUITE_ARGS=unit runs the
# unit part alone.
.PHONY: celery-suite

celery-suite: venv
	PYTHON=$(BIN)/python bash .ci/celery_suite/run.sh $(CELERY_SUITE_ARGS)

# make docs: the documentation site (docs/, Sphinx with MyST and furo) in docs/_build/html,
# with the `docs` extra installed on top of the dev one. Every warning is an error, as in CI.
# SPHINXOPTS=-E rebuilds every page (an incremental build reports only the pages it rereads).
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: docs

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,docs]'
	@touch $@

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html $(SPHINXOPTS) docs docs/_build/html

# make django-demo: the Django example (examples/django/README.md): migrate, one order,
# one retry, on SQLite with a worker thread. DJANGO_DEMO_ARGS="--database-url
# postgresql://... --broker-url redis://..." runs it on PostgreSQL and Redis instead, with a
# `celery worker` process.
.PHONY: django-demo

django-demo: venv
	$(BIN)/python -m examples.django $(DJANGO_DEMO_ARGS)
