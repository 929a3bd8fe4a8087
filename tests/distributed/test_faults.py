"""A rank that dies, raises or hangs makes the other fail with a DistributedError
naming itself, the operation and the peer (gloo, 2 processes).

NOTE: no timed assertions: a dead peer must be noticed without the group's
timeout, so those runs give the group a timeout (600 s) far beyond the
harness's (60 s); had rank 0 waited for it, the harness would kill it and fail.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from engine_helpers import batches, nvme_pair, train
from harness import spawn_ranks

from infinity.distributed import Collectives, DistributedError, resolve_world

pytestmark = pytest.mark.distributed

GROUP_TIMEOUT = 600.0  # never reached by a dead peer's detection
SHARD = 1 << 16


def _gather(rank: int, fault: str) -> str | None:
    """Rank 1 misbehaves as ``fault`` says; rank 0 gathers and returns its error."""
    collectives = Collectives(resolve_world())
    full = torch.full((2 * SHARD,), float(rank))
    if rank == 1:
        if fault == "exit-before":
            os._exit(3)
        if fault == "raise-before":
            raise ValueError("planted failure on rank 1")
        if fault == "exit-inside":
            time.sleep(0.5)  # rank 0 is (most likely) waiting inside the gather by now
            os._exit(3)
        if fault == "hang":
            time.sleep(3.5)  # past rank 0's group timeout (2 s), then leave quietly
            return None
    try:
        collectives.all_gather_in_place(full, "gathering chunk 3")
    except DistributedError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("fault", ["exit-before", "exit-inside", "raise-before"])
def test_a_peer_that_stops_fails_the_waiting_rank_naming_it(fault: str) -> None:
    rank0, rank1 = spawn_ranks(_gather, fault, timeout=60.0, group_timeout=GROUP_TIMEOUT)
    assert rank0.finished, rank0.describe()
    message = rank0.result
    assert message is not None, "rank 0's gather succeeded with its peer gone"
    assert message.startswith("rank 0 of 2: gathering chunk 3 failed: ")
    assert "the connection to rank 1 closed: that process exited or crashed" in message
    assert not rank1.finished
    if fault == "raise-before":
        assert rank1.error is not None and "planted failure on rank 1" in rank1.error
    else:
        assert rank1.exitcode == 3


def test_a_hung_peer_is_reported_at_the_group_timeout() -> None:
    rank0, rank1 = spawn_ranks(_gather, "hang", timeout=60.0, group_timeout=2.0)
    assert rank1.finished and rank1.result is None
    message = rank0.result
    assert message is not None, "rank 0's gather succeeded without its peer"
    assert message.startswith("rank 0 of 2: gathering chunk 3 failed: ")
    assert "rank 1 did not join within the process group's timeout" in message


def _train_until_rank_1_dies(rank: int, nvme_root: str) -> str | None:
    """Both ranks train a sharded tiny GPT (states on NVMe); in the second step rank 1
    exits in the middle of the forward pass. Rank 0 returns its error."""
    model, optimizer, _ref, _ref_opt = nvme_pair(nvme_root, host_factor=1.0)
    data = batches(2)
    train(model, optimizer, data[:1])
    if rank == 1:
        model.blocks[2].register_forward_hook(lambda *_: os._exit(3))
    try:
        train(model, optimizer, data[1:])
    except DistributedError as exc:
        return str(exc)
    return None


def test_a_rank_killed_mid_step_fails_the_other_naming_it(tmp_path) -> None:
    rank0, rank1 = spawn_ranks(
        _train_until_rank_1_dies, str(tmp_path), timeout=90.0, group_timeout=GROUP_TIMEOUT
    )
    assert rank1.exitcode == 3 and not rank1.finished
    assert rank0.finished, rank0.describe()  # returned: it neither hung nor crashed
    message = rank0.result
    assert message is not None, "rank 0 finished its step without rank 1"
    assert message.startswith("rank 0 of 2: ")
    assert "the connection to rank 1 closed: that process exited or crashed" in message
