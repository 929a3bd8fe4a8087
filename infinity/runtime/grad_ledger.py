"""What the engine knows of each tensor's gradient: held or not, and its pending factor.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on
:class:`~infinity.runtime.model_chunks.ModelChunks`. It is the only component
that moves the per-tensor gradient states (``chunks.has_grad``, see
:mod:`infinity.runtime.model_chunks`) and the pending gradient factors.

- ``param.grad`` set to ``None`` (or a sentinel zeroed in place) by the user is
  how the engine learns gradients were zeroed: :meth:`collect_zeroed` turns
  that into states here and in the chunk manager.
- A multiplication of a gradient (clipping) is only recorded, as a pending
  factor per tensor. The step folds a common factor into the fused kernel's
  gradient scale; the factors are written into the chunks only when something
  needs the scaled values in place (see :mod:`infinity.runtime.gradients`).
- A clamp (``clip_grad_value_``) is recorded too, and written into the chunks,
  one pass per chunk, before anything reads the gradients (a norm, a step, the
  next backward): torch clamps tensor by tensor, which would read and write an
  NVMe-homed chunk once per tensor.

``version`` changes whenever a gradient as the user sees it may have changed,
so a cache of norms keyed by it never serves stale values.

What ``param.grad`` holds meanwhile, and what torch's clipping calls on it:
:mod:`infinity.runtime.grad_sentinel`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import closing

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.pieces import windows
from infinity.chunks.states import UpdateState
from infinity.runtime.grad_sentinel import GradientInChunks, is_zeroed
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.params import ModelChangedError, ParamEntry


class GradientLedger:
    """Per-tensor gradient states and pending factors of one model."""

    def __init__(self, chunks: ModelChunks) -> None:
        self.chunks = chunks
        self.manager = chunks.manager
        self.has_grad = chunks.has_grad  # moved only here (see ModelChunks)
        n = len(chunks.registry.entries)
        self.factors = [1.0] * n  # per tensor: the pending clip factor
        # Per tensor: a pending clamp (lower, upper; None: unbounded) in stored units.
        # NOTE: a tensor never has both a factor and a clamp pending (clamp applies
        # the factors first, scale the clamps), so their order cannot matter.
        self.clamps: dict[int, tuple[float | None, float | None]] = {}
        self.version = 0

    def changed(self) -> None:
        """The gradients (as the user sees them) may have changed."""
        self.version += 1

    def received(self, index: int) -> None:
        """Tensor ``index``'s gradient arrived in its chunk."""
        self.has_grad.received(index)

    # --- zeroing -------------------------------------------------------------------
    def collect_zeroed(self) -> None:
        """Gradients whose ``param.grad`` the user set to ``None`` (zero_grad) are dropped."""
        chunks = self.chunks
        zeroed_chunks: dict[int, list[ParamEntry]] = {}
        for entry in chunks.registry.entries:
            if not self.has_grad[entry.index]:
                continue
            grad = entry.param.grad
            if grad is not None and not isinstance(grad, GradientInChunks):
                raise ModelChangedError(
                    f"{entry.name}.grad was assigned a tensor; gradients of offloaded parameters "
                    "live in chunks and cannot be set by hand"
                )
            if is_zeroed(grad):
                entry.param.grad = None
                self.has_grad.dropped(entry.index)
                zeroed_chunks.setdefault(chunks.chunk_of(entry.index), []).append(entry)
        if zeroed_chunks:
            self.reset_factors(e.index for es in zeroed_chunks.values() for e in es)
        for chunk, entries in zeroed_chunks.items():
            if not any(self.has_grad[e.index] for e in chunks.chunk_members[chunk]):
                self.manager.grads.zeroed(chunk)
            else:
                self._zero_grad_ranges(chunk, entries)
        if zeroed_chunks and not self.has_grad.any:
            self.manager.grad_flow.found_inf = False

    def reset(self) -> None:
        """Forget every gradient (after loading a checkpoint)."""
        self.clamps.clear()
        for entry in self.chunks.registry.entries:
            if isinstance(entry.param.grad, GradientInChunks):
                entry.param.grad = None
        self.has_grad.drop_all()
        self.reset_factors()
        self.manager.grad_flow.invalidate_grads()

    def _zero_grad_ranges(self, chunk: int, entries: list[ParamEntry]) -> None:
        """Zero some tensors' gradients inside a chunk whose other gradients stay."""
        if not self.manager.grads.home_valid(chunk):
            return  # nothing kept to zero (a later read or addition raises)
        self._change(chunk, {entry.index: torch.Tensor.zero_ for entry in entries})

    def _change(self, chunk: int, changes: dict[int, Callable[[torch.Tensor], object]]) -> None:
        """Apply ``changes[index]`` in place to tensor ``index``'s gradient in ``chunk``,
        window by window (an oversize chunk is never staged whole).

        Element-wise, so each rank changes its own shard alone (no gather)."""
        # NOTE [gradient norms on the device]: a later clip must not read the norms of
        # the values before this change (a chunk with no new gradient in the next
        # micro-batch keeps them until the step).
        self.manager.grads.changed_in_place(chunk)
        layout = self.chunks.layout
        each = windows(self.manager, Kind.GRAD, chunk, write=True, gather=False)
        with closing(each):
            for window in each:
                grads = window.parts[0].view(self.chunks.dtype)
                for index, change in changes.items():
                    slot = layout.slots[index]
                    where = window.overlap(slot.offset, slot.numel)
                    if where is not None:
                        change(grads[where[1]])

    # --- pending factors -------------------------------------------------------------
    def scale(self, index: int, factor: float) -> None:
        """Record a multiplication of tensor ``index``'s gradient by ``factor``."""
        if index in self.clamps:
            self.apply_clamps()
        self.factors[index] *= factor
        self.changed()

    def clamp(self, index: int, lower: float | None, upper: float | None) -> None:
        """Record ``clamp_(lower, upper)`` of tensor ``index``'s stored gradient.

        ``clamp_min_`` then ``clamp_max_`` (clip_grad_value_'s foreach form) merge
        into one clamp; any other sequence on one tensor applies the first. A pending
        clip factor is written in first: in a 16-bit chunk the product rounds to 16
        bits, as torch's ``mul_`` of a 16-bit ``param.grad`` does (without a clamp the
        factor folds into the update in fp32 instead)."""
        if self.factors[index] != 1.0:
            self.apply_factors()
        pending = self.clamps.get(index)
        if pending is not None:
            if pending[1] is None and lower is None and not _nan(pending[0], upper):
                lower = pending[0]
            else:
                self.apply_clamps()
        self.clamps[index] = (lower, upper)
        self.changed()

    def apply_clamps(self) -> None:
        """Write the pending clamps into the gradient chunks (queued updates settled)."""
        pending = {i: c for i, c in self.clamps.items() if self.has_grad[i]}
        self.clamps.clear()
        if not pending:
            return
        self._check_nothing_queued("clamps")
        for chunk, group in self.chunks.layout.group_by_chunk(pending, int).items():
            self._change(chunk, {i: _clamped(*pending[i]) for i in group})
        self.changed()

    def stored_gradient(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """A stored gradient with its pending factor applied (``view`` itself if none)."""
        factor = self.factors[index]
        return view if factor == 1.0 else view * factor

    def step_factor(self, indices: Iterable[int]) -> float:
        """The factor the step applies to the gradients of ``indices`` (those stepped).

        One factor shared by all folds into the kernel; otherwise the factors
        are first written into the chunks and the step applies none.
        """
        factors = {self.factor_of(i) for i in indices if self.has_grad[i]}
        if len(factors) <= 1:
            return factors.pop() if factors else 1.0
        self.apply_factors()
        return 1.0

    def apply_factors(self) -> None:
        """Write the pending factors into the gradient chunks (then all are 1).

        The caller has settled queued updates (they read these gradients).
        """
        pending = {
            i: self.factor_of(i)
            for i, f in enumerate(self.factors)
            if f != 1.0 and self.has_grad[i]
        }
        self.factors = [1.0] * len(self.factors)
        if not pending:
            return
        self._check_nothing_queued("factors")
        for chunk, group in self.chunks.layout.group_by_chunk(pending, int).items():
            self._change(chunk, {i: _times(pending[i]) for i in group})
        self.changed()

    def _check_nothing_queued(self, what: str) -> None:
        updates = self.manager.updates
        queued = (UpdateState.TRAILING, UpdateState.EARLY, UpdateState.COMPUTING)
        if any(updates.count(u) for u in queued):
            raise AssertionError(f"gradient {what} applied while updates are queued")

    def factor_of(self, index: int) -> float:
        """Tensor ``index``'s pending factor; raises if it is not finite."""
        factor = self.factors[index]
        if not math.isfinite(factor):
            raise RuntimeError(
                f"the gradient of {self.chunks.registry.entries[index].name} was scaled by "
                f"{factor} (a clip coefficient from a non-finite gradient norm); call "
                "optimizer.zero_grad() before the next backward, or clip with "
                "error_if_nonfinite=True to stop at the bad norm"
            )
        return factor

    def reset_factors(self, indices: Iterable[int] | None = None) -> None:
        """Gradients of ``indices`` (all when ``None``) were dropped: no pending factor
        or clamp."""
        for i in range(len(self.factors)) if indices is None else indices:
            self.factors[i] = 1.0
            self.clamps.pop(i, None)
        self.changed()


def _times(factor: float) -> Callable[[torch.Tensor], object]:
    """Multiply a gradient in place by ``factor``."""
    return lambda grads: grads.mul_(factor)


def _clamped(lower: float | None, upper: float | None) -> Callable[[torch.Tensor], object]:
    """Clamp a gradient in place, as ``Tensor.clamp_`` does (the same op on the same
    stored values as torch's on ``param.grad``)."""
    return lambda grads: grads.clamp_(min=lower, max=upper)


def _nan(*bounds: float | None) -> bool:
    return any(b is not None and math.isnan(b) for b in bounds)
