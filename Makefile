# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# Both create or refresh .venv; a second run reinstalls nothing.

PYTHON     ?= python3
VENV       ?= .venv
# Override for a CUDA build, e.g. make setup TORCH_SPEC='torch==2.13.0 --index-url ...'
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.infinity-installed
SOURCES    := setup.py pyproject.toml $(shell find cpp -name '*.cpp' -o -name '*.hpp' 2>/dev/null)
DEMO_ARGS  ?=

.PHONY: setup demo test test-gpu check-install lint bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

# NOTE: torch goes in first and only if the venv lacks one, so pip never
# resolves `torch>=2.4` to a multi-GB CUDA wheel on a CPU machine.
$(STAMP): $(PY) $(SOURCES)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet "pybind11>=2.12" "setuptools>=68" wheel
	$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/infinity train $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q tests

# On a machine with a GPU and a CUDA torch already installed (no venv, no
# download): build the native module against that torch, run the tests
# marked `cuda` (on a machine without a GPU they are reported as skipped).
test-gpu:
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PYTHON) -m pytest -q -m cuda -rs tests/cuda

# A fresh venv, `pip install .` without extras, the command run outside the tree.
check-install:
	PYTHON=$(PYTHON) TORCH_SPEC='$(TORCH_SPEC)' .ci/check_install

# The layers and their contracts: pyproject.toml ([tool.importlinter], [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check infinity tests bench
	$(VENV)/bin/ruff format --check infinity tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: setup
	$(PY) bench/nvme_vs_fio.py --path .infinity/bench
	$(VENV)/bin/infinity bench adam

clean:
	rm -rf build *.egg-info infinity/_C*.so .infinity
