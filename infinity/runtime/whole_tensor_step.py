"""Updates for an optimizer that reads whole tensors (``ChunkOptimizer.whole_tensors``:
Adafactor's norms and row and column means), where a chunk is not in host memory whole.

Oversize chunks staged in spans (:func:`step_tensor_in_spans`): such an update
cannot run span by span. An oversize chunk holds one tensor, so
its update gathers the tensor: a first pass over the spans copies its
gradient and fp32 master (the parameters, for fp32) into one transient tensor
each, the optimizer steps the whole tensor, and a second pass writes the
master and the 16-bit parameters back span by span, without reading them
again. Each span's bytes still cross the disk once each way, as in the
element-wise path (``oversize_step.py``); host staging stays span-sized, and
the transient copies are outside the budgets, like the temporaries of the
optimizer's own step and the whole-tensor accessors (``state_dict``).

Sharded chunks (data parallel, :func:`step_chunk_gathered`): a tensor may
straddle two ranks' shards, so every rank gathers the whole chunk (its
gradient, unit and, unless rewritten, parameters), steps every tensor of it
alike and keeps its own shard of the result. Each rank keeps a whole copy of
the per-tensor states (Adafactor's factors), updated identically everywhere
from the same values: the result is the one process's, bit for bit. The
gathers are collective; see NOTE [collective updates run in a fixed order].
"""

from __future__ import annotations

import torch

from infinity.chunks.manager import typed
from infinity.chunks.shards import WholeChunk, close_whole, open_whole
from infinity.chunks.span_access import open_span
from infinity.chunks.spans import span_key, span_ranges
from infinity.core.names import Kind
from infinity.optim.chunk_optimizer import StepViews
from infinity.runtime.step_context import Run, StepContext, step_window


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


def step_chunk_gathered(
    engine: StepContext, chunk: int, runs: list[Run], covered: bool, grad_scale: float
) -> None:
    """Update sharded ``chunk`` whole on every rank, each keeping its own shard (see the
    module docstring). Collective: every rank calls it for the same chunks in the
    same order."""
    manager = engine.manager
    plan = engine.plan
    has_master = plan.has_master
    optimizer = engine.chunk_optimizer
    capacity = engine.layout.chunks[chunk].capacity
    grad_bytes, grad_handle = open_whole(manager, (Kind.GRAD, chunk), writable=False)
    optim_bytes, optim_handle = open_whole(manager, (Kind.OPTIM, chunk))
    # 16-bit: the parameters are only written (unless some tensors keep old values).
    unread = has_master and covered
    param_bytes, param_handle = open_whole(manager, (Kind.PARAM, chunk), load=not unread)
    try:
        unit = optimizer.unit_views(typed(optim_bytes, torch.float32), capacity, has_master)
        grads, params = typed(grad_bytes, engine.dtype), typed(param_bytes, engine.dtype)
        step_window(engine, chunk, runs, (0, capacity), grads, unit, params, unread, grad_scale)
    finally:
        close_whole(manager, grad_handle, modified=False, keep=True)
        close_whole(manager, optim_handle, modified=True, keep=True)
        close_whole(manager, param_handle, modified=True, keep=True)
    assert isinstance(grad_handle, WholeChunk)  # sharded: open_whole gathers
    manager.consume_grad(grad_handle.copy)
    manager.drop_param(chunk)
