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

import torch

from infinity.chunks.cache import Copy
from infinity.chunks.homes import Kind
from infinity.chunks.shards import close_whole, open_whole
from infinity.chunks.span_access import open_span
from infinity.chunks.spans import is_split, span_ranges
from infinity.optim.chunk_optimizer import UnitViews
from infinity.optim.offloaded import MomentState
from infinity.runtime.model_chunks import ModelChunks


def _unit(engine: ModelChunks, chunk: int, region: torch.Tensor) -> UnitViews:
    """A chunk's optimizer unit cut into its parts (state slots in the stored format)."""
    capacity = engine.layout.chunks[chunk].capacity
    return engine.chunk_optimizer.unit_views(region, capacity, engine.plan.has_master)


def read_moments(engine: ModelChunks, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
    """``(index, (step, {slot: state}))`` copies for tensors stepped at least once
    (the caller has settled queued updates: a stale read raises ``StaleRead``)."""
    stepped = [i for i in indices if engine.tensor_steps[i] > 0]
    for chunk, group in engine.layout.group_by_chunk(stepped, int).items():
        if is_split(engine.plan, chunk):
            yield from _read_split(engine, chunk, group)
            continue
        region, copy = open_whole(engine.manager, (Kind.OPTIM, chunk), writable=False)
        try:
            unit = _unit(engine, chunk, region)
            for i in group:
                slot = engine.layout.slots[i]
                span = slice(slot.offset, slot.offset + slot.numel)
                # NOTE: fp32 copies whatever the stored format (int8 decoded), as torch's.
                values = engine.chunk_optimizer.read_state(unit, span)
                states = {k: v.view(slot.shape) for k, v in values.items()}
                yield i, (engine.tensor_steps[i], {**states, **_tensor_copies(engine, i)})
        finally:
            close_whole(engine.manager, copy, modified=False)


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
    for chunk, group in engine.layout.group_by_chunk(values, int).items():
        if is_split(engine.plan, chunk):
            _write_split(engine, chunk, {i: values[i] for i in group})
            continue
        # NOTE: every rank writes the same states and keeps its shard: no gather
        # (an int8 block never straddles two shards).
        region, copy = open_whole(engine.manager, (Kind.OPTIM, chunk), gather=False)
        try:
            unit = _unit(engine, chunk, region)
            optimizer = engine.chunk_optimizer
            for i in group:
                slot = engine.layout.slots[i]
                span = slice(slot.offset, slot.offset + slot.numel)
                value = values[i]
                if value is None:
                    zeros = torch.zeros(slot.numel)
                    optimizer.write_state(unit, span, dict.fromkeys(optimizer.state_slots, zeros))
                    engine.tensor_steps[i] = 0
                    continue
                step, states = value
                full = _complete(optimizer.state_slots, states, slot.numel)
                optimizer.write_state(unit, span, full)
                engine.tensor_steps[i] = step
        finally:
            close_whole(engine.manager, copy, modified=True)


def _each_span_unit(
    engine: ModelChunks, chunk: int, first: int, last: int, *, load: bool = True
) -> Iterator[tuple[slice, slice, UnitViews, Copy | None]]:
    """For each span of oversize ``chunk`` overlapping elements ``[first, last)``:
    (where in the range, where in the span, the span's unit views, its copy to close)."""
    optimizer, has_master = engine.chunk_optimizer, engine.plan.has_master
    for low, high in span_ranges(engine.plan, chunk):
        a, b = max(low, first), min(high, last)
        if a >= b:
            continue
        pieces, copy = open_span(engine.manager, Kind.OPTIM, chunk, low, high, load=load)
        yield (
            slice(a - first, b - first),
            slice(a - low, b - low),
            optimizer.piece_views(pieces, has_master),
            copy,
        )


def _read_split(
    engine: ModelChunks, chunk: int, group: list[int]
) -> Iterator[tuple[int, MomentState]]:
    """:func:`read_moments` of an oversize chunk, span by span (never staged whole)."""
    optimizer = engine.chunk_optimizer
    for i in group:
        slot = engine.layout.slots[i]
        states = {name: torch.empty(slot.numel) for name in optimizer.state_slots}
        spans = _each_span_unit(engine, chunk, slot.offset, slot.offset + slot.numel)
        for into, span, unit, copy in spans:
            try:
                for name, values in optimizer.read_state(unit, span).items():
                    states[name][into].copy_(values)
            finally:
                engine.manager.close_host(copy, modified=False)
        shaped = {k: v.view(slot.shape) for k, v in states.items()}
        yield i, (engine.tensor_steps[i], {**shaped, **_tensor_copies(engine, i)})


def _write_split(engine: ModelChunks, chunk: int, values: dict[int, MomentState | None]) -> None:
    """:func:`write_moments` of an oversize chunk, span by span."""
    optimizer = engine.chunk_optimizer
    for i, value in values.items():
        slot = engine.layout.slots[i]
        step, states = value if value is not None else (0, None)
        flat = {
            name: values.reshape(-1).to(torch.float32)
            for name, values in _complete(optimizer.state_slots, states or {}, slot.numel).items()
        }
        spans = _each_span_unit(engine, chunk, slot.offset, slot.offset + slot.numel)
        for into, span, unit, copy in spans:
            try:
                optimizer.write_state(unit, span, {k: v[into] for k, v in flat.items()})
            finally:
                engine.manager.close_host(copy, modified=True)
        engine.tensor_steps[i] = step


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
