# animastor-tasks — the targets users and CI rely on.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install up down demo test test-fast lint bench bench-quick faults clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,local]'
	touch $(STAMP)

install: $(STAMP)

## Bring Postgres and Redis up (the configured ones, or local throwaway ones) and migrate.
up: install
	$(BIN)/animastor-tasks up

down: install
	$(BIN)/animastor-tasks down

## The whole story on one machine: stores, workers, beat, Flower, a sample book.
demo: install
	$(BIN)/animastor-tasks demo

## Everything CI runs: two workers, the suites on servers of their own beside the rest (tests/conftest.py).
test: install
	$(BIN)/pytest -q -n 2 --durations=20

test-fast: install
	$(BIN)/pytest -q -n 2 tests/unit tests/integration tests/dev

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: install
	$(BIN)/python -m bench.run

bench-quick: install
	$(BIN)/python -m bench.run --quick

## The fault-injection suite with more trials than CI runs.
faults: install
	ANIMASTOR_FAULT_SCALE=long $(BIN)/pytest -q -n 2 -m "faults or cluster" tests/faults tests/cluster

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache test-output
