# Two entry points on a fresh machine:  `make demo` (set up + serve the demo model)
# and `make test` (set up + run the tests). `.ci/run` runs `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-all

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/tidal serve

# Two workers (pytest-xdist), each taking a whole file at a time, one torch thread each: the tiny test models
# gain nothing from a second thread, and the files' server processes and rank processes overlap better.
# `make test` leaves out the full-size fuzz and load runs (marked `slow`); `make test-all` runs them too.
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=30

test: setup
	$(PYTEST) -m "not slow"

test-all: setup
	$(PYTEST)
