"""With chunks sharded over 2 ranks sharing one ``nvme_path``, each rank's swap
file lives under ``nvme_path/rank-<r>/`` (read from the directory itself), and
closing leaves no swap file or private directory behind."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from engine_helpers import batches, nvme_pair, train
from harness import run_ranks

from infinity.offload import engine_of

pytestmark = pytest.mark.distributed


def _listing(root: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, name), root)
        for d, dirs, files in os.walk(root)
        for name in dirs + files
    )


def _train_on_nvme(rank: int, root: str) -> tuple[int, list[str], str]:
    """This rank's pid, what ``root`` holds while its model is open, its swap file's path."""
    model, opt, _ref, _ref_opt = nvme_pair(root, host_factor=1.0)
    swap = engine_of(model).swap
    assert swap is not None, "the test config must put states on NVMe"
    train(model, opt, batches(1))
    dist.barrier()  # both ranks list after both opened their swap files
    during = _listing(root)
    dist.barrier()
    engine_of(model).close()
    return os.getpid(), during, swap.path


def test_each_rank_swaps_under_its_own_folder_and_close_leaves_nothing(tmp_path) -> None:
    root = str(tmp_path / "nvme")
    results = run_ranks(_train_on_nvme, root)
    for rank, (pid, during, swap_path) in enumerate(results):
        assert os.path.dirname(os.path.dirname(swap_path)) == os.path.join(root, f"rank-{rank}")
        own = [p for p in during if p.startswith(f"rank-{rank}/infinity-chunks-{pid}-")]
        assert len(own) == 2, during  # the private directory and the swap file in it
    assert sorted(p for p in results[0][1] if "/" not in p) == ["rank-0", "rank-1"]
    assert results[0][1] == results[1][1]  # both saw both ranks' files
    assert _listing(root) == ["rank-0", "rank-1"]  # the empty rank folders only
