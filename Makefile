# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Which torch: where `nvidia-smi` lists a GPU, PyPI's torch (on Linux, the CUDA build); elsewhere the CPU build,
# because a plain `pip install torch` on Linux pulls the CUDA build and several GB of CUDA libraries: a wheel pip
# finds without an index (its find-links, e.g. one already on this machine's disk), else PyTorch's CPU index.
# `make TORCH_INDEX=https://download.pytorch.org/whl/cu126` picks the index, `make TORCH_INDEX=` PyPI's build,
# `make TORCH=torch==2.9.0` the version. With your own torch, `pip install -e ".[test]"` keeps it (torch>=2.9).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?= $(if $(shell nvidia-smi -L 2>/dev/null),,https://download.pytorch.org/whl/cpu)

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -z "$(TORCH_INDEX)" ]; then set -x; $(PY) -m pip install -q "$(TORCH)"; \
	elif $(PY) -m pip install -q --no-index --no-deps "$(TORCH)" 2>/dev/null; then echo "$(TORCH): a wheel on disk"; \
	else set -x; $(PY) -m pip install -q "$(TORCH)" --index-url "$(TORCH_INDEX)"; fi
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# The demo and the tests run on the CPU (gloo), also where there are GPUs: CUDA_VISIBLE_DEVICES= hides them, so
# that two ranks never ask for a second GPU a machine may not have. docs/gpus.md is the way to train on GPUs.
demo: $(VENV)/.installed
	CUDA_VISIBLE_DEVICES= $(VENV)/bin/smp demo

test: $(VENV)/.installed
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q

test-slow: $(VENV)/.installed
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q -m slow

# The prepared GPU check (benchmarks/gpu_check.py, docs/benchmarks.md): CUDA_VISIBLE_DEVICES is left as it is, since
# this target is for the GPU; without one it runs its CPU half. Under 8 minutes on one GPU.
gpu-check: $(VENV)/.installed
	$(PY) benchmarks/gpu_check.py

# Static checks (config in pyproject.toml); the `test` extra installs ruff and mypy.
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m mypy

.PHONY: setup demo test test-slow gpu-check lint
