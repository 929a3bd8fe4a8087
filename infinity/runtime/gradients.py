"""Gradient events of the engine: arrival, start and end of backward, zeroing.

A mixin of :class:`~infinity.runtime.engine.OffloadEngine` (split out to keep
one concern per module); it uses the engine's registry, layout, states and
chunk manager.
"""

from __future__ import annotations

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.span_access import each_span
from infinity.chunks.spans import is_split
from infinity.chunks.states import TensorState
from infinity.core.names import Phase
from infinity.runtime.engine_fields import EngineFields
from infinity.runtime.errors import ModelChangedError
from infinity.runtime.params import ParamEntry
from infinity.runtime.sentinel import GradientInChunks, is_zeroed

_S = TensorState


class GradientEvents(EngineFields):
    """What happens when autograd hands the engine a gradient."""

    def on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient is ready: move it into its gradient chunk."""
        self._note_backward()
        entry = self.registry.by_id[id(param)]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        slot = self.layout.slots[entry.index]
        chunk = slot.chunk
        self.access(Phase.GRAD, chunk)
        self.manager.write_grad(chunk, slot.offset, grad)
        self.sample(Phase.GRAD, chunk)
        self.has_grad[entry.index] = True
        self.set_state(entry, _S.HOLD_AFTER_BWD)
        counters = self.states[chunk]
        if counters.count(_S.HOLD_AFTER_FWD) == 0 and not counters.in_compute:
            self.manager.flush_grad(chunk)
            if self.overlap and self.optimizer is not None:
                self._step_early(chunk)

    def before_grad(self, grad: torch.Tensor) -> None:
        """Tensor hook of a parameter, run before its AccumulateGrad."""
        self._note_backward()

    def _note_backward(self) -> None:
        """First event of a backward pass: settle last step's gradients, arm the end hook."""
        if self._backward_active:
            return
        self.check_not_stepped_early("a second backward before optimizer.step()")
        self.settle_step()  # the updates still queued read the previous gradients
        self._backward_active = True
        # Sentinels the user dropped (zero_grad) mean "zeroed"; the rest must
        # leave param.grad before AccumulateGrad runs, or it would add to them.
        self.collect_zeroed_grads()
        # Accumulating onto clipped gradients: the clip factor must be in the chunks.
        self.apply_grad_factors()
        self.forget_grad_norms()
        for entry in self.registry.entries:
            if isinstance(entry.param.grad, GradientInChunks):
                entry.param.grad = None
        # NOTE: queue_callback runs once the whole backward pass is done;
        # that is where partial gradient chunks (unused parameters) go home.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._backward_active = False
        self.manager.flush_all_grads()
        self.set_sentinels()
        self.trace.end_backward()
        self.manager.check_io()  # raised from backward(), not at some later call

    def set_sentinels(self) -> None:
        """Every parameter with a gradient in chunks shows a sentinel in ``.grad``."""
        for entry in self.registry.entries:
            if self.has_grad[entry.index] and entry.param.grad is None:
                entry.param.grad = GradientInChunks(entry.param.data, self, entry.index)

    def collect_zeroed_grads(self) -> None:
        """Gradients whose ``param.grad`` the user set to ``None`` (zero_grad) are dropped."""
        zeroed_chunks: dict[int, list[ParamEntry]] = {}
        for entry in self.registry.entries:
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
                self.has_grad[entry.index] = False
                zeroed_chunks.setdefault(self.layout.slots[entry.index].chunk, []).append(entry)
        if zeroed_chunks:
            self.reset_grad_factors(e.index for es in zeroed_chunks.values() for e in es)
        for chunk, entries in zeroed_chunks.items():
            if not any(self.has_grad[e.index] for e in self.chunk_members[chunk]):
                self.manager.grads.zeroed(chunk)
            else:
                self._zero_grad_ranges(chunk, entries)
        if zeroed_chunks and not any(self.has_grad):
            self.manager.found_inf = False

    def reset_gradients(self) -> None:
        """Forget every gradient (after loading a checkpoint)."""
        for entry in self.registry.entries:
            if isinstance(entry.param.grad, GradientInChunks):
                entry.param.grad = None
        self.has_grad = [False] * len(self.registry.entries)
        self.reset_grad_factors()
        self.manager.invalidate_grads()

    def _zero_grad_ranges(self, chunk: int, entries: list[ParamEntry]) -> None:
        """Zero some tensors' gradients inside a chunk whose other gradients stay."""
        if not self.manager.grads.home_valid(chunk):
            return  # nothing kept to zero (a later read or addition raises)
        if is_split(self.plan, chunk):
            for entry in entries:
                slot = self.layout.slots[entry.index]
                end = slot.offset + slot.numel
                for _at, parts in each_span(
                    self.manager, Kind.GRAD, chunk, slot.offset, end, modify=True
                ):
                    parts[0].zero_()
            return
        region, copy = self.manager.open_host((Kind.GRAD, chunk))
        for entry in entries:
            self.chunk_view(region, entry).zero_()
        self.manager.close_host(copy, modified=True)
