# Coral: the two set-up commands are `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# SkyPilot pins click<8.2, so it gets its own environment (tests load exported tasks with it).
SKY_VENV ?= .venv-sky
SKY_STAMP := $(SKY_VENV)/.installed

.PHONY: help demo test test-long bench lint calibrate clean venv

help:
	@echo 'make demo       create .venv, install Coral, run a 12-minute cost study on the core scenario'
	@echo 'make test       create/update .venv and .venv-sky (side by side), run the test suite on TEST_JOBS=2'
	@echo '                workers (a test file to a worker; TEST_JOBS=1 runs one process); the tests'
	@echo '                marked `long` (soaks, the fidelity study on the real runtime, SkyPilot and Ray'
	@echo '                lifecycle runs) are skipped there, each naming the reduced form make test runs'
	@echo 'make test-long  the tests marked `long` in their full form (CORAL_LONG_TESTS=1 pytest -m long)'
	@echo 'make bench      the speed/accuracy targets (QUICK=1 skips the extended build, FULL=1 adds more)'
	@echo 'make lint       ruff, the import-linter contracts and mypy'
	@echo 'make calibrate  coral calibrate: fit the performance model to the shipped measurements'
	@echo 'make clean      remove both environments and build outputs'

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-install when the package metadata changes. An editable install writes no bytecode, and
# this environment may forbid writing it on import (PYTHONDONTWRITEBYTECODE): compile it once,
# as `pip install` of a wheel does, so every `coral` process doesn't recompile the sources.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,runtime]'
	$(BIN)/python -m compileall -q src
	touch $(STAMP)

# Only tests/deploy/test_skypilot_accepts.py runs it, three times: pip's byte-compiling of every
# module would cost about a minute, so it compiles (by importing them) only the modules those runs load.
$(SKY_STAMP): pyproject.toml
	$(PY) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install -q --no-compile 'skypilot==0.14.1'
	PYTHONDONTWRITEBYTECODE= $(SKY_VENV)/bin/python -c 'import yaml, sky; from sky import catalog'
	touch $(SKY_STAMP)

venv: $(STAMP) $(SKY_STAMP)

demo: $(STAMP)
	$(BIN)/coral experiment cost core --duration-s 720 --out runs/demo-cost-core

# The two environments are independent: they install side by side (mostly waiting on downloads).
# The suite runs on TEST_JOBS pytest-xdist workers, a test file to a worker (its module fixtures
# are built once); TEST_JOBS=1 runs it in one process.
TEST_JOBS ?= 2
test:
	$(MAKE) -j2 $(STAMP) $(SKY_STAMP)
	$(BIN)/python -m pytest $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile,)

# the full form of the tests marked `long` (soaks, the fidelity study on the real runtime)
test-long: $(STAMP) $(SKY_STAMP)
	CORAL_LONG_TESTS=1 $(BIN)/python -m pytest -m long

# `make bench` also installs the bench extra (aiconfigurator-core, for its `peer` section); the
# test suite never needs it.
$(VENV)/.installed-bench: pyproject.toml | $(STAMP)
	$(BIN)/pip install -q -e '.[test,runtime,bench]'
	touch $@

bench: $(STAMP) $(VENV)/.installed-bench
	$(BIN)/python -m compileall -q src
	$(BIN)/python bench/run.py $(if $(FULL),--full,) $(if $(QUICK),--quick,)

calibrate: $(STAMP)
	$(BIN)/coral calibrate

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports --no-logo
	$(BIN)/mypy src

clean:
	rm -rf $(VENV) $(SKY_VENV) .pytest_cache build *.egg-info src/*.egg-info
