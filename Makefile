# Two commands for a fresh machine with Python 3.10+ and make:
#   make demo   install into .venv and run the quickstart example
#   make test   install into .venv and run lint, type checks and the whole test suite
# While working: make test-fast (lint, then the tests not marked slow: under a minute, no subprocesses).
VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
SYSTEM_PYTHON ?= python3

.PHONY: demo test test-fast lint bench clean

$(INSTALLED): pyproject.toml constraints.txt
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --constraint constraints.txt --editable ".[dev]"
	touch $(INSTALLED)

demo: $(INSTALLED)
	$(PYTHON) examples/quickstart.py

lint: $(INSTALLED)
	$(VENV)/bin/ruff check src callbacks frontends tests examples benchmarks
	$(VENV)/bin/ruff format --check src callbacks frontends tests examples benchmarks
	$(VENV)/bin/mypy

test: lint
	$(PYTHON) -m pytest -q

test-fast: $(INSTALLED)
	$(VENV)/bin/ruff check src callbacks tests examples benchmarks
	$(VENV)/bin/ruff format --check src callbacks tests examples benchmarks
	$(PYTHON) -m pytest -q -m "not slow"

bench: $(INSTALLED)
	$(PYTHON) -m pip install --quiet --constraint constraints.txt --editable ".[dev,bench]"
	$(PYTHON) benchmarks/overhead.py
	$(PYTHON) benchmarks/overhead.py --instructions
	$(PYTHON) benchmarks/checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
