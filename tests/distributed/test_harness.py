"""The 2-process harness: results in rank order, a raising rank named with its
traceback, a hanging rank killed at the timeout, no process left behind."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
import torch.distributed as dist
from harness import RanksFailed, run_ranks, spawn_ranks

pytestmark = pytest.mark.distributed


def _sum_of_ranks(rank: int, offset: int) -> tuple[int, int, float]:
    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)
    return rank, dist.get_world_size(), float(value.item())


def _raise_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return rank


def _hang_on_rank_1(rank: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def _gone(pid: int | None) -> bool:
    assert pid is not None
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_results_come_back_in_rank_order_from_a_real_group() -> None:
    # 10 + 11: each rank contributed its own value to a gloo all-reduce
    assert run_ranks(_sum_of_ranks, 10) == [(0, 2, 21.0), (1, 2, 21.0)]


def test_an_exception_in_rank_1_fails_naming_it_with_its_traceback() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_1)
    message = str(info.value)
    assert "1 of 2 ranks failed" in message
    assert "rank 1 raised" in message
    assert "ValueError: planted failure on rank 1" in message
    assert "_raise_on_rank_1" in message  # the rank's own traceback
    assert "rank 0" not in message


def test_a_hanging_rank_is_killed_at_the_timeout_and_named() -> None:
    # (rank 1 would sleep an hour: the call returning at all is the kill)
    with pytest.raises(RanksFailed, match=r"ranks \[1\] of 2 were still running after 10 s"):
        run_ranks(_hang_on_rank_1, timeout=10.0)


def test_no_rank_process_outlives_the_call() -> None:
    outcomes = spawn_ranks(_raise_on_rank_1)
    assert [o.finished for o in outcomes] == [True, False]
    assert outcomes[0].result == 0
    assert outcomes[1].error is not None and "planted failure" in outcomes[1].error
    assert all(_gone(o.pid) for o in outcomes)
