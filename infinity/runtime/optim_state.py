"""Optimizer states (Adam: the moments) and step counts of offloaded parameters,
as torch's optimizer state.

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
from infinity.chunks.span_access import read_tensor, write_elements
from infinity.chunks.spans import is_split
from infinity.optim.offloaded import MomentState


def _slot_views(engine, chunk: int, region: torch.Tensor) -> dict[str, torch.Tensor]:
    """The flat state slots of a chunk's optimizer unit, by name (Adam: exp_avg, exp_avg_sq)."""
    capacity = engine.layout.chunks[chunk].capacity
    unit = engine.chunk_optimizer.unit_views(
        typed(region, torch.float32), capacity, engine.plan.has_master
    )
    return unit.state


def read_moments(engine, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
    """``(index, (step, {slot: state}))`` copies for tensors stepped at least once."""
    engine.settle_step()
    stepped = [i for i in indices if engine.tensor_steps[i] > 0]
    for chunk, group in engine.layout.group_by_chunk(stepped, int).items():
        if is_split(engine.plan, chunk):
            yield from _read_split(engine, chunk, group)
            continue
        region, copy = engine.manager.open_host((Kind.OPTIM, chunk), writable=False)
        try:
            views = _slot_views(engine, chunk, region)
            for i in group:
                slot = engine.layout.slots[i]
                span = slice(slot.offset, slot.offset + slot.numel)
                states = {k: v[span].view(slot.shape).clone() for k, v in views.items()}
                yield i, (engine.tensor_steps[i], states)
        finally:
            engine.manager.close_host(copy, modified=False)


def check_moments(engine, values: dict[int, MomentState | None]) -> None:
    """Raise (changing nothing) if a state does not fit its tensor."""
    for i, value in values.items():
        if value is None:
            continue
        step, states = value
        entry = engine.registry.entries[i]
        if not entry.trainable:
            raise ValueError(f"optimizer state for {entry.name}, which is frozen (no moments)")
        shape = engine.layout.slots[i].shape
        for key in engine.chunk_optimizer.state_slots:
            moment = states[key]
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
        if is_split(engine.plan, chunk):
            _write_split(engine, chunk, {i: values[i] for i in group})
            continue
        region, copy = engine.manager.open_host((Kind.OPTIM, chunk))
        try:
            views = _slot_views(engine, chunk, region)
            for i in group:
                slot = engine.layout.slots[i]
                span = slice(slot.offset, slot.offset + slot.numel)
                value = values[i]
                if value is None:
                    for view in views.values():
                        view[span].zero_()
                    engine.tensor_steps[i] = 0
                    continue
                step, states = value
                for key, view in views.items():
                    view[span].copy_(states[key].reshape(-1))
                engine.tensor_steps[i] = step
        finally:
            engine.manager.close_host(copy, modified=True)


def _slot_parts(engine) -> dict[str, int]:
    """Each state slot's part index in an optimizer unit (after the master, if any)."""
    first = int(engine.plan.has_master)
    return {name: first + k for k, name in enumerate(engine.chunk_optimizer.state_slots)}


def _read_split(engine, chunk: int, group: list[int]) -> Iterator[tuple[int, MomentState]]:
    """:func:`read_moments` of an oversize chunk, span by span."""
    for i in group:
        slot = engine.layout.slots[i]
        states = {
            name: read_tensor(engine.manager, Kind.OPTIM, slot, torch.float32, part)
            for name, part in _slot_parts(engine).items()
        }
        yield i, (engine.tensor_steps[i], states)


def _write_split(engine, chunk: int, values: dict[int, MomentState | None]) -> None:
    """:func:`write_moments` of an oversize chunk, span by span."""
    for i, value in values.items():
        slot = engine.layout.slots[i]
        step, states = value if value is not None else (0, None)
        for name, part in _slot_parts(engine).items():
            moment = (
                torch.zeros(slot.numel, dtype=torch.float32)
                if states is None
                else states[name].reshape(-1).to(torch.float32)
            )
            write_elements(engine.manager, Kind.OPTIM, chunk, part, slot.offset, moment)
        engine.tensor_steps[i] = step
