"""Data parallel (issue 19): chunks sharded over 2 gloo ranks train like one process.

2 ranks x batch B against plain PyTorch x batch 2B (``torch.optim.AdamW``,
single-tensor). The tolerance is measured in the same test from two sources of
noise that have nothing to do with infinity: torch's fused against its
single-tensor AdamW, and data-parallel arithmetic itself (plain torch with the
gradients of the two half batches averaged, as DDP computes them, against the
whole batch). Adam turns rounding-level gradient differences into visible
parameter differences, so the second is the larger.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_llama
from harness import run_ranks, state_rel_error

import infinity
from infinity.core.names import HOST, NVME
from infinity.offload import engine_of
from infinity.optim import CPUAdam

pytestmark = pytest.mark.distributed

VOCAB, SEQ, B, STEPS, LR = 128, 16, 2, 3, 1e-2
NOISE_MULTIPLE = 4
# name -> (NVMe, micro-batches per step, clip norm, overlap_optimizer)
CASES = {
    "host": (False, 1, 0.0, False),
    "nvme+accumulation": (True, 2, 0.0, False),
    "nvme+clipping": (True, 1, 1.0, False),
    "nvme+overlap": (True, 1, 0.0, True),
}


def _model() -> torch.nn.Module:
    return tiny_llama(VOCAB, hidden=64, tie=True)  # tied embedding and head


def _config(nvme: str | None, overlap: bool = False) -> infinity.Config:
    return infinity.Config(
        device="cpu",
        dtype="fp32",
        device_memory="512KiB",
        host_memory="400KiB" if nvme else "64MiB",
        nvme_path=nvme,
        chunk_size="32KiB",
        overlap_optimizer=overlap,
    )


def _batches(accumulation: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 * B, SEQ), generator=g) for _ in range(STEPS * accumulation)]


def _train(model, optimizer, batches, accumulation, clip, part=None) -> list[float]:
    """Train; ``part=(rank, world)`` feeds that rank its slice of every batch."""
    losses = []
    for step in range(STEPS):
        for micro in range(accumulation):
            ids = batches[step * accumulation + micro]
            if part is not None:
                rank, world = part
                size = ids.shape[0] // world
                ids = ids[rank * size : (rank + 1) * size]
            loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
            losses.append(float(loss))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _rank_cases(rank: int, nvme_root: str) -> dict[str, dict]:
    out = {}
    for name, (nvme, accumulation, clip, overlap) in CASES.items():
        model = infinity.offload(_model(), _config(nvme_root if nvme else None, overlap))
        optimizer = CPUAdam(model.parameters(), lr=LR, weight_decay=0.1)
        _train(model, optimizer, _batches(accumulation), accumulation, clip, part=(rank, 2))
        engine = engine_of(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out[name] = {
            "state": state if rank == 0 else None,
            "home_bytes": engine.plan.home_bytes(NVME) + engine.plan.home_bytes(HOST),
            "nvme_written": engine.manager.traffic.nvme_write_bytes,
            "sent": engine.collectives.bytes_sent,
        }
        engine.close()
    return out


def _plain(
    accumulation: int, clip: float, *, fused: bool = False, halves: bool = False, steps=STEPS
):
    """Plain PyTorch on the whole batch (``halves``: the mean of the half batches'
    gradients, as two data-parallel ranks compute it) for ``steps`` steps."""
    model = _model()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=0.1, fused=fused or None, foreach=False
    )
    batches = _batches(accumulation)
    for step in range(steps):
        for micro in range(accumulation):
            ids = batches[step * accumulation + micro]
            parts = [ids[:B], ids[B:]] if halves else [ids]
            for part in parts:
                loss = model(input_ids=part, labels=part).loss / accumulation / len(parts)
                loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict[str, dict]]:
    root = tmp_path_factory.mktemp("nvme")
    return run_ranks(_rank_cases, str(root), timeout=300.0)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_like_one_process_with_twice_the_batch(trained, name):
    _nvme, accumulation, clip, _overlap = CASES[name]
    ref = _plain(accumulation, clip)
    gap = max(
        state_rel_error(_plain(accumulation, clip, fused=True), ref),
        state_rel_error(_plain(accumulation, clip, halves=True), ref),
    )
    error = state_rel_error(trained[0][name]["state"], ref)
    assert error <= NOISE_MULTIPLE * gap, (name, error, gap)
    # NOTE: the bound must be able to fail: a skipped or stale update (what one
    # step moves the parameters) lands far outside it. Measured, not a fixed
    # fraction of LR: the noise depends on the CPU's kernels (AVX2 machines
    # measure about 2.7e-6, above the 1e-3 x LR this once used).
    one_step = state_rel_error(_plain(accumulation, clip, steps=STEPS - 1), ref)
    assert NOISE_MULTIPLE * gap < 0.01 * one_step, (gap, one_step)


def test_each_rank_keeps_half_the_states_and_writes_half_the_bytes(trained, tmp_path):
    for name, (nvme, accumulation, clip, overlap) in CASES.items():
        model = infinity.offload(_model(), _config(str(tmp_path) if nvme else None, overlap))
        engine = engine_of(model)
        whole = engine.plan.home_bytes(NVME) + engine.plan.home_bytes(HOST)
        for rank in range(2):
            assert 0.45 * whole <= trained[rank][name]["home_bytes"] <= 0.6 * whole, name
            assert trained[rank][name]["sent"] > 0
        if name == "nvme+accumulation":
            optimizer = CPUAdam(model.parameters(), lr=LR, weight_decay=0.1)
            _train(model, optimizer, _batches(accumulation), accumulation, clip)
            single = engine.manager.traffic.nvme_write_bytes
            for rank in range(2):
                assert trained[rank][name]["nvme_written"] <= 0.6 * single, (rank, single)
