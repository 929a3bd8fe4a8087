"""Fill the chunks with the model's initial values, chunk by chunk.

Parameters that already have values are copied in and their memory is released
at once. Parameters on the ``meta`` device get memory inside a chunk-sized fp32
scratch buffer, then ``init(module)`` runs on each module that owns one (default:
the model's own ``_init_weights`` for a ``transformers`` model, else
``module.reset_parameters()``), so a model larger than host memory never exists
whole in RAM: at most the chunks one module spans are open at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from infinity.chunks.pieces import write_initial
from infinity.chunks.states import TensorState
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.params import ParamEntry, ParamRegistry, is_pretrained_model, placeholder

InitFn = Callable[[nn.Module], None]
# ``offload(model, cfg, init=LOAD)``: meta parameters stay unset (their chunks hold
# zeros) until a load writes them; using one before raises UnsetParameterError.
LOAD = "load"
Init = InitFn | str
log = logging.getLogger("infinity")


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``."""
    module.reset_parameters()  # type: ignore[operator]


def native_init(model: nn.Module) -> InitFn | None:
    """The model's own initialisation, where its library defines one: a ``transformers``
    ``PreTrainedModel``'s ``_init_weights(module)`` (what ``from_config`` would run,
    module by module); ``None`` otherwise (then ``reset_parameters()``)."""
    if not is_pretrained_model(model):
        return None
    init = getattr(model, "_init_weights", None)
    return init if callable(init) else None


def modules_needing_init(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own a parameter on the meta device."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if any(p.is_meta for p in m.parameters(recurse=False))
    ]


def check_initialisable(model: nn.Module, init: Init | None) -> None:
    """With the default init, every module with meta parameters needs ``reset_parameters``,
    and every meta buffer needs a module that can fill it; ``init`` is a callable,
    ``None`` or :data:`LOAD`."""
    if isinstance(init, str):
        if init != LOAD:
            raise ValueError(f"init={init!r}: pass a callable init(module), None, or {LOAD!r}")
        _refuse_meta_buffers(model, lambda m: False)  # nothing fills a buffer
        return
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
    _refuse_meta_buffers(model, lambda m: callable(getattr(m, "reset_parameters", None)))


def _refuse_meta_buffers(model: nn.Module, fills: Callable[[nn.Module], bool]) -> None:
    """Raise naming every buffer on ``meta`` whose module the init cannot fill."""
    unfillable = [
        f"{prefix}.{name}" if prefix else name
        for prefix, m in model.named_modules()
        for name, buf in m.named_buffers(recurse=False)
        if buf is not None and buf.is_meta and not fills(m)
    ]
    if unfillable:
        raise ValueError(unfilled_buffers_message(unfillable))


def unfilled_buffers_message(names: list[str]) -> str:
    """The error for buffers left on ``meta``: which ones, and how to get real values."""
    return (
        f"buffers on the meta device that nothing initialised: {', '.join(names)}. "
        "The model's constructor computes them, but under torch.device('meta') it computed "
        "nothing; build the model under `with infinity.init_empty():` (parameters on meta, "
        "buffers real), or pass init=fn to infinity.offload() that fills them "
        "(fn(module) is also called on each module owning a meta buffer)."
    )


@dataclass
class PendingBuffer:
    """A meta buffer given zeroed memory, which ``init`` must fill."""

    module: nn.Module
    name: str
    full_name: str
    tensor: torch.Tensor
    version: int

    def filled(self) -> bool:
        """Whether ``init`` replaced the buffer or wrote into it.

        NOTE: in-place writes bump the tensor's version counter; a write through
        ``.data`` does not, so a non-zero value counts as written too.
        """
        current = self.module._buffers.get(self.name)
        if current is not self.tensor or self.tensor._version != self.version:
            return True
        return bool(self.tensor.numel() and torch.count_nonzero(self.tensor).item())


def materialize_buffers(model: nn.Module, device: torch.device) -> list[PendingBuffer]:
    """Give meta buffers zeroed memory; returns them so ``fill_chunks`` can check that
    ``init`` filled each (never hand out uninitialised values)."""
    pending = []
    for prefix, module in model.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                real = torch.zeros_like(buf, device=device)
                module._buffers[name] = real
                full = f"{prefix}.{name}" if prefix else name
                pending.append(PendingBuffer(module, name, full, real, real._version))
    return pending


class _Progress:
    """Logs "n of N chunks" every few seconds while filling a large model.

    Initialising a big model on NVMe takes minutes; a silent pause there is
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

    def __init__(self, values: torch.Tensor, pending: int) -> None:
        self.values = values
        self.pending = pending


class _ScratchPool:
    """Zeroed fp32 scratch buffers, reused by capacity.

    NOTE: allocating and freeing one chunk-sized buffer per chunk let glibc's
    dynamic mmap threshold move them onto the heap, where freed buffers stayed
    resident: filling a 224 MiB model grew RSS by 275 MiB instead of ~80.
    Reusing them bounds the scratch memory by the chunks open at once.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, capacity: int) -> torch.Tensor:
        free = self._free.get(capacity)
        if free:
            return free.pop().zero_()
        return torch.zeros(capacity, dtype=torch.float32)

    def give(self, values: torch.Tensor) -> None:
        self._free.setdefault(values.numel(), []).append(values)


def take_values(
    registry: ParamRegistry, dtype: torch.dtype, device: torch.device
) -> tuple[set[int], dict[int, torch.Tensor]]:
    """Point every parameter at its placeholder, at offload: the indices of those that
    were on ``meta`` (``init`` makes their values in :func:`fill_chunks`), and the
    values of the others, kept until :func:`fill_chunks` copies them into the chunks.

    NOTE [the layout is decided once, late]: from offload on, a parameter looks as
    offloaded (a placeholder on the engine's device and in its dtype), whether or
    not the chunks are laid out yet: libraries read ``model.device`` from it
    (``transformers``' ``generate`` puts its inputs there) before any forward.
    NOTE: a meta tensor's .data cannot be re-pointed at real memory; swap_tensors
    turns the same Parameter object (tied references and all) into a real one, so
    user references stay valid. At offload, before the optimizer registry holds
    weak references to the parameters (swap_tensors refuses a tensor with one).
    """
    on_meta: set[int] = set()
    kept: dict[int, torch.Tensor] = {}
    for entry in registry.entries:
        if entry.placeholder is None:
            entry.placeholder = placeholder(entry.shape, dtype, device)
        if entry.param.is_meta:
            on_meta.add(entry.index)
            fresh = nn.Parameter(entry.placeholder, requires_grad=entry.trainable)
            torch.utils.swap_tensors(entry.param, fresh)
            entry.placeholder_version = entry.param._version
        else:
            kept[entry.index] = entry.param.data
            entry.show_placeholder()
    return on_meta, kept


def fill_chunks(
    engine: OffloadEngine,
    model: nn.Module,
    init: Init | None,
    pending: list[PendingBuffer] = (),  # type: ignore[assignment]
    on_meta: set[int] = frozenset(),  # type: ignore[assignment]
    kept: dict[int, torch.Tensor] | None = None,
) -> None:
    """Write every chunk's initial values and release the model's own parameter memory.
    ``on_meta`` and ``kept``: from :func:`take_values` (the parameters ``init`` fills,
    and the values of the others, dropped here as their chunks are written).

    ``init`` also runs on each module owning a ``pending`` buffer that it did
    not run on already; a pending buffer it leaves untouched is an error. With
    :data:`LOAD`, meta parameters are left unset (zeros) for a load to fill."""
    lazy = init == LOAD
    init_fn: InitFn = (lambda module: None) if lazy else (init or default_init)  # type: ignore[assignment]
    layout = engine.layout
    open_chunks: dict[int, _OpenChunk] = {}
    scratch = _ScratchPool()
    done: set[int] = set()
    progress = _Progress(layout.num_chunks)

    def scratch_view(entry: ParamEntry) -> torch.Tensor:
        slot = layout.slots[entry.index]
        chunk = open_chunks.get(slot.chunk)
        if chunk is None:
            members = engine.chunks.chunk_members[slot.chunk]
            chunk = open_chunks[slot.chunk] = _OpenChunk(
                scratch.take(layout.chunks[slot.chunk].capacity), len(members)
            )
        return chunk.values[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def finish(entry: ParamEntry) -> None:
        done.add(entry.index)
        engine.chunks.release(entry)
        chunk_index = layout.slots[entry.index].chunk
        chunk = open_chunks[chunk_index]
        chunk.pending -= 1
        if chunk.pending == 0:
            # Background: waiting for each write made initialising a model
            # on NVMe the sum of compute and disk time, not the larger of the two.
            write_initial(engine.manager, chunk_index, chunk.values, background=True)
            scratch.give(chunk.values)
            del open_chunks[chunk_index]
            progress.advance()

    initialised: set[nn.Module] = set()
    for module, entries in engine.registry.owners.items():
        todo = [e for e in entries if e.index not in done]
        if not todo:
            continue
        meta = [e for e in todo if e.index in on_meta]
        for entry in todo:
            if entry.index not in on_meta:
                with torch.no_grad():
                    scratch_view(entry).copy_(
                        kept.pop(entry.index) if kept is not None else entry.param.data
                    )
                finish(entry)
        if not meta:
            continue
        for entry in meta:
            entry.param.data = scratch_view(entry)
        with torch.no_grad():
            init_fn(module)
        initialised.add(module)
        if lazy:
            engine.chunks.unset.update(e.index for e in meta)
        for entry in meta:
            finish(entry)
    if open_chunks:
        raise AssertionError(f"chunks {sorted(open_chunks)} were never completed")
    # The last writes land (or their error raises) before offload returns.
    engine.manager.synchronize()
    _fill_buffers(pending, None if lazy else init, initialised)  # type: ignore[arg-type]
    for entry in engine.registry.entries:
        engine.chunks.set_state(entry, TensorState.HOLD)


def fill_parameterless_buffers(
    pending: list[PendingBuffer], init: Init | None
) -> list[PendingBuffer]:
    """Fill the pending buffers of modules that own no parameter (rotary embeddings'
    frequencies, say) now, at offload, raising as :func:`fill_chunks` would if ``init``
    leaves one untouched; the others, whose modules' parameters get memory only when
    the model is laid out (NOTE [the layout is decided once, late]), are returned."""
    owns_params = [any(True for _ in b.module.parameters(recurse=False)) for b in pending]
    early = [b for b, owns in zip(pending, owns_params, strict=True) if not owns]
    _fill_buffers(early, None if init == LOAD else init, set())  # type: ignore[arg-type]
    return [b for b, owns in zip(pending, owns_params, strict=True) if owns]


def _fill_buffers(
    pending: list[PendingBuffer], init: InitFn | None, initialised: set[nn.Module]
) -> None:
    """Run ``init`` on buffer-owning modules it has not seen; every pending buffer must
    then hold values (the default init runs only where ``reset_parameters`` exists)."""
    for buffer in pending:
        module = buffer.module
        if module in initialised:
            continue
        initialised.add(module)
        if init is not None:
            init(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()  # type: ignore[operator]
    unfilled = [b.full_name for b in pending if not b.filled()]
    if unfilled:
        raise ValueError(unfilled_buffers_message(unfilled))
