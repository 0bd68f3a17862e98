# The two commands a newcomer needs are `make run` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
# The client distribution's locked wheels (requirements/client.txt), from
# which tests/workflows/test_client_install.py installs clients/python into
# a fresh virtualenv with no index: the suite needs no network once make
# has installed.
WHEELHOUSE = $(VENV)/wheelhouse
# The suite runs in parallel (pytest-xdist). It waits on servers, Squids and
# timers far more than it computes, so it runs more processes than the 2 cores
# CI has; a fixed count keeps CI predictable. What each process must own alone
# (ports, installation id, Squid names) is in tests/helpers/xdist.py.
# `make test PYTEST_WORKERS=0` runs everything in one process.
PYTEST_WORKERS ?= 8
PYTEST_XDIST    = -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: run test test-quick histories lint bench tools test-tools clean bytecode lock

## The virtualenv holds exactly the locked versions (requirements/dev.txt,
## every file checked against its hash), so a clone installs next month what
## it installs today; the project itself goes in on top, without resolving
## anything more, beside the scrapers' client it imports (clients/python).
## uv installs them (requirements/installer.txt, put in by pip): a minute
## less than pip on every fresh clone, most of it compiling in parallel the
## bytecode that nothing writes later where PYTHONDONTWRITEBYTECODE is set.
## `make lock` moves the pins.
UV = $(BIN)/uv pip install --python $(BIN)/python -q
$(STAMP): pyproject.toml clients/python/pyproject.toml requirements/dev.txt requirements/client.txt \
		requirements/installer.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --require-hashes -r requirements/installer.txt
	$(UV) --require-hashes --compile-bytecode -r requirements/dev.txt
	$(UV) --no-deps --no-build-isolation -e ./clients/python -e .
	$(BIN)/python -m pip download -q --require-hashes --only-binary :all: -r requirements/client.txt -d $(WHEELHOUSE)
	touch $@

## The workflow sandbox re-imports the workflow modules for every new
## workflow run; where PYTHONDONTWRITEBYTECODE is set (as in the Dockerfile)
## nothing caches their bytecode, so each run would compile them again.
## Compiling is quick when nothing changed (only changed files are redone).
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q -x '/\.' .

## Squid and curl; the tests also want promtool (Debian's prometheus package),
## and for docs/scrapers.md's Playwright example Debian's Chromium (Playwright's
## own comes from outside the package registries) and certutil, which makes it
## trust the test site's CA.
tools:
	@bash deploy/local/ensure-tools.sh

test-tools:
	@bash deploy/local/ensure-tools.sh promtool:prometheus \
		chromium-headless-shell:chromium-headless-shell certutil:libnss3-tools

## Temporal dev server + worker + local Squid provider; Ctrl-C stops it all.
## `make run CONFIG=path` runs the worker on another providers config (given
## on the command line only: a CONFIG in the environment may mean anything).
run: $(STAMP) tools bytecode
	$(BIN)/python deploy/local/devenv.py \
		$(if $(filter command line,$(origin CONFIG)),--providers-config '$(CONFIG)')

## The whole suite, as CI runs it.
test: $(STAMP) test-tools bytecode
	$(BIN)/pytest $(PYTEST_XDIST)

## Everything but the slow end-to-end tests.
test-quick: $(STAMP) test-tools bytecode
	$(BIN)/pytest $(PYTEST_XDIST) -m "not slow"

## Record the current release's histories (pyproject.toml's version) into
## tests/histories/<version>/ for the replay test: every test that records one
## runs. Recordings a release already has are kept (docs/upgrades.md).
HISTORY_TESTS = $(shell grep -rl --include='test_*.py' record_history tests)
histories: $(STAMP) tools bytecode
	PROXY_OPERATOR_RECORD_HISTORIES=1 $(BIN)/pytest $(PYTEST_XDIST) $(HISTORY_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP) tools bytecode
	$(BIN)/python -m bench

## Refreshes the locks to the newest releases pyproject.toml's ranges allow:
## requirements/app.txt (the application, as the Dockerfile installs it),
## requirements/dev.txt (it and the test extra, held to app.txt's pins) and
## requirements/client.txt (clients/python with its scrapy extra, held to
## dev.txt's pins: the wheels the client's install test uses) and
## requirements/installer.txt (uv, which installs the virtualenv).
## `make lock UPGRADE='temporalio scrapy'` moves only those and keeps every
## other pin (also the way to take in a dependency added to pyproject.toml).
## Markers are evaluated for the machine that runs it, so it runs only where
## CI and the image run, Python 3.11 on Linux; the hashes cover the files of
## every platform.
UPGRADE ?=
PIP_COMPILE = CUSTOM_COMPILE_COMMAND='make lock' $(BIN)/pip-compile -q --generate-hashes \
	--allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
	$(if $(strip $(UPGRADE)),$(addprefix --upgrade-package ,$(UPGRADE)),--upgrade)
lock: $(STAMP)
	@$(BIN)/python -c 'import sys; sys.exit(None if sys.platform == "linux" and \
		sys.version_info[:2] == (3, 11) else "make lock runs on Python 3.11 on Linux only")'
	$(PIP_COMPILE) --all-build-deps -o requirements/app.txt pyproject.toml
	$(PIP_COMPILE) --extra test -o requirements/dev.txt pyproject.toml requirements/dev.in
	$(PIP_COMPILE) --extra scrapy -o requirements/client.txt \
		clients/python/pyproject.toml requirements/client.in
	$(PIP_COMPILE) -o requirements/installer.txt requirements/installer.in
	sed -i '2a # on Linux, where CI and the image run it (the hashes cover every platform)' \
		requirements/app.txt requirements/dev.txt requirements/client.txt requirements/installer.txt

## Removes .data (make run's workflows and proxies), the virtualenv and the
## build's leftovers; refuses while workflows are open in .data or make run
## runs from it (deploy/local/clean.py). `make clean FORCE=1` removes anyway.
clean:
	$(PYTHON) deploy/local/clean.py $(if $(filter 1,$(FORCE)),--force)
	rm -rf $(VENV)
