"""``CPUAdam.state_dict()`` holds offloaded parameters' moments in torch's format.

References: ``torch.optim.AdamW``'s own state dict after the same steps, and
training continued from a loaded state dict against uninterrupted AdamW.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import batches, global_rel_error, nvme_pair, tiny_gpt, train

import infinity
from infinity.optim import CPUAdam


def _trained(tmp_path, steps: int = 2):
    model, opt, ref, ref_opt = nvme_pair(tmp_path)
    data = batches(2 * steps)
    train(model, opt, data[:steps])
    train(ref, ref_opt, data[:steps])
    return model, opt, ref, ref_opt, data[steps:]


def test_state_dict_equals_adamw_state_dict(tmp_path):
    _model, opt, _ref, ref_opt, _rest = _trained(tmp_path)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys() and theirs["state"]
    for key, state in theirs["state"].items():
        assert float(ours["state"][key]["step"]) == float(state["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            mine = ours["state"][key][name]
            assert mine.shape == state[name].shape and mine.dtype == state[name].dtype
            # gradients differ by rounding: compare tensors by their relative distance
            assert float((mine - state[name]).norm()) <= 1e-5 * float(state[name].norm())


@pytest.mark.parametrize("source", ["cpu_adam", "adamw"])
def test_training_continues_exactly_from_a_loaded_state_dict(tmp_path, source):
    _model, opt, ref, ref_opt, rest = _trained(tmp_path / "a")
    saved = (opt if source == "cpu_adam" else ref_opt).state_dict()
    fresh = infinity.offload(tiny_gpt(seed=5), infinity.Config(device="cpu", dtype="fp32"))
    fresh.load_state_dict(ref.state_dict())
    fresh_opt = CPUAdam(fresh.parameters(), lr=1e-3, weight_decay=0.1)
    fresh_opt.load_state_dict(saved)
    train(fresh, fresh_opt, rest)
    train(ref, ref_opt, rest)
    assert global_rel_error(fresh, ref) < 1e-5


def test_a_state_dict_of_another_model_raises_and_changes_nothing(tmp_path):
    _model, opt, _ref, _ref_opt, _rest = _trained(tmp_path)
    before = opt.state_dict()
    bad = opt.state_dict()
    key = next(iter(bad["state"]))
    bad["state"][key]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k, state in before["state"].items():
        torch.testing.assert_close(after["state"][k], state, rtol=0, atol=0)
