"""Tests on the fence device, the GPU stand-in that computes on the CPU.

The device is loaded when this file is imported, before any test runs a
backward pass (autograd starts its device threads once per process: NOTE [the
fence device] in docs/NOTES.md). Every test compares with plain PyTorch or with
the same job on the CPU backend: the fence computes with the CPU's kernels, so
the two agree bit for bit wherever the arithmetic is the same.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if os.environ.get("INFINITY_FENCE_TESTS") != "1":  # pragma: no cover - tests/conftest.py
    raise RuntimeError("run the fence tests as `INFINITY_FENCE_TESTS=1 pytest tests/fence`")

from infinity.devices import fence

fence.load()


@pytest.fixture(scope="session")
def fence_native():
    """``infinity._fence``: the device's allocation counters."""
    return fence.load()
