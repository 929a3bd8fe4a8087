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


def _rank_zero_alone(rank: int, what: str) -> str:
    """Train one step on both ranks, then ``what`` on rank 0 alone (the habit of DDP
    code), then the next training step on both: each rank's error."""
    import torch

    model = infinity.offload(tiny_gpt(), config(chunk_size="16KiB", device_memory="96KiB"))
    opt = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(ids, ids).backward()
    opt.step()
    opt.zero_grad()
    try:
        if rank == 0:
            if what == "evaluate":
                with torch.no_grad():
                    model(ids, ids)
            elif what == "state_dict":
                model.state_dict()
            elif what == "load_state_dict":
                model.load_state_dict(tiny_gpt(seed=1).state_dict())
        model(ids, ids).backward()
        if rank == 0 and what == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    except DistributedError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("what", "doing"),
    [
        ("evaluate", "rank 0 is starting a forward without gradients"),
        ("state_dict", "rank 0 is starting reading parameter values (state_dict)"),
        ("load_state_dict", "rank 0 is starting writing parameter values (load_state_dict)"),
        ("clip_grad_norm_", "rank 0 is starting reading gradient norms (clip_grad_norm_)"),
    ],
)
def test_a_call_on_rank_zero_alone_fails_on_every_rank_naming_it(what, doing) -> None:
    """Rank 0 alone evaluating crashed its process (gloo: "Is there a distributed
    collective mismatch in your code?") while rank 1 saw a closed connection; alone
    loading a state dict (no collective inside) would leave the ranks' shards of two
    different models. Now both ranks raise at the first call they do not share."""
    errors = run_ranks(_rank_zero_alone, what)
    other = "optimizer.step()" if what == "clip_grad_norm_" else "a training forward"
    for error in errors:
        assert "the ranks diverged" in error and doing in error, error
        assert f"rank 1 is starting {other}" in error, error
