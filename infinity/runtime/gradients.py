"""The gradient sink: arrival of gradients, start and end of backward.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on the
model's chunks, the fetcher (each arrival is an access), the update queue, the
gradient ledger and norms, and the update pipeline (early steps). It owns the
backward-pass state (:class:`~infinity.runtime.model_chunks.Backward`).

:class:`GradientNorms`, the norms and scaling of the gradients held in chunks
(what ``clip_grad_norm_`` needs), is built on the model's chunks, the gradient
ledger (which holds the pending factors) and the update queue (settled before
any read). The gradient
sentinel (:mod:`infinity.runtime.grad_ledger`) answers ``torch.linalg.vector_norm``
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
from infinity.chunks.pieces import tensor_values
from infinity.chunks.states import TensorState
from infinity.core.names import Phase
from infinity.optim.offloaded import LossScaler
from infinity.runtime.grad_ledger import GradientLedger
from infinity.runtime.grad_sentinel import GradientInChunks
from infinity.runtime.model_chunks import LEGAL_BACKWARD, Backward, Lifecycle, ModelChunks
from infinity.runtime.params import ParamEntry, tensor_index
from infinity.runtime.stepping import UpdatePipeline
from infinity.runtime.update_queue import ParamFetcher, UpdateQueue

_S = TensorState


class GradientSink:
    """What happens when autograd hands the engine a gradient."""

    def __init__(
        self,
        chunks: ModelChunks,
        fetcher: ParamFetcher,
        queue: UpdateQueue,
        ledger: GradientLedger,
        norms: GradientNorms,
        pipeline: UpdatePipeline,
        *,
        overlap: bool,
    ) -> None:
        """``overlap`` (``Config(overlap_optimizer=True)``): step each chunk as soon as
        its gradients are complete."""
        self.chunks = chunks
        self.manager = chunks.manager
        self.flow = chunks.manager.grad_flow  # the owner of the device gradient chunks
        self.fetcher = fetcher
        self.queue = queue
        self.ledger = ledger
        self.norms = norms
        self.pipeline = pipeline
        self.overlap = overlap
        self.backward = Lifecycle(Backward.IDLE, LEGAL_BACKWARD, "backward pass")

    @property
    def running(self) -> bool:
        """A backward pass is running (its end-of-backward callback has not come)."""
        return self.backward.state is Backward.RUNNING

    def on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient is ready: move it into its gradient chunk."""
        self.note_backward()
        chunks = self.chunks
        entry = chunks.registry.by_id[id(param)]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        slot = chunks.layout.slots[entry.index]
        chunk = slot.chunk
        self.fetcher.access(Phase.GRAD, chunk)
        self.flow.write_grad(chunk, slot.offset, grad)
        chunks.sample(Phase.GRAD, chunk)
        self.ledger.received(entry.index)
        chunks.set_state(entry, _S.HOLD_AFTER_BWD)
        counters = chunks.states[chunk]
        if counters.count(_S.HOLD_AFTER_FWD) == 0 and not counters.in_compute:
            self.flow.flush_grad(chunk)
            if self.overlap and self.pipeline.optimizer is not None:
                self.pipeline.step_early(chunk)

    def before_grad(self, grad: torch.Tensor) -> None:
        """Tensor hook of a parameter, run before its AccumulateGrad."""
        if grad.requires_grad:
            # NOTE: a gradient with a graph of its own comes from create_graph=True.
            # It would keep every parameter view of that graph alive in the device
            # slots (backward then ran out of them with PoolExhausted), and its chunk
            # copy could carry no graph anyway.
            raise RuntimeError(
                "backward(create_graph=True) or torch.autograd.grad(..., create_graph=True) "
                "asks for gradients of gradients, which offloaded parameters cannot give: "
                "their gradients go into chunks, outside any graph. Compute higher-order "
                "terms (gradient penalties, MAML) with a model that is not offloaded"
            )
        self.note_backward()

    def note_backward(self) -> None:
        """First event of a backward pass: settle last step's gradients, arm the end hook."""
        if self.running:
            return
        self.manager.collectives.align("backward")
        self.queue.check_not_stepped_early("a second backward before optimizer.step()")
        self.queue.settle()  # the updates still queued read the previous gradients
        self.backward.move(Backward.RUNNING)
        # Sentinels the user dropped (zero_grad) mean "zeroed"; the rest must
        # leave param.grad before AccumulateGrad runs, or it would add to them.
        self.ledger.collect_zeroed()
        # Accumulating onto clipped gradients: the clip must be in the chunks.
        self.ledger.apply_clamps()
        self.ledger.apply_factors()
        self.ledger.changed()
        self.norms.forget()  # they may be on the device: not beside this pass's
        for entry in self.chunks.registry.entries:
            if isinstance(entry.param.grad, GradientInChunks):
                entry.param.grad = None
        # queue_callback runs once the whole backward pass is done;
        # that is where partial gradient chunks (unused parameters) go home.
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """The backward pass ended (or was found interrupted): flush what is left."""
        self.backward.move(Backward.IDLE)
        self.flow.flush_all_grads()
        self.set_sentinels()
        self.fetcher.trace.end_backward()
        self.manager.failures.check()  # raised from backward(), not at some later call

    def set_sentinels(self) -> None:
        """Every parameter with a gradient in chunks shows a sentinel in ``.grad``."""
        has_grad = self.chunks.has_grad
        for entry in self.chunks.registry.entries:
            if has_grad[entry.index] and entry.param.grad is None:
                entry.param.grad = GradientInChunks(entry.param.data, self.norms, entry.index)


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

    def forget(self) -> None:
        """Drop the cached norms (a backward starts: they are of gradients about to change)."""
        self._cache.clear()

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
        self.ledger.apply_clamps()
        chunks = self.chunks
        has_grad = chunks.has_grad
        with_grad = (chunks.registry.entries[i] for i in indices if has_grad[i])
        for chunk, group in chunks.layout.group_by_chunk(with_grad, tensor_index).items():
            # Views of a whole chunk; an oversize chunk is never staged whole: a
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
            self.ledger.apply_clamps()  # (the device's norms are of the values before)
            self._collected = self.ledger.version
        cache = self._norm_cache().setdefault(norm_type, {})
        if not cache:  # the first norm asked of these gradients (a sharded read gathers)
            self.chunks.manager.collectives.align("reading gradient norms (clip_grad_norm_)")
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
        # Views of the norms where they were taken: reading them waits for
        # nothing (the H200 synchronized twice a tensor, a copy to the host and back).
        for i, value in zip(indices, norms.unbind(), strict=True):
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

    def clamp_grad(self, index: int, lower: float | None, upper: float | None) -> None:
        """Clamp tensor ``index``'s gradient to ``[lower, upper]`` (recorded, applied
        before it is next read); with fp16 the bounds are of the unscaled gradient."""
        self.queue.check_not_stepped_early("clip_grad_value_")
        self.queue.settle()  # a queued update reads these gradients unclamped
        if self.scaler is not None:
            # NOTE: the stored values are the gradient times the loss scale, a power of
            # two from the default initial and minimum scales on: comparing them with
            # the bounds times it is then exact.
            scale = self.scaler.scale
            lower = None if lower is None else lower * scale
            upper = None if upper is None else upper * scale
        self.ledger.clamp(index, lower, upper)
