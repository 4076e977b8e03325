# `make demo` and `make test` work on a fresh machine: each builds .venv itself.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# CPU build on machines without a GPU; on a GPU host set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
# Tests and the demo start hundreds of Python processes that import this package: where the
# environment forbids writing bytecode, each of them compiled every module it imports again
# (about 12 % of the suite's CPU time on a 2-core machine).  __pycache__ is git-ignored.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv demo demo-remap test test-all clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python examples/demo.py

demo-remap: venv
	$(BIN)/python examples/kill_and_remap.py

# Two pytest workers (pytest-xdist), one test file each at a time (module fixtures and a file's
# order kept), files handed out in collection order (tests/conftest.py puts the longest first):
# one pytest process kept only one of the two cores busy.  TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: venv
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-all: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
