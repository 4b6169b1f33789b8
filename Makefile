# Set-up and everyday commands. `make test` is what CI runs.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
# Test processes (pytest-xdist); 0 runs the tests in this one.
PYTEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck pytest demo bench stress docs docs-serve api-snapshot clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test,bench,demo,docs,hf]"
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples docs/hooks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/hooks scripts

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

test: lint typecheck docs pytest

# The main job: generate with a transformers model bigger than its memory budget
# (flags: DEMO_ARGS=...).
demo: install
	$(PY) benchmarks/demo.py $(DEMO_ARGS)

# Every benchmark, results in benchmarks/results/ (JSON, summary.md, timeline.png).
bench: install
	$(PY) benchmarks/run_all.py

# Longer fault, load and leak runs than the bounded ones inside `make test`.
stress: install
	$(PY) tests/stress/run.py

docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Record upstream torch-to-nnef's tensor API (tests/data/upstream_tensor_api.json), which
# tests/test_upstream_api.py compares this package against. UPSTREAM_PYTHON is a scratch
# Python with upstream's wheel installed (pip install --no-deps), never this project's venv.
api-snapshot:
	@test -n "$(UPSTREAM_PYTHON)" || { echo "usage: make api-snapshot UPSTREAM_PYTHON=/path/to/scratch/bin/python"; exit 2; }
	$(UPSTREAM_PYTHON) scripts/upstream_api_snapshot.py tests/data/upstream_tensor_api.json

# The site at http://127.0.0.1:8000, rebuilt on change (its search box needs a server).
docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
