"""The loss a block of tokens at a time (``infinity/models/losses.py``) is the full loss.

References: ``F.cross_entropy`` over the full logits (plain PyTorch), and a
``transformers`` model's own loss (``model(input_ids, labels=...)``), on plain and on
offloaded models. The same loss to fp32 rounding, the same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import config, tiny_gpt, tiny_llama

import infinity
from infinity.models.losses import IGNORE_INDEX, blockwise_cross_entropy, causal_lm_loss
from infinity.offload import engine_of

transformers = pytest.importorskip("transformers")


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rtol * b.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_blockwise_equals_the_full_loss_and_its_gradients(block, dtype):
    """Also in bf16: each block's gradient rounds where the full one does, and the
    weight's is summed over the blocks in fp32 and rounded once."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 16, generator=g).to(dtype).requires_grad_()
    head = torch.nn.Linear(16, 50).to(dtype)
    targets = torch.randint(0, 50, (3, 40), generator=g)
    targets[0, :11] = IGNORE_INDEX
    full = F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())
    full.backward()
    expected = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
    hidden.grad = head.weight.grad = head.bias.grad = None
    ours = blockwise_cross_entropy(hidden, head.weight, targets, block, bias=head.bias)
    ours.backward()
    rtol = 1e-5 if dtype == torch.float32 else 2**-8  # one rounding of the compute dtype
    assert _close(ours.detach(), full.detach(), 1e-6)
    for got, want in zip((hidden.grad, head.weight.grad, head.bias.grad), expected, strict=True):
        assert _close(got.float(), want.float(), rtol)
    nothing = torch.full_like(targets, IGNORE_INDEX)
    assert blockwise_cross_entropy(hidden, head.weight, nothing, block).item() == 0.0


def test_bf16_blockwise_gradients_are_as_close_as_the_full_ones_to_exact():
    """Against float64: the blockwise weight gradient is no further from exact than the
    full loss's own bf16 gradient (summing bf16 blocks was 2-7x further in the sweep)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(512, 64, generator=g)
    weight = torch.randn(96, 64, generator=g) * 0.1
    targets = torch.randint(0, 96, (512,), generator=g)

    def weight_grad(dtype: torch.dtype, block: int | None) -> torch.Tensor:
        h, w = hidden.to(dtype), weight.to(dtype).requires_grad_()
        if block is None:
            F.cross_entropy(F.linear(h, w).float(), targets).backward()
        else:
            blockwise_cross_entropy(h, w, targets, block).backward()
        return w.grad.double()

    exact = weight_grad(torch.float64, None)
    full = (weight_grad(torch.bfloat16, None) - exact).norm()
    blocks = (weight_grad(torch.bfloat16, 16) - exact).norm()
    assert blocks <= 1.5 * full, (float(blocks), float(full))


def test_an_offloaded_gpt_trains_on_the_blockwise_loss_like_the_full_one():
    plain = tiny_gpt(vocab_size=200)
    ours = infinity.offload(copy.deepcopy(plain), config(device_memory="256KiB"))
    ours.head.loss_block_tokens = 9
    plain.head.loss_block_tokens = 0  # the full logits
    try:
        g = torch.Generator().manual_seed(3)
        x, y = (torch.randint(0, 200, (2, 32), generator=g) for _ in range(2))
        loss, ref = ours(x, y), plain(x, y)
        assert _close(loss.detach(), ref.detach(), 1e-6)
        loss.backward()
        ref.backward()
        grads = infinity.gradients(ours)
        for name, p in plain.named_parameters():
            assert _close(grads[name], p.grad), name
    finally:
        engine_of(ours).close()


@pytest.mark.parametrize("block", [None, 5])
@pytest.mark.parametrize("offloaded", [False, True], ids=["plain", "offloaded"])
def test_causal_lm_loss_is_the_transformers_loss(block, offloaded, tmp_path):
    base = tiny_llama(vocab=128, tie=True)
    model = copy.deepcopy(base)
    if offloaded:
        model = infinity.offload(model, config(device_memory="96KiB", chunk_size="16KiB"))
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 128, (2, 12), generator=g)
        labels = ids.clone()
        labels[1, :4] = IGNORE_INDEX
        targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # as transformers shifts
        expected = base(input_ids=ids, labels=labels).loss
        expected.backward()
        loss = causal_lm_loss(model, ids, targets, block_tokens=block)
        assert _close(loss.detach(), expected.detach(), 1e-6)
        loss.backward()
        grads = infinity.gradients(model) if offloaded else dict(
            (n, p.grad) for n, p in model.named_parameters()
        )  # fmt: skip
        for name, p in base.named_parameters():
            assert _close(grads[name], p.grad), name
    finally:
        if offloaded:
            engine_of(model).close()


def test_causal_lm_loss_finds_the_model_inside_a_peft_wrapper():
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(
        tiny_llama(vocab=128), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    targets = F.pad(ids, (0, 1), value=IGNORE_INDEX)[:, 1:]
    expected = model(input_ids=ids, labels=ids).loss
    assert _close(causal_lm_loss(model, ids, targets, block_tokens=3).detach(), expected.detach())


def test_a_model_that_transforms_its_logits_is_refused():
    """Gemma 2 soft-caps its logits after the output embedding."""
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="transforms its logits"):
        causal_lm_loss(model, ids, ids, block_tokens=4)
