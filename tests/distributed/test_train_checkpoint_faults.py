"""``infinity train``'s checkpoints with a model sharded over 2 ranks: rank 0 writes
while both gather. A rank that dies in the middle of a save makes rank 0 fail naming
it, and leaves the run directory as it was: the previous checkpoint whole (loaded
back by the library in one process), no new step, no temporary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_helpers import batches, config, nvme_pair, tiny_gpt, train
from harness import spawn_ranks

import infinity
from infinity.cli.main import _build_parser
from infinity.cli.train import checkpoints as ckpt
from infinity.cli.train.checkpoints import RunDirectory
from infinity.cli.train.settings import resolve_settings
from infinity.distributed import DistributedError

pytestmark = pytest.mark.distributed


def _state(step: int) -> ckpt.TrainerState:
    argv = ["train", "--preset", "tiny"]
    args = _build_parser(argv)[0].parse_args(argv)
    return ckpt.TrainerState(
        step=step,
        run_id="unused",
        settings=resolve_settings(args, None),
        scheduler={"last_epoch": step},
        rng=bytes(torch.get_rng_state().numpy()),
        tokens=0,
        last_loss=None,
    )


def _save_then_die(rank: int, root: str) -> str | None:
    """Save step 1 on both ranks; in step 2's save rank 1 exits. Rank 0's error."""
    model, optimizer, _ref, _ref_opt = nvme_pair(Path(root) / "nvme", host_factor=1.0)
    data = batches(2)
    if rank == 0:
        run = RunDirectory.new(Path(root), [])
    path = [str(run.path) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if rank == 1:
        run = RunDirectory(Path(path[0]), -1, [], fresh=True)  # as ranks.share_run_dir
    train(model, optimizer, data[:1])
    ckpt.save(run, model, optimizer, _state(1))
    train(model, optimizer, data[1:])
    if rank == 1:
        ckpt.write_checkpoint = lambda *_: os._exit(3)  # dies as the gathers start
    try:
        ckpt.save(run, model, optimizer, _state(2))
    except DistributedError as exc:
        return str(exc)
    return None


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_whole(tmp_path) -> None:
    rank0, rank1 = spawn_ranks(_save_then_die, str(tmp_path), group_timeout=600.0)
    assert rank1.exitcode == 3
    assert rank0.finished, rank0.describe()
    message = rank0.result
    assert message is not None and message.startswith("rank 0 of 2: ")
    assert "the connection to rank 1 closed" in message
    (run,) = (p for p in tmp_path.iterdir() if p.name.startswith("run-"))
    assert sorted(p.name for p in run.iterdir()) == ["step-00000001"]  # no step 2, no temp
    model = infinity.offload(tiny_gpt(), config(chunk_size="24KiB"))
    infinity.load_checkpoint(run / "step-00000001", model)  # CRC-checked, in one process
