# Two entry points on a fresh machine:  `make demo` (set up + serve the demo model)
# and `make test` (set up + run the tests). `.ci/run` runs `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/tidal serve

test: setup
	$(PY) -m pytest -q
