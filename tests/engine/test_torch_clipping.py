"""torch's own gradient clipping on offloaded parameters equals it on a plain model.

``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` / ``clip_grads_with_norm_``
run unchanged on both models; the reference is the same call on a plain copy's
real gradients (and ``torch.optim.AdamW`` for the steps after clipping).
"""

from __future__ import annotations

import copy

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
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam

GRAD_RTOL = 1e-6  # same kernels on the same fp32 gradients: rounding only


def _assert_grads_match(model, ref):
    ours = infinity.gradients(model)
    theirs = {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
@pytest.mark.parametrize("max_norm", [1e6, 0.05])
def test_clip_grad_norm_matches_plain_model(norm_type, max_norm):
    model, ref = clipping_pair()
    backward_both(model, ref)
    ours = clip_grad_norm_(model.parameters(), max_norm, norm_type)
    theirs = clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    assert type(ours) is torch.Tensor and ours.shape == ()
    assert float(ours) == pytest.approx(float(theirs), rel=GRAD_RTOL)
    clipped = float(theirs) > max_norm
    assert clipped == (max_norm == 0.05)  # both branches are exercised
    _assert_grads_match(model, ref)
    # a second norm sees the clipped gradients, as torch does
    again = get_total_norm([p.grad for p in model.parameters()], norm_type)
    expected = get_total_norm([p.grad for p in ref.parameters()], norm_type)
    assert float(again) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0, 3.0])
def test_norm_and_clip_are_bit_exact_against_torch_on_the_same_values(norm_type):
    """The reference holds the chunks' gradient values in ordinary tensors."""
    model, _ref = clipping_pair()
    gpt_loss(model, batches(1)[0]).backward()
    grads = infinity.gradients(model)
    plain = []
    for name, _param in model.named_parameters():  # torch sums the norms in this order
        p = torch.nn.Parameter(torch.empty_like(grads[name]))
        p.grad = grads[name]
        plain.append((name, p))
    ours = clip_grad_norm_(model.parameters(), 0.05, norm_type)
    theirs = clip_grad_norm_([p for _, p in plain], 0.05, norm_type)
    assert float(ours) == float(theirs)
    clipped = infinity.gradients(model)
    for name, p in plain:
        assert torch.equal(clipped[name], p.grad), name


@pytest.mark.parametrize("foreach", [None, True, False])
def test_get_total_norm_then_clip_grads_with_norm(foreach):
    model, ref = clipping_pair()
    backward_both(model, ref)
    totals = []
    for m in (model, ref):
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        total = get_total_norm(grads, 2.0, foreach=foreach)
        clip_grads_with_norm_(m.parameters(), 0.1, total, foreach=foreach)
        totals.append(float(total))
    assert totals[0] == pytest.approx(totals[1], rel=GRAD_RTOL)
    _assert_grads_match(model, ref)


def test_mixed_offloaded_and_ordinary_parameters_in_one_call():
    model, ref = clipping_pair()
    backward_both(model, ref)
    extra = torch.nn.Parameter(torch.zeros(5))
    extra.grad = torch.linspace(-3.0, 3.0, 5)
    extra_ref = torch.nn.Parameter(torch.zeros(5))
    extra_ref.grad = extra.grad.clone()
    for foreach in (None, True):
        ours = clip_grad_norm_([*model.parameters(), extra], 0.5, foreach=foreach)
        theirs = clip_grad_norm_([*ref.parameters(), extra_ref], 0.5, foreach=foreach)
        assert float(ours) == pytest.approx(float(theirs), rel=GRAD_RTOL)
        torch.testing.assert_close(extra.grad, extra_ref.grad)
    _assert_grads_match(model, ref)


def test_accumulation_after_clipping_scales_only_the_gradient_so_far():
    model, ref = clipping_pair()
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    backward_both(model, ref, 0)
    for m in (model, ref):
        clip_grad_norm_(m.parameters(), 0.05)
    backward_both(model, ref, 1)  # adds to the clipped gradients
    _assert_grads_match(model, ref)
    norms = [float(clip_grad_norm_(m.parameters(), 0.2)) for m in (model, ref)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    opt.step()
    ref_opt.step()
    assert global_rel_error(model, ref) < 1e-6


def test_clip_factor_on_some_tensors_only_reaches_the_step():
    """A factor on one tensor (not a global clip) is written into its chunk before the step."""
    model, ref = clipping_pair()
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    backward_both(model, ref)
    for m in (model, ref):
        m.blocks[1].fc.weight.grad.mul_(0.25)
        clip_grad_norm_(m.parameters(), 0.05)
    _assert_grads_match(model, ref)
    opt.step()
    ref_opt.step()
    assert global_rel_error(model, ref) < 1e-6


def test_error_if_nonfinite_raises_like_torch():
    model, ref = clipping_pair()
    batch = batches(1)[0]
    for m in (model, ref):
        (gpt_loss(m, batch) * float("inf")).backward()
        with pytest.raises(RuntimeError, match="non-finite"):
            clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)


def test_nan_clip_factor_is_refused_at_the_step_not_applied_silently():
    model, _ref = clipping_pair()
    opt = CPUAdam(model.parameters())
    (gpt_loss(model, batches(1)[0]) * float("nan")).backward()
    clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="non-finite gradient norm"):
        opt.step()


def test_training_with_clipping_on_nvme_matches_adamw(tmp_path):
    model, opt, ref, ref_opt = nvme_pair(tmp_path)
    data = batches(4)
    for m, o in ((model, opt), (ref, ref_opt)):
        train(m, o, data, accum=2, before_step=lambda _s, m=m: clip_grad_norm_(m.parameters(), 0.1))
    assert global_rel_error(model, ref) < 1e-5


def test_fp16_norm_is_the_unscaled_gradient_norm():
    """fp16 gradients are loss-scaled in the chunks; the norm is of the true gradient."""
    model, ref = clipping_pair(dtype="fp16")
    opt = CPUAdam(model.parameters())
    batch = batches(1)[0]
    opt.scale_loss(gpt_loss(model, batch)).backward()
    gpt_loss(ref, batch).backward()
    ours = clip_grad_norm_(model.parameters(), 1e6)
    theirs = clip_grad_norm_(ref.parameters(), 1e6)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-2)  # fp16 gradients


def test_overlapped_step_refuses_clipping_loudly():
    """overlap_optimizer=True stepped the chunks during backward: no norm, no silent clip."""
    model, _ref = clipping_pair(overlap_optimizer=True)
    opt = CPUAdam(model.parameters())
    gpt_loss(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="overlap_optimizer=False"):
        clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # the promised step still completes


def test_fp16_training_with_clipping_follows_clipped_fp32_adamw():
    """The clip factor and the inverse loss scale meet in the kernel: fp16 training
    with torch's clip lands near clipped fp32 AdamW, far from unclipped AdamW."""
    base = tiny_gpt()
    data = batches(6)
    refs = {}
    for clip in (True, False):
        ref = copy.deepcopy(base)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        before = (lambda _s, m=ref: clip_grad_norm_(m.parameters(), 0.05)) if clip else None
        train(ref, ref_opt, data, accum=2, before_step=before)
        refs[clip] = ref
    model = infinity.offload(base, config(dtype="fp16", device_memory="256KiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    clip = lambda _s: clip_grad_norm_(model.parameters(), 0.05)  # noqa: E731
    train(model, opt, data, accum=2, scale=opt.scale_loss, before_step=clip)
    apart = global_rel_error(refs[True], refs[False])
    assert global_rel_error(model, refs[True]) < 0.25 * apart  # measured 0.13


def test_zeroed_and_stale_gradients():
    """zero_grad(set_to_none=False) leaves zero gradients (norm 0, as torch); a
    sentinel kept from before zero_grad() refuses to answer instead of inventing one."""
    model, ref = clipping_pair()
    backward_both(model, ref)
    for m in (model, ref):
        m.zero_grad(set_to_none=False)
        assert float(clip_grad_norm_(m.parameters(), 1.0)) == 0.0
    backward_both(model, ref)
    stale = next(model.parameters()).grad
    model.zero_grad()
    with pytest.raises(RuntimeError, match="no gradient"):
        torch.linalg.vector_norm(stale)


def _clipped_run(*, from_device: bool, accum: int = 1, steps: int = 4):
    """Train with clipping at 0.05; ``from_device=False`` drops the norms taken at the
    flush before each clip, so every norm is read from the chunks (the reference)."""
    model = infinity.offload(tiny_gpt(), config(device_memory="256KiB", chunk_size="16KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    grads = engine_of(model).manager.grads

    def clip(step: int) -> None:
        if not from_device:
            grads.norms.clear()
        clip_grad_norm_(model.parameters(), 0.05)

    losses = train(model, opt, batches(steps * accum), accum=accum, before_step=clip)
    return model, losses, engine_of(model).norms.device_hits


def test_norms_taken_on_the_device_equal_the_norms_of_the_chunks():
    """NOTE [gradient norms on the device]: after the first clip the next backward takes
    each chunk's norms at its flush; clipping with them trains bit for bit as with the
    norms read back from the chunks (the same expression on the same values)."""
    ours, losses, hits = _clipped_run(from_device=True)
    ref, ref_losses, ref_hits = _clipped_run(from_device=False)
    assert hits > 0 and ref_hits == 0
    assert losses == ref_losses
    for name, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


def test_accumulated_gradients_are_not_clipped_with_one_micro_batch_norms():
    """Under accumulation a chunk's second flush adds to its home: the norms of the first
    are dropped, and clipping reads the sums (against a plain model clipping its own)."""
    ours, _, hits = _clipped_run(from_device=True, accum=2)
    ref, ref_opt = reference_pair(tiny_gpt(), lr=1e-3, weight_decay=0.1)

    def clip(step: int) -> None:
        clip_grad_norm_(ref.parameters(), 0.05)

    train(ref, ref_opt, batches(8), accum=2, before_step=clip)
    assert hits == 0
    assert global_rel_error(ours, ref) < 1e-6


class _SkipsB(torch.nn.Module):
    """Two linear layers; ``use_b=False`` leaves ``b`` without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if use_b else y


def test_clip_between_micro_batches_when_a_chunk_gets_no_new_gradient():
    """A clip factor written into the chunks at the next backward changes the stored
    values: a chunk that gets no gradient from that micro-batch must not be clipped again
    with the norms taken at its earlier flush (it was, from the second step on)."""
    torch.manual_seed(0)
    model = _SkipsB()
    ref = copy.deepcopy(model)
    cfg = config(device_memory="64KiB", host_memory="1MiB", chunk_size="20KiB")
    model = infinity.offload(model, cfg)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _step in range(3):
        norms = []
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).sum().backward()
            clip_grad_norm_(m.parameters(), 0.5)
            m(2 * x, use_b=False).pow(2).sum().backward()
            norms.append(float(clip_grad_norm_(m.parameters(), 0.5)))
            o.step()
            o.zero_grad()
        assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    assert engine_of(model).norms.device_hits > 0  # the device's norms were used
    assert global_rel_error(model, ref) < 1e-6
