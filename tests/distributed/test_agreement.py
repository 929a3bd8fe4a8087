"""``infinity.offload`` under a 2-rank group refuses a Config or model that differs
across ranks, on every rank, naming the first difference and both values."""

from __future__ import annotations

import pytest
from engine_helpers import config, tiny_gpt
from harness import run_ranks

import infinity
from infinity.distributed import DistributedError
from infinity.offload import engine_of

pytestmark = pytest.mark.distributed


def _offload(rank: int, configs: list[dict], models: list[dict]) -> str | None:
    """Offload a tiny GPT on each rank with that rank's overrides: the error or None."""
    cfg = config(chunk_size="24KiB", **configs[rank])
    model = tiny_gpt(**models[rank])
    try:
        infinity.offload(model, cfg)
    except DistributedError as exc:
        return str(exc)
    engine_of(model).close()
    return None


def test_a_different_dtype_fails_on_both_ranks_naming_the_field() -> None:
    errors = run_ranks(_offload, [{}, {"dtype": "bf16"}], [{}, {}])
    expected = 'Config field \'dtype\' is "fp32" on rank 0 and "bf16" on rank 1'
    assert all(e is not None and expected in e for e in errors), errors


def test_a_different_parameter_shape_fails_naming_the_parameter() -> None:
    errors = run_ranks(_offload, [{}, {}], [{}, {"hidden": 64}])
    # the GPT's first parameter: its position embedding (seq_len 32 x hidden)
    expected = "parameter 'wpe' is shape (32, 32), torch.float32, requires_grad=True on rank 0"
    assert all(e is not None and expected in e and "shape (32, 64)" in e for e in errors), errors


def test_ranks_with_their_own_nvme_paths_agree(tmp_path) -> None:
    paths = [{"nvme_path": str(tmp_path / f"disk-{rank}")} for rank in range(2)]
    assert run_ranks(_offload, paths, [{}, {}]) == [None, None]


def test_nvme_on_one_rank_only_fails_naming_nvme_path(tmp_path) -> None:
    errors = run_ranks(_offload, [{}, {"nvme_path": str(tmp_path)}], [{}, {}])
    expected = "Config field 'nvme_path' is null on rank 0 and \"a path (NVMe on)\" on rank 1"
    assert all(e is not None and expected in e for e in errors), errors
