"""With ``INFINITY_CUDA_MEMORY_SNAPSHOTS=DIR``: each CUDA test records the caching
allocator's history, and one that fails saves it as ``DIR/<test>.pickle``
(``torch.cuda.memory``'s snapshot format: what was alive at a device peak above the
forecast, and where it was allocated). A diagnosis aid for a lent GPU
(``bench/gpu_check.sh`` sets it); off by default."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
import torch

SNAPSHOTS = os.environ.get("INFINITY_CUDA_MEMORY_SNAPSHOTS")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Keep each phase's report on the test, for the snapshot fixture to read."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _memory_snapshot(request: pytest.FixtureRequest) -> Iterator[None]:
    if not SNAPSHOTS or not torch.cuda.is_available():
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        yield
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[-90:]
            os.makedirs(SNAPSHOTS, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(SNAPSHOTS, name + ".pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
