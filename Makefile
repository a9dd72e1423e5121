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

# Re-install when the package metadata changes. The environment may forbid writing bytecode on
# import (PYTHONDONTWRITEBYTECODE), so everything is compiled once here, or every `coral` process
# would recompile torch. pip compiles on one core; compileall -j0 compiles the same files on all of
# them (about 35 s less here). A few third-party files are not Python 3.11 (torch's
# testing/_internal/py312_intrinsics.py): pip skips them silently, and so does this step.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e '.[test,runtime]'
	$(BIN)/python -m compileall -q -j0 src
	$(BIN)/python -m compileall -q -j0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $(STAMP)

# Only the tests in tests/deploy that load exported tasks run it, five times: pip's byte-compiling of
# every module would cost about a minute, so it compiles (by importing them) only the modules those
# runs load (pandas: SkyPilot's catalog reads its CSV with it).
$(SKY_STAMP): pyproject.toml
	$(PY) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install -q --no-compile 'skypilot==0.14.1'
	PYTHONDONTWRITEBYTECODE= $(SKY_VENV)/bin/python -c 'import yaml, pandas, sky; from sky import catalog'
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
