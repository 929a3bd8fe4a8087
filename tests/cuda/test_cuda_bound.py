"""The step's bound on a GPU (``infinity.stats(model)["last_step"]``, runtime/stepping.py).

The references are CUDA events the test records itself around plain PyTorch's
forward and backward of the same model, and the bytes the engine counted: the
device compute of an offloaded step is the GPU's work (not less than plain's,
nor swollen by the waits of a budget a quarter of the parameters), and the link's
seconds turn its bytes into a rate a PCIe or NVLink link can have.
"""

from __future__ import annotations

import copy
import statistics

import torch
from cuda_helpers import needs_cuda

import infinity
from infinity.models.gpt import GPT, GPTConfig, init_weights
from infinity.optim import CPUAdam

pytestmark = needs_cuda

SHAPE = GPTConfig(vocab_size=8192, seq_len=512, layers=6, hidden=1024, heads=16)
BATCH = 8


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(SHAPE)
    model.apply(init_weights)
    return model


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, SHAPE.seq_len)
    return [torch.randint(0, SHAPE.vocab_size, shape, generator=g) for _ in range(n)]


def _plain_compute_seconds(model: GPT) -> float:
    """The median forward + backward of plain PyTorch in bf16 on the GPU (events)."""
    model = copy.deepcopy(model).cuda().to(torch.bfloat16)
    times = []
    for ids in _batches(5):
        ids = ids.cuda()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(ids, ids)
        loss.backward()
        end.record()
        end.synchronize()
        model.zero_grad(set_to_none=True)
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def _lap(model) -> dict:
    """The last step's lap, with what bounded it."""
    stats = infinity.stats(model)
    return {**stats["last_step"], "bound_by": stats["last_step_bound_by"]}


def _laps(model: GPT, device_memory: int) -> list[dict]:
    model = infinity.offload(
        copy.deepcopy(model),
        infinity.Config(device="cuda", dtype="bf16", device_memory=device_memory),
    )
    opt = CPUAdam(model.parameters(), lr=1e-4)
    laps = []
    for ids in _batches(5):
        ids = ids.cuda()
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad()
        laps.append(_lap(model))
    return laps[2:]


def test_device_compute_is_the_gpus_work_and_waits_are_not_in_it() -> None:
    base = _model()
    plain = _plain_compute_seconds(base)
    params = sum(p.numel() for p in base.parameters())
    resident = _laps(base, device_memory=params * 2 * 3)
    # (at least four embedding tables: the largest module's chunks, a gradient's, slack)
    quarter = _laps(
        base, device_memory=max(params * 2 // 4, 4 * SHAPE.vocab_size * SHAPE.hidden * 2)
    )
    resident_compute = statistics.median(lap["device_compute_seconds"] for lap in resident)
    quarter_compute = statistics.median(lap["device_compute_seconds"] for lap in quarter)
    # not less than plain's work (the engine's idle brackets never remove kernels)...
    assert resident_compute >= 0.8 * plain, (resident_compute, plain)
    assert quarter_compute >= 0.8 * plain, (quarter_compute, plain)
    # ... and a quarter budget's waits for its chunks stay out of it
    for lap in quarter:
        assert lap["device_compute_seconds"] <= lap["seconds"]
        assert lap["h2d_bytes"] > 0
        rate = lap["h2d_bytes"] / lap["h2d_seconds"]
        assert 1e9 < rate < 1e12, rate  # bytes/s a host-device link can move
        assert lap["bound_by"] in ("device compute", "host optimizer", "host to device",
                                   "device to host")  # fmt: skip
    assert quarter_compute <= 1.5 * resident_compute + 0.005, (quarter_compute, resident_compute)
