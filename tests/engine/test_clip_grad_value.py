"""``torch.nn.utils.clip_grad_value_`` on offloaded parameters equals it on a plain model.

The reference is the same call on a plain copy's real gradients (and
``torch.optim.AdamW`` for the steps after): bit for bit on the same values, and in
training with gradients on NVMe, under accumulation, beside ``clip_grad_norm_`` in
either order, and with fp16 loss scaling.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    backward_both,
    batches,
    clipping_pair,
    config,
    global_rel_error,
    gpt_loss,
    nvme_pair,
    reference_pair,
    tiny_gpt,
    train,
)
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

import infinity
from infinity.core.names import NVME
from infinity.offload import engine_of
from infinity.optim import CPUAdam

# A bound every dtype holds exactly that clamps about a quarter of the tiny GPT's
# first gradients (so both sides of it are exercised).
VALUE = 2.0**-8


def _assert_grads_equal(model, ref) -> None:
    ours = infinity.gradients(model)
    theirs = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        assert torch.equal(ours[name], grad), name


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_value_is_bit_exact_against_torch(foreach):
    model, ref = clipping_pair()
    backward_both(model, ref)
    clamped = sum(int((p.grad.abs() > VALUE).sum()) for p in ref.parameters())
    assert 0.1 < clamped / sum(p.numel() for p in ref.parameters()) < 0.9
    for m in (model, ref):
        clip_grad_value_(m.parameters(), VALUE, foreach=foreach)
    _assert_grads_equal(model, ref)
    # the norm after sees the clamped values (not the norms taken at the flush)
    norms = [float(clip_grad_norm_(m.parameters(), 1e6)) for m in (model, ref)]
    assert norms[0] == norms[1]


def test_mixed_offloaded_and_ordinary_tensors_in_one_call():
    model, ref = clipping_pair()
    backward_both(model, ref)
    extras = []
    for _ in (model, ref):
        extra = torch.nn.Parameter(torch.zeros(5))
        extra.grad = torch.linspace(-3.0, 3.0, 5)
        extras.append(extra)
    for m, extra in zip((model, ref), extras, strict=True):
        clip_grad_value_([*m.parameters(), extra], 0.5, foreach=True)
    assert torch.equal(extras[0].grad, extras[1].grad)
    assert float(extras[0].grad.abs().max()) == 0.5
    _assert_grads_equal(model, ref)


@pytest.mark.parametrize("order", ["value-then-norm", "norm-then-value"])
def test_beside_clip_grad_norm_in_either_order(order):
    model, ref = clipping_pair()
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        backward_both(model, ref, step)
        for m in (model, ref):
            if order == "value-then-norm":
                clip_grad_value_(m.parameters(), VALUE)
                clip_grad_norm_(m.parameters(), 0.05)
            else:
                clip_grad_norm_(m.parameters(), 0.05)
                clip_grad_value_(m.parameters(), VALUE / 4)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert global_rel_error(model, ref) < 1e-6


def test_clamp_between_micro_batches_then_accumulate():
    """The clamp is in the chunks before the next backward adds to them, as torch's is."""
    model, ref = clipping_pair()
    backward_both(model, ref, 0)
    for m in (model, ref):
        clip_grad_value_(m.parameters(), VALUE)
    backward_both(model, ref, 1)
    torch.testing.assert_close(infinity.gradients(model), {
        name: p.grad for name, p in ref.named_parameters()
    }, rtol=1e-6, atol=1e-9)  # fmt: skip


def test_training_with_gradients_on_nvme_clamps_each_chunk_once(tmp_path):
    model, opt, ref, ref_opt = nvme_pair(tmp_path, host_factor=1.0, chunk_size="8KiB")
    assert infinity.stats(model)["placement"]["grad"][NVME] > 0
    ledger = engine_of(model).ledger
    passes: list[int] = []
    change = ledger._change
    ledger._change = lambda chunk, changes: (passes.append(chunk), change(chunk, changes))[1]

    def clip(_step: int, m=model) -> None:
        passes.clear()
        clip_grad_value_(m.parameters(), VALUE)
        clip_grad_norm_(m.parameters(), 1e6)  # reads them: the clamps are written now
        assert len(passes) == len(set(passes)) > 0  # one pass per chunk, not per tensor

    train(model, opt, batches(6), accum=2, before_step=clip)
    train(ref, ref_opt, batches(6), accum=2, before_step=lambda _s: clip_grad_value_(
        ref.parameters(), VALUE))  # fmt: skip
    assert global_rel_error(model, ref) < 1e-6


def test_fp16_clamps_the_unscaled_gradient():
    """fp16 gradients are loss-scaled in the chunks; the bound is of the true gradient."""
    base = tiny_gpt()
    ref, ref_opt = reference_pair(base, lr=1e-2)
    loose, loose_opt = reference_pair(base, lr=1e-2)  # the same training without the clamp
    model = infinity.offload(base, config(dtype="fp16", device_memory="256KiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(4)
    value = VALUE / 4  # the clamp moves the weights well beyond fp16's own noise (0.011)
    train(ref, ref_opt, data, before_step=lambda _s: clip_grad_value_(ref.parameters(), value))
    clip = lambda _s: clip_grad_value_(model.parameters(), value)  # noqa: E731
    train(model, opt, data, scale=opt.scale_loss, before_step=clip)
    train(loose, loose_opt, data)
    assert global_rel_error(model, ref) < 0.25 * global_rel_error(loose, ref)  # measured 0.18


def test_overlapped_step_refuses_clip_grad_value_loudly():
    model, _ref = clipping_pair(overlap_optimizer=True)
    opt = CPUAdam(model.parameters())
    gpt_loss(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="clip_grad_value_ after a backward"):
        clip_grad_value_(model.parameters(), VALUE)
    opt.step()


def test_zeroed_gradients_stay_zero_and_a_bound_past_zero_is_refused():
    model, ref = clipping_pair()
    backward_both(model, ref)
    for m in (model, ref):
        m.zero_grad(set_to_none=False)
        clip_grad_value_(m.parameters(), VALUE)
        assert float(clip_grad_norm_(m.parameters(), 1.0)) == 0.0
    with pytest.raises(RuntimeError, match="zeroed gradient"):
        next(model.parameters()).grad.clamp_(min=1.0)
