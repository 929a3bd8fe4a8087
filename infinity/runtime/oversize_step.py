"""The optimizer update of an oversize chunk, span by span.

An oversize chunk (one tensor larger than a normal chunk) is updated in spans
of the normal chunk size (``chunks/spans.py``): for each span its gradient, its
slice of the optimizer unit and its parameters come to host memory, the kernel
runs over the parts of the chunk's runs inside the span, and the span is
written back while the next one is read. The update is element-wise, so the
result is bit for bit the one of stepping the chunk whole; each run keeps its
own hyper-parameters and step count.
"""

from __future__ import annotations

from infinity.chunks.span_access import open_span
from infinity.chunks.spans import span_key, span_ranges
from infinity.core.names import Kind
from infinity.runtime.step_context import Run, StepContext, step_window


def step_chunk_in_spans(
    engine: StepContext, chunk: int, runs: list[Run], covered: bool, grad_scale: float
) -> None:
    """Update oversize chunk ``chunk`` in place in its homes, span by span
    (the spans of :func:`~infinity.runtime.offloaded_step.step_chunk`)."""
    manager = engine.manager
    has_master = engine.plan.has_master
    optimizer = engine.chunk_optimizer
    # 16-bit: the parameter chunk is only written (unless some tensors keep old values).
    load_params = not (has_master and covered)
    kinds = [Kind.GRAD, Kind.OPTIM] + ([Kind.PARAM] if load_params else [])
    ranges = span_ranges(engine.plan, chunk)
    for position, (start, end) in enumerate(ranges):
        if position + 1 < len(ranges):
            # NOTE: the next span travels while the kernel runs on this one; the
            # current span's staged copies must not be its victims.
            current = {span_key(kind, chunk, start, end) for kind in kinds}
            for kind in kinds:
                manager.prefetch_host(span_key(kind, chunk, *ranges[position + 1]), current)
        grad_parts, grad_copy = open_span(manager, Kind.GRAD, chunk, start, end, writable=False)
        optim_parts, optim_copy = open_span(manager, Kind.OPTIM, chunk, start, end)
        param_parts, param_copy = open_span(
            manager, Kind.PARAM, chunk, start, end, load=load_params
        )
        try:
            grads = grad_parts[0].view(engine.dtype)
            params = param_parts[0].view(engine.dtype)
            unit = optimizer.piece_views(optim_parts, has_master)
            step_window(
                engine, chunk, runs, (start, end), grads, unit, params, not load_params, grad_scale
            )
        finally:
            # NOTE: write-backs land in the background (keep=True), as for a whole chunk.
            manager.close_host(grad_copy, modified=False, keep=True)
            manager.close_host(optim_copy, modified=True, keep=True)
            manager.close_host(param_copy, modified=True, keep=True)
    manager.drop_param(chunk)
