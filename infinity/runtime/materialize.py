"""Fill the chunks with the model's initial values, chunk by chunk.

Parameters that already have values are copied in and their memory is released
at once. Parameters on the ``meta`` device get memory inside a chunk-sized fp32
scratch buffer, then ``init(module)`` runs on each module that owns one (default
``module.reset_parameters()``), so a model larger than host memory never exists
whole in RAM: at most the chunks one module spans are open at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from infinity.chunks.states import TensorState
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry

InitFn = Callable[[nn.Module], None]
log = logging.getLogger("infinity")


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``."""
    module.reset_parameters()  # type: ignore[operator]


def modules_needing_init(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own a parameter on the meta device."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if any(p.is_meta for p in m.parameters(recurse=False))
    ]


def check_initialisable(model: nn.Module, init: InitFn | None) -> None:
    """With the default init, every module with meta parameters needs ``reset_parameters``."""
    if init is not None:
        return
    missing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in modules_needing_init(model)
        if not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            "these modules have parameters on the meta device but no reset_parameters() to "
            f"initialise them: {', '.join(missing)}. Pass init=fn to infinity.offload(); "
            "fn(module) is called once the module's parameters have memory."
        )


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Give meta buffers real (uninitialised) memory; ``init`` is expected to fill them."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=device)


class _Progress:
    """Logs "n of N chunks" every few seconds while filling a large model.

    NOTE: initialising a big model on NVMe takes minutes; a silent pause there is
    what users of other offload engines report as a hang.
    """

    def __init__(self, total: int, every_s: float = 5.0) -> None:
        self.total = total
        self.done = 0
        self.every_s = every_s
        self._start = self._last = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= self.every_s or (
            self.done == self.total and now - self._start > self.every_s
        ):
            self._last = now
            log.info(
                "infinity: filled %d of %d chunks (%.0f s)",
                self.done,
                self.total,
                now - self._start,
            )


class _OpenChunk:
    """An fp32 scratch chunk waiting for its tensors' values."""

    def __init__(self, capacity: int, pending: int) -> None:
        self.values = torch.zeros(capacity, dtype=torch.float32)
        self.pending = pending


def fill_chunks(engine: OffloadEngine, model: nn.Module, init: InitFn | None) -> None:
    """Write every chunk's initial values and release the model's own parameter memory."""
    init_fn = init or default_init
    layout = engine.layout
    open_chunks: dict[int, _OpenChunk] = {}
    done: set[int] = set()
    progress = _Progress(layout.num_chunks)

    def scratch_view(entry: ParamEntry) -> torch.Tensor:
        slot = layout.slots[entry.index]
        chunk = open_chunks.get(slot.chunk)
        if chunk is None:
            members = engine.chunk_members[slot.chunk]
            chunk = open_chunks[slot.chunk] = _OpenChunk(
                layout.chunks[slot.chunk].capacity, len(members)
            )
        return chunk.values[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def finish(entry: ParamEntry) -> None:
        done.add(entry.index)
        engine.release(entry)
        chunk_index = layout.slots[entry.index].chunk
        chunk = open_chunks[chunk_index]
        chunk.pending -= 1
        if chunk.pending == 0:
            engine.manager.write_initial(chunk_index, chunk.values)
            del open_chunks[chunk_index]
            progress.advance()

    on_meta = {e.index for e in engine.registry.entries if e.param.is_meta}
    for entry in engine.registry.entries:
        if entry.index in on_meta:
            # NOTE: a meta tensor's .data cannot be re-pointed at real memory;
            # swap_tensors turns the same Parameter object (tied references and
            # all) into a real one, so user references stay valid.
            engine.release_new(entry)
    for module, entries in engine.registry.owners.items():
        todo = [e for e in entries if e.index not in done]
        if not todo:
            continue
        meta = [e for e in todo if e.index in on_meta]
        for entry in todo:
            if entry.index not in on_meta:
                with torch.no_grad():
                    scratch_view(entry).copy_(entry.param.data)
                finish(entry)
        if not meta:
            continue
        for entry in meta:
            entry.param.data = scratch_view(entry)
        with torch.no_grad():
            init_fn(module)
        for entry in meta:
            finish(entry)
    if open_chunks:
        raise AssertionError(f"chunks {sorted(open_chunks)} were never completed")
    leftovers = [name for name, b in model.named_buffers() if b.is_meta]
    if leftovers:
        raise ValueError(
            f"buffers still on the meta device after init: {', '.join(leftovers)}; "
            "pass an init function that fills them"
        )
    for entry in engine.registry.entries:
        engine.set_state(entry, TensorState.HOLD)
