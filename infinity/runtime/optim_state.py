"""Optimizer states (Adam: the moments; each optimizer's state slots) and step counts
of offloaded parameters, as torch's optimizer state.

The optimizers' ``state_dict()`` / ``load_state_dict()`` use this so that loops which
save and restore the optimizer themselves (``transformers.Trainer``
checkpoints, Accelerate's ``save_state``) keep the moments of offloaded
parameters. Values are copied chunk by chunk from the optimizer-state units
(host or NVMe); the copies themselves need RAM for all of them, as torch's
state dict does. ``infinity.save_checkpoint`` streams instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import closing

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.pieces import Window, windows
from infinity.optim.chunk_optimizer import UnitViews
from infinity.optim.offloaded import MomentState
from infinity.runtime.model_chunks import ModelChunks


def read_moments(engine: ModelChunks, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
    """``(index, (step, {slot: state}))`` copies for tensors stepped at least once
    (the caller has settled queued updates: a stale read raises ``StaleRead``)."""
    stepped = [i for i in indices if engine.tensor_steps[i] > 0]
    optimizer = engine.chunk_optimizer
    for chunk, group in engine.layout.group_by_chunk(stepped, int).items():
        slots = [engine.layout.slots[i] for i in group]
        states = [
            {name: torch.empty(slot.numel) for name in optimizer.state_slots} for slot in slots
        ]
        for unit, window in _units(engine, chunk, write=False):
            for slot, values in zip(slots, states, strict=True):
                where = window.overlap(slot.offset, slot.numel)
                if where is None:
                    continue
                # NOTE: fp32 copies whatever the stored format (int8 decoded), as torch's.
                for name, value in optimizer.read_state(unit, where[1]).items():
                    values[name][where[0]].copy_(value)
        for i, slot, values in zip(group, slots, states, strict=True):
            shaped = {k: v.view(slot.shape) for k, v in values.items()}
            yield i, (engine.tensor_steps[i], {**shaped, **_tensor_copies(engine, i)})


def _units(engine: ModelChunks, chunk: int, *, write: bool) -> Iterator[tuple[UnitViews, Window]]:
    """Each window of ``chunk``'s optimizer unit (whole, or its spans) with its unit views
    (state slots in the stored format).

    NOTE: writing, every rank writes the same states and keeps its shard: no gather
    (an int8 block never straddles two shards)."""
    optimizer, has_master = engine.chunk_optimizer, engine.plan.has_master
    each = windows(engine.manager, Kind.OPTIM, chunk, write=write, gather=not write)
    with closing(each):
        for window in each:
            yield optimizer.piece_views(window.parts, has_master), window


def check_moments(engine: ModelChunks, values: dict[int, MomentState | None]) -> None:
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
            moment = states.get(key)  # NOTE: absent: zeros (torch.optim.SGD's None buffer)
            if moment is not None and tuple(moment.shape) != tuple(shape):
                raise ValueError(
                    f"optimizer state {key} of {entry.name} has shape {tuple(moment.shape)}, the "
                    f"parameter has {tuple(shape)}: the state dict is from another model"
                )
        shapes = engine.chunk_optimizer.tensor_state_shapes(tuple(shape))
        for key, size in shapes.items():
            given = states.get(key)
            if given is None:
                raise ValueError(
                    f"optimizer state of {entry.name} has no {key!r} (it has {sorted(states)}): "
                    "the state dict is from another optimizer"
                )
            if tuple(given.shape) != size:
                raise ValueError(
                    f"optimizer state {key} of {entry.name} has shape {tuple(given.shape)}, "
                    f"a parameter of shape {tuple(shape)} has {size}: the state dict is from "
                    "another model"
                )
        if step < 0:
            raise ValueError(f"optimizer state of {entry.name} has step {step}")


def write_moments(engine: ModelChunks, values: dict[int, MomentState | None]) -> None:
    """Set moments and step counts (by tensor index; ``None``: no state, as never
    stepped); check with :func:`check_moments` first. The caller has settled."""
    for i, value in values.items():
        _set_tensor_state(engine, i, value[1] if value is not None else {})
    optimizer = engine.chunk_optimizer
    for chunk, group in engine.layout.group_by_chunk(values, int).items():
        slots = [engine.layout.slots[i] for i in group]
        flats = [
            {
                name: given.reshape(-1).to(torch.float32)
                for name, given in _complete(
                    optimizer.state_slots, _states(values[i]), slot.numel
                ).items()
            }
            for i, slot in zip(group, slots, strict=True)
        ]
        for unit, window in _units(engine, chunk, write=True):
            for slot, flat in zip(slots, flats, strict=True):
                where = window.overlap(slot.offset, slot.numel)
                if where is not None:
                    optimizer.write_state(unit, where[1], {k: v[where[0]] for k, v in flat.items()})
        for i in group:
            value = values[i]
            engine.tensor_steps[i] = value[0] if value is not None else 0


def _states(value: MomentState | None) -> dict[str, torch.Tensor]:
    """The per-element states of ``value`` (none: zeros, as never stepped)."""
    return value[1] if value is not None else {}


def _complete(
    slots: tuple[str, ...], states: dict[str, torch.Tensor], numel: int
) -> dict[str, torch.Tensor]:
    """``states`` with zeros for every slot it leaves out."""
    return {name: states[name] if name in states else torch.zeros(numel) for name in slots}


def _tensor_copies(engine: ModelChunks, index: int) -> dict[str, torch.Tensor]:
    """Copies of tensor ``index``'s per-tensor states (none for most optimizers)."""
    return {name: value.clone() for name, value in engine.tensor_state(index).items()}


def _set_tensor_state(engine: ModelChunks, index: int, states: dict[str, torch.Tensor]) -> None:
    """Set tensor ``index``'s per-tensor states from ``states`` (zeros for those it
    leaves out, as a fresh state)."""
    current = engine.tensor_state(index)
    for name, value in current.items():
        given = states.get(name)
        if given is None:
            value.zero_()
        else:
            value.copy_(given.reshape(value.shape))
