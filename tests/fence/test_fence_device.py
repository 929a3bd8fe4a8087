"""The fence device itself: it fails where CUDA fails, and computes what the CPU computes.

The references are plain PyTorch on the CPU (the same model and optimizer) and
the error messages CUDA gives for the same mistakes.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from engine_helpers import batches, gpt_loss, tiny_gpt

import infinity
from infinity.devices.fence import FenceBackend
from infinity.io import aligned_empty

FENCE = torch.device("fence", 0)
SAME_DEVICE = "Expected all tensors to be on the same device"


def test_plain_training_on_the_fence_equals_the_cpu_bit_for_bit():
    cpu = tiny_gpt()
    dev = copy.deepcopy(cpu).to(FENCE)
    assert all(p.device == FENCE for p in dev.parameters())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (cpu, dev)]
    for x, y in batches(3):
        for model, opt, where in ((cpu, opts[0], "cpu"), (dev, opts[1], FENCE)):
            gpt_loss(model, (x.to(where), y.to(where))).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize(
    "mistake",
    [
        pytest.param(lambda w, x: torch.nn.functional.embedding(x, w), id="host-index"),
        pytest.param(lambda w, x: w @ x.float().view(-1, 1).expand(-1, w.shape[1]), id="matmul"),
        pytest.param(lambda w, x: torch.cat([w, torch.zeros(1, w.shape[1])]), id="cat"),
        pytest.param(lambda w, x: w + torch.ones(w.shape), id="add"),
    ],
)
def test_a_host_tensor_meeting_device_compute_fails_as_on_cuda(mistake):
    weight = torch.randn(8, 8, device=FENCE)
    index = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    with pytest.raises(RuntimeError, match=SAME_DEVICE) as info:
        mistake(weight, index)
    assert "fence:0" in str(info.value) and "infinity.device_of(model)" in str(info.value)


def test_what_cuda_accepts_from_the_host_the_fence_accepts():
    """0-dim host tensors are scalars to CUDA's kernels; host indices index."""
    x = torch.arange(6.0, device=FENCE)
    assert torch.equal((x * torch.tensor(2.0)).cpu(), torch.arange(6.0) * 2)
    assert torch.equal(x[torch.tensor([1, 3])].cpu(), torch.tensor([1.0, 3.0]))
    assert x.to("cpu").device.type == "cpu" and x.cpu().sum().item() == 15.0


def test_a_device_tensor_reaching_host_code_is_refused(tmp_path):
    """The native kernels and the I/O engine take host tensors only, as with CUDA."""
    from infinity.io import SwapFile

    with pytest.raises((TypeError, ValueError), match="fence"):
        torch.zeros(4, device=FENCE).numpy()
    params = [torch.nn.Parameter(torch.randn(16, device=FENCE))]
    params[0].grad = torch.randn(16, device=FENCE)
    with pytest.raises((ValueError, TypeError), match="fence"):
        infinity.optim.CPUAdam(params, lr=1e-3).step()
    with SwapFile(tmp_path, 1 << 20) as swap, pytest.raises(ValueError, match="fence"):
        swap.write(torch.zeros(4096, dtype=torch.uint8, device=FENCE), 0)
    backend = FenceBackend()
    try:
        with pytest.raises(ValueError, match="host and device"):
            backend.copy_async(torch.empty(8, device=FENCE), torch.empty(8, device=FENCE))
    finally:
        backend.close()


def test_views_share_storage_and_copies_cross_the_boundary_exactly():
    backend = FenceBackend()
    try:
        slab = backend.alloc_device(1 << 16)
        assert slab.device == FENCE and slab.data_ptr() % 4096 == 0
        view = slab[4096:8192].view(torch.float32).view(32, 32)
        assert view.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
        alias = backend.alias(slab[:4096])
        assert alias.device == FENCE and alias.data_ptr() == slab.data_ptr()
        assert alias.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
        assert alias.untyped_storage()._cdata != slab.untyped_storage()._cdata
        host = aligned_empty(4096, pinned=False)
        host.copy_(torch.arange(4096, dtype=torch.int32).to(torch.uint8))
        backend.copy_async(slab[8192:12288], host).wait()
        back = aligned_empty(4096, pinned=False)
        backend.copy_async(back, slab[8192:12288]).wait()
        assert torch.equal(back, host)
    finally:
        backend.close()


def test_the_allocator_counts_device_bytes(fence_native):
    before = fence_native.memory_allocated()
    x = torch.empty(1 << 20, dtype=torch.uint8, device=FENCE)
    assert fence_native.memory_allocated() - before >= 1 << 20
    del x
    assert fence_native.memory_allocated() == before


def test_device_of_names_the_engine_device_and_offloading_computes_there(tmp_path):
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    cfg = infinity.Config(device="fence", dtype="fp32", device_memory="256KiB", chunk_size="64KiB")
    model = infinity.offload(model, cfg)
    assert infinity.device_of(model) == FENCE
    assert infinity.device_of(ref) == torch.device("cpu")
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        gpt_loss(model, (x, y))  # inputs left on the host, as a GPU would refuse them
    loss = gpt_loss(model, (x.to(FENCE), y.to(FENCE)))
    assert loss.device == FENCE
    assert loss.item() == gpt_loss(ref, (x, y)).item()


def test_the_device_budget_bounds_what_the_engine_holds_on_the_device(fence_native, tmp_path):
    """Measured by the device's own allocator, as tests/cuda measures torch's on a GPU:
    after a step (its activations freed) the engine holds at most ``device_memory``."""
    from infinity.offload import engine_of

    before = fence_native.memory_allocated()
    cfg = infinity.Config(device="fence", dtype="fp32", device_memory="192KiB", chunk_size="32KiB")
    model = infinity.offload(tiny_gpt(), cfg)
    try:
        opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
        for x, y in batches(2):
            gpt_loss(model, (x.to(FENCE), y.to(FENCE))).backward()
            opt.step()
            opt.zero_grad()
        held = fence_native.memory_allocated() - before
        assert infinity.stats(model)["device_peak_bytes"] <= cfg.device_memory
        assert 0 < held <= cfg.device_memory + (16 << 10), (held, cfg.device_memory)
    finally:
        engine_of(model).close()
    del model, opt
    gc.collect()
    assert fence_native.memory_allocated() - before <= 16 << 10  # a dropped model gives it back


def test_the_blockwise_loss_never_holds_the_full_logits(fence_native):
    """Measured by the device's allocator: a step's peak with the loss taken a block
    of tokens at a time (models/losses.py) against the full fp32 logits."""
    from infinity.models.losses import blockwise_cross_entropy

    tokens, vocab = 1024, 4096
    full_logits = tokens * vocab * 4  # 16 MiB
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 64, generator=g).to(FENCE).requires_grad_()
    head = torch.nn.Linear(64, vocab, bias=False).to(FENCE)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(FENCE)
    peaks = {}
    for kind in ("full", "blocks"):
        base = fence_native.memory_allocated()
        fence_native.reset_peak_memory_stats()
        if kind == "full":
            loss = torch.nn.functional.cross_entropy(head(hidden).float(), targets)
        else:
            loss = blockwise_cross_entropy(hidden, head.weight, targets, block_tokens=64)
        loss.backward()
        peaks[kind] = fence_native.max_memory_allocated() - base
        hidden.grad, head.weight.grad = None, None
    assert peaks["full"] >= full_logits
    assert peaks["blocks"] * 8 <= peaks["full"], peaks  # 11x less measured
