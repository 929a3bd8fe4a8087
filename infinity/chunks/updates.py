"""A chunk's optimizer update in host memory, whatever shape the chunk takes.

The update walks :func:`update_windows`: each window holds the
chunk's gradients, optimizer unit and parameters over the same elements (its
home; an oversize chunk's span; or, for an optimizer that reads whole tensors
(``ChunkOptimizer.whole_tensors``: Adafactor's norms and row and column means),
the whole chunk). Under data parallel such an optimizer gets each chunk
gathered whole from every rank (a tensor may straddle two ranks' shards):
every rank steps all of it alike and keeps its own shard of the result, and
each rank keeps a whole copy of the per-tensor states (Adafactor's factors),
updated identically everywhere, so the result is the one process's, bit for
bit. The gathers are collective; see
NOTE [collective updates run in a fixed order]. An oversize chunk's one tensor
is copied out of its spans instead (:func:`_gather_spans`).

The step over chunks (``runtime/offloaded_step.py``) steps each window; nothing
above this module asks whether a chunk is whole, in spans or sharded.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import closing
from typing import Any, NamedTuple

import torch

from infinity.chunks.manager import ChunkManager
from infinity.chunks.pieces import Window, windows
from infinity.chunks.pools import SpanKey, is_split, part_ranges, span_key, span_ranges
from infinity.chunks.shards import WholeChunk, close_whole, open_whole, whole_bytes
from infinity.config import ConfigError
from infinity.core.names import DEVICE, Kind
from infinity.core.plan import FP32_BYTES, Plan
from infinity.optim.chunk_optimizer import StateFormat, unit_ranges
from infinity.utils.sizes import format_size


class UpdateWindow(NamedTuple):
    """Elements ``[start, end)`` of chunk ``chunk`` opened for its optimizer update:
    the gradients and parameters (compute dtype) one piece each, the optimizer unit
    its pieces in home order (fp32 master, each state slot's values and int8
    scales), all uint8 and starting at element ``start``. ``params`` is ``None`` in
    a tensor gathered from its spans with an fp32 master: it is written from the
    master when the window closes."""

    chunk: int
    start: int
    end: int
    grads: torch.Tensor
    unit: list[torch.Tensor]
    params: torch.Tensor | None
    handles: tuple[Any, Any, Any]  # what closes the gradients, the unit, the parameters


def opens_once(plan: Plan, chunk: int) -> bool:
    """The update of ``chunk`` is one window of this process's own homes: not spans of
    an oversize chunk, not gathered from other ranks (it waits on nobody once open)."""
    return not plan.sharded and not is_split(plan, chunk)


def gathers_from_ranks(plan: Plan, *, whole: bool) -> bool:
    """Every update gathers its chunk from every rank (collective): a sharded plan
    stepped by an optimizer that reads whole tensors (``whole``)."""
    return plan.sharded and whole


def update_windows(
    manager: ChunkManager, chunk: int, *, load_params: bool, whole: bool
) -> Generator[UpdateWindow, None, None]:
    """Every window of ``chunk``'s update, in order, each opened with
    :func:`open_update` and closed with :func:`close_update` when the next is drawn
    (a success) or the caller raises (a failure): an oversize chunk's spans, the
    next span's reads started while the caller computes on this one; else one
    window, this rank's home. Wrap the iterator in :func:`contextlib.closing`.

    ``whole`` (an optimizer that reads whole tensors): every tensor lies in one
    window. A sharded chunk is then gathered whole from every rank (collective);
    an oversize chunk's one tensor is copied out of its spans into transient
    host tensors (:func:`_gather_spans`) and written back span by span when the
    window closes, without reading them again.
    """
    plan = manager.plan
    spans = is_split(plan, chunk)
    if spans and not whole:
        ranges = span_ranges(plan, chunk)
    else:
        capacity = plan.layout.chunks[chunk].capacity
        ranges = [(0, capacity) if whole else plan.home_window(chunk)]
    kinds = [Kind.GRAD, Kind.OPTIM] + ([Kind.PARAM] if load_params else [])
    for position, (start, end) in enumerate(ranges):
        if position + 1 < len(ranges):
            # NOTE: the next span travels while the kernel runs on this one; the
            # current span's staged copies must not be its victims.
            current = {span_key(kind, chunk, start, end) for kind in kinds}
            for kind in kinds:
                manager.prefetch_host(span_key(kind, chunk, *ranges[position + 1]), current)
        if spans and whole:
            window = _gather_spans(manager, chunk)
        else:
            # Unsharded, the whole chunk (``gather``) is the home: not collective.
            window = open_update(manager, chunk, start, end, load_params=load_params, gather=whole)
        try:
            yield window
        except BaseException:
            close_update(manager, window, succeeded=False)
            raise
        close_update(manager, window, succeeded=True)


def open_update(
    manager: ChunkManager,
    chunk: int,
    start: int,
    end: int,
    *,
    load_params: bool,
    gather: bool = False,
) -> UpdateWindow:
    """Bring elements ``[start, end)`` of ``chunk``'s gradients, unit and parameters
    (read only if ``load_params``) to host memory: a span of an oversize chunk, this
    rank's home window, or (``gather``) the whole chunk, gathered from every rank
    when sharded (collective)."""
    plan = manager.plan
    if is_split(plan, chunk):
        opened: list[tuple[list[torch.Tensor], Any]] = []
        try:
            for kind, load, writable in _opens(load_params):
                opened.append(
                    manager.open_span(
                        kind, chunk, start, end, load=load, writable=writable, on_device=True
                    )
                )
        except BaseException:
            for _parts, copy in opened:
                manager.close_host(copy, modified=False, keep=True)
            raise
        (grad_parts, g), (unit_parts, o), (param_parts, p) = opened
        return UpdateWindow(chunk, start, end, grad_parts[0], unit_parts, param_parts[0], (g, o, p))
    handles: list[Any] = []
    regions: list[torch.Tensor] = []
    try:
        for kind, load, writable in _opens(load_params):
            key = (kind, chunk)
            if gather:
                region, handle = open_whole(manager, key, load=load, writable=writable)
            else:
                # A chunk homed on the device is stepped there, on its home.
                region, handle = manager.open_host(
                    key, load=load, writable=writable, on_device=True
                )
            regions.append(region)
            handles.append(handle)
    except BaseException:
        for handle in handles:
            close_whole(manager, handle, modified=False, keep=True)
        raise
    grads, unit, params = regions
    width = end - start
    fmt = StateFormat(plan.state_dtype)
    ranges = unit_ranges(fmt, len(plan.state_slots), width, plan.has_master, 0, width)
    pieces = [unit[offset : offset + nbytes] for offset, nbytes in ranges if nbytes]
    grad, optim, param = handles
    return UpdateWindow(chunk, start, end, grads, pieces, params, (grad, optim, param))


def _opens(load_params: bool) -> list[tuple[Kind, bool, bool]]:
    """(kind, load, writable) of each key an update opens, in order."""
    return [(Kind.GRAD, True, False), (Kind.OPTIM, True, True), (Kind.PARAM, load_params, True)]


def close_update(manager: ChunkManager, window: UpdateWindow, *, succeeded: bool) -> None:
    """Write back what the update changed; after a success the gradients are consumed
    and the device's copy of the parameters, now stale, dropped.

    Write-backs finish in the background (keep=True): the slot is reused only
    once its write has landed, so window i-1 is written while window i computes and
    window i+1 is read.
    """
    grad, unit, params = window.handles
    if isinstance(grad, _Transient):
        try:
            if succeeded:
                _scatter_spans(manager, window)
        finally:
            manager.transient_account.sub(grad.nbytes)
        if succeeded:
            manager.drop_param(window.chunk)
        return
    close_whole(manager, grad, modified=False, keep=True)
    close_whole(manager, unit, modified=True, keep=True)
    close_whole(manager, params, modified=True, keep=True)
    if succeeded:
        manager.grad_flow.consume_grad(grad.copy if isinstance(grad, WholeChunk) else grad)
        manager.drop_param(window.chunk)


class _Transient(NamedTuple):
    """The handle of a window of transient copies (``nbytes``, counted in the
    manager's transient account while it is open)."""

    nbytes: int


def _gather_spans(manager: ChunkManager, chunk: int) -> UpdateWindow:
    """Oversize ``chunk``'s gradients, unit pieces and (without an fp32 master) its
    parameters, copied out of its spans into transient host tensors: one window of
    the whole chunk.

    Such a chunk holds one tensor, and an optimizer that reads whole tensors
    cannot step it span by span. Each span's bytes still cross the disk once each
    way; host staging stays span-sized, and the copies are outside the budgets
    (the transient account), like the temporaries of the optimizer's own step.
    """
    plan = manager.plan
    capacity = plan.layout.chunks[chunk].capacity
    unit_sizes = [n for _offset, n in part_ranges(plan, SpanKey(Kind.OPTIM, chunk, 0, capacity))]
    grads = torch.empty(capacity * plan.element_size, dtype=torch.uint8)
    unit = [torch.empty(n, dtype=torch.uint8) for n in unit_sizes]
    params = None if plan.has_master else torch.empty_like(grads)
    nbytes = grads.numel() * (1 if plan.has_master else 2) + sum(unit_sizes)
    manager.transient_account.add(nbytes)
    try:
        copies: list[tuple[Kind, list[torch.Tensor]]] = [(Kind.GRAD, [grads]), (Kind.OPTIM, unit)]
        if params is not None:
            copies.append((Kind.PARAM, [params]))
        for kind, wholes in copies:
            with closing(windows(manager, kind, chunk, keep=True, ahead=True)) as each:
                for span in each:
                    for whole, part, (at, n) in zip(
                        wholes, span.parts, _within(plan, kind, chunk, span), strict=True
                    ):
                        whole[at : at + n].copy_(part[:n])
    except BaseException:
        manager.transient_account.sub(nbytes)
        raise
    return UpdateWindow(chunk, 0, capacity, grads, unit, params, (_Transient(nbytes), None, None))


def _scatter_spans(manager: ChunkManager, window: UpdateWindow) -> None:
    """Write a gathered window's unit pieces and parameters (cast from the fp32 master
    when there is one) back into the oversize chunk's spans, without reading them."""
    plan, chunk = manager.plan, window.chunk
    master = window.unit[0].view(torch.float32) if window.params is None else None
    for kind, wholes in ((Kind.OPTIM, window.unit), (Kind.PARAM, [window.params])):
        if not wholes:
            continue  # a unit without pieces (CPUAdafactor in fp32)
        with closing(windows(manager, kind, chunk, load=False, write=True, keep=True)) as each:
            for span in each:
                for whole, part, (at, n) in zip(
                    wholes, span.parts, _within(plan, kind, chunk, span), strict=True
                ):
                    part.zero_()
                    if whole is not None:
                        part[:n].copy_(whole[at : at + n])
                    else:  # the parameters, from the master
                        assert master is not None
                        part[:n].view(manager.dtype).copy_(master[span.start : span.end])


def _within(plan: Plan, kind: Kind, chunk: int, span: Window) -> list[tuple[int, int]]:
    """Where each piece of ``span`` of ``(kind, chunk)`` lies in the same piece of the
    whole chunk: (byte offset, bytes), from the two layouts' byte ranges in the home."""
    capacity = plan.layout.chunks[chunk].capacity
    whole = part_ranges(plan, SpanKey(kind, chunk, 0, capacity))
    here = part_ranges(plan, SpanKey(kind, chunk, span.start, span.end))
    return [(at - base, n) for (at, n), (base, _n) in zip(here, whole, strict=True)]


def check_whole_tensors(plan: Plan, owner: str, *, overlap: bool) -> None:
    """Raise :class:`~infinity.config.ConfigError` where the whole tensors an optimizer
    reads in its step (``ChunkOptimizer.whole_tensors``) cannot be brought together.

    NOTE: an oversize chunk staged in spans holds one tensor, which the step
    gathers from its spans; a sharded chunk is gathered from every rank
    (:func:`update_windows`). Each such update is then collective and
    runs where every rank runs it, see
    NOTE [collective updates run in a fixed order]: not during backward, where
    chunks complete at different moments on each rank, and not over a shard in spans.
    """
    if not plan.sharded:
        return
    if overlap:
        raise ConfigError(
            f"{owner} reads whole tensors in its step, which on a model sharded over "
            f"{plan.shard_count} processes gathers each chunk from every rank: that cannot "
            "run during backward. Use Config(overlap_optimizer=False) (the default), or "
            "CPUAdam, CPULion or CPUSGD with overlap_optimizer=True"
        )
    split = [i for i in range(plan.layout.num_chunks) if is_split(plan, i)]
    if split:
        raise ConfigError(
            f"{owner} reads whole tensors in its step, but chunk {split[0]} (of "
            f"{format_size(plan.param_bytes(split[0]))} per process) is staged in spans on a "
            f"model sharded over {plan.shard_count} processes: gathering it from every rank "
            "is not supported. Give Config(chunk_size=...) at least the largest tensor's "
            "share per process, or use CPUAdam, CPULion or CPUSGD"
        )


def transient_limit(plan: Plan, whole_tensors: bool) -> int:
    """The most host bytes of whole-chunk and whole-tensor copies at once (outside the
    host budget; ``ChunkManager.transient_account`` measures them).

    Sharded, a chunk is opened whole on every rank: Adafactor's step opens its
    gradient, unit and parameters at once, a unit's shards arriving in a buffer of the
    unit's size (state dicts and checkpoints open one kind at a time: less). Unsharded,
    Adafactor steps an oversize tensor whole: its fp32 master and its gradient. A host
    reader of a chunk homed on the device gets a copy of one of its keys at a time
    (``DeviceHomeCopy``; NOTE [chunks homed on the device])."""
    chunks = range(plan.layout.num_chunks)
    homed = max(
        (
            max(plan.param_bytes(i), plan.optim_bytes(i))
            for i in chunks
            if plan.optim_home[i] == DEVICE
        ),
        default=0,
    )
    return max(homed, _whole_copies(plan, whole_tensors))


def _whole_copies(plan: Plan, whole_tensors: bool) -> int:
    """:func:`transient_limit` of the whole-chunk and whole-tensor copies."""
    chunks = range(plan.layout.num_chunks)
    if plan.sharded:
        return max(
            (
                whole_bytes(plan, (Kind.GRAD, i))
                + 2 * whole_bytes(plan, (Kind.OPTIM, i))
                + whole_bytes(plan, (Kind.PARAM, i))
                for i in chunks
            ),
            default=0,
        )
    if not whole_tensors:
        return 0
    per_element = FP32_BYTES + plan.element_size
    return max(
        (plan.layout.chunks[i].capacity * per_element for i in chunks if is_split(plan, i)),
        default=0,
    )
