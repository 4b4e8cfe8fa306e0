# Developer entry points. `make test` is the test command the README gives.
#
#   make venv   create .venv (if missing) and install the package with its dev extras
#   make test   run the test suite
#   make demo   run the example project
#   make lint   ruff and mypy

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Touched after a successful install: a newer pyproject.toml triggers a reinstall.
STAMP := $(VENV)/.installed

.PHONY: venv test demo lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

test: venv
	$(BIN)/pytest --cov=celery_duraflow --cov-report=term-missing:skip-covered $(PYTEST_ARGS)

demo: venv
	$(BIN)/python -m example_project

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
