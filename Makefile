# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# torch is pinned to the CPU build on this machine's disk (a plain `pip install torch` pulls CUDA wheels);
# bring your own torch elsewhere and `pip install -e .` respects it (the package asks for a range).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/smp demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# Static checks (config in pyproject.toml); the `test` extra installs ruff and mypy.
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m mypy

.PHONY: setup demo test test-slow lint
