# The two commands a newcomer needs are `make run` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: run test test-quick lint bench tools test-tools clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

## Squid and curl; the tests also want promtool (Debian's prometheus package).
tools:
	@bash deploy/local/ensure-tools.sh

test-tools:
	@bash deploy/local/ensure-tools.sh promtool:prometheus

## Temporal dev server + worker + local Squid provider; Ctrl-C stops it all.
run: $(STAMP) tools
	$(BIN)/python deploy/local/devenv.py

## The whole suite, as CI runs it.
test: $(STAMP) test-tools
	$(BIN)/pytest

## Everything but the slow end-to-end tests.
test-quick: $(STAMP) test-tools
	$(BIN)/pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP) tools
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .data .mypy_cache .ruff_cache .pytest_cache
