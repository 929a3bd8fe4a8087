"""What every CUDA test shares: the marker, and the skip on a machine without a GPU.

NOTE: the skip is explicit and names its reason, so a run without a GPU
reports these tests as skipped, never as passed (`make test-gpu` runs them
where a GPU is lent; docs/BENCHMARKS.md says when they last ran).
"""

from __future__ import annotations

import pytest
import torch

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on one)"
    ),
]
