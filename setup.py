"""Build script: the Python package plus the native module ``infinity._C``.

The native module is plain C++17 over libc and the kernel headers (no libaio,
no liburing, no torch headers): Python passes raw pointers after validating
tensors, so the build needs only pybind11 and a C++ compiler.

``infinity._fence`` (cpp/fence/, the fence test device: NOTE [the fence device] in docs/NOTES.md)
links against libtorch, so it is built only where torch is importable at build
time (``pip install --no-build-isolation``, as the Makefile does); elsewhere
``Config(device="fence")`` says how to get it.
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
    sorted(f for f in glob.glob("cpp/**/*.cpp", recursive=True) if not f.startswith("cpp/fence/")),
    include_dirs=["cpp"],
    # NOTE: without the headers listed, editing one would not trigger a rebuild.
    depends=sorted(glob.glob("cpp/**/*.hpp", recursive=True)),
    cxx_std=17,
    extra_compile_args=_CXX_FLAGS,
    extra_link_args=_LINK_FLAGS,
)



def _fence_extension() -> Pybind11Extension | None:
    """``infinity._fence`` against the torch this build sees, or None without one.

    NOTE: not under the sanitizers (libtorch is not instrumented, and
    `make test-native` tests the I/O and kernel code, not this).
    """
    if _SANITIZE or os.environ.get("INFINITY_NO_FENCE"):
        return None
    try:
        import torch
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError:
        return None
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return Pybind11Extension(
        "infinity._fence",
        sorted(glob.glob("cpp/fence/*.cpp")),
        include_dirs=["cpp", *include_paths()],
        depends=["cpp/fence/fence.hpp"],
        library_dirs=library_paths(),
        libraries=["c10", "torch", "torch_cpu"],
        define_macros=[("_GLIBCXX_USE_CXX11_ABI", str(abi))],
        cxx_std=20,  # NOTE: torch 2.13's headers are C++20
        extra_compile_args=["-O2", "-Wall", "-fvisibility=hidden", "-Wno-unused-parameter"],
    )


class _BuildExt(build_ext):
    """pybind11's build_ext, with the fence optional: a torch whose C++ API it does not
    build against leaves the package without ``infinity._fence`` (device="fence" then
    says so), never without ``infinity._C``."""

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        if ext.name != "infinity._fence":
            return super().build_extension(ext)
        try:
            return super().build_extension(ext)
        except Exception as exc:
            print(f"warning: infinity._fence (the fence test device) was not built: {exc}")
            return None


fence = _fence_extension()
setup(
    ext_modules=[ext] if fence is None else [ext, fence],
    cmdclass={"build_ext": _BuildExt},
)
