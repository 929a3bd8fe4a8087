"""Gradient chunks come home as exactly what plain PyTorch computed, zeros elsewhere.

Device gradient slots are reused and never cleared up front (only the parts no
gradient overwrote are zeroed, at the flush). These tests start every device
slot as NaN bytes, so any element the engine forgets to zero shows up.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import config
from test_equivalence import Branchy

import infinity
from infinity.chunks.homes import Kind
from infinity.chunks.pieces import read_elements
from infinity.devices.cpu import CpuBackend
from infinity.offload import engine_of


@pytest.fixture
def poisoned_device(monkeypatch):
    """Every device slab starts as 0xFF bytes (NaN in every float dtype)."""
    original = CpuBackend.alloc_device

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        slab = original(self, nbytes)
        slab.fill_(255)
        return slab

    monkeypatch.setattr(CpuBackend, "alloc_device", alloc_device)


def _loss(model, x, y, use_b):
    return torch.nn.functional.cross_entropy(model(x, use_b).reshape(-1, 50), y.reshape(-1))


def _expected_chunk(engine, chunk: int, ref: torch.nn.Module):
    """The chunk built from the reference gradients (each tensor at its slot, zeros
    elsewhere) and the mask of the elements that hold a gradient."""
    ref_grads = dict(ref.named_parameters())
    spec = engine.layout.chunks[chunk]
    expected = torch.zeros(spec.capacity)
    has_grad = torch.zeros(spec.capacity, dtype=torch.bool)
    for entry in engine.chunks.chunk_members[chunk]:
        slot = engine.layout.slots[entry.index]
        grad = ref_grads[entry.name].grad
        if grad is not None:
            expected[slot.offset : slot.offset + slot.numel] = grad.reshape(-1)
            has_grad[slot.offset : slot.offset + slot.numel] = True
    return expected, has_grad


@pytest.mark.parametrize("nvme", [False, True], ids=["host_homes", "nvme_homes"])
@pytest.mark.parametrize("steps", [1, 2], ids=["first_backward", "after_a_step"])
def test_gradient_chunks_hold_reference_gradients_and_zeros(poisoned_device, tmp_path, nvme, steps):
    model = Branchy()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    extra = {"nvme_path": str(tmp_path), "host_memory": "96KiB"} if nvme else {}
    model = infinity.offload(model, config(device_memory="24KiB", chunk_size="4KiB", **extra))
    opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = torch.randint(0, 50, (4, 8), generator=g)
        y = torch.randint(0, 50, (4, 8), generator=g)
        use_b = step % 2 == 1  # the last backward leaves branch b without gradients
        ref_opt.zero_grad()
        _loss(ref, x, y, use_b).backward()
        opt.zero_grad()
        _loss(model, x, y, use_b).backward()
        if step + 1 < steps:
            ref_opt.step()
            opt.step()
    engine = engine_of(model)
    checked = 0
    for chunk in range(engine.layout.num_chunks):
        if not engine.manager.grads.has_grads(chunk):
            continue  # no gradient reached this chunk: its home is not read
        # (in spans when the chunk is oversize: it is never staged whole then)
        capacity = engine.layout.chunks[chunk].capacity
        got = read_elements(engine.manager, Kind.GRAD, chunk, 0, 0, capacity, torch.float32)
        expected, has_grad = _expected_chunk(engine, chunk, ref)
        assert torch.equal(got[~has_grad], torch.zeros(int((~has_grad).sum()))), (
            f"chunk {chunk}: elements without a gradient are not zero"
        )
        # after a step the parameters differ from the reference by fp32 rounding
        tol = 1e-5 if steps == 1 else 1e-3
        torch.testing.assert_close(got[has_grad], expected[has_grad], rtol=tol, atol=tol * 1e-2)
        checked += 1
    assert checked >= 3
    # branch b's bias shares a chunk with used tensors: its range was checked as zeros
    b_bias = next(e for e in engine.registry.entries if e.name == "b.bias")
    assert engine.manager.grads.has_grads(engine.layout.slots[b_bias.index].chunk)
    engine.close()
