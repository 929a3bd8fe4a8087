"""Sharded over two ranks, the last reference to a model frees it at once on each rank
(NOTE [the model owns its engine]): with the garbage collector off, no reference
cycle through the gradients' reduce-scatters, the gathers or the collectives keeps
the model, its engine or its swap file after ``del``."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from engine_helpers import tiny_llama
from harness import run_ranks

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam

pytestmark = pytest.mark.distributed


def _rank_drops(rank: int, folder: str) -> tuple[bool, bool, list[str]]:
    gc.collect()
    gc.disable()
    nvme = os.path.join(folder, str(rank))
    os.makedirs(nvme)
    config = infinity.Config(
        device="cpu", dtype="fp32", device_memory="1MiB", host_memory=400_000,
        chunk_size="16KiB", nvme_path=nvme,
    )  # fmt: skip
    model = infinity.offload(tiny_llama(128, hidden=64, intermediate=128), config)
    optimizer = CPUAdam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert os.listdir(os.path.join(nvme, f"rank-{rank}")), "the states should spill to NVMe"
    engine, dropped = weakref.ref(engine_of(model)), weakref.ref(model)
    del model, optimizer
    # The empty rank-<r> folder stays for the next run, as nvme_path does.
    left = [os.path.relpath(os.path.join(d, n), nvme) for d, dirs, files in os.walk(nvme)
            for n in dirs + files]  # fmt: skip
    return dropped() is None, engine() is None, [p for p in left if p != f"rank-{rank}"]


def test_each_rank_frees_its_model_engine_and_swap_file_at_the_last_reference(tmp_path):
    for rank, (model_freed, engine_freed, left) in enumerate(run_ranks(_rank_drops, str(tmp_path))):
        assert model_freed and engine_freed, f"rank {rank}: a reference cycle keeps them"
        assert left == [], f"rank {rank}: the swap file outlived the model"
