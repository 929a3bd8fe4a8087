"""``save_pretrained`` replaces its directory atomically and never deletes foreign files.

Checked against the files on disk and ``transformers``' own loader.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import infinity
from infinity.pretrained import safetensors_io


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def offloaded(make_model, offload_config):
    return infinity.offload(make_model("llama-tied"), offload_config())


def test_a_new_save_replaces_an_earlier_one_completely(tmp_path, offloaded):
    out = tmp_path / "out"
    infinity.save_pretrained(offloaded, out, max_shard_size="40KB")
    assert "model.safetensors.index.json" in _names(out)
    infinity.save_pretrained(offloaded, out)
    assert _names(out) == ["config.json", "generation_config.json", "model.safetensors"]
    assert _names(tmp_path) == ["out"]  # no temporary directory left behind
    back = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, value in offloaded.state_dict().items():
        assert torch.equal(back[name], value), name


def test_a_directory_with_other_files_is_left_alone(tmp_path, offloaded):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(infinity.PretrainedError, match="notes.txt"):
        infinity.save_pretrained(offloaded, out)
    assert _names(out) == ["notes.txt"]
    assert _names(tmp_path) == ["mine"]


def test_a_failed_save_keeps_the_previous_one(tmp_path, offloaded, monkeypatch):
    out = tmp_path / "out"
    infinity.save_pretrained(offloaded, out)
    before = {name: (out / name).read_bytes() for name in _names(out)}
    calls = []

    def failing_write(self, name, data):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        self._handle.write(data)

    monkeypatch.setattr(safetensors_io.ShardWriter, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        infinity.save_pretrained(offloaded, out)
    assert {name: (out / name).read_bytes() for name in _names(out)} == before
    assert _names(tmp_path) == ["out"]
