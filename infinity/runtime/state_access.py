"""Read and write the values behind offloaded parameters, chunk by chunk.

Used by ``model.state_dict()`` / ``load_state_dict()``, by checkpoints and by
``infinity.gradients``. Every access goes through the chunk manager, so values
come from wherever the chunk's home is (host or NVMe).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator

import torch
from torch import nn

from infinity.chunks.homes import Kind
from infinity.chunks.manager import typed
from infinity.chunks.shards import close_whole, open_whole
from infinity.chunks.span_access import read_tensor, write_elements
from infinity.chunks.spans import is_split
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry, tensor_index


def read_params(
    engine: OffloadEngine, entries: Iterable[ParamEntry], *, master: bool = False
) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
    """Copies of parameter values (compute dtype; fp32 masters when ``master``)."""
    entries = list(entries)
    engine.chunks.require_set(entries, "reading parameter values")
    engine.settle_step()
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        use_master = master and engine.plan.has_master and engine.layout.chunks[chunk].trainable
        key = (Kind.OPTIM, chunk) if use_master else (Kind.PARAM, chunk)
        dtype = torch.float32 if use_master else engine.dtype
        if is_split(engine.plan, chunk):
            for entry in group:
                yield (
                    entry,
                    read_tensor(engine.manager, key[0], engine.layout.slots[entry.index], dtype),
                )
            continue
        region, copy = open_whole(engine.manager, key, writable=False)
        try:
            flat = typed(region, torch.float32 if use_master else engine.dtype)
            for entry in group:
                slot = engine.layout.slots[entry.index]
                yield entry, flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        finally:
            close_whole(engine.manager, copy, modified=False)


def write_params(engine: OffloadEngine, values: dict[int, torch.Tensor]) -> None:
    """Set parameters (by tensor index) to ``values``; fp32 masters follow."""
    engine.settle_step()
    entries = [engine.registry.entries[i] for i in values]
    _write_entries(engine, entries, values)
    engine.chunks.mark_set(values)


def _write_entries(
    engine: OffloadEngine, entries: list[ParamEntry], values: dict[int, torch.Tensor]
) -> None:
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        for key, dtype in ((Kind.PARAM, engine.dtype), (Kind.OPTIM, torch.float32)):
            if key is Kind.OPTIM and not (
                engine.plan.has_master and engine.layout.chunks[chunk].trainable
            ):
                continue
            if is_split(engine.plan, chunk):
                _write_split(engine, key, dtype, chunk, group, values)
                continue
            # NOTE: every rank writes the same values and keeps its shard: no gather.
            region, copy = open_whole(engine.manager, (key, chunk), gather=False)
            try:
                flat = typed(region, dtype)
                for entry in group:
                    slot = engine.layout.slots[entry.index]
                    value = _checked(entry, values[entry.index], slot.shape)
                    flat[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
            finally:
                close_whole(engine.manager, copy, modified=True)
        engine.manager.drop_param(chunk)


def _checked(entry: ParamEntry, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``value``, if it has the parameter's shape."""
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{entry.name}: value of shape {tuple(value.shape)} does not match the "
            f"parameter's shape {shape}"
        )
    return value


def _write_split(
    engine: OffloadEngine,
    kind: Kind,
    dtype: torch.dtype,
    chunk: int,
    group: list[ParamEntry],
    values: dict[int, torch.Tensor],
) -> None:
    """``write_params`` of an oversize chunk, span by span."""
    for entry in group:
        slot = engine.layout.slots[entry.index]
        value = _checked(entry, values[entry.index], slot.shape)
        write_elements(engine.manager, kind, chunk, 0, slot.offset, value.to(dtype))


def _grad_views(
    engine: OffloadEngine, indices: Iterable[int]
) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
    """The gradients of the tensors in ``indices`` that have one, chunk by chunk, as
    torch's ``param.grad`` would hold them: views of the host copies (valid during
    the iteration step), or scaled copies where a clip factor is pending."""
    for entry, view in engine.norms.grad_views(indices):
        yield entry, engine.ledger.stored_gradient(entry.index, view)


def gradients(model: nn.Module, engine: OffloadEngine) -> dict[str, torch.Tensor]:
    """Copies of every gradient held in chunks, by parameter name (RAM for all of them)."""
    indices = range(len(engine.registry.entries))
    return {entry.name: view.clone() for entry, view in _grad_views(engine, indices)}


ValueWriter = Callable[[list[torch.Tensor]], None]


def stream_params_in(engine: OffloadEngine, writers: dict[int, ValueWriter]) -> None:
    """Set parameters (by tensor index) chunk by chunk, without holding any value whole.

    ``writers[index](destinations)`` writes the tensor's values into each flat
    destination: the parameter in the compute dtype and, for 16-bit training,
    its fp32 master. Each chunk is opened once (both kinds at a time) and its
    device copy dropped afterwards.
    """
    engine.settle_step()
    entries = [engine.registry.entries[i] for i in writers]
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        master = engine.plan.has_master and engine.layout.chunks[chunk].trainable
        if is_split(engine.plan, chunk):
            # NOTE: the writers fill whole tensors: one transient copy of the
            # tensor, then written in spans (staging stays chunk-sized).
            for entry in group:
                slot = engine.layout.slots[entry.index]
                flats = [torch.empty(slot.numel, dtype=engine.dtype)]
                flats += [torch.empty(slot.numel, dtype=torch.float32)] if master else []
                writers[entry.index](flats)
                for kind, flat in zip((Kind.PARAM, Kind.OPTIM), flats, strict=False):
                    write_elements(engine.manager, kind, chunk, 0, slot.offset, flat)
            engine.manager.drop_param(chunk)
            continue
        # NOTE: sharded, each rank keeps its shard of what it writes: no gather.
        opened = [(open_whole(engine.manager, (Kind.PARAM, chunk), gather=False), engine.dtype)]
        try:
            if master:
                optim = open_whole(engine.manager, (Kind.OPTIM, chunk), gather=False)
                opened.append((optim, torch.float32))
            flats = [typed(region, dtype) for (region, _copy), dtype in opened]
            for entry in group:
                slot = engine.layout.slots[entry.index]
                writers[entry.index]([f[slot.offset : slot.offset + slot.numel] for f in flats])
        finally:
            for (_region, copy), _dtype in opened:
                close_whole(engine.manager, copy, modified=True)
        engine.manager.drop_param(chunk)
    engine.chunks.mark_set(writers)


def param_bytes_by_chunk(
    engine: OffloadEngine, entries: Iterable[ParamEntry]
) -> Generator[tuple[ParamEntry, memoryview], None, None]:
    """The raw bytes (compute dtype) of each parameter, chunk by chunk, zero-copy.

    A view is valid only until the next item is drawn.
    """
    entries = list(entries)
    engine.chunks.require_set(entries, "reading parameter values")
    engine.settle_step()
    size = engine.plan.element_size
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        if is_split(engine.plan, chunk):
            for entry in group:
                slot = engine.layout.slots[entry.index]
                flat = read_tensor(engine.manager, Kind.PARAM, slot, engine.dtype).reshape(-1)
                yield entry, flat.view(torch.uint8).numpy().data
            continue
        region, copy = open_whole(engine.manager, (Kind.PARAM, chunk), writable=False)
        try:
            data = region.numpy().data
            for entry in group:
                slot = engine.layout.slots[entry.index]
                yield entry, data[slot.offset * size : (slot.offset + slot.numel) * size]
        finally:
            close_whole(engine.manager, copy, modified=False)
