"""``infinity.stats(model)``: bytes per tier, traffic, peaks and the last step's timings."""

from __future__ import annotations

from typing import Any

from torch import nn

from infinity.offload import engine_of
from infinity.runtime.memory import io_stats, memory_stats, tier_stats
from infinity.utils.process_memory import PRETRAINED_READS


def stats(model: nn.Module) -> dict[str, Any]:
    """Counters of an offloaded model.

    Peaks are exact (the manager's accounting of occupied slots, homes
    included); traffic counters are totals since ``offload``; ``last_step``
    splits the wall time of the latest optimizer step interval into waiting on
    each tier and everything else (computing), and sets it against its bound
    (``bound_seconds``, ``step_over_bound``: runtime/stepping.py), which
    ``last_step_bound_by`` names. ``activations`` (with
    ``Config(activations="offload")``): saved tensors per tier now and at peak,
    NVMe bytes written and read, and the reads backward waited for. ``world``: this process's rank
    among the processes its chunks are sharded over, and what it communicated.
    ``optimizer_tensor_state_bytes``: the optimizer's per-tensor states kept in
    host memory beside the units (Adafactor's factors): the plan reserves them in
    the host budget, beside the chunks the host peak counts. ``memory``: per tier the
    budget's named lines (limit and measured peak), the device allocator's peak (CUDA,
    the fence), the resident set's peak and baseline, and the forecast
    (:func:`infinity.memory_forecast`) if one was made.
    """
    engine = engine_of(model)
    out: dict[str, Any] = {
        "device": engine.backend.name,
        "dtype": engine.config.dtype,
        **tier_stats(engine.chunks),
        "steps": engine.pipeline.step_count,
        # per-tensor optimizer states in host memory, inside the host budget but not
        # chunks (Adafactor's factors; 0 for the others): see NOTE [per-tensor optimizer state]
        "optimizer_tensor_state_bytes": sum(
            value.nbytes
            for states in engine.chunks.tensor_states.values()
            for value in states.values()
        ),
        "last_step": dict(engine.pipeline.step_timer.last),
        "last_step_bound_by": engine.pipeline.step_timer.bound_by,
        **io_stats(engine.chunks),
    }
    out["world"] = {
        "rank": engine.world.rank,
        "size": engine.world.size,
        # payload this rank sent to collectives, and the time it spent in them
        # (waiting for the other ranks included)
        "sent_bytes": engine.collectives.bytes_sent,
        "collective_seconds": engine.collectives.seconds,
    }
    # Saved tensors: the last forward's bytes and per token (every policy); with
    # "offload" / "auto" per tier (now and peak), NVMe traffic, and how often backward
    # waited for a read (reads_not_ahead: none started); "auto"'s choice per block.
    out["activations"] = engine.activation_policy.snapshot()
    out["memory"] = memory = memory_stats(engine)
    # Beside the host budget while weights load (infinity.load_pretrained): one block.
    memory["host"]["pretrained_read_block"] = PRETRAINED_READS.line()
    if engine.scaler is not None:
        out["loss_scale"] = engine.scaler.scale
        out["skipped_steps"] = engine.scaler.skipped_steps
    return out
