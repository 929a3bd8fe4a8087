"""What the optimizer step over chunks uses of an engine, and one kernel call's run.

Shared by :mod:`~infinity.runtime.offloaded_step` (whole chunks) and
:mod:`~infinity.runtime.oversize_step` (oversize chunks in spans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from infinity.chunks.layout import ChunkLayout
from infinity.chunks.manager import ChunkManager
from infinity.core.names import Phase
from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews, UnitViews
from infinity.runtime.params import ParamEntry


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
                # NOTE: refused when the optimizer is bound (optimizer_binding.py):
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
    chunk: int,
    runs: list[Run],
    window: tuple[int, int],
    grads: torch.Tensor,
    unit: UnitViews,
    params: torch.Tensor,
    params_unread: bool,
    grad_scale: float,
) -> None:
    """The update of elements ``window`` of chunk ``chunk`` in host memory (the whole
    home, a shard's or one span of an oversize chunk): its gradients and parameters
    (compute dtype) and its optimizer unit's views, all starting at ``window[0]``.

    ``params_unread``: the parameters were not read (every tensor is rewritten
    from its master), so the window's tail after the last run gets the zeros it
    had, not a staging slot's stale bytes.
    """
    start = window[0]
    if params_unread:
        params[max(runs[-1].end - start, 0) :].zero_()
    master = unit.master if unit.master is not None else params
    out16 = params if engine.plan.has_master else None
    optimizer = engine.chunk_optimizer
    step_runs(optimizer, unit, master, grads, out16, runs, window, grad_scale, engine, chunk)
