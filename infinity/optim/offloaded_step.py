"""The optimizer step over chunks: stream optimizer-state units through the host.

For every trainable chunk with gradients: bring its gradient, its optimizer
unit (fp32 master + moments) and its parameter chunk to host memory (straight
from their homes, or staged from NVMe), run the fused CPU-Adam kernel over
each *run* of tensors that share hyper-parameters and step count, write back
what changed, and drop the now-stale device copy of the parameters.

Tensors without a gradient are skipped exactly as ``torch.optim`` skips
``grad is None``: no moment update, no weight decay, no step count.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.manager import typed
from infinity.optim import kernels
from infinity.optim.hyper import AdamHyperParams


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of a chunk updated by one kernel call: elements ``[start, end)``."""

    start: int
    end: int
    hyper: AdamHyperParams
    step: int


def plan_runs(
    members: list[tuple[int, int, int]],
    hyper_of: Callable[[int], AdamHyperParams | None],
    step_of: Callable[[int], int],
    capacity: int,
) -> tuple[list[Run], bool]:
    """Group a chunk's tensors into runs; ``members`` are (tensor index, offset, numel).

    ``hyper_of`` gives ``None`` for a tensor without gradient (skipped); runs
    break there and wherever hyper-parameters or step counts change. Returns
    the runs and whether every tensor is updated: then the runs are stretched to
    tile ``[0, capacity)`` (gaps hold zeros, which Adam keeps at zero) and the
    old parameter values need not be read.
    """
    groups: list[list] = []  # [start, end, hyper, step]
    covered = True
    previous_skipped = False
    for index, offset, numel in sorted(members, key=lambda m: m[1]):
        if numel == 0:
            continue
        hyper = hyper_of(index)
        if hyper is None:
            covered = False
            previous_skipped = True
            continue
        step = step_of(index) + 1
        last = groups[-1] if groups else None
        if last is not None and not previous_skipped and last[2] == hyper and last[3] == step:
            last[1] = offset + numel
        else:
            groups.append([offset, offset + numel, hyper, step])
        previous_skipped = False
    if covered and groups:
        groups[0][0] = 0
        for a, b in itertools.pairwise(groups):
            a[1] = b[0]
        groups[-1][1] = capacity
    runs = [Run(start, end, hyper, step) for start, end, hyper, step in groups]
    return runs, covered and bool(runs)


def step_chunk(engine, chunk: int, runs: list[Run], covered: bool, grad_scale: float) -> None:
    """Update one chunk in place in its homes (see module docstring)."""
    manager = engine.manager
    capacity = engine.layout.chunks[chunk].capacity
    has_master = engine.plan.has_master
    grad_bytes, grad_copy = manager.open_host((Kind.GRAD, chunk))
    optim_bytes, optim_copy = manager.open_host((Kind.OPTIM, chunk))
    # 16-bit: the parameter chunk is only written (unless some tensors keep old values).
    param_bytes, param_copy = manager.open_host(
        (Kind.PARAM, chunk), load=not (has_master and covered)
    )
    try:
        state = typed(optim_bytes, torch.float32)
        grads = typed(grad_bytes, engine.dtype)
        params = typed(param_bytes, engine.dtype)
        parts = 3 if has_master else 2
        views = [state[k * capacity : (k + 1) * capacity] for k in range(parts)]
        master = views[0] if has_master else params
        exp_avg, exp_avg_sq = views[-2], views[-1]
        for run in runs:
            span = slice(run.start, run.end)
            h = run.hyper
            kernels.adam_step(
                master[span],
                grads[span],
                exp_avg[span],
                exp_avg_sq[span],
                step=run.step,
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                adamw=h.adamw,
                grad_scale=grad_scale,
                out16=params[span] if has_master else None,
            )
    finally:
        # NOTE: write-backs finish in the background (keep=True): the slot is
        # reused only once its write has landed, so chunk i-1 is written while
        # chunk i computes and chunk i+1 is read.
        manager.close_host(grad_copy, modified=False)
        manager.close_host(optim_copy, modified=True, keep=True)
        manager.close_host(param_copy, modified=True, keep=True)
    manager.drop_param(chunk)


def prefetch_chunk(engine, chunk: int, covered: bool) -> None:
    """Start reading what :func:`step_chunk` will need for ``chunk`` (NVMe homes only)."""
    manager = engine.manager
    manager.prefetch_host((Kind.GRAD, chunk))
    manager.prefetch_host((Kind.OPTIM, chunk))
    if not (engine.plan.has_master and covered):
        manager.prefetch_host((Kind.PARAM, chunk))


def run_chunks(
    engine, chunks: list[int], hyper_by_index: dict[int, AdamHyperParams], grad_scale: float
) -> int:
    """Step the given trainable chunks, pipelined; returns the tensors updated.

    ``hyper_by_index`` maps a tensor index (of ``engine.registry``) to its
    group's hyper-parameters; tensors the optimizer does not own are left alone.
    """

    def hyper_of(index: int) -> AdamHyperParams | None:
        return hyper_by_index.get(index) if engine.has_grad[index] else None

    work = []
    for chunk in chunks:
        spec = engine.layout.chunks[chunk]
        members = [
            (e.index, engine.layout.slots[e.index].offset, engine.layout.slots[e.index].numel)
            for e in engine.chunk_members[chunk]
        ]
        runs, covered = plan_runs(members, hyper_of, engine.tensor_steps.__getitem__, spec.capacity)
        if runs:
            work.append((chunk, members, runs, covered))
    updated = 0
    # Pipeline: read unit i+1 while the kernel runs on unit i (and i-1 is written back).
    for position, (chunk, members, runs, covered) in enumerate(work):
        if position + 1 < len(work):
            after = work[position + 1]
            prefetch_chunk(engine, after[0], after[3])
        step_chunk(engine, chunk, runs, covered, grad_scale)
        engine.sample("optimizer", chunk)
        for index, _offset, _numel in members:
            if hyper_of(index) is not None:
                engine.tensor_steps[index] += 1
                updated += 1
    return updated


def offloaded_step(
    engine, hyper_by_index: dict[int, AdamHyperParams], grad_scale: float, skip: set[int]
) -> int:
    """One optimizer step over every trainable chunk not in ``skip`` (already stepped)."""
    chunks = [i for i, spec in enumerate(engine.layout.chunks) if spec.trainable and i not in skip]
    return run_chunks(engine, chunks, hyper_by_index, grad_scale)
