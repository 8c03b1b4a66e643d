# Two entry points, each self-installing and idempotent on a fresh machine:
#   make demo   - creates .venv, installs, runs the embedded default job (configs/tiny.py)
#   make test   - creates .venv with the test extra, runs the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A rerun resumes from the checkpoints in WORKDIR (delete it to start over).
WORKDIR ?= /tmp/sage_jax_demo
# extra flags for the demo run, e.g. DEMO_ARGS="--config.max_steps=3" (CI's smoke run)
DEMO_ARGS ?=

.PHONY: demo test install install-test clean

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(PY) -m sage_jax.main --config=configs/tiny.py --workdir=$(WORKDIR) $(DEMO_ARGS)

# Two workers, whole files each (a file's module fixtures are built once): most of the suite is single-threaded
# XLA compilation, so this about halves the wall time on CI's 2 cores. Files go out heaviest first (the order
# tests/conftest.py collects them in; xdist would otherwise reorder by test count). PYTEST_ARGS="-n 0" runs it
# serially.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(PYTEST_ARGS) --durations=15 tests

clean:
	rm -rf $(VENV)
