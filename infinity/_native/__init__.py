"""Access to the compiled module ``infinity._C`` with a clear error if it is missing."""

from __future__ import annotations

import functools
from types import ModuleType


def native() -> ModuleType:
    """Return ``infinity._C``; raise ``ImportError`` with the build command if it is not built."""
    try:
        from infinity import _C
    except ImportError as exc:  # pragma: no cover - only on a broken install
        raise ImportError(
            "infinity's native module infinity._C is not built. Run `make setup` "
            "(or `pip install --no-build-isolation -e .`) from the project root."
        ) from exc
    return _C


@functools.cache
def submodule(name: str) -> ModuleType:
    """``infinity._C.<name>`` (``adam``, ``lion``, ``sgd``), looked up once: the kernels'
    wrappers call it on the per-chunk path."""
    return getattr(native(), name)
