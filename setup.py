"""Build script: the Python package plus the native module ``infinity._C``.

The native module is plain C++17 over libc and the kernel headers (no libaio,
no liburing, no torch headers): Python passes raw pointers after validating
tensors, so the build needs only pybind11 and a C++ compiler.
"""

from __future__ import annotations

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# One compiler process per core (INFINITY_BUILD_JOBS overrides): the sources
# are independent, and a 16-core GPU machine then builds in seconds.
ParallelCompile("INFINITY_BUILD_JOBS", default=0).install()

# NOTE: no -march=native. SIMD kernels opt in per function with target
# attributes and are chosen at run time, so a build runs on any x86-64 CPU.
_CXX_FLAGS = ["-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread"]
_LINK_FLAGS = ["-pthread"]
if os.environ.get("INFINITY_DEBUG_BUILD"):
    _CXX_FLAGS = ["-O1", "-g", "-Wall", "-Wextra", "-fno-omit-frame-pointer", "-pthread"]

# INFINITY_SANITIZE=address,undefined (or thread): a build instrumented by the
# sanitizers, for `make test-native` and `make test-native-tsan`. The Makefile
# builds it into its own folder (build/sanitize/...), never in place, so the
# normal build is left alone. NOTE: -fno-sanitize-recover makes every finding
# fatal, so a test run cannot pass with a report scrolled by in its output.
_SANITIZE = os.environ.get("INFINITY_SANITIZE", "").strip()
if _SANITIZE:
    _CXX_FLAGS = [
        f"-fsanitize={_SANITIZE}",
        "-fno-sanitize-recover=all",
        "-fno-omit-frame-pointer",
        "-O1",
        "-g",
        "-Wall",
        "-Wextra",
        "-pthread",
    ]
    _LINK_FLAGS = [f"-fsanitize={_SANITIZE}", "-pthread"]

ext = Pybind11Extension(
    "infinity._C",
    sorted(glob.glob("cpp/**/*.cpp", recursive=True)),
    include_dirs=["cpp"],
    # NOTE: without the headers listed, editing one would not trigger a rebuild.
    depends=sorted(glob.glob("cpp/**/*.hpp", recursive=True)),
    cxx_std=17,
    extra_compile_args=_CXX_FLAGS,
    extra_link_args=_LINK_FLAGS,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
