"""Checkpoints record the optimizer whose state they hold: a resume with the same
optimizer is exact, a load into a model laid out for another one is refused naming both."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import batches, config, param_bytes, tiny_gpt, train

import infinity
from infinity.checkpoint.format import META, dump_meta
from infinity.offload import engine_of
from infinity.optim import CPUSGD, CPUAdafactor, CPUAdam, CPULion

MAKERS = {
    "lion": lambda ps: CPULion(ps, lr=2e-3, weight_decay=0.1),
    "sgd": lambda ps: CPUSGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: CPUAdam(ps, lr=3e-3),
    "adafactor": lambda ps: CPUAdafactor(ps, lr=2e-2, weight_decay=0.01),
}


def _setup(tmp_path, optimizer: str, *, chunk="12KiB", state_dtype="fp32", seed=0):
    model = tiny_gpt(seed=seed)
    pbytes = param_bytes(model, 2)
    (tmp_path / "nvme").mkdir(exist_ok=True)
    cfg = config(
        dtype="bf16",
        device_memory=pbytes * 6 // 10,
        host_memory=pbytes * 4,
        nvme_path=str(tmp_path / "nvme"),
        chunk_size=chunk,
        optimizer_state_dtype=state_dtype,
    )
    model = infinity.offload(model, cfg)
    return model, MAKERS[optimizer](model.parameters())


@pytest.mark.parametrize(
    ("optimizer", "state_dtype"),
    [("lion", "fp32"), ("lion", "int8"), ("sgd", "bf16"), ("adafactor", "fp32")],
)
def test_a_resume_with_the_same_optimizer_is_exact(tmp_path, optimizer, state_dtype):
    data = batches(6, seed=4)
    model, opt = _setup(tmp_path, optimizer, state_dtype=state_dtype)
    straight = train(model, opt, data)
    engine_of(model).close()

    model, opt = _setup(tmp_path, optimizer, state_dtype=state_dtype)
    first = train(model, opt, data[:3])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    meta = json.loads((tmp_path / "ckpt" / META).read_text())
    assert meta["chunk_optimizer"]["name"] == optimizer
    # into another chunk layout: tensors are found by name
    model, opt = _setup(tmp_path, optimizer, chunk="8KiB", state_dtype=state_dtype, seed=7)
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    second = train(model, opt, data[3:])
    assert first + second == straight
    engine_of(model).close()


def test_a_checkpoint_loads_only_into_a_model_laid_out_for_its_optimizer(tmp_path):
    model, opt = _setup(tmp_path, "lion")
    train(model, opt, batches(1))
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    model, opt = _setup(tmp_path, "adam")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(infinity.CheckpointError, match=r"CPULion.*CPUAdam"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    engine_of(model).close()


def test_a_checkpoint_from_before_version_4_holds_adam_state(tmp_path):
    model, opt = _setup(tmp_path, "adam")
    train(model, opt, batches(1))
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    meta = json.loads((tmp_path / "ckpt" / META).read_text())
    del meta["chunk_optimizer"], meta["meta_sha256"]
    meta["version"] = 3
    dump_meta(meta, tmp_path / "ckpt" / META)
    model, opt = _setup(tmp_path, "adam")
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    model, opt = _setup(tmp_path, "sgd")
    with pytest.raises(infinity.CheckpointError, match=r"CPUAdam.*exp_avg_sq.*CPUSGD"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()


def test_an_adafactor_checkpoint_carries_its_factors_and_loads_into_nothing_else(tmp_path):
    """Adafactor's per-tensor states follow the units in optim.bin (offsets in
    meta.json, checked); CPUAdam's model refuses the checkpoint, naming both."""
    model, opt = _setup(tmp_path, "adafactor")
    train(model, opt, batches(2))
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    meta = json.loads((tmp_path / "ckpt" / META).read_text())
    assert meta["optimizer"][0]["hyper"]["eps"] == [None, 1e-3]
    matrix = next(t for t in meta["tensors"] if len(t["shape"]) == 2)
    assert sorted(matrix["tensor_state"]) == ["col_var", "row_var"]
    model, opt = _setup(tmp_path, "adam")
    with pytest.raises(infinity.CheckpointError, match=r"CPUAdafactor.*none.*CPUAdam"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
    # a factor missing from meta.json is refused before anything loads
    del matrix["tensor_state"]["col_var"], meta["meta_sha256"]
    dump_meta(meta, tmp_path / "ckpt" / META)
    model, opt = _setup(tmp_path, "adafactor")
    with pytest.raises(infinity.CheckpointError, match=r"tensor_state.*col_var"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    engine_of(model).close()
