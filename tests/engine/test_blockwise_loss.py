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


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_blockwise_equals_the_full_loss_and_its_gradients(block):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (3, 40), generator=g)
    targets[0, :11] = IGNORE_INDEX
    full = F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())
    full.backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    ours = blockwise_cross_entropy(hidden, head, targets, block)
    ours.backward()
    assert _close(ours.detach(), full.detach(), 1e-6)
    assert _close(hidden.grad, expected[0]) and _close(head.weight.grad, expected[1])
    with torch.no_grad():  # evaluation: no checkpointing, the same value
        assert _close(blockwise_cross_entropy(hidden, head, targets, block), full.detach(), 1e-6)
    nothing = torch.full_like(targets, IGNORE_INDEX)
    assert blockwise_cross_entropy(hidden, head, nothing, block).item() == 0.0


def test_an_offloaded_gpt_trains_on_the_blockwise_loss_like_the_full_one():
    plain = tiny_gpt(vocab_size=200)
    ours = infinity.offload(copy.deepcopy(plain), config(device_memory="256KiB"))
    ours.loss_block_tokens = 9
    plain.loss_block_tokens = 0  # the full logits
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
