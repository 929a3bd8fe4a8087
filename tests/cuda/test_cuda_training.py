"""Training on the GPU against plain PyTorch on the GPU: every kind on each tier.

The cases are the equivalence sweep's (tests/equivalence), moved to
``backend="cuda"``: the pinned one-process cases (every kind of chunk on the
host and on NVMe, fp32 and bf16 compute, each state dtype, accumulation,
clipping, the overlapped step) and a few drawn ones. Each is judged as on the
CPU: the reference is the same ``transformers`` Llama computing on the GPU
with ``torch.optim.AdamW`` (or the sweep's quantised reference), the tolerance
is torch's own noise measured in the same test.
"""

from __future__ import annotations

import os

import pytest
import torch
from cuda_helpers import needs_cuda
from sweep_cases import EVALUATED, EXAMPLES, FP16, PINNED, RESUMED, Case, draw_cases
from sweep_run import check, run_case

pytestmark = needs_cuda
pytest.importorskip("transformers")

# bench/gpu_check.sh draws 24 (INFINITY_CUDA_SWEEP_DRAWN); `make test-gpu` a handful.
DRAWN = int(os.environ.get("INFINITY_CUDA_SWEEP_DRAWN", "6"))
CASES = [
    c.on("cuda")
    for c in [*EXAMPLES, *PINNED, *RESUMED, *EVALUATED, *FP16, *draw_cases(27, DRAWN)]
    if c.world == 1
]


@pytest.mark.parametrize("case", CASES, ids=Case.name)
def test_gpu_training_equals_plain_pytorch_on_the_gpu(case: Case, tmp_path) -> None:
    check(run_case(case, str(tmp_path)))


def test_device_budget_bounds_what_the_engine_allocates_on_the_gpu(tmp_path) -> None:
    """The engine's device slots fit ``device_memory`` (measured by torch's allocator)."""
    from sweep_train import build_model, config

    import infinity
    from infinity.offload import engine_of

    case = Case(backend="cuda", host=0.25, device=0.35, chunk_size="16KiB", layers=4)
    model = build_model(case)
    # NOTE: cuBLAS keeps a workspace per stream in torch's allocator (tens of
    # MiB on Hopper), created by the first matmul: not the engine's bytes.
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated()
    cfg = config(case, model, str(tmp_path))
    model = infinity.offload(model, cfg)
    try:
        ids = torch.randint(0, case.vocab, (case.batch, case.seq), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        stats = infinity.stats(model)
        assert stats["device"] == "cuda"
        assert stats["device_peak_bytes"] <= cfg.device_memory
        # Slots are allocated once: what torch holds beyond the model's buffers
        # is the budgeted slabs (activations of this tiny model are freed by now).
        held = torch.cuda.memory_allocated() - before
        assert held <= cfg.device_memory + (1 << 20), (held, cfg.device_memory)
    finally:
        engine_of(model).close()
