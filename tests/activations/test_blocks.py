"""Which modules ``activations="checkpoint"`` recomputes, and the errors that name them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity.activations.blocks import CheckpointedBlocks, find_blocks
from infinity.config import ConfigError
from infinity.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def test_a_transformers_model_checkpoints_its_decoder_layers() -> None:
    names = [name for name, _ in find_blocks(_llama())]
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_any_model_checkpoints_its_longest_uniform_module_list() -> None:
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=3, heads=4))
    blocks = find_blocks(model)
    assert len(blocks) == 3 and len({type(m) for _, m in blocks}) == 1


def test_blocks_named_by_module_or_class_and_only_the_outermost() -> None:
    model = _llama()
    assert [n for n, _ in find_blocks(model, ["model.layers.1"])] == ["model.layers.1"]
    # a block and a module inside it: only the block is recomputed
    picked = find_blocks(model, ["LlamaDecoderLayer", "LlamaMLP"])
    assert [n for n, _ in picked] == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_a_name_that_matches_nothing_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="'model.layer.1'"):
        find_blocks(_llama(), ["model.layer.1"])
    with pytest.raises(ConfigError, match="activation_blocks"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_checkpointed_forward_is_undone_on_remove() -> None:
    model = _llama()
    layer = model.model.layers[0]
    wrapped = CheckpointedBlocks(find_blocks(model))
    assert "forward" in layer.__dict__
    wrapped.remove()
    assert "forward" not in layer.__dict__


def test_config_rejects_unknown_policies_and_bad_block_lists() -> None:
    with pytest.raises(ConfigError, match="activations='swap'"):
        infinity.Config(activations="swap")
    with pytest.raises(ConfigError, match="activation_blocks"):
        infinity.Config(activation_blocks="LlamaDecoderLayer")
    with pytest.raises(ConfigError, match="activation_min_bytes"):
        infinity.Config(activation_min_bytes=-1)
    config = infinity.Config(activations="offload", activation_blocks=["a", "b"])
    assert infinity.Config.from_dict(config.to_dict()) == config


def test_generation_under_no_grad_does_not_checkpoint(tmp_path) -> None:
    """Inference through a checkpointed model runs the blocks directly (nothing to save)."""
    torch.manual_seed(0)
    plain = _llama().eval()
    torch.manual_seed(0)
    model = infinity.offload(
        _llama().eval(), infinity.Config(dtype="fp32", activations="checkpoint")
    )
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=4, do_sample=False)
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)
