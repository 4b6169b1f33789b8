# Set-up and everyday commands. `make test` is what CI runs.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck pytest demo bench stress docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test,bench,demo]"
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest -q

test: lint typecheck pytest

demo:
	@echo "make demo: the streaming demo is not built yet" >&2; exit 1

bench:
	@echo "make bench: the benchmark suite is not built yet" >&2; exit 1

stress:
	@echo "make stress: the stress suite is not built yet" >&2; exit 1

docs:
	@echo "make docs: the documentation site is not built yet" >&2; exit 1

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
