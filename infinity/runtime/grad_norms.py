"""Norms and scaling of the gradients held in chunks: what ``clip_grad_norm_`` needs.

A mixin of :class:`~infinity.runtime.engine.OffloadEngine`. The gradient
sentinel (:mod:`infinity.runtime.sentinel`) answers ``torch.linalg.vector_norm``
and ``mul_`` through it, so ``torch.nn.utils.clip_grad_norm_`` works unchanged:

- a norm is computed per tensor from its chunk, one pass per chunk and norm
  type, and kept until the gradients change;
- a multiplication is only recorded (a pending factor per tensor). The step
  folds a common factor into the fused Adam kernel's gradient scale, so
  clipping costs no pass over the gradients. The factor is written into the
  chunks only when something else needs the scaled values in place: the next
  backward adding to them (gradient accumulation after clipping), or a step
  whose tensors carry different factors.

Gradients are seen as torch would hold them: fp16 loss scaling removed, the
pending factor applied.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.manager import typed
from infinity.chunks.span_access import each_span, read_tensor
from infinity.chunks.spans import is_split
from infinity.runtime.engine_fields import EngineFields
from infinity.runtime.params import ParamEntry, tensor_index


class GradientNorms(EngineFields):
    """Per-tensor gradient norms and pending gradient factors of an engine."""

    def init_grad_norms(self) -> None:
        """Start with no pending factor and no cached norm."""
        self.grad_factors = [1.0] * len(self.registry.entries)
        self._norm_cache: dict[float, dict[int, torch.Tensor]] = {}

    def forget_grad_norms(self) -> None:
        """The gradients changed: cached norms are stale."""
        self._norm_cache.clear()

    # --- reading gradients ----------------------------------------------------------
    def grad_views(
        self, indices: Iterable[int], *, keep: bool = False
    ) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
        """Views of the stored gradients (loss-scaled, pending factor not applied) of
        the tensors in ``indices`` that have one, chunk by chunk; valid while the
        iteration rests on them. ``keep`` leaves NVMe staging copies cached."""
        self.synchronize()
        self.collect_zeroed_grads()
        with_grad = (self.registry.entries[i] for i in indices if self.has_grad[i])
        for chunk, group in self.layout.group_by_chunk(with_grad, tensor_index).items():
            if is_split(self.plan, chunk):
                # NOTE: an oversize chunk is never staged whole: a copy of the tensor.
                for entry in group:
                    slot = self.layout.slots[entry.index]
                    yield entry, read_tensor(self.manager, Kind.GRAD, slot, self.dtype)
                continue
            region, copy = self.manager.open_host((Kind.GRAD, chunk), writable=False)
            try:
                for entry in group:
                    yield entry, self.chunk_view(region, entry)
            finally:
                self.manager.close_host(copy, modified=False, keep=keep)

    def grad_norm(self, index: int, norm_type: float) -> torch.Tensor:
        """The norm of tensor ``index``'s gradient as torch would see it (fp32, 0-d).

        Computed with the other tensors of its chunk in one pass, then cached
        (torch asks tensor by tensor: a hit must cost next to nothing).
        """
        self.check_not_stepped_early("clip_grad_norm_")
        norm_type = float(norm_type)
        cached = self._norm_cache.get(norm_type, {}).get(index)
        if cached is not None:
            return cached
        self.collect_zeroed_grads()  # may forget the cache: before taking it
        cache = self._norm_cache.setdefault(norm_type, {})
        members = self.chunk_members[self.layout.slots[index].chunk]
        for entry, view in self.grad_views([e.index for e in members], keep=True):
            cache[entry.index] = self._norm_of(view, entry.index, norm_type)
        if index not in cache:
            raise RuntimeError(
                f"{self.registry.entries[index].name} has no gradient in infinity's chunks any "
                "more (zeroed, or a checkpoint was loaded): read param.grad again after backward"
            )
        return cache[index]

    def _norm_of(self, view: torch.Tensor, index: int, norm_type: float) -> torch.Tensor:
        factor = self.grad_factors[index]
        if self.scaler is not None:
            factor /= self.scaler.scale
        if factor == 1.0:
            return torch.linalg.vector_norm(view, norm_type, dtype=torch.float32)
        # NOTE: the norm of the scaled values, as torch computes it after mul_
        # (not the norm times the factor: that differs in rounding, and for norm 0).
        return torch.linalg.vector_norm(view.to(torch.float32) * factor, norm_type)

    def stored_gradient(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """A stored gradient with its pending factor applied (``view`` itself if none)."""
        factor = self.grad_factors[index]
        return view if factor == 1.0 else view * factor

    # --- scaling ----------------------------------------------------------------------
    def scale_grad(self, index: int, factor: float) -> None:
        """Multiply tensor ``index``'s gradient by ``factor`` (recorded, applied later)."""
        self.check_not_stepped_early("clip_grad_norm_")
        if factor == 1.0:
            return
        self.settle_step()  # a queued update reads these gradients with the old factor
        self.grad_factors[index] *= factor
        self.forget_grad_norms()

    def step_grad_factor(self, indices: Iterable[int]) -> float:
        """The factor the step applies to the gradients of ``indices`` (those stepped).

        One factor shared by all folds into the kernel; otherwise the factors
        are first written into the chunks and the step applies none.
        """
        factors = {self._factor_of(i) for i in indices if self.has_grad[i]}
        if len(factors) <= 1:
            return factors.pop() if factors else 1.0
        self.apply_grad_factors()
        return 1.0

    def apply_grad_factors(self) -> None:
        """Write the pending factors into the gradient chunks (then all are 1)."""
        pending = {
            i: self._factor_of(i)
            for i, f in enumerate(self.grad_factors)
            if f != 1.0 and self.has_grad[i]
        }
        self.grad_factors = [1.0] * len(self.grad_factors)
        if not pending:
            return
        self.settle_step()
        for chunk, group in self.layout.group_by_chunk(pending, int).items():
            if is_split(self.plan, chunk):
                for i in group:
                    slot = self.layout.slots[i]
                    end = slot.offset + slot.numel
                    for _at, parts in each_span(
                        self.manager, Kind.GRAD, chunk, slot.offset, end, modify=True
                    ):
                        parts[0].view(self.dtype).mul_(pending[i])
                continue
            region, copy = self.manager.open_host((Kind.GRAD, chunk))
            try:
                flat = typed(region, self.dtype)
                for i in group:
                    slot = self.layout.slots[i]
                    flat[slot.offset : slot.offset + slot.numel].mul_(pending[i])
            finally:
                self.manager.close_host(copy, modified=True)
        self.forget_grad_norms()

    def _factor_of(self, index: int) -> float:
        factor = self.grad_factors[index]
        if not math.isfinite(factor):
            raise RuntimeError(
                f"the gradient of {self.registry.entries[index].name} was scaled by {factor} "
                "(a clip coefficient from a non-finite gradient norm); call "
                "optimizer.zero_grad() before the next backward, or clip with "
                "error_if_nonfinite=True to stop at the bad norm"
            )
        return factor

    def reset_grad_factors(self, indices: Iterable[int] | None = None) -> None:
        """Gradients of ``indices`` (all when ``None``) were dropped: no pending factor."""
        for i in range(len(self.grad_factors)) if indices is None else indices:
            self.grad_factors[i] = 1.0
        self.forget_grad_norms()
