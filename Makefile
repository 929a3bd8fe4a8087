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

.PHONY: setup demo test test-gpu test-native test-native-tsan check-install lint bench clean

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

# NOTE [the fence device]: tests/fence runs in a pytest process of its own (the
# device is registered process-wide); without INFINITY_FENCE_TESTS=1 the first
# run does not collect it.
test: setup
	$(PY) -m pytest -q tests
	INFINITY_FENCE_TESTS=1 $(PY) -m pytest -q tests/fence

# On a machine with a GPU and a CUDA torch already installed (no venv, no
# download): build the native module against that torch, run the tests
# marked `cuda` (on a machine without a GPU they are reported as skipped).
test-gpu:
	@grep -m1 '^Last GPU pass:' docs/BENCHMARKS.md || true
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	CUBLAS_WORKSPACE_CONFIG=:4096:8 $(PYTHON) -m pytest -q -m cuda -rs tests/cuda

# The native module under AddressSanitizer + UBSan, and ThreadSanitizer:
# `setup.py build` with INFINITY_SANITIZE puts an instrumented copy of the
# package in build/sanitize/<name>/lib, apart from the in-place module that
# `make test` uses, and pytest imports it from there through PYTHONPATH. The
# pytest script (not `python -m pytest`, which puts the source tree first on
# sys.path) and the import check make sure the instrumented module is tested.
# CPython is not instrumented: the runtime is preloaded (it must be the first
# library loaded), and leak checks are off (Python frees little at exit).
# NOTE: libstdc++ is preloaded right after it: the python binary does not link
# libstdc++, so without it ASan finds no real __cxa_throw to intercept and
# aborts ("CHECK failed ... real___cxa_throw") at the first C++ exception of
# any extension (matplotlib's ft2font was the first here).
SAN_TESTS  ?= tests/io tests/optim tests/devices tests/engine/test_io_faults.py
TSAN_TESTS ?= tests/io
SAN_CC     ?= g++
comma      := ,
SAN_CHECK   = import infinity._C as c, sys; \
              sys.exit(0 if "/build/sanitize/" in c.__file__ else "not instrumented: " + c.__file__)

# $(call san_build,<sanitizers>,<name>)
define san_build
	INFINITY_SANITIZE=$(1) $(PY) setup.py --quiet build \
	    --build-lib build/sanitize/$(2)/lib --build-temp build/sanitize/$(2)/tmp
endef

# $(call san_run,<name>,<runtime library>,<options>,<tests>)
define san_run
	cd build/sanitize/$(1) && PYTHONPATH=$(CURDIR)/build/sanitize/$(1)/lib $(3) \
	    LD_PRELOAD="$$($(SAN_CC) -print-file-name=$(2)) $$($(SAN_CC) -print-file-name=libstdc++.so)" \
	    $(abspath $(PY)) -c '$(SAN_CHECK)'
	PYTHONPATH=$(CURDIR)/build/sanitize/$(1)/lib $(3) \
	    LD_PRELOAD="$$($(SAN_CC) -print-file-name=$(2)) $$($(SAN_CC) -print-file-name=libstdc++.so)" \
	    $(VENV)/bin/pytest -q $(4)
endef

test-native: setup
	$(call san_build,address$(comma)undefined,asan)
	$(call san_run,asan,libasan.so,ASAN_OPTIONS=detect_leaks=0 \
	    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1,$(SAN_TESTS))

# ThreadSanitizer on the I/O engine's threads (in CI, after test-native). CPython
# and torch are not instrumented, so TSan sees only the native module's side of
# each hand-off; tests/tsan.supp is where a report shown to be such a blind spot
# would go, with its reason. It holds none. A test's child interpreter must import
# the instrumented copy too (tests/io/io_helpers.python_child): a child that
# loaded the plain module gave the one false report this build has had.
test-native-tsan: setup
	$(call san_build,thread,tsan)
	$(call san_run,tsan,libtsan.so,TSAN_OPTIONS="halt_on_error=1 \
	    suppressions=$(CURDIR)/tests/tsan.supp",$(TSAN_TESTS))

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
	$(VENV)/bin/infinity bench optim

clean:
	rm -rf build *.egg-info infinity/_C*.so .infinity
