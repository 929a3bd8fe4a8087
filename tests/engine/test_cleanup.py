"""Nothing left behind: a dropped model frees its threads and its swap file."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
from engine_helpers import batches, nvme_pair


def native_threads() -> list[str]:
    """Names of this process's threads started by infinity's native code (``inf-*``)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue  # the thread ended while we listed
        if name.startswith("inf-"):
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_dropped_models_free_threads_and_swap_dirs(tmp_path, overlap):
    gc.collect()  # garbage of earlier tests must not be freed during the measurement
    baseline = native_threads()
    x, y = batches(1)[0]
    for _ in range(5):
        model, optimizer, _, _ = nvme_pair(tmp_path, overlap_optimizer=overlap)
        assert len(native_threads()) > len(baseline)
        assert os.listdir(tmp_path), "the states should be on NVMe"
        model(x, y).backward()
        optimizer.step()  # with NVMe states the update trails into the next forward
        optimizer.zero_grad()
        del model, optimizer
        gc.collect()
        assert os.listdir(tmp_path) == []
        assert native_threads() == baseline
