# Two entry points a new user needs: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
CONFIG ?= broker.yaml

.PHONY: setup run test test-fast test-brokers lint bench bench-setup clean

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PYTHON) not found)"; exit 1; }
	@# The Spark pipeline needs a JVM (17+); Debian's package when none is there.
	@command -v java >/dev/null 2>&1 || { echo "installing Java 17 for Spark (openjdk-17-jre-headless)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq openjdk-17-jre-headless; } \
		|| { echo "Java 17 is required by the Spark pipeline: install openjdk-17-jre-headless"; exit 1; }
	@# The replication tests run a real etcd (the coordinator of HA): Debian's package when none is there.
	@command -v etcd >/dev/null 2>&1 || { echo "installing etcd for the replication tests (etcd-server)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq etcd-server; } \
		|| { echo "etcd is required by the replication tests: install etcd-server"; exit 1; }
	@# Debian's python3.11 makes no venv without its venv package (ensurepip): that package when missing.
	@test -x $(VENV)/bin/python || $(PYTHON) -c 'import ensurepip' >/dev/null 2>&1 || { \
		echo "installing the venv module of Python 3.11 (python3.11-venv)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3.11-venv; } \
		|| { echo "Python's venv module is required: install python3.11-venv"; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test,bench,pipeline]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/amqtt-durable broker -c $(CONFIG)

# The tests run in TEST_WORKERS processes (pytest-xdist), each test where a worker is free; each
# worker that runs a Spark test starts its own SparkSession (a JVM): the Spark tests come first in the
# collection (tests/conftest.py), so worksteal leaves them with the first worker (while they take less
# than a worker's share of the run), which starts one JVM for them all (test_pipeline_audit.py alone:
# 209 s of test time in one worker at load 6-8, 495 s split over two at load 8-12, each worker starting
# a JVM, warming it up and running the module's shared audit). free_port gives each worker its
# own block of ports outside the kernel's ephemeral range (plugin/amqtt_durable/process.py), so
# brokers of three workers never race each other or an outgoing connection for a port.
# PYTHONDONTWRITEBYTECODE is emptied (bytecode caching on) for the tests: the suite starts every broker,
# CLI and example as a Python process of its own, and where it is set (some CI images set it) each of those
# compiled amqtt_durable from source again and each worker rewrote every test module's asserts again
# (side by side on two cores: 179 s without the cache, 142 s with it, from a tree without __pycache__).
# --dist worksteal: a worker that runs out of tests takes some of another's queue. With xdist's default
# (load) the tests handed out last stayed with their worker: in a timed run the other two workers stood
# idle for the last 264 s of 1,827 while the first still worked through Spark audits queued to it.
TEST_WORKERS ?= 3
PYTEST := PYTHONDONTWRITEBYTECODE= $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The whole suite names its 30 slowest tests at the end, so a run shows where its time goes.
test: $(STAMP)
	$(PYTEST) --durations=30

# The unit tests: pure logic and real LevelDB stores, no broker process (about half a minute).
test-fast: $(STAMP)
	$(PYTEST) tests/unit

# Everything but the tests marked slow (Spark, fleet runs, failovers): real brokers, a few minutes.
test-brokers: $(STAMP)
	$(PYTEST) -m 'not slow'

lint: $(STAMP)
	$(VENV)/bin/ruff check plugin client_sdk pipeline fleet tests bench examples
	$(VENV)/bin/mypy

# Mosquitto (Debian package) is the third broker of bench_durable.py and bench_storm.py; they skip its
# columns, and say so, when it cannot be installed.
bench-setup: $(STAMP)
	@command -v mosquitto >/dev/null 2>&1 || test -x /usr/sbin/mosquitto || { echo "installing Mosquitto (mosquitto)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq mosquitto; } \
		|| echo "Mosquitto could not be installed: the benchmarks leave its columns empty"

bench: $(STAMP) bench-setup
	$(VENV)/bin/python bench/bench_durable.py
	$(VENV)/bin/python bench/bench_storm.py
	$(VENV)/bin/python bench/bench_sdk.py
	$(VENV)/bin/python bench/bench_pipeline.py
	$(VENV)/bin/python bench/bench_fleet.py
	$(VENV)/bin/python bench/bench_wildcards.py
	$(VENV)/bin/python bench/bench_retained_startup.py
	$(VENV)/bin/python bench/bench_replication.py

clean:
	rm -rf $(VENV) data .pytest_cache
