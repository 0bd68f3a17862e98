# The two commands a newcomer needs are `make run` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: run test test-quick lint bench squid clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

squid:
	@bash deploy/local/ensure-squid.sh

## Temporal dev server + worker + local Squid provider; Ctrl-C stops it all.
run: $(STAMP) squid
	$(BIN)/python deploy/local/devenv.py

## The whole suite, as CI runs it.
test: $(STAMP) squid
	$(BIN)/pytest

## Everything but the slow end-to-end tests.
test-quick: $(STAMP) squid
	$(BIN)/pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP) squid
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .data .mypy_cache .ruff_cache .pytest_cache
