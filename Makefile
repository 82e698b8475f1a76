# Two commands for a fresh machine with Python 3.10+ and make:
#   make demo   install into .venv and run the quickstart example
#   make test   install into .venv and run lint, type checks and the whole test suite
VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
SYSTEM_PYTHON ?= python3

.PHONY: demo test lint bench clean

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

bench: $(INSTALLED)
	$(PYTHON) -m pip install --quiet --constraint constraints.txt --editable ".[dev,bench]"
	$(PYTHON) benchmarks/overhead.py
	$(PYTHON) benchmarks/overhead.py --instructions
	$(PYTHON) benchmarks/checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
