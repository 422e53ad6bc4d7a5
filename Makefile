# Two entry points a new user needs: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
CONFIG ?= broker.yaml

.PHONY: setup run test test-fast lint bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test,bench,pipeline]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/amqtt-durable broker -c $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m 'not slow'

lint: $(STAMP)
	$(VENV)/bin/ruff check plugin client_sdk pipeline tests bench examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/python bench/bench_durable.py
	$(VENV)/bin/python bench/bench_sdk.py

clean:
	rm -rf $(VENV) data .pytest_cache
