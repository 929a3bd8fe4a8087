"""``transformers.Trainer`` under ``torchrun``: 2 processes train like 1 on the doubled batch.

Each run is the same script (``trainer_job.py``: an offloaded Llama, ``CPUAdam``,
clipping, accumulation), started as a user starts it. The reference is one
process with twice the per-device batch; the tolerance is the noise of computing
the same gradient as a mean over smaller micro-batches (one process, half the
batch, twice the accumulation), measured in the same test, and it must be far
below what one step moves the weights (so a missed average or a double one fails).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB = Path(__file__).with_name("trainer_job.py")
REPO = Path(__file__).resolve().parents[2]


def _job(tmp: Path, name: str, nproc: int, batch: int, accumulation: int, *extra: str) -> dict:
    out = tmp / f"{name}.pt"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    cmd = [*launcher, str(JOB), str(out), f"--batch={batch}", f"--accumulation={accumulation}"]
    if nproc == 1:
        cmd = [sys.executable, str(JOB), str(out), f"--batch={batch}"]
        cmd += [f"--accumulation={accumulation}"]
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "engine")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, *extra], env=env, capture_output=True, text=True, timeout=300, cwd=tmp
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - v.double()).pow(2).sum()) for k, v in b.items())
    den = sum(float(v.double().pow(2).sum()) for v in b.values())
    return (num / den) ** 0.5


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_two_torchrun_ranks_with_the_trainer_equal_one_process(tmp_path, nvme):
    extra = ("--nvme", str(tmp_path / "nvme")) if nvme else ()
    two = _job(tmp_path, "two", 2, 2, 2, *extra)
    one = _job(tmp_path, "one", 1, 4, 2, *extra)
    halves = _job(tmp_path, "halves", 1, 2, 4, *extra)
    assert two["world"] == 2 and one["world"] == 1
    noise = _rel(halves["state"], one["state"])
    one_step = _rel(_job(tmp_path, "short", 1, 4, 2, "--steps=2", *extra)["state"], one["state"])
    error = _rel(two["state"], one["state"])
    bound = max(4 * noise, 1e-6)
    assert bound < 0.5 * one_step, (bound, one_step)  # a missed update would show
    assert error <= bound, (error, noise, two["losses"], one["losses"])
    # The losses the Trainer logged agree too (each rank's mean, averaged).
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
