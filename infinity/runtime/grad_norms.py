"""Norms and scaling of the gradients held in chunks: what ``clip_grad_norm_`` needs.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on the
model's chunks, the gradient ledger (which holds the pending factors) and the
update queue (settled before any read). The gradient
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

from collections.abc import Iterable, Iterator
from contextlib import closing

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.tensor_views import tensor_values
from infinity.optim.loss_scale import LossScaler
from infinity.runtime.grad_ledger import GradientLedger
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.params import ParamEntry, tensor_index
from infinity.runtime.update_queue import UpdateQueue


class GradientNorms:
    """Per-tensor gradient norms of an engine, and the sentinel's multiplications."""

    def __init__(
        self,
        chunks: ModelChunks,
        ledger: GradientLedger,
        queue: UpdateQueue,
        scaler: LossScaler | None,
    ) -> None:
        self.chunks = chunks
        self.ledger = ledger
        self.queue = queue
        self.scaler = scaler
        # Norms by norm type and tensor, valid while the ledger's version is this one.
        self._cache: dict[float, dict[int, torch.Tensor]] = {}
        self._version = ledger.version
        # The ledger's version when zeroed gradients were last collected for the norms.
        self._collected: int | None = None
        self.device_hits = 0  # chunks whose norms came from the device (tests read it)

    def _norm_cache(self) -> dict[float, dict[int, torch.Tensor]]:
        if self._version != self.ledger.version:
            self._cache.clear()
            self._version = self.ledger.version
        return self._cache

    # --- reading gradients ----------------------------------------------------------
    def grad_views(
        self, indices: Iterable[int], *, keep: bool = False, collect: bool = True
    ) -> Iterator[tuple[ParamEntry, torch.Tensor]]:
        """Views of the stored gradients (loss-scaled, pending factor not applied) of
        the tensors in ``indices`` that have one, chunk by chunk; valid while the
        iteration rests on them. ``keep`` leaves NVMe staging copies cached;
        ``collect=False``: the caller collected the zeroed gradients already."""
        self.queue.synchronize()
        if collect:
            self.ledger.collect_zeroed()
        chunks = self.chunks
        has_grad = chunks.has_grad
        with_grad = (chunks.registry.entries[i] for i in indices if has_grad[i])
        for chunk, group in chunks.layout.group_by_chunk(with_grad, tensor_index).items():
            # NOTE: views of a whole chunk; an oversize chunk is never staged whole: a
            # copy of each tensor.
            slots = [chunks.layout.slots[entry.index] for entry in group]
            values = tensor_values(chunks.manager, Kind.GRAD, chunk, slots, chunks.dtype, keep=keep)
            with closing(values):
                for entry, slot, flat in zip(group, slots, values, strict=True):
                    yield entry, flat.view(slot.shape)

    def grad_norm(self, index: int, norm_type: float) -> torch.Tensor:
        """The norm of tensor ``index``'s gradient as torch would see it (fp32, 0-d).

        Computed with the other tensors of its chunk in one pass, then cached
        (torch asks tensor by tensor: a hit must cost next to nothing).
        """
        self.queue.check_not_stepped_early("clip_grad_norm_")
        norm_type = float(norm_type)
        cached = self._norm_cache().get(norm_type, {}).get(index)
        if cached is not None:
            return cached
        # NOTE: once per version, not per chunk: a pass over every tensor per chunk
        # made clipping quadratic in the model's tensors (12 ms a step for a 16-layer
        # Llama). A gradient zeroed by the user later in the same pass is no longer
        # asked for, and the tensors still asked for keep their values.
        if self._collected != self.ledger.version:
            self.ledger.collect_zeroed()  # may change the version: before taking the cache
            self._collected = self.ledger.version
        cache = self._norm_cache().setdefault(norm_type, {})
        chunk = self.chunks.chunk_of(index)
        if not self._from_device(chunk, norm_type, cache):
            members = self.chunks.chunk_members[chunk]
            indices = [e.index for e in members]
            for entry, view in self.grad_views(indices, keep=True, collect=False):
                cache[entry.index] = self._norm_of(view, entry.index, norm_type)
        if index not in cache:
            raise RuntimeError(
                f"{self.chunks.registry.entries[index].name} has no gradient in infinity's "
                "chunks any more (zeroed, or a checkpoint was loaded): read param.grad again "
                "after backward"
            )
        return cache[index]

    def _from_device(self, chunk: int, norm_type: float, cache: dict[int, torch.Tensor]) -> bool:
        """Fill ``cache`` with ``chunk``'s norms taken on the device at its flush, if
        they are the ones asked for; False if not (read from the chunks then).

        NOTE [gradient norms on the device]: 2-norms of the stored values, the same
        expression as :meth:`_norm_of` with no pending factor and no loss scale."""
        grads = self.chunks.manager.grads
        grads.norms_wanted = True  # the next backward takes them
        taken = grads.norms.get(chunk)
        if taken is None or norm_type != 2.0 or self.scaler is not None:
            return False
        indices, norms = taken
        factors = self.ledger.factors
        if any(factors[i] != 1.0 for i in indices):
            return False
        has_grad = self.chunks.has_grad
        # NOTE: one small copy; it waits for the chunk's norms (queued at its flush).
        for i, value in zip(indices, norms.to("cpu"), strict=True):
            if has_grad[i]:
                cache[i] = value
        self.device_hits += 1
        return True

    def _norm_of(self, view: torch.Tensor, index: int, norm_type: float) -> torch.Tensor:
        factor = self.ledger.factors[index]
        if self.scaler is not None:
            factor /= self.scaler.scale
        if factor == 1.0:
            return torch.linalg.vector_norm(view, norm_type, dtype=torch.float32)
        # NOTE: the norm of the scaled values, as torch computes it after mul_
        # (not the norm times the factor: that differs in rounding, and for norm 0).
        return torch.linalg.vector_norm(view.to(torch.float32) * factor, norm_type)

    # --- scaling ----------------------------------------------------------------------
    def scale_grad(self, index: int, factor: float) -> None:
        """Multiply tensor ``index``'s gradient by ``factor`` (recorded, applied later)."""
        self.queue.check_not_stepped_early("clip_grad_norm_")
        if factor == 1.0:
            return
        self.queue.settle()  # a queued update reads these gradients with the old factor
        self.ledger.scale(index, factor)
