# make demo: set up and run the main job.  make test: set up and run every check.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EXTRAS ?= dev,pipeline

FW_STAMP := tests/firmware/node_modules/.package-lock.json
UMQTT  := .cache/umqtt/umqtt/simple.py

.PHONY: demo test lint bench setup system-deps firmware-deps clean

setup: system-deps $(STAMP) firmware-deps

# The firmware tests: MicroPython's WebAssembly port (npm) and umqtt.simple (pinned sdist).
firmware-deps: $(FW_STAMP) $(UMQTT)

$(FW_STAMP): tests/firmware/package.json tests/firmware/package-lock.json
	cd tests/firmware && npm ci --no-audit --no-fund --loglevel=error

$(UMQTT): scripts/fetch-umqtt.py
	$(PY) scripts/fetch-umqtt.py

system-deps:
	@bash scripts/install-system-deps.sh

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

# The Python tools only: no apt-get, no npm (a quick check before a commit).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	scripts/typecheck.sh

# Most tests wait on real processes (brokers, gateways, Spark): three workers side by side
# (devkit/broker.py gives each its own slice of ports); on 2 cores a fresh clone took
# 23 min with three, 29-30 with two (the CPU was busy 11 of 30 min). TEST_WORKERS=0
# runs them in one. The slowest 25 are listed at the end: where the time goes.
TEST_WORKERS ?= 3

test: setup lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

demo: setup
	$(PY) -m devkit.demo

bench: setup
	$(PY) bench/uplink_drain.py
	$(PY) bench/sensors.py
	$(PY) bench/gateway.py
	$(PY) bench/wear.py
	$(PY) bench/login_attack.py
	$(PY) bench/chaos_compare.py
	$(PY) bench/pipeline.py
	$(PY) bench/firmware.py
	$(PY) bench/node_tls.py
	$(PY) bench/peers_restart.py
	$(PY) bench/outbox_sqlitedict.py
	$(PY) bench/ingest_writeback.py --processes 10
	$(PY) bench/pipeline.py --fleet --histories 1e6,1e7,5e7 --streams 100,10000
	$(PY) bench/completeness_growth.py --streams 10000 --days 1,7,30

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache demo-out .cache tests/firmware/node_modules
