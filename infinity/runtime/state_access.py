"""Read and write the values behind offloaded parameters, chunk by chunk.

Used by ``model.state_dict()`` / ``load_state_dict()``, by checkpoints and by
``infinity.gradients``. Every access goes through the chunk manager, so values
come from wherever the chunk's home is (host or NVMe).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from infinity.chunks.homes import Kind
from infinity.chunks.manager import typed
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry, tensor_index


def read_params(
    engine: OffloadEngine, entries: Iterable[ParamEntry], *, master: bool = False
) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
    """Copies of parameter values (compute dtype; fp32 masters when ``master``)."""
    engine.settle_step()
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        use_master = master and engine.plan.has_master and engine.layout.chunks[chunk].trainable
        key = (Kind.OPTIM, chunk) if use_master else (Kind.PARAM, chunk)
        region, copy = engine.manager.open_host(key, writable=False)
        try:
            flat = typed(region, torch.float32 if use_master else engine.dtype)
            for entry in group:
                slot = engine.layout.slots[entry.index]
                yield entry, flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        finally:
            engine.manager.close_host(copy, modified=False)


def write_params(engine: OffloadEngine, values: dict[int, torch.Tensor]) -> None:
    """Set parameters (by tensor index) to ``values``; fp32 masters follow."""
    engine.settle_step()
    entries = [engine.registry.entries[i] for i in values]
    for chunk, group in engine.layout.group_by_chunk(entries, tensor_index).items():
        for key, dtype in ((Kind.PARAM, engine.dtype), (Kind.OPTIM, torch.float32)):
            if key is Kind.OPTIM and not (
                engine.plan.has_master and engine.layout.chunks[chunk].trainable
            ):
                continue
            region, copy = engine.manager.open_host((key, chunk))
            try:
                flat = typed(region, dtype)
                for entry in group:
                    slot = engine.layout.slots[entry.index]
                    value = values[entry.index]
                    if tuple(value.shape) != slot.shape:
                        raise ValueError(
                            f"{entry.name}: value of shape {tuple(value.shape)} does not match the "
                            f"parameter's shape {slot.shape}"
                        )
                    flat[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
            finally:
                engine.manager.close_host(copy, modified=True)
        engine.manager.drop_param(chunk)


def _grad_views(
    engine: OffloadEngine, indices: Iterable[int]
) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
    """The gradients of the tensors in ``indices`` that have one, chunk by chunk, as
    torch's ``param.grad`` would hold them: views of the host copies (valid during
    the iteration step), or scaled copies where a clip factor is pending."""
    for entry, view in engine.grad_views(indices):
        yield entry, engine.stored_gradient(entry.index, view)


def gradients(model: nn.Module, engine: OffloadEngine) -> dict[str, torch.Tensor]:
    """Copies of every gradient held in chunks, by parameter name (RAM for all of them)."""
    indices = range(len(engine.registry.entries))
    return {entry.name: view.clone() for entry, view in _grad_views(engine, indices)}
