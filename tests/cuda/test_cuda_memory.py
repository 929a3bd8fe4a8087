"""The forecast of a step's device peak against CUDA's allocator.

As tests/fence/test_fence_memory.py does on the fence: an offloaded GPT's steps on
the GPU, the allocator's peak over them (``max_memory_allocated``) against
``infinity.memory_forecast``'s device peak, which on CUDA also counts the cuBLAS
workspaces the step's first matmuls make (``MemoryForecast.library_workspaces``).
Whether an earlier test made them already is not known here: the forecast measures
what they add now, so measured and forecast agree either way; one case clears them
first, so that the line is there to be counted.
"""

from __future__ import annotations

import gc

import pytest
import torch
from cuda_helpers import needs_cuda
from engine_helpers import tiny_gpt

import infinity
from infinity.offload import engine_of

pytestmark = needs_cuda


def _clear_library_workspaces() -> None:
    """Free cuBLAS's workspaces (every thread's), so that the next matmuls make them."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()


@pytest.mark.parametrize(
    ("dtype", "policy", "fresh"),
    [
        ("fp32", "keep", True),
        ("fp32", "keep", False),
        ("fp32", "offload", False),
        ("fp32", "checkpoint", False),
        ("bf16", "keep", True),
        ("bf16", "offload", False),
    ],
)
def test_an_offloaded_step_on_the_gpu_stays_within_the_forecast_device_peak(
    tmp_path, dtype, policy, fresh
):
    gc.collect()  # earlier tests' engines: their slots would be freed mid-test
    model = tiny_gpt(layers=4, hidden=64, vocab_size=512, seq_len=64)
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    if fresh:
        _clear_library_workspaces()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what earlier tests left, and the batch
    config = infinity.Config(
        device="cuda",
        dtype=dtype,
        device_memory="1MiB",
        host_memory="4MiB",
        nvme_path=str(tmp_path),
        activations=policy,
        activation_min_bytes=0,
    )
    model = infinity.offload(model, config)
    try:
        opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
        forecast = infinity.memory_forecast(model, lambda m: m(ids, ids), ids.numel())
        if fresh:
            # the forward's thread and autograd's each made one
            assert forecast.library_workspaces > 0, forecast
            assert "library workspaces" in forecast.describe()[1]
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            model(ids, ids).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        memory = infinity.stats(model)["memory"]
        measured = memory["device"]["allocated_peak_bytes"]
        assert measured == torch.cuda.max_memory_allocated()
        measured -= before
        assert memory["forecast"]["device_peak"] == forecast.device_peak
        assert memory["forecast"]["library_workspaces"] == forecast.library_workspaces
        # the forecast holds, and is not so loose it could not fail
        assert forecast.device_peak * 0.5 <= measured <= forecast.device_peak, (forecast, measured)
        for name, line in memory["device"]["lines"].items():
            assert line["peak"] <= line["limit"], (name, line)
    finally:
        engine_of(model).close()
