"""What a user runs on a GPU, on the GPU: the jobs of ``tests/fence/device_jobs.py``.

The same functions run on the fence device in every ``make test``; here they run
on CUDA against plain PyTorch on the GPU. Deterministic algorithms are on, so
the jobs that compare bit for bit (offloaded against kept activations, a resume
in a fresh process against an uninterrupted run) compare the engine, not
atomics (``bench/gpu_check.sh`` sets ``CUBLAS_WORKSPACE_CONFIG``).
"""

from __future__ import annotations

import device_jobs
import pytest
import torch
from cuda_helpers import needs_cuda

pytestmark = needs_cuda
pytest.importorskip("transformers")


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("job", device_jobs.JOBS, ids=lambda job: job.__name__)
def test_a_gpu_job_on_the_gpu(job, tmp_path, deterministic):
    job("cuda", tmp_path)
