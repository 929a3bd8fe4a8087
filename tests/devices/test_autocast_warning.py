"""A training forward under torch.autocast to another dtype than the model's offload dtype
is told, once, that autocast keeps a cast copy of every weight for backward."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_helpers import tiny_gpt

import infinity


def _offloaded(dtype: str) -> torch.nn.Module:
    return infinity.offload(tiny_gpt(), infinity.Config(device="cpu", dtype=dtype))


def _autocast_warnings(model: torch.nn.Module, *, grad: bool, steps: int = 2) -> list[str]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids)
            if grad:
                out.float().mean().backward()
    return [str(w.message) for w in caught if "autocast" in str(w.message)]


def test_an_fp32_model_under_bf16_autocast_is_told_once_what_autocast_keeps():
    model = _offloaded("fp32")
    said = _autocast_warnings(model, grad=True)
    assert len(said) == 1, said
    assert "dtype='bf16'" in said[0] and "copy of the weights" in said[0]
    # and what it says is so: the saved bytes of a forward grow by the casts
    stats = infinity.stats(model)["activations"]["saved_last_forward_bytes"]
    plain = _offloaded("fp32")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    plain(ids).float().mean().backward()
    assert stats > infinity.stats(plain)["activations"]["saved_last_forward_bytes"]


@pytest.mark.parametrize("grad", [True, False])
def test_no_word_where_autocast_casts_nothing_or_nothing_is_saved(grad):
    if grad:
        assert _autocast_warnings(_offloaded("bf16"), grad=True) == []
    else:
        assert _autocast_warnings(_offloaded("fp32"), grad=False) == []
