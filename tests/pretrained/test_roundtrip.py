"""Round trips against ``transformers``' own ``save_pretrained`` / ``from_pretrained``.

In: a checkpoint written by ``transformers`` (fp32 or bf16, one file or
shards) loads into an offloaded model whose ``state_dict()`` equals the file's
values in the compute dtype and whose logits equal the plain model's. Out:
``infinity.save_pretrained`` writes what ``transformers`` loads back bit for
bit, under the same tensor names ``transformers`` itself saves.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

import infinity

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB = 300
SMALL_SHARD = "40KB"  # several shards for these models


def _saved_keys(directory) -> set[str]:
    """Tensor names in a saved model directory, read with the safetensors package."""
    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.parametrize("kind", ["llama-tied", "llama-untied", "gpt2"])
@pytest.mark.parametrize("file_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shard", [SMALL_SHARD, "2GB"])
def test_transformers_checkpoint_in_and_out(
    tmp_path, make_model, offload_config, kind, file_dtype, shard
):
    plain = make_model(kind).to(DTYPES[file_dtype])
    source = tmp_path / "hf"
    plain.save_pretrained(source, max_shard_size=shard)
    sharded = (source / "model.safetensors.index.json").exists()
    assert sharded == (shard == SMALL_SHARD)

    model = infinity.from_pretrained(source, offload_config(file_dtype))
    expected = plain.state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name

    # NOTE: the logits reference is the model as transformers itself loads the file
    # (its buffers, e.g. rotary frequencies, stay fp32 in a bf16 model).
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[file_dtype])
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference.eval()(x).logits
        have = model(x).logits
    assert torch.equal(have, want)

    out = tmp_path / "out"
    infinity.save_pretrained(model, out, max_shard_size=shard)
    assert json.loads((out / "config.json").read_text())["model_type"] == plain.config.model_type
    assert _saved_keys(out) == _saved_keys(source)  # same names, tied weight saved once
    assert (out / "model.safetensors.index.json").exists() == sharded
    back = transformers.AutoModelForCausalLM.from_pretrained(out)  # dtype from config.json
    reloaded = back.state_dict()
    assert reloaded.keys() == got.keys()
    for name, value in got.items():
        assert reloaded[name].dtype == value.dtype, name
        assert torch.equal(reloaded[name], value), name


@pytest.mark.parametrize("file_dtype,train_dtype", [("bf16", "fp32"), ("fp32", "bf16")])
def test_dtype_conversion_matches_torch(
    tmp_path, make_model, offload_config, file_dtype, train_dtype
):
    plain = make_model("llama-untied", seed=1).to(DTYPES[file_dtype])
    plain.save_pretrained(tmp_path / "hf")
    model = infinity.from_pretrained(tmp_path / "hf", offload_config(train_dtype))
    got = model.state_dict()
    for name, value in plain.state_dict().items():
        want = value.to(DTYPES[train_dtype]) if value.is_floating_point() else value
        if name.endswith("inv_freq"):
            want = value  # buffers keep the model's own dtype
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name], want), name


def test_bf16_training_keeps_fp32_file_values_as_masters(tmp_path, make_model, offload_config):
    """With 16-bit compute the fp32 masters come from the file itself, not from the
    rounded 16-bit parameters."""
    from infinity.offload import engine_of
    from infinity.runtime.state_access import read_params

    plain = make_model("llama-untied", seed=2)
    plain.save_pretrained(tmp_path / "hf")
    model = infinity.from_pretrained(tmp_path / "hf", offload_config("bf16"))
    engine = engine_of(model)
    expected = dict(plain.named_parameters())
    masters = list(read_params(engine, engine.registry.entries, master=True))
    assert len(masters) == len(expected)
    for entry, value in masters:
        assert value.dtype == torch.float32
        assert torch.equal(value, expected[entry.name].detach()), entry.name


def test_base_model_file_with_legacy_buffers_loads_like_transformers(
    tmp_path, make_model, offload_config
):
    """The original GPT-2 files name tensors without the ``transformer.`` prefix and
    carry causal-mask buffers the model no longer has; transformers loads them."""
    from safetensors.torch import save_file

    plain = make_model("gpt2", seed=4)
    tensors = {k: v.contiguous() for k, v in plain.transformer.state_dict().items()}
    for i in range(plain.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    directory = tmp_path / "legacy"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    plain.config.save_pretrained(directory)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    model = infinity.from_pretrained(directory, offload_config())  # strict
    got = model.state_dict()
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("route", ["from_pretrained", "load_pretrained"])
def test_load_and_save_through_nvme_homes(tmp_path, make_model, offload_config, route):
    """Parameters and fp32 masters homed on NVMe are written through staging slots,
    both when the checkpoint initialises the chunks (``from_pretrained``) and when it
    overwrites an offloaded model (``load_pretrained``)."""
    from infinity.offload import engine_of
    from infinity.runtime.state_access import read_params

    plain = make_model("llama-untied", seed=5)
    plain.save_pretrained(tmp_path / "hf", max_shard_size=SMALL_SHARD)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = offload_config("bf16", host_memory="256KiB", device_memory="160KiB",
                            chunk_size="16KiB", nvme_path=str(nvme))  # fmt: skip
    if route == "from_pretrained":
        model = infinity.from_pretrained(tmp_path / "hf", config)
    else:
        with infinity.init_empty():
            model = transformers.AutoModelForCausalLM.from_config(plain.config)
        model = infinity.offload(model, config, init=model._init_weights)
        assert infinity.load_pretrained(model, tmp_path / "hf") == ([], [], [])
    engine = engine_of(model)
    assert "nvme" in engine.plan.param_home and set(engine.plan.optim_home) == {"nvme"}
    assert infinity.stats(model)["nvme_bytes"] > 0
    expected = dict(plain.named_parameters())
    for entry, value in read_params(engine, engine.registry.entries, master=True):
        assert torch.equal(value, expected[entry.name].detach()), entry.name
    got = model.state_dict()
    for name, value in plain.state_dict().items():
        want = value if name.endswith("inv_freq") else value.to(torch.bfloat16)
        assert torch.equal(got[name], want), name
    infinity.save_pretrained(model, tmp_path / "out", max_shard_size=SMALL_SHARD)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, value in got.items():
        assert torch.equal(back[name], value), name


def test_from_pretrained_reports_and_initialises_missing_weights(
    tmp_path, make_model, offload_config
):
    from safetensors.torch import save_file

    plain = make_model("llama-untied", seed=6)
    directory = tmp_path / "partial"
    directory.mkdir()
    tensors = {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    plain.config.save_pretrained(directory)
    with pytest.raises(infinity.PretrainedError, match="lm_head.weight"):
        infinity.from_pretrained(directory, offload_config())
    model = infinity.from_pretrained(directory, offload_config(), strict=False)
    got = model.state_dict()
    for name, value in tensors.items():
        assert torch.equal(got[name], value), name
    head = got["lm_head.weight"]  # the model's own init (normal, std initializer_range)
    assert abs(head.std().item() - plain.config.initializer_range) < 0.1 * 0.02


def test_the_file_is_read_when_the_optimizer_lays_the_model_out(
    tmp_path, make_model, offload_config
):
    """NOTE [the layout is decided once, late]: ``from_pretrained`` reads nothing until
    the optimizer is constructed, so the homes are planned for that optimizer (Lion's:
    less NVMe than Adam's where the host is small) and still hold the file's values."""
    from infinity.offload import engine_of
    from infinity.optim import CPULion

    plain = make_model("llama-untied", seed=3)
    plain.save_pretrained(tmp_path / "hf")
    pbytes = sum(p.numel() for p in plain.parameters()) * 4
    config = offload_config(
        host_memory=pbytes * 5 // 2,
        # below a slot for every chunk copy: no chunk homed on the device, the states on
        # the host and NVMe (NOTE [chunks homed on the device])
        device_memory=pbytes,
        nvme_path=str(tmp_path / "nvme"),
        chunk_size="16KiB",
    )
    model = infinity.from_pretrained(tmp_path / "hf", config)
    engine = engine_of(model)
    assert not engine.laid_out
    CPULion(model.parameters(), lr=1e-4)
    assert engine.laid_out_by == "the construction of CPULion"
    assert engine.home_plan.nvme_bytes < engine.offload_plan.nvme_bytes
    got = model.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(got[name], value), name
    engine.close()


@pytest.mark.parametrize("what", ["missing", "empty folder"])
def test_from_pretrained_names_a_path_that_holds_no_model(tmp_path, offload_config, what):
    """A missing folder reached transformers' hub check ("Repo id must use alphanumeric
    chars ..."), which says nothing about a local path."""
    path = tmp_path / "model"
    if what == "empty folder":
        path.mkdir()
    expected = "has no config.json" if path.exists() else "is not a directory"
    with pytest.raises(infinity.PretrainedError, match=expected):
        infinity.from_pretrained(path, offload_config("fp32"))
