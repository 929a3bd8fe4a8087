"""The chunks' counters for ``infinity.stats``: sizes, budgets, reserved and peak bytes
per tier, homes per kind, and the traffic so far.

Read from the plan and the chunk manager's exact accounting, so that
``infinity/stats.py`` reaches neither.
"""

from __future__ import annotations

from typing import Any

from infinity.core.names import HOST, NVME
from infinity.runtime.model_chunks import ModelChunks


def tier_stats(chunks: ModelChunks) -> dict[str, Any]:
    """Chunk size and count, each tier's budget, reservation and peak, NVMe bytes and
    registration, and the homes per kind and tier."""
    manager, plan = chunks.manager, chunks.plan
    return {
        "chunk_size": plan.layout.chunk_bytes,
        "num_chunks": plan.layout.num_chunks,
        "device_budget_bytes": plan.budgets.device,
        "device_reserved_bytes": manager.device_account.reserved,
        "device_peak_bytes": manager.device_account.peak,
        "host_budget_bytes": plan.budgets.host,
        "host_reserved_bytes": manager.host_account.reserved,
        "host_peak_bytes": manager.host_account.peak,
        "nvme_budget_bytes": plan.budgets.nvme,
        "nvme_bytes": manager.nvme_account.used,
        # staging slabs registered with io_uring (no page pinning per transfer)
        "nvme_registered_buffers": manager.fixed_buffers is None,
        "placement": {
            kind: {tier: sum(h == tier for h in homes) for tier in (HOST, NVME)}
            for kind, homes in (
                ("param", plan.param_home),
                ("grad", plan.grad_home),
                ("optim", plan.optim_home),
            )
        },
    }


def io_stats(chunks: ModelChunks) -> dict[str, Any]:
    """The traffic counters since ``offload``, and why io_uring refused the staging
    buffers if it did."""
    manager = chunks.manager
    out: dict[str, Any] = {}
    if manager.fixed_buffers is not None and manager.fixed_buffers.startswith("io_uring"):
        out["nvme_registration_error"] = manager.fixed_buffers  # the kernel refused
    out.update(manager.traffic.snapshot())
    return out
