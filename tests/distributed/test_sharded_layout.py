"""Data parallel: the ranks lay their chunks out late, and for the same optimizer.

Two gloo ranks offload one model with a small host budget and construct
``CPUSGD``: both lay out homes planned for it (fewer NVMe bytes than the offload
plan's Adam) and train like plain PyTorch's SGD on the whole batch. Where one
rank reads the model before the other constructs its optimizer, they would lay
out for different units: both raise, naming each rank's reason (NOTE [the
layout is decided once, late]).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_llama
from harness import run_ranks, state_rel_error

import infinity
from infinity.distributed import DistributedError
from infinity.offload import engine_of
from infinity.optim import CPUSGD

pytestmark = pytest.mark.distributed

VOCAB, SEQ, B, STEPS, LR = 128, 16, 2, 3, 0.05


def _model() -> torch.nn.Module:
    return tiny_llama(VOCAB, hidden=64, tie=True)


def _config(nvme: str) -> infinity.Config:
    return infinity.Config(
        device="cpu",
        dtype="fp32",
        device_memory="512KiB",
        host_memory="400KiB",
        nvme_path=nvme,
        chunk_size="32KiB",
    )


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 * B, SEQ), generator=g) for _ in range(STEPS)]


def _sgd(params, cls=CPUSGD, **kw):
    return cls(params, lr=LR, momentum=0.9, weight_decay=0.01, **kw)


def _rank(rank: int, nvme_root: str, reads_first: int | None) -> dict:
    model = infinity.offload(_model(), _config(nvme_root))
    engine = engine_of(model)
    if rank == reads_first:
        try:
            infinity.stats(model)  # lays out for Adam: the other rank is in CPUSGD's
        except DistributedError as exc:
            return {"error": str(exc)}
        return {"error": None}
    try:
        optimizer = _sgd(model.parameters())
    except DistributedError as exc:
        return {"error": str(exc)}
    out = {"before": engine.offload_plan.nvme_bytes, "after": engine.home_plan.nvme_bytes}
    for ids in _batches():
        ids = ids[rank * B : (rank + 1) * B]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # NOTE: collective
    out["state"] = state if rank == 0 else None
    engine.close()
    return out


def _plain() -> dict:
    model = _model()
    optimizer = _sgd(model.parameters(), torch.optim.SGD, foreach=False)
    for ids in _batches():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_both_ranks_lay_out_for_their_optimizer_and_train_like_one_process(tmp_path):
    results = run_ranks(_rank, str(tmp_path), None, timeout=300.0)
    for result in results:
        assert result["after"] < result["before"]
    assert state_rel_error(results[0]["state"], _plain()) < 1e-5


def test_a_rank_that_reads_first_makes_both_raise_naming_the_reasons(tmp_path):
    results = run_ranks(_rank, str(tmp_path), 1, timeout=300.0)
    for result in results:
        message = result["error"]
        assert message is not None and "different optimizers" in message
        assert "the construction of CPUSGD" in message and "a read of its" in message


def _wrap_in_ddp(rank: int) -> str:
    model = infinity.offload(_model(), infinity.Config(device="cpu", dtype="fp32"))
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except TypeError as error:
        return str(error)
    return "wrapped"


def test_wrapping_an_offloaded_model_in_ddp_is_refused_naming_what_to_do():
    """DDP's constructor broadcast rank 0's values into the parameter placeholders and
    failed inside torch ("more than one element of the written-to tensor refers to a single
    memory location"); an offloaded model is data parallel already."""
    for message in run_ranks(_wrap_in_ddp):
        assert "without the DDP wrapper" in message, message
