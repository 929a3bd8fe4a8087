"""The planner's estimate of the bytes each link moves per step (``Plan.traffic``).

Shown by ``infinity plan``; measured against the engine's counters in
``tests/engine/test_plan_estimate.py`` and, sharded, against what real ranks
send in ``tests/cli/test_plan_nproc.py``.
"""

from __future__ import annotations

from collections.abc import Collection

from infinity.chunks.pools import is_split
from infinity.core.names import DEVICE, NVME
from infinity.core.plan import Plan


def estimate_traffic(plan: Plan, *, consume_grads: bool = False) -> dict[str, int]:
    """Bytes each link moves in one step (one micro-batch, no accumulation); sharded,
    also the bytes this rank sends to collectives (``allgather_bytes``,
    ``reduce_scatter_bytes``: what ``Collectives.bytes_sent`` counts).

    ``consume_grads`` (``overlap_optimizer=True``): gradients homed on NVMe are
    used from host staging by their step and never go to disk.
    """
    n = plan.layout.num_chunks
    # A chunk homed on the device never crosses the link (its copies are device to device).
    linked = [i for i in range(n) if plan.param_home[i] != DEVICE]
    params = sum(plan.param_bytes(i) for i in linked)
    grads = sum(plan.param_bytes(i) for i in linked if plan.grad_home[i] is not None)
    # Backward runs the chunks in reverse, so what forward left on the
    # device (all but a gradient slot's worth) is used again at once, and only
    # the rest, forward's first chunks, is fetched a second time.
    # The device caches whole chunks while a sharded rank moves (and counts)
    # its shard of each: the cache is worth ``1/shard_count`` of its bytes here.
    trainable = [i for i in range(n) if plan.grad_home[i] is not None]
    whole_grads = sum(plan.device_param_bytes(i) for i in trainable)
    largest_grad = max((plan.device_param_bytes(i) for i in trainable), default=0)
    # Sharded, two gradient chunks stay on the device until complete.
    grad_slots = 2 if plan.sharded else 1
    cached = (plan.device_bytes - grad_slots * largest_grad) // plan.shard_count
    refetched = min(params, max(0, params - cached))
    on_nvme = [i for i in range(n) if plan.param_home[i] == NVME]
    nvme_param = sum(plan.param_bytes(i) for i in on_nvme)
    # An oversize chunk's gradients go home in spans even when consumed.
    nvme_grad = sum(
        plan.param_bytes(i)
        for i in range(n)
        if plan.grad_home[i] == NVME and (not consume_grads or is_split(plan, i))
    )
    nvme_optim = sum(plan.optim_bytes(i) for i in range(n) if plan.optim_home[i] == NVME)
    updated = [i for i in on_nvme if plan.grad_home[i] is not None]
    updated_nvme_params = sum(plan.param_bytes(i) for i in updated)
    # fp32 has no master: the step reads the parameter chunk itself, from a
    # landed device copy when there is one (device -> host, not the disk).
    # Overlapped, each chunk is stepped right after backward used it; else
    # the device still holds what backward used last, forward's first chunks.
    from_device = 0
    if not plan.has_master:
        from_device = updated_nvme_params if consume_grads else _leading(plan, cached, updated)
    fp32_params_read = 0 if plan.has_master else updated_nvme_params - from_device
    # Re-fetched chunks are forward's first ones; parameters spill from the back.
    nvme_refetched = _leading(plan, refetched, on_nvme)
    traffic = {
        "h2d_bytes": params + refetched,
        "d2h_bytes": grads + from_device,
        "nvme_read_bytes": nvme_param + nvme_refetched + nvme_grad + nvme_optim + fp32_params_read,
        "nvme_write_bytes": nvme_grad + nvme_optim + updated_nvme_params,
    }
    if plan.sharded:
        # Sent by this rank: its shard once per gather of a parameter chunk (each
        # fetch above is one), and every whole gradient chunk once per micro-batch.
        traffic["allgather_bytes"] = params + refetched
        traffic["reduce_scatter_bytes"] = whole_grads
    return traffic


def _leading(plan: Plan, nbytes: int, chunks: Collection[int]) -> int:
    """Bytes of ``chunks`` within the first ``nbytes`` of parameter chunks, in
    forward order."""
    total = start = 0
    for i in range(plan.layout.num_chunks):
        if start >= nbytes:
            break
        end = start + plan.param_bytes(i)
        if i in chunks:
            total += min(end, nbytes) - start
        start = end
    return total
