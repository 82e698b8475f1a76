# Two commands for a fresh machine with Python 3.10+ and make:
#   make demo   install into .venv and run the quickstart example
#   make test   install into .venv and run lint, type checks and the whole test suite
# While working: make test-fast (ruff, then the tests not marked slow, on 2 workers: ~1.5 minutes, no subprocesses).
# make docs builds the documentation site into site/ (--strict: a broken link or reference fails); make docs-serve
# serves it at http://127.0.0.1:8000 while you edit.
VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
SYSTEM_PYTHON ?= python3
# Every folder of code, and the docs site's two Python files (not its markdown, whose code blocks ruff would
# reformat), for every lint and format check (make lint and make test-fast check the same ones).
CODE := src callbacks tests examples benchmarks tools docs/hooks.py docs/griffe_field_docs.py
# The package's folders. The editable install is strict (docs/architecture.md, Packaging): a tree of links to each
# file, so adding, removing or renaming a file, which changes its folder's time, installs again.
PACKAGE_FOLDERS := $(shell find src/cadence callbacks -name __pycache__ -prune -o -type d -print)

.PHONY: demo test test-floor test-fast lint check-code docs docs-serve bench clean

$(INSTALLED): pyproject.toml constraints.txt $(PACKAGE_FOLDERS)
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --constraint constraints.txt --editable ".[dev]" --config-settings editable_mode=strict
	touch $(INSTALLED)

# make demo installs the runtime dependencies alone (no Lightning, MLflow, W&B or transformers: those are the dev
# extras make test installs); where make test has installed already, it reuses that environment.
RUNTIME := $(VENV)/.runtime

$(RUNTIME): pyproject.toml constraints.txt $(PACKAGE_FOLDERS)
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --constraint constraints.txt --editable . --config-settings editable_mode=strict
	touch $(RUNTIME)

demo: $(if $(wildcard $(INSTALLED)),$(INSTALLED),$(RUNTIME))
	$(PYTHON) examples/quickstart.py

check-code: $(INSTALLED)
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)

# tools/api_breaks.py: the public API compared with the last release's (docs/versioning.md).
lint: check-code
	$(VENV)/bin/mypy
	$(PYTHON) tools/api_breaks.py

# NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about MkDocs 2.0 on every build; the build does not use it.
docs: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet

docs-serve: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs serve --strict

# Worker processes for make test: most of the suite waits on the processes it starts (ranks, scripts), so more
# workers than cores pay off; tests/conftest.py keeps each module that shares a module-scoped fixture on one worker.
TEST_WORKERS ?= 4

test: lint docs
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

# The lowest torch pyproject.toml promises, tested: a venv of its own with the dev extras and torch pinned to
# TORCH_FLOOR (older torch wheels on the registry are the CUDA builds: about 3 GB, ~15 minutes to install here),
# then the fast lane. docs/versioning.md says what was measured.
TORCH_FLOOR ?= 2.9.1
FLOOR_VENV := .venv-floor

test-floor:
	$(SYSTEM_PYTHON) -m venv $(FLOOR_VENV)
	sed 's/^torch==.*/torch==$(TORCH_FLOOR)/' constraints.txt > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet --constraint $(FLOOR_VENV)/constraints.txt --editable ".[dev]" --config-settings editable_mode=strict
	$(FLOOR_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q -m "not slow" -n 2

test-fast: check-code
	$(PYTHON) -m pytest -q -m "not slow" -n 2

bench: $(INSTALLED)
	$(PYTHON) -m pip install --quiet --constraint constraints.txt --editable ".[dev,bench]" --config-settings editable_mode=strict
	$(PYTHON) benchmarks/overhead.py
	$(PYTHON) benchmarks/overhead.py --instructions
	$(PYTHON) benchmarks/checkpoint.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build site *.egg-info src/*.egg-info
