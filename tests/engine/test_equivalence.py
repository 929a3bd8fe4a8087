"""Offloaded training equals plain PyTorch training (torch.optim.AdamW in RAM).

Each case trains the same model on the same batches twice: once plainly, once
through ``infinity.offload`` + ``CPUAdam`` with tight budgets, and compares
the parameters after N steps.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    batches,
    config,
    global_rel_error,
    learnable_batches,
    param_bytes,
    per_tensor_rel_errors,
    reference_pair,
    tiny_gpt,
    tiny_llama,
    train,
)

import infinity
from infinity.optim import CPUAdam

STEPS = 4
TOL = 1e-5  # fp32: FMA-level differences of the fused kernel, amplified a little by training


def _offloaded(model, **cfg):
    return infinity.offload(model, config(**cfg))


def _check_fp32(model, ref):
    err = global_rel_error(model, ref)
    assert err < TOL, f"global relative error {err:.2e}"
    worst = max(per_tensor_rel_errors(model, ref).items(), key=lambda kv: kv[1])
    assert worst[1] < 100 * TOL, f"tensor {worst[0]} off by {worst[1]:.2e}"


@pytest.mark.parametrize(
    "case",
    ["device_below_params", "host_below_states", "grad_accumulation", "checkpointing"],
)
def test_gpt_fp32_matches_torch(case, tmp_path):
    model = tiny_gpt(checkpoint_activations=(case == "checkpointing"))
    ref, ref_opt = reference_pair(model)
    pbytes = param_bytes(model, 4)
    cfg = {"device_memory": pbytes * 6 // 10, "chunk_size": "24KiB"}
    if case == "host_below_states":
        cfg.update(host_memory=pbytes * 2, nvme_path=str(tmp_path))  # states are 4x params
    accum = 2 if case == "grad_accumulation" else 1
    model = _offloaded(model, **cfg)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(STEPS * accum)
    losses = train(model, opt, data, accum=accum)
    ref_losses = train(ref, ref_opt, data, accum=accum)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _check_fp32(model, ref)
    stats = infinity.stats(model)
    assert stats["device_peak_bytes"] <= pbytes * 6 // 10
    if case == "host_below_states":
        assert stats["host_peak_bytes"] <= pbytes * 2
        assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0
        assert stats["placement"]["optim"]["nvme"] > 0


def test_frozen_parameters_stay_put_and_others_match(tmp_path):
    model = tiny_gpt()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    ref, _ = reference_pair(model)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1, foreach=False
    )
    frozen_before = {k: v.clone() for k, v in model.blocks[0].state_dict().items()}
    model = _offloaded(model, device_memory=param_bytes(model, 4) * 6 // 10, chunk_size="24KiB")
    opt = CPUAdam([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    data = batches(STEPS)
    train(model, opt, data)
    train(ref, ref_opt, data)
    _check_fp32(model, ref)
    for k, v in model.blocks[0].state_dict().items():
        assert torch.equal(v, frozen_before[k])


class Branchy(torch.nn.Module):
    """A model whose second branch runs only on even steps (unused parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(50, 32)
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 50)

    def forward(self, x, use_b):
        h = torch.relu(self.a(self.emb(x)))
        if use_b:
            h = h + torch.relu(self.b(h))
        return self.head(h)


def test_branch_unused_in_some_steps_is_skipped_like_torch():
    model = Branchy()
    ref, ref_opt = reference_pair(model)
    model = _offloaded(model, device_memory="32KiB", chunk_size="4KiB")
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    data = [
        (
            torch.randint(0, 50, (4, 8), generator=g),
            torch.randint(0, 50, (4, 8), generator=g),
            s % 2 == 0,
        )
        for s in range(6)
    ]

    def loss_fn(m, batch):
        x, y, use_b = batch
        return torch.nn.functional.cross_entropy(m(x, use_b).reshape(-1, 50), y.reshape(-1))

    train(model, opt, data, loss_fn=loss_fn)
    train(ref, ref_opt, data, loss_fn=loss_fn)
    _check_fp32(model, ref)


def _llama(vocab=128):
    return tiny_llama(vocab, hidden=64, intermediate=128, tie=True)


def test_llama_tied_embeddings_fp32_matches_torch(tmp_path):
    model = _llama()
    ref, ref_opt = reference_pair(model)
    pbytes = param_bytes(model, 4)
    model = _offloaded(
        model,
        device_memory=pbytes // 2,
        host_memory=pbytes * 2,
        nvme_path=str(tmp_path),
        chunk_size="16KiB",
    )
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(STEPS, vocab=128)

    def loss_fn(m, batch):
        x, y = batch
        return m(input_ids=x, labels=y).loss

    losses = train(model, opt, data, loss_fn=loss_fn)
    ref_losses = train(ref, ref_opt, data, loss_fn=loss_fn)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _check_fp32(model, ref)


def _llama_loss(m, batch):
    x, y = batch
    # transformers shifts labels left by one; roll so position t+1 is labelled f(x[t]).
    return m(input_ids=x, labels=torch.roll(y, 1, dims=1)).loss


def _gpt_loss(m, batch):
    return m(*batch)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_16bit_loss_curves_follow_fp32(kind, dtype, tmp_path):
    """bf16/fp16 compute with fp32 masters, states partly on NVMe, tracks fp32 training:
    every step's loss within 2% (GPT) or 3% (Llama) of plain fp32 PyTorch."""
    model = tiny_gpt(seed=1) if kind == "gpt" else _llama(vocab=96)
    loss_fn, tolerance, drop = (_gpt_loss, 0.02, 0.5) if kind == "gpt" else (_llama_loss, 0.03, 0.3)
    ref, ref_opt = reference_pair(model, lr=3e-3)
    pbytes = param_bytes(model, 2)
    model = _offloaded(
        model,
        dtype=dtype,
        device_memory=pbytes // 2,
        host_memory=pbytes * 4,
        nvme_path=str(tmp_path),
        chunk_size="8KiB",
    )
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = learnable_batches(12, seed=2)
    losses = train(model, opt, data, loss_fn=loss_fn, scale=opt.scale_loss)
    ref_losses = train(ref, ref_opt, data, loss_fn=loss_fn)
    assert losses[-1] < losses[0] - drop  # it learns
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) / theirs < tolerance, (losses, ref_losses)
