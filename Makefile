# The two commands: `make demo` runs the main job, `make test` passes the tests.
# Both work on a fresh Debian machine with only Python, make and git.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Debian packages the tests use: iproute2 (network namespaces for the lab), prometheus and
# prometheus-alertmanager (rules, scrapes, pages), chromium (browser tests), openssl (certificates).
DEBS   ?= iproute2 prometheus prometheus-alertmanager chromium openssl nftables
PYTEST_WORKERS ?= 2

.PHONY: demo test check lint typecheck unit debs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,torch]'
	touch $@

# Installs only what is missing; apt-get update first, as a fresh machine's lists are empty.
debs:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "missing Debian packages:$$missing (run as root or: sudo apt-get install$$missing)"; fi; \
	fi

demo: $(STAMP)
	$(VENV)/bin/ridethrough demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	bash tests/tools/typecheck.sh

# The parallel suite first; then, alone, the whole-system story (`serial`): its detections and timings must not
# compete with other tests for the machine's cores.
unit: $(STAMP) debs
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not serial" --durations=30
	$(VENV)/bin/pytest -q -m serial

test: lint typecheck unit

bench: $(STAMP)
	$(PY) bench/ingest.py --quick

clean:
	rm -rf $(VENV) .ridethrough .pytest_cache .mypy_cache .ruff_cache
