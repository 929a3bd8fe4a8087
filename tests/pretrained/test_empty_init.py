"""``infinity.init_empty`` and meta buffers: real values or a clear error, never garbage.

The reference for every value is the same ``transformers`` model built normally.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import infinity

ROTARY = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf in model.named_buffers()}


def test_init_empty_puts_parameters_on_meta_and_computes_buffers(llama_config):
    reference = transformers.LlamaForCausalLM(llama_config(tied=True))
    with infinity.init_empty():
        model = transformers.LlamaForCausalLM(llama_config(tied=True))
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives
    expected = _buffers(reference)
    assert set(expected) >= set(ROTARY)
    for name, buf in model.named_buffers():
        assert not buf.is_meta, name
        assert torch.equal(buf, expected[name]), name


def test_offloaded_llama_from_init_empty_keeps_rotary_frequencies(offload_config, llama_config):
    reference = transformers.LlamaForCausalLM(llama_config(tied=False))
    with infinity.init_empty():
        model = transformers.LlamaForCausalLM(llama_config(tied=False))
    model = infinity.offload(model, offload_config(), init=model._init_weights)
    expected = _buffers(reference)
    for name in ROTARY:
        assert torch.equal(model.get_buffer(name), expected[name]), name


def test_bare_meta_route_names_each_unfilled_buffer_and_the_fix(offload_config, llama_config):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(tied=True))

    def weights_only(module: nn.Module) -> None:  # fills parameters, not buffers
        for p in module.parameters(recurse=False):
            nn.init.normal_(p, std=0.02)

    with pytest.raises(ValueError) as err:
        infinity.offload(model, offload_config(), init=weights_only)
    message = str(err.value)
    for name in ROTARY:
        assert name in message
    assert "infinity.init_empty()" in message


def test_bare_meta_route_with_a_filling_init_gives_the_real_values(offload_config, llama_config):
    """``transformers``' own ``_init_weights`` recomputes rotary buffers: it now runs on
    modules that own meta buffers, so the bare route gives correct values too."""
    reference = transformers.LlamaForCausalLM(llama_config(tied=True))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(tied=True))
    model = infinity.offload(model, offload_config(), init=model._init_weights)
    for name in ROTARY:
        assert torch.equal(model.get_buffer(name), reference.get_buffer(name)), name


def test_default_init_fails_before_allocating_for_a_buffer_nothing_can_fill(offload_config):
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("scale", torch.arange(4.0))

        def forward(self, x):
            return self.linear(x) * self.scale

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match=r"scale\b.*infinity.init_empty"):
        infinity.offload(model, offload_config())
    with infinity.init_empty():
        model = Scaled()
    model = infinity.offload(model, offload_config())
    assert torch.equal(model.scale, torch.arange(4.0))


def test_init_empty_restores_module_registration_after_an_error():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), infinity.init_empty():
        with infinity.init_empty():  # nested
            nn.Linear(2, 2)
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta


def test_a_transformers_model_gets_its_own_initialisation_by_default(offload_config, llama_config):
    """Issue 28: no init= needed for a PreTrainedModel built under init_empty; the
    reference is what transformers' own construction gives (same distributions:
    normal(0, initializer_range) matrices, ones in the RMSNorms)."""
    cfg = llama_config(tied=False)
    reference = transformers.LlamaForCausalLM(cfg)
    with infinity.init_empty():
        model = transformers.LlamaForCausalLM(cfg)
    model = infinity.offload(model, offload_config())
    ours = model.state_dict()
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        value = ours[name]
        assert value.isfinite().all(), name
        if "norm" in name:
            assert torch.equal(value, ref), name  # deterministic: ones
        elif ref.dim() == 2:
            assert abs(value.std().item() - ref.std().item()) < 0.25 * ref.std().item(), name
            assert not torch.equal(value, torch.zeros_like(value)), name
    for name in ROTARY:
        assert torch.equal(model.get_buffer(name), reference.get_buffer(name)), name
