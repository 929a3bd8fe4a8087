"""``infinity plan``'s activation lines: what each policy keeps per step, and the
tokens per step that fit beside the states."""

from __future__ import annotations

from typing import Any

import torch

from infinity.activations.estimate import estimate, step_memory
from infinity.activations.policy import choose_blocks
from infinity.config import Config, ConfigError
from infinity.core.plan import Plan
from infinity.runtime.budgets import DTYPE_OF
from infinity.utils.process_memory import resident_bytes
from infinity.utils.sizes import format_size


def activations_at(
    model: torch.nn.Module, plan: Plan, config: Config, batch: int, seq_len: int
) -> dict[str, Any]:
    """Saved bytes per step under each policy, and what fits (a JSON-ready dict).

    Activations count against the device budget: what the chunk slots
    leave of it holds "keep"'s and "checkpoint"'s activations; "offload" moves
    them to what the states leave of the host budget, then to NVMe.
    """
    target = "cuda" if config.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    try:
        est = estimate(model, batch, seq_len, DTYPE_OF[config.dtype], target)
    except (ConfigError, TypeError, RuntimeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    tokens = batch * seq_len
    slots = plan.min_device_bytes or plan.device_bytes
    host_room = max(0, plan.budgets.host - plan.host_bytes)
    nvme_room = None if plan.budgets.nvme is None else max(0, plan.budgets.nvme - plan.nvme_bytes)
    one_block = max(est.per_block, default=est.total)
    on_device = {"keep": est.total, "checkpoint": est.checkpoint, "offload": one_block}
    room = max(0, plan.budgets.device - slots)
    # "auto" keeps blocks in the room the plan's own slots leave (as the engine does)
    auto_room = max(0, plan.budgets.device - plan.device_bytes)

    def fit(policy: str) -> int:
        per_token = on_device[policy] / tokens
        fits = int(room / per_token) if per_token else 0
        if policy == "offload" and est.total:
            fits = min(fits, int((host_room + (nvme_room or 0)) / (est.total / tokens)))
        return fits

    auto = choose_blocks(est.per_block, auto_room, host_room, has_nvme=nvme_room is not None)
    work = _working_set(model, config, batch, seq_len, target)
    return {
        "working_set_bytes": work,
        # the step's peak per tier (runtime/memory.py): the device's lines and working set;
        # the host's lines and this process's resident set now (the libraries and model)
        "forecast_device_peak": plan.device_bytes + work,
        "device_in_host": target == "cpu",
        "forecast_resident_peak": resident_bytes()
        + plan.host_bytes
        + (plan.device_bytes + work if target == "cpu" else 0),
        "auto": {c: auto.count(c) for c in ("keep", "offload", "checkpoint")},
        "batch_size": batch,
        "seq_len": seq_len,
        "saved_bytes": est.total,
        "blocks": len(est.per_block),
        "device_bytes": on_device,
        "min_chunk_slot_bytes": slots,
        "device_memory_needed": {k: slots + v for k, v in on_device.items()},
        "host_room_bytes": host_room,
        "nvme_room_bytes": nvme_room,
        "tokens_that_fit": {policy: fit(policy) for policy in on_device},
    }


def _working_set(
    model: torch.nn.Module, config: Config, batch: int, seq_len: int, target: str
) -> int:
    """The step's working set on the device (``step_memory``): the model's own loss over
    ``batch x seq_len`` token ids, under ``config.activations`` ("auto" at its most)."""
    ids = torch.zeros((batch, seq_len), dtype=torch.long, device=target)

    def step(m: torch.nn.Module) -> torch.Tensor:
        try:
            return m(input_ids=ids, labels=ids).loss
        except TypeError:  # not a transformers model: the GPT takes (ids, targets)
            return m(ids, ids)

    policy = "keep" if config.activations == "auto" else config.activations
    return step_memory(model, step, DTYPE_OF[config.dtype], target, policy=policy).peak


def activation_lines(act: dict[str, Any]) -> list[str]:
    """The plan's text lines for :func:`activations_at`'s result."""
    if "error" in act:
        return [f"activations: not estimated ({act['error']})"]
    tokens = act["batch_size"] * act["seq_len"]
    dev = act["device_bytes"]
    need = act["device_memory_needed"]
    fits = act["tokens_that_fit"]
    nvme = act["nvme_room_bytes"]
    return [
        f"activations of {act['batch_size']} x {act['seq_len']} tokens (Config.activations), "
        f"{format_size(act['saved_bytes'])} saved ({format_size(act['saved_bytes'] / tokens)} "
        "per token):",
        f"  keep        {format_size(dev['keep']):>12} on the device",
        f"  checkpoint  {format_size(dev['checkpoint']):>12} on the device (block inputs, and "
        f"one of {act['blocks']} blocks recomputed at a time)",
        f"  offload     {format_size(dev['offload']):>12} on the device (at most about one "
        f"block's); the rest to host memory ({format_size(act['host_room_bytes'])} free "
        "beside the states)"
        + (f", then NVMe ({format_size(nvme)} free)" if nvme is not None else ", no NVMe tier"),
        "  auto        per block, last first: "
        + ", ".join(f"{n} {c}" for c, n in act["auto"].items() if n)
        + " (keep where the plan's chunk slots leave device room, then offload, then "
        "checkpoint)",
        f"  device_memory they need beside the smallest chunk slots "
        f"({format_size(act['min_chunk_slot_bytes'])}): keep {format_size(need['keep'])}, "
        f"checkpoint {format_size(need['checkpoint'])}, offload {format_size(need['offload'])}",
        f"  tokens per step that fit these budgets: keep {fits['keep']}, "
        f"checkpoint {fits['checkpoint']}, offload {fits['offload']}",
        f"forecast peak of a step (Config.activations): working set "
        f"{format_size(act['working_set_bytes'])} on the device beside its chunk slots = "
        f"device {format_size(act['forecast_device_peak'])}; resident set "
        f"{format_size(act['forecast_resident_peak'])} (this process now, the host's lines"
        + (", the device's" if act["device_in_host"] else "")
        + ")",
    ]
