"""``infinity.save_pretrained`` of a ``peft`` LoRA model writes the merged base model.

The reference is peft's own merge on a model in RAM: a plain ``PeftModel`` given
the offloaded model's values (``load_state_dict(model.state_dict())``), then
``merge_and_unload().state_dict()``. The file must hold the same names and, with
peft's default fp32 adapters, the same bits. Before, the save wrote the peft
names (``base_model.model....base_layer.weight``, the adapters beside them) under
the base model's ``config.json``: ``from_pretrained`` loaded a model of random
weights. peft's ``merge_and_unload()`` on an offloaded model failed inside torch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.optim import CPUAdam
from infinity.pretrained.safetensors_io import PretrainedError

peft = pytest.importorskip("peft")

CASES = {
    # kind, compute dtype, LoRA targets, modules_to_save, steps trained
    "llama-fp32-trained": (
        "llama-untied",
        "fp32",
        ["q_proj", "v_proj", "down_proj"],
        ["lm_head"],
        2,
    ),
    "llama-bf16": ("llama-tied", "bf16", ["q_proj", "o_proj"], None, 0),
    "gpt2-conv1d": ("gpt2", "fp32", ["c_attn", "c_proj"], None, 2),
}


def _lora(kind: str, targets: list[str], modules_to_save: list[str] | None, **extra):
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        modules_to_save=modules_to_save,
        fan_in_fan_out=kind == "gpt2",
        init_lora_weights=False,  # B nonzero: every adapter changes its weight
        **extra,
    )


@pytest.mark.parametrize("case", CASES)
def test_a_lora_model_saves_as_peft_merges_it(tmp_path, make_model, offload_config, case):
    kind, dtype, targets, modules_to_save, steps = CASES[case]
    base = make_model(kind).train()
    if dtype == "bf16":
        base = base.to(torch.bfloat16)  # peft keeps the adapters in fp32
    torch.manual_seed(1)
    lora = _lora(kind, targets, modules_to_save)
    model = infinity.offload(
        peft.get_peft_model(copy.deepcopy(base), lora), offload_config(dtype, chunk_size="24KiB")
    )
    optimizer = CPUAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = peft.get_peft_model(copy.deepcopy(base), lora)
    if steps:  # the trained values; untrained, the adapters as peft made them (fp32)
        reference.load_state_dict(model.state_dict())
    else:
        torch.manual_seed(1)
        reference = peft.get_peft_model(copy.deepcopy(base), lora)
    want = reference.merge_and_unload().state_dict()

    infinity.save_pretrained(model, tmp_path / "merged")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    tied = {"lm_head.weight"} if kind != "llama-untied" else set()
    assert set(got) == set(want) - tied
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    back = infinity.from_pretrained(tmp_path / "merged", offload_config(dtype))  # strict
    merged = {k: v for k, v in back.state_dict().items() if k in want}
    assert all(torch.equal(merged[k], want[k]) for k in got)


def test_what_is_not_merged_is_refused_before_anything_is_written(
    tmp_path, make_model, offload_config
):
    base = make_model("llama-untied")
    lora = _lora("llama", ["q_proj"], None, use_dora=True)
    model = infinity.offload(peft.get_peft_model(base, lora), offload_config())
    with pytest.raises(PretrainedError, match=r"'model\.layers\.0\.self_attn\.q_proj' \(DoRA\)"):
        infinity.save_pretrained(model, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_other_adapters_than_lora_are_refused_before_anything_is_written(
    tmp_path, make_model, offload_config
):
    ia3 = peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    model = infinity.offload(peft.get_peft_model(make_model("llama-untied"), ia3), offload_config())
    with pytest.raises(PretrainedError, match="with IA3 adapters cannot be saved merged"):
        infinity.save_pretrained(model, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_peft_merge_on_an_offloaded_model_is_refused_naming_the_save(
    tmp_path, make_model, offload_config
):
    base = make_model("llama-untied")
    model = infinity.offload(
        peft.get_peft_model(base, _lora("llama", ["q_proj"], None)), offload_config()
    )
    before = model.state_dict()
    for merge in (model.merge_and_unload, model.merge_adapter):
        with pytest.raises(TypeError, match=r"infinity\.save_pretrained\(model, path\)"):
            merge()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
