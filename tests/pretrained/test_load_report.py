"""``load_pretrained``'s key report against ``nn.Module.load_state_dict`` on the plain model.

Checkpoints are written with ``safetensors.torch.save_file``; the expected
missing / unexpected keys are what torch reports for the same tensors.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import infinity


class Net(nn.Module):
    """Two layers, a persistent buffer and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.second(torch.relu(self.first(x))) * self.scale


def _plain(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _offloaded(offload_config, seed: int = 0) -> nn.Module:
    return infinity.offload(_plain(seed), offload_config())


def _file(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_full_checkpoint_loads_params_and_persistent_buffers(tmp_path, offload_config):
    source = _plain(1).state_dict()
    source["scale"] = torch.arange(4.0)
    model = _offloaded(offload_config)
    result = infinity.load_pretrained(model, _file(tmp_path, source))
    assert result == ([], [], [])
    got = model.state_dict()
    for name, value in source.items():
        assert torch.equal(got[name], value), name


def test_non_strict_report_equals_torch_and_loads_the_rest(tmp_path, offload_config):
    source = _plain(1).state_dict()
    del source["second.bias"], source["scale"]
    source["extra.weight"] = torch.zeros(2)
    plain = _plain(0)
    torch_result = plain.load_state_dict(dict(source), strict=False)
    model = _offloaded(offload_config)
    result = infinity.load_pretrained(model, _file(tmp_path, source), strict=False)
    assert sorted(result.missing_keys) == sorted(torch_result.missing_keys)
    assert sorted(result.unexpected_keys) == sorted(torch_result.unexpected_keys)
    assert result.mismatched_keys == []
    got, want = model.state_dict(), plain.state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_strict_raises_names_every_key_and_changes_nothing(tmp_path, offload_config):
    source = _plain(1).state_dict()
    del source["first.bias"]
    source["stray"] = torch.zeros(1)
    source["second.weight"] = torch.zeros(5, 16)  # mis-shaped
    with pytest.raises(RuntimeError) as torch_err:
        _plain(0).load_state_dict(dict(source), strict=True)
    model = _offloaded(offload_config)
    before = model.state_dict()
    path = _file(tmp_path, source)
    with pytest.raises(infinity.PretrainedError) as err:
        infinity.load_pretrained(model, path)
    for key in ("first.bias", "stray", "second.weight"):
        assert key in str(torch_err.value)  # torch reports the same three keys
        assert key in str(err.value)
    assert "strict=False" in str(err.value)
    after = model.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    # non-strict: the mis-shaped tensor is reported and skipped, the rest loaded
    result = infinity.load_pretrained(model, path, strict=False)
    assert result.missing_keys == ["first.bias"]
    assert result.unexpected_keys == ["stray"]
    assert [m.split(":")[0] for m in result.mismatched_keys] == ["second.weight"]
    assert torch.equal(model.state_dict()["first.weight"], source["first.weight"])
    assert torch.equal(model.state_dict()["second.weight"], before["second.weight"])


def test_tied_parameter_loads_from_either_name(tmp_path, offload_config):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    model = infinity.offload(Tied(), offload_config())
    value = torch.randn(10, 4)
    result = infinity.load_pretrained(model, _file(tmp_path, {"embed.weight": value}))
    assert result == ([], [], [])
    assert torch.equal(model.state_dict()["head.weight"], value)


def test_bad_paths_say_what_is_expected(tmp_path, offload_config):
    model = _offloaded(offload_config)
    with pytest.raises(infinity.PretrainedError, match="neither"):
        infinity.load_pretrained(model, tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(infinity.PretrainedError, match="not a readable safetensors"):
        infinity.load_pretrained(model, tmp_path / "junk.safetensors")
