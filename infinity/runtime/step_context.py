"""What the optimizer step over chunks uses of an engine, and one kernel call's run.

Shared by :mod:`~infinity.runtime.offloaded_step`, which walks each chunk's
update windows (:func:`~infinity.chunks.pieces.update_windows`: its home, a
span of an oversize chunk, or a whole chunk gathered from every rank) and
steps each with :func:`step_window`, and by the update below.

Updates for an optimizer that reads whole tensors (``ChunkOptimizer.whole_tensors``:
Adafactor's norms and row and column means), where a chunk is not in host memory whole.

Oversize chunks staged in spans (:func:`step_tensor_in_spans`): such an update
cannot run span by span. An oversize chunk holds one tensor, so
its update gathers the tensor: a first pass over the spans copies its
gradient and fp32 master (the parameters, for fp32) into one transient tensor
each, the optimizer steps the whole tensor, and a second pass writes the
master and the 16-bit parameters back span by span, without reading them
again. Each span's bytes still cross the disk once each way, as in the
element-wise path (``offloaded_step.py``); host staging stays span-sized, and
the transient copies are outside the budgets, like the temporaries of the
optimizer's own step and the whole-tensor accessors (``state_dict``).

Sharded chunks (data parallel: one window gathered whole, ``gather=True``): a tensor may
straddle two ranks' shards, so every rank gathers the whole chunk (its
gradient, unit and, unless rewritten, parameters), steps every tensor of it
alike and keeps its own shard of the result. Each rank keeps a whole copy of
the per-tensor states (Adafactor's factors), updated identically everywhere
from the same values: the result is the one process's, bit for bit. The
gathers are collective; see NOTE [collective updates run in a fixed order].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from infinity.chunks.layout import ChunkLayout
from infinity.chunks.manager import ChunkManager, typed
from infinity.chunks.pieces import UpdateWindow
from infinity.chunks.span_access import open_span
from infinity.chunks.spans import is_split, span_key, span_ranges
from infinity.config import ConfigError
from infinity.core.names import Kind, Phase
from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews, UnitViews
from infinity.runtime.params import ParamEntry
from infinity.utils.sizes import format_size


class HeldGradients(Protocol):
    """Per tensor: whether its gradient is in the chunks."""

    def __getitem__(self, index: int) -> bool: ...


class StepContext(Protocol):
    """Exactly what the step over chunks uses of a model's chunks
    (:class:`~infinity.runtime.model_chunks.ModelChunks` provides it)."""

    manager: ChunkManager
    layout: ChunkLayout
    plan: Plan
    dtype: torch.dtype
    chunk_optimizer: ChunkOptimizer[Any]
    chunk_members: list[list[ParamEntry]]  # per chunk, its parameters
    tensor_steps: list[int]  # per tensor: optimizer steps taken (advanced here)

    @property
    def has_grad(self) -> HeldGradients:
        """Per tensor: its gradient is in the chunks (read only here)."""

    def sample(self, phase: Phase, chunk: int) -> None:
        """Add the tiers' state after an access to the memory timeline."""

    def tensor_state(self, index: int) -> dict[str, torch.Tensor]:
        """Tensor ``index``'s per-tensor optimizer states (allocated on first use)."""
        ...


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of a chunk updated by one kernel call: elements ``[start, end)``."""

    start: int
    end: int
    hyper: object  # the optimizer's hyper-parameters (compared by value)
    step: int
    tensor: int | None = None  # the one tensor of a ``whole_tensors`` optimizer's run


def step_runs(
    optimizer: ChunkOptimizer[Any],
    unit: UnitViews,
    master: torch.Tensor,
    grads: torch.Tensor,
    out16: torch.Tensor | None,
    runs: list[Run],
    window: tuple[int, int],
    grad_scale: float,
    engine: StepContext,
    chunk: int,
) -> None:
    """Run the optimizer over the parts of ``runs`` inside elements ``window`` of
    chunk ``chunk``, whose views (``unit``, ``master``, ``grads``, ``out16``) start at
    ``window[0]``: a whole chunk is the window ``(0, capacity)``, a span or a data-parallel
    shard its range. Each part is numbered by its chunk and its offset in the chunk
    (``StepViews.rounding``), the same in every window, so a chunk stepped whole, in spans
    or in shards stores the same bytes.
    A run naming its tensor gets the tensor's shape and per-tensor states from
    ``engine``, and must lie wholly inside the window."""
    start, end = window
    for run in runs:
        low, high = max(run.start, start), min(run.end, end)
        if low >= high:
            continue
        shape, tensor_state = None, {}
        if run.tensor is not None:
            if (low, high) != (run.start, run.end):
                # NOTE: refused when the optimizer is bound (check_whole_tensors, below):
                # reaching here is a bug, not a user error.
                raise AssertionError(f"tensor {run.tensor} is cut by the window {window}")
            shape = engine.layout.slots[run.tensor].shape
            tensor_state = engine.tensor_state(run.tensor)
        span = slice(low - start, high - start)
        views = StepViews(
            master[span],
            grads[span],
            unit.span(span),
            out16[span] if out16 is not None else None,
            unit.scale_span(span),
            shape,
            tensor_state,
            rounding=(chunk, low),
        )
        optimizer.step(views, run.hyper, step=run.step, grad_scale=grad_scale)


def step_window(
    engine: StepContext,
    window: UpdateWindow,
    runs: list[Run],
    params_unread: bool,
    grad_scale: float,
) -> None:
    """The update of an opened window of a chunk (its whole home, a shard's, a whole
    chunk gathered from every rank or one span of an oversize chunk: see
    :func:`~infinity.chunks.pieces.update_windows`).

    ``params_unread``: the parameters were not read (every tensor is rewritten
    from its master), so the window's tail after the last run gets the zeros it
    had, not a staging slot's stale bytes.
    """
    dtype = engine.dtype
    grads, params = typed(window.grads, dtype), typed(window.params, dtype)
    unit = engine.chunk_optimizer.piece_views(window.unit, engine.plan.has_master)
    if params_unread:
        params[max(runs[-1].end - window.start, 0) :].zero_()
    master = unit.master if unit.master is not None else params
    out16 = params if engine.plan.has_master else None
    optimizer = engine.chunk_optimizer
    bounds = (window.start, window.end)
    step_runs(optimizer, unit, master, grads, out16, runs, bounds, grad_scale, engine, window.chunk)


def step_tensor_in_spans(
    engine: StepContext, chunk: int, runs: list[Run], grad_scale: float
) -> None:
    """Update the one tensor of oversize ``chunk`` whole (see module docstring)."""
    run = runs[0]
    tensor = run.tensor
    if len(runs) != 1 or tensor is None:
        raise AssertionError(f"oversize chunk {chunk} steps one whole tensor, got runs {runs}")
    account = engine.manager.transient_account
    copies = (run.end - run.start) * (4 + engine.dtype.itemsize)  # _gather's master, grad
    account.add(copies)
    try:
        master, grad = _gather(engine, chunk, run)
        shape = engine.layout.slots[tensor].shape
        views = StepViews(master, grad, {}, None, {}, shape, engine.tensor_state(tensor))
        engine.chunk_optimizer.step(views, run.hyper, step=run.step, grad_scale=grad_scale)
        _scatter(engine, chunk, run, master)
        del master, grad, views
    finally:
        account.sub(copies)
    engine.manager.drop_param(chunk)


def _gather(engine: StepContext, chunk: int, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor's fp32 master and its gradient, copied out of the chunk's spans."""
    manager = engine.manager
    has_master = engine.plan.has_master
    source = Kind.OPTIM if has_master else Kind.PARAM  # where the fp32 values live
    master = torch.empty(run.end - run.start, dtype=torch.float32)
    grad = torch.empty(run.end - run.start, dtype=engine.dtype)
    ranges = span_ranges(engine.plan, chunk)
    for position, (start, end) in enumerate(ranges):
        if position + 1 < len(ranges):
            # NOTE: the next span travels while this one is copied; this span's
            # staged copies must not be its victims.
            current = {span_key(kind, chunk, start, end) for kind in (Kind.GRAD, source)}
            for kind in (Kind.GRAD, source):
                manager.prefetch_host(span_key(kind, chunk, *ranges[position + 1]), current)
        low, high = max(run.start, start), min(run.end, end)
        grad_parts, grad_copy = open_span(manager, Kind.GRAD, chunk, start, end, writable=False)
        parts, copy = open_span(manager, source, chunk, start, end, writable=False)
        try:
            if low < high:
                into = slice(low - run.start, high - run.start)
                here = slice(low - start, high - start)
                grad[into].copy_(grad_parts[0].view(engine.dtype)[here])
                values = parts[0].view(torch.float32 if has_master else engine.dtype)
                master[into].copy_(values[here])
        finally:
            manager.close_host(grad_copy, modified=False, keep=True)
            manager.close_host(copy, modified=False, keep=True)
    return master, grad


def _scatter(engine: StepContext, chunk: int, run: Run, master: torch.Tensor) -> None:
    """Write the updated master (and the parameters in the compute dtype) back into the
    chunk's spans; elements outside the tensor (the padded tail) get zeros."""
    manager = engine.manager
    has_master = engine.plan.has_master
    for start, end in span_ranges(engine.plan, chunk):
        low, high = max(run.start, start), min(run.end, end)
        into = slice(low - run.start, high - run.start)
        here = slice(low - start, high - start)
        kinds = [Kind.OPTIM, Kind.PARAM] if has_master else [Kind.PARAM]
        for kind in kinds:
            parts, copy = open_span(manager, kind, chunk, start, end, load=False)
            try:
                dtype = torch.float32 if kind is Kind.OPTIM else engine.dtype
                values = parts[0].view(dtype)
                values.zero_()
                if low < high:
                    values[here].copy_(master[into])
            finally:
                # NOTE: write-backs land in the background (keep=True), as elsewhere.
                manager.close_host(copy, modified=True, keep=True)


def check_whole_tensors(plan: Plan, owner: str, *, overlap: bool) -> None:
    """Raise :class:`~infinity.config.ConfigError` where the whole tensors an optimizer
    reads in its step (``ChunkOptimizer.whole_tensors``) cannot be brought together.

    NOTE: an oversize chunk staged in spans holds one tensor, which the step
    gathers from its spans; a sharded chunk is gathered from every rank
    (``runtime/step_context.py``). Each such update is then collective and
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
