"""Checkpoints: streamed, atomic, pickle-free, and an exact resume."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import batches, config, param_bytes, tiny_gpt, train

import infinity
from infinity.optim import CPUAdam


def _setup(tmp_path, dtype="bf16", chunk="12KiB", seed=0):
    model = tiny_gpt(seed=seed)
    pbytes = param_bytes(model, 2)
    model = infinity.offload(
        model,
        config(
            dtype=dtype,
            device_memory=pbytes * 6 // 10,
            host_memory=pbytes * 4,
            nvme_path=str(tmp_path / "nvme"),
            chunk_size=chunk,
        ),
    )
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    return model, opt


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    (tmp_path / "nvme").mkdir()
    data = batches(8, seed=4)
    model, opt = _setup(tmp_path)
    straight = train(model, opt, data)

    model, opt = _setup(tmp_path)
    first = train(model, opt, data[:4])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    del model, opt
    # resume into a *different* chunk layout: tensors are found by name
    model, opt = _setup(tmp_path, chunk="8KiB", seed=123)
    opt.param_groups[0]["lr"] = 1.0  # restored from the checkpoint
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert opt.param_groups[0]["lr"] == 3e-3
    second = train(model, opt, data[4:])
    assert first + second == straight


def test_state_dict_has_real_values_and_load_state_dict_writes_chunks(tmp_path):
    (tmp_path / "nvme").mkdir()
    plain = tiny_gpt()
    expected = {k: v.to(torch.bfloat16) for k, v in plain.state_dict().items()}
    model, _ = _setup(tmp_path)
    sd = model.state_dict()
    assert sd.keys() == expected.keys()
    for k in sd:
        assert torch.equal(sd[k], expected[k]), k
    other = {k: torch.randn_like(v.float()) for k, v in expected.items()}
    other["head.weight"] = other["wte.weight"]  # tied: one tensor under two names
    result = model.load_state_dict(other)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in model.state_dict().items():
        assert torch.equal(v, other[k].to(torch.bfloat16)), k


def test_checkpoint_files_are_plain_and_corruption_is_detected(tmp_path):
    (tmp_path / "nvme").mkdir()
    model, opt = _setup(tmp_path)
    train(model, opt, batches(2))
    path = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["meta.json", "optim.bin", "param.bin"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == "infinity-checkpoint"
    # the parameter file holds exactly the bf16 bytes of each tensor
    raw = (path / "param.bin").read_bytes()
    sd = model.state_dict()
    for t in meta["tensors"]:
        n = sd[t["name"]].numel()
        stored = torch.frombuffer(
            bytearray(raw[t["param_offset"] : t["param_offset"] + 2 * n]), dtype=torch.bfloat16
        )
        assert torch.equal(stored, sd[t["name"]].reshape(-1))
    with open(path / "optim.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(infinity.CheckpointError, match="CRC"):
        infinity.load_checkpoint(path, model, opt)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "nvme").mkdir()
    model, opt = _setup(tmp_path)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    before = (tmp_path / "ckpt" / "param.bin").read_bytes()
    train(model, opt, batches(1))

    from infinity.checkpoint import temporaries

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(temporaries, "replace_dir", boom)
    with pytest.raises(KeyboardInterrupt):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert (tmp_path / "ckpt" / "param.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "nvme"]


def test_mismatched_model_is_refused(tmp_path):
    (tmp_path / "nvme").mkdir()
    model, opt = _setup(tmp_path)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    other = infinity.offload(tiny_gpt(hidden=64), config(dtype="bf16", device_memory="1MiB"))
    with pytest.raises(infinity.CheckpointError, match="shape"):
        infinity.load_checkpoint(tmp_path / "ckpt", other)


def test_replacing_a_checkpoint_never_leaves_the_path_missing(tmp_path, monkeypatch):
    import os

    from infinity.checkpoint import temporaries

    for exchange in (True, False):
        new, target = tmp_path / f"new{exchange}", tmp_path / f"ckpt{exchange}"
        new.mkdir()
        target.mkdir()
        (new / "f").write_text("new")
        (target / "f").write_text("old")
        if not exchange:
            monkeypatch.setattr(temporaries, "_exchange", lambda a, b: False)
            real_rename, calls = os.rename, []

            def flaky_rename(a, b, calls=calls, real_rename=real_rename):
                calls.append(a)
                if len(calls) == 2:  # interrupted between moving the old one aside and the new in
                    raise KeyboardInterrupt
                real_rename(a, b)

            monkeypatch.setattr(temporaries.os, "rename", flaky_rename)
            with pytest.raises(KeyboardInterrupt):
                temporaries.replace_dir(new, target)
            monkeypatch.setattr(temporaries.os, "rename", real_rename)
            assert (target / "f").read_text() == "old"  # rolled back, not missing
        temporaries.replace_dir(new, target)
        assert (target / "f").read_text() == "new"
        assert not new.exists()
