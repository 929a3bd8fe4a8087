"""Adam moments and step counts of offloaded parameters, as torch's optimizer state.

``CPUAdam.state_dict()`` / ``load_state_dict()`` use this so that loops which
save and restore the optimizer themselves (``transformers.Trainer``
checkpoints, Accelerate's ``save_state``) keep the moments of offloaded
parameters. Values are copied chunk by chunk from the optimizer-state units
(host or NVMe); the copies themselves need RAM for all of them, as torch's
state dict does. ``infinity.save_checkpoint`` streams instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.manager import typed
from infinity.optim.offloaded import MomentState


def _moment_views(engine, chunk: int, region: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat exp_avg and exp_avg_sq of a chunk's optimizer unit (master first, if any)."""
    capacity = engine.layout.chunks[chunk].capacity
    state = typed(region, torch.float32)
    parts = 3 if engine.plan.has_master else 2
    return (
        state[(parts - 2) * capacity : (parts - 1) * capacity],
        state[(parts - 1) * capacity : parts * capacity],
    )


def read_moments(engine, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
    """``(index, (step, exp_avg, exp_avg_sq))`` copies for tensors stepped at least once."""
    engine.settle_step()
    stepped = [i for i in indices if engine.tensor_steps[i] > 0]
    for chunk, group in engine.layout.group_by_chunk(stepped, int).items():
        region, copy = engine.manager.open_host((Kind.OPTIM, chunk), writable=False)
        try:
            exp_avg, exp_avg_sq = _moment_views(engine, chunk, region)
            for i in group:
                slot = engine.layout.slots[i]
                span = slice(slot.offset, slot.offset + slot.numel)
                yield (
                    i,
                    (
                        engine.tensor_steps[i],
                        exp_avg[span].view(slot.shape).clone(),
                        exp_avg_sq[span].view(slot.shape).clone(),
                    ),
                )
        finally:
            engine.manager.close_host(copy, modified=False)


def check_moments(engine, values: dict[int, MomentState | None]) -> None:
    """Raise (changing nothing) if a state does not fit its tensor."""
    for i, value in values.items():
        if value is None:
            continue
        step, exp_avg, exp_avg_sq = value
        entry = engine.registry.entries[i]
        if not entry.trainable:
            raise ValueError(f"optimizer state for {entry.name}, which is frozen (no moments)")
        shape = engine.layout.slots[i].shape
        for key, moment in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if tuple(moment.shape) != tuple(shape):
                raise ValueError(
                    f"optimizer state {key} of {entry.name} has shape {tuple(moment.shape)}, the "
                    f"parameter has {tuple(shape)}: the state dict is from another model"
                )
        if step < 0:
            raise ValueError(f"optimizer state of {entry.name} has step {step}")


def write_moments(engine, values: dict[int, MomentState | None]) -> None:
    """Set moments and step counts (by tensor index; ``None``: no state, as never
    stepped); check with :func:`check_moments` first."""
    engine.settle_step()
    for chunk, group in engine.layout.group_by_chunk(values, int).items():
        region, copy = engine.manager.open_host((Kind.OPTIM, chunk))
        try:
            exp_avg, exp_avg_sq = _moment_views(engine, chunk, region)
            for i in group:
                slot = engine.layout.slots[i]
                span = slice(slot.offset, slot.offset + slot.numel)
                value = values[i]
                if value is None:
                    exp_avg[span].zero_()
                    exp_avg_sq[span].zero_()
                    engine.tensor_steps[i] = 0
                    continue
                step, m, v = value
                exp_avg[span].copy_(m.reshape(-1))
                exp_avg_sq[span].copy_(v.reshape(-1))
                engine.tensor_steps[i] = step
        finally:
            engine.manager.close_host(copy, modified=True)
