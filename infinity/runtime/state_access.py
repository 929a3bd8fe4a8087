"""Read and write the values behind offloaded parameters, chunk by chunk.

Used by ``model.state_dict()`` / ``load_state_dict()``, by checkpoints and by
``infinity.gradients``. Every access goes through the chunk manager, so values
come from wherever the chunk's home is (host or NVMe).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import ExitStack, closing

import torch
from torch import nn

from infinity.chunks.homes import Kind
from infinity.chunks.pieces import tensor_values
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry, tensor_index


def read_params(
    engine: OffloadEngine, entries: Iterable[ParamEntry], *, master: bool = False
) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
    """Copies of parameter values (compute dtype; fp32 masters when ``master``)."""
    entries = list(entries)
    engine.chunks.require_set(entries, "reading parameter values")
    engine.collectives.align("reading parameter values (state_dict)")
    engine.queue.settle()
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        use_master = master and engine.plan.has_master and engine.layout.chunks[chunk].trainable
        kind = Kind.OPTIM if use_master else Kind.PARAM
        dtype = torch.float32 if use_master else engine.dtype
        slots = [engine.layout.slots[entry.index] for entry in group]
        values = tensor_values(engine.manager, kind, chunk, slots, dtype, copy=True)
        with closing(values):
            for entry, slot, flat in zip(group, slots, values, strict=True):
                yield entry, flat.view(slot.shape)


def write_params(engine: OffloadEngine, values: dict[int, torch.Tensor]) -> None:
    """Set parameters (by tensor index) to ``values``; fp32 masters follow."""
    engine.collectives.align("writing parameter values (load_state_dict)")
    engine.queue.settle()
    entries = [engine.registry.entries[i] for i in values]
    _write_entries(engine, entries, values)
    engine.chunks.mark_set(values)


def _write_entries(
    engine: OffloadEngine, entries: list[ParamEntry], values: dict[int, torch.Tensor]
) -> None:
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        slots = [engine.layout.slots[entry.index] for entry in group]
        for kind, dtype in _stored_kinds(engine, chunk):
            # Every rank writes the same values and keeps its shard: no gather.
            views = tensor_values(
                engine.manager, kind, chunk, slots, dtype, write=True, fill=False, gather=False
            )
            with closing(views):
                for entry, slot, flat in zip(group, slots, views, strict=True):
                    flat.copy_(_checked(entry, values[entry.index], slot.shape).reshape(-1))
        engine.manager.drop_param(chunk)


def _stored_kinds(engine: OffloadEngine, chunk: int) -> list[tuple[Kind, torch.dtype]]:
    """Where a chunk's parameter values live: the parameters, and the fp32 masters
    of a 16-bit run's trainable chunks."""
    kinds = [(Kind.PARAM, engine.dtype)]
    if engine.plan.has_master and engine.layout.chunks[chunk].trainable:
        kinds.append((Kind.OPTIM, torch.float32))
    return kinds


def _checked(entry: ParamEntry, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``value``, if it has the parameter's shape."""
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{entry.name}: value of shape {tuple(value.shape)} does not match the "
            f"parameter's shape {shape}"
        )
    return value


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
    engine.collectives.align("reading gradients (infinity.gradients)")
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
    engine.queue.settle()
    entries = [engine.registry.entries[i] for i in writers]
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        slots = [engine.layout.slots[entry.index] for entry in group]
        with ExitStack() as stack:
            # Sharded, each rank keeps its shard of what it writes: no gather.
            # An oversize chunk's tensors come as one transient copy each.
            streams = [
                stack.enter_context(
                    closing(
                        tensor_values(
                            engine.manager,
                            kind,
                            chunk,
                            slots,
                            dtype,
                            write=True,
                            fill=False,
                            gather=False,
                        )
                    )
                )
                for kind, dtype in _stored_kinds(engine, chunk)
            ]
            for entry, *flats in zip(group, *streams, strict=True):
                writers[entry.index](flats)
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
    engine.queue.settle()
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        slots = [engine.layout.slots[entry.index] for entry in group]
        with closing(
            tensor_values(engine.manager, Kind.PARAM, chunk, slots, engine.dtype)
        ) as values:
            for entry, flat in zip(group, values, strict=True):
                yield entry, flat.view(torch.uint8).numpy().data
