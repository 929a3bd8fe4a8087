"""``offload(model, cfg, init="load")``: nothing is initialised, nothing unset is ever used.

Parameters built under ``init_empty`` stay *unset* until a load writes them.
References: the weights ``transformers`` saved (read back by
``transformers`` itself), and the plain model's own forward.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import infinity


def _empty(llama_config, tied=False):
    with infinity.init_empty():
        return transformers.LlamaForCausalLM(llama_config(tied=tied))


def test_unset_parameters_refuse_every_use_and_name_themselves(offload_config, llama_config):
    model = infinity.offload(_empty(llama_config), offload_config(), init="load")
    ids = torch.randint(0, 64, (1, 8))
    with pytest.raises(infinity.UnsetParameterError, match=r"forward: parameter 'model\.embed"):
        model(input_ids=ids)
    with pytest.raises(infinity.UnsetParameterError, match="init='load'"):
        model.state_dict()
    with pytest.raises(infinity.UnsetParameterError, match="saving a checkpoint"):
        infinity.save_checkpoint("unused", model)


def test_a_load_sets_them_and_a_partial_load_names_what_is_missing(
    tmp_path, offload_config, llama_config
):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(llama_config(tied=False))
    reference.save_pretrained(tmp_path / "ckpt")
    model = infinity.offload(_empty(llama_config), offload_config(), init="load")
    infinity.load_pretrained(model, tmp_path / "ckpt")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, expected)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name

    partial = infinity.offload(_empty(llama_config), offload_config(), init="load")
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    partial.load_state_dict(state, strict=False)
    with pytest.raises(infinity.UnsetParameterError, match=r"'lm_head\.weight'") as err:
        partial(input_ids=ids)
    assert "embed_tokens" not in str(err.value)  # only what was not loaded is named


def test_init_must_be_a_callable_none_or_load(offload_config, llama_config):
    with pytest.raises(ValueError, match="init='zeros'"):
        infinity.offload(_empty(llama_config), offload_config(), init="zeros")
