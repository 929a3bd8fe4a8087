"""The optimizer step over chunks: stream optimizer-state units through the host.

For every trainable chunk with gradients: bring its gradient, its optimizer
unit (fp32 master + state slots) and its parameter chunk to host memory
(straight from their homes, or staged from NVMe), run the engine's
``chunk_optimizer`` (the optimizer's fused kernel) over each *run* of tensors
that share hyper-parameters and step count, write back what changed, and
drop the now-stale device copy of the parameters.

Tensors without a gradient are skipped exactly as ``torch.optim`` skips
``grad is None``: no moment update, no weight decay, no step count.

Each chunk is updated window by window (``chunks/updates.py``
``update_windows``): one window, its home, for a normal chunk; an oversize
chunk (one tensor larger than a normal chunk) in spans of the normal chunk
size (``chunks/pools.py``): for each span its gradient, its slice of the
optimizer unit and its parameters come to host memory, the kernel runs over
the parts of the chunk's runs inside the span, and the span is written back
while the next one is read. The update is element-wise, so the
result is bit for bit the one of stepping the chunk whole; each run keeps its
own hyper-parameters and step count. The step works on a model's chunks
(:class:`~infinity.runtime.model_chunks.ModelChunks`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.updates import UpdateWindow, close_update, open_update, update_windows
from infinity.core.names import DEVICE, Phase
from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews, UnitViews
from infinity.runtime.model_chunks import ModelChunks


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of a chunk updated by one kernel call: elements ``[start, end)``."""

    start: int
    end: int
    hyper: object  # the optimizer's hyper-parameters (compared by value)
    step: int
    tensor: int | None = None  # the one tensor of a ``whole_tensors`` optimizer's run


def plan_runs(
    members: list[tuple[int, int, int]],
    hyper_of: Callable[[int], object | None],
    step_of: Callable[[int], int],
    *,
    whole_tensors: bool = False,
) -> tuple[list[Run], bool]:
    """Group a chunk's tensors into runs; ``members`` are (tensor index, offset, numel).

    ``hyper_of`` gives ``None`` for a tensor without gradient (skipped); runs
    break there and wherever hyper-parameters or step counts change. Returns
    the runs and whether every tensor is updated: then the runs are stretched
    over the gaps between them, from element 0 to the end of the last tensor
    (gaps hold zeros, which every optimizer keeps at zero), and the old parameter values
    need not be read. The chunk's empty tail is left out: updating zeros
    would only cost time.

    ``whole_tensors`` (an optimizer whose update reads whole tensors, such as
    Adafactor's norms): one run per tensor, naming it, never stretched; the old
    parameters are then not read only if the tensors leave no gap.
    """
    groups: list[list[Any]] = []  # [start, end, hyper, step, tensor]
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
        last = groups[-1] if groups and not whole_tensors else None
        if last is not None and not previous_skipped and last[2] == hyper and last[3] == step:
            last[1] = offset + numel
        else:
            groups.append([offset, offset + numel, hyper, step, index])
        previous_skipped = False
    if whole_tensors:
        runs = [
            Run(start, end, hyper, step, tensor=index) for start, end, hyper, step, index in groups
        ]
        # NOTE: a gap between tensors (alignment) is not rewritten from a master, so
        # the parameter chunk must then be read to keep its bytes.
        gapless = bool(runs) and runs[0].start == 0
        gapless = gapless and all(a.end == b.start for a, b in itertools.pairwise(runs))
        return runs, covered and gapless
    if covered and groups:
        groups[0][0] = 0
        for a, b in itertools.pairwise(groups):
            a[1] = b[0]
    runs = [Run(start, end, hyper, step) for start, end, hyper, step, _index in groups]
    return runs, covered and bool(runs)


def step_chunk(
    engine: ModelChunks, chunk: int, runs: list[Run], covered: bool, grad_scale: float
) -> None:
    """Update one chunk in place in its homes, window by window (see module docstring)."""
    unread = engine.plan.has_master and covered
    each = update_windows(
        engine.manager, chunk, load_params=not unread, whole=engine.chunk_optimizer.whole_tensors
    )
    with closing(each):
        for window in each:
            step_window(engine, window, runs, unread, grad_scale)


@dataclass
class OpenedChunk:
    """One chunk's update between its host bytes opened and closed (its compute apart,
    so that it may run on a worker thread: NOTE [host updates on a worker]). Chunks
    whose update opens once only (``chunks.updates.opens_once``)."""

    engine: ModelChunks
    window: UpdateWindow
    runs: list[Run]
    unread: bool  # the parameters were not read (every tensor is rewritten)
    grad_scale: float

    @classmethod
    def open(
        cls, engine: ModelChunks, chunk: int, runs: list[Run], covered: bool, grad_scale: float
    ) -> OpenedChunk:
        """Bring the chunk's gradients, optimizer unit and parameters to host memory."""
        # 16-bit: the parameter chunk is only written (unless some tensors keep old values).
        unread = engine.plan.has_master and covered
        start, end = engine.plan.home_window(chunk)
        window = open_update(engine.manager, chunk, start, end, load_params=not unread)
        return cls(engine, window, runs, unread, grad_scale)

    def compute(self) -> None:
        """The kernels over the opened bytes (touches nothing but them)."""
        step_window(self.engine, self.window, self.runs, self.unread, self.grad_scale)

    def close(self, *, succeeded: bool) -> None:
        """Write back what changed; after a success the gradients are consumed and the
        device's copy of the parameters, now stale, dropped."""
        close_update(self.engine.manager, self.window, succeeded=succeeded)


@dataclass(frozen=True)
class ChunkWork:
    """What one chunk's update needs: its tensors and kernel runs."""

    chunk: int
    updated: tuple[int, ...]  # tensor indices whose step advances
    runs: tuple[Run, ...]
    covered: bool  # every tensor updated: the old parameter chunk need not be read

    def keys(self, has_master: bool) -> list[tuple[Kind, int]]:
        """The storage keys :func:`step_chunk` reads."""
        keys = [(Kind.GRAD, self.chunk), (Kind.OPTIM, self.chunk)]
        if not (has_master and self.covered):
            keys.append((Kind.PARAM, self.chunk))
        return keys


def plan_chunk(
    engine: ModelChunks, chunk: int, hyper_by_index: Mapping[int, object]
) -> ChunkWork | None:
    """The update of ``chunk``, or ``None`` if none of its tensors has a gradient."""
    members = tuple(
        (e.index, engine.layout.slots[e.index].offset, engine.layout.slots[e.index].numel)
        for e in engine.chunk_members[chunk]
    )

    def hyper_of(index: int) -> object | None:
        return hyper_by_index.get(index) if engine.has_grad[index] else None

    runs, covered = plan_runs(
        list(members),
        hyper_of,
        engine.tensor_steps.__getitem__,
        whole_tensors=engine.chunk_optimizer.whole_tensors,
    )
    updated = tuple(i for i, _offset, numel in members if numel and hyper_of(i) is not None)
    return ChunkWork(chunk, updated, tuple(runs), covered) if runs else None


def prefetch_chunk(engine: ModelChunks, work: ChunkWork, ahead: Iterable[ChunkWork] = ()) -> bool:
    """Start reading what :func:`step_chunk` will need (NVMe homes only; never blocks);
    False if some read found no free staging slot.

    NOTE: the works ``ahead`` of this one run sooner: their staged data is
    never evicted for this prefetch. Without that, a queue of updates longer
    than the staging slots (an I/O-bound step) evicted landed units to read
    later ones, and read each unit two or three times per step.
    """
    has_master = engine.plan.has_master
    protect = {key for earlier in ahead for key in earlier.keys(has_master)}
    started = [engine.manager.prefetch_host(key, protect) for key in work.keys(has_master)]
    return all(started)


def chunk_ready(engine: ModelChunks, work: ChunkWork) -> bool:
    """Everything the update reads is in host memory (no wait would happen)."""
    return all(engine.manager.host.host_ready(key) for key in work.keys(engine.plan.has_master))


def finish_chunk(engine: ModelChunks, work: ChunkWork, grad_scale: float) -> int:
    """Run the update of one planned chunk; returns the tensors updated."""
    # NOTE: a queued update runs when the next forward first touches its chunk, inside
    # the user's modes there. Under torch.inference_mode() the tensors it makes (the
    # per-tensor states of a first step, such as Adafactor's factored moments) would be
    # inference tensors, which no later step outside that mode could update in place;
    # under torch.autocast("cpu") its matmuls (Adafactor's factored estimate) would run
    # in bf16. It computes as optimizer.step() does, outside both.
    # NOTE [chunks homed on the device]: a device that computes apart runs a homed chunk's
    # update as its own kernels, device compute in the step's bound, not host optimizer time
    # (nor time the device idles for the host, which `updating` brackets).
    on_device = engine.plan.optim_home[work.chunk] == DEVICE
    timed = (
        contextlib.nullcontext()
        if on_device and engine.manager.backend.computes_apart
        else engine.manager.traffic.updating()
    )
    with torch.inference_mode(False), torch.autocast("cpu", enabled=False), timed:
        step_chunk(engine, work.chunk, list(work.runs), work.covered, grad_scale)
    return count_update(engine, work)


def count_update(engine: ModelChunks, work: ChunkWork) -> int:
    """A chunk's update has run: its tensors' steps advance, the timeline notes it;
    returns the tensors updated."""
    engine.sample(Phase.OPTIMIZER, work.chunk)
    for index in work.updated:
        engine.tensor_steps[index] += 1
    return len(work.updated)


def run_works(engine: ModelChunks, works: list[ChunkWork], grad_scale: float) -> int:
    """Update planned chunks in order, pipelined: read unit i+1 while the kernel runs
    on unit i (and unit i-1 is written back)."""
    updated = 0
    for position, work in enumerate(works):
        if position + 1 < len(works):
            prefetch_chunk(engine, works[position + 1], ahead=[work])
        updated += finish_chunk(engine, work, grad_scale)
    return updated


def plan_works(
    engine: ModelChunks, hyper_by_index: Mapping[int, object], skip: set[int]
) -> list[ChunkWork]:
    """The updates of one optimizer step: every trainable chunk not in ``skip`` (handled)."""
    works = []
    for chunk, spec in enumerate(engine.layout.chunks):
        if spec.trainable and chunk not in skip:
            work = plan_chunk(engine, chunk, hyper_by_index)
            if work is not None:
                works.append(work)
    return works


def step_runs(
    optimizer: ChunkOptimizer[Any],
    unit: UnitViews,
    master: torch.Tensor,
    grads: torch.Tensor,
    out16: torch.Tensor | None,
    runs: list[Run],
    window: tuple[int, int],
    grad_scale: float,
    engine: ModelChunks,
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
                # Refused when the optimizer is bound (check_whole_tensors, below):
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
    engine: ModelChunks,
    window: UpdateWindow,
    runs: list[Run],
    params_unread: bool,
    grad_scale: float,
) -> None:
    """The update of an opened window of a chunk (its whole home, a shard's, a whole
    chunk gathered from every rank or one span of an oversize chunk: see
    :func:`~infinity.chunks.updates.update_windows`).

    ``params_unread``: the parameters were not read (every tensor is rewritten
    from its master), so the window's tail after the last run gets the zeros it
    had, not a staging slot's stale bytes.
    """
    dtype = engine.dtype
    grads = window.grads.view(dtype)
    params = None if window.params is None else window.params.view(dtype)
    unit = engine.chunk_optimizer.piece_views(window.unit, engine.plan.has_master)
    if params_unread and params is not None:
        params[max(runs[-1].end - window.start, 0) :].zero_()
    master = unit.master if unit.master is not None else params
    assert master is not None  # a window without parameters has a master
    out16 = params if engine.plan.has_master else None
    optimizer = engine.chunk_optimizer
    bounds = (window.start, window.end)
    step_runs(optimizer, unit, master, grads, out16, runs, bounds, grad_scale, engine, window.chunk)
