"""The gradient sink: arrival of gradients, start and end of backward.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on the
model's chunks, the fetcher (each arrival is an access), the update queue, the
gradient ledger and norms, and the update pipeline (early steps). It owns the
backward-pass state (:class:`~infinity.runtime.lifecycles.Backward`).
"""

from __future__ import annotations

import torch

from infinity.chunks.states import TensorState
from infinity.core.names import Phase
from infinity.runtime.fetcher import ParamFetcher
from infinity.runtime.grad_ledger import GradientLedger
from infinity.runtime.grad_norms import GradientNorms
from infinity.runtime.lifecycles import LEGAL_BACKWARD, Backward, Lifecycle
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.sentinel import GradientInChunks
from infinity.runtime.stepping import UpdatePipeline
from infinity.runtime.update_queue import UpdateQueue

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
        self.manager.write_grad(chunk, slot.offset, grad)
        chunks.sample(Phase.GRAD, chunk)
        self.ledger.received(entry.index)
        chunks.set_state(entry, _S.HOLD_AFTER_BWD)
        counters = chunks.states[chunk]
        if counters.count(_S.HOLD_AFTER_FWD) == 0 and not counters.in_compute:
            self.manager.flush_grad(chunk)
            if self.overlap and self.pipeline.optimizer is not None:
                self.pipeline.step_early(chunk)

    def before_grad(self, grad: torch.Tensor) -> None:
        """Tensor hook of a parameter, run before its AccumulateGrad."""
        self.note_backward()

    def note_backward(self) -> None:
        """First event of a backward pass: settle last step's gradients, arm the end hook."""
        if self.running:
            return
        self.queue.check_not_stepped_early("a second backward before optimizer.step()")
        self.queue.settle()  # the updates still queued read the previous gradients
        self.backward.move(Backward.RUNNING)
        # Sentinels the user dropped (zero_grad) mean "zeroed"; the rest must
        # leave param.grad before AccumulateGrad runs, or it would add to them.
        self.ledger.collect_zeroed()
        # Accumulating onto clipped gradients: the clip factor must be in the chunks.
        self.ledger.apply_factors()
        self.ledger.changed()
        for entry in self.chunks.registry.entries:
            if isinstance(entry.param.grad, GradientInChunks):
                entry.param.grad = None
        # NOTE: queue_callback runs once the whole backward pass is done;
        # that is where partial gradient chunks (unused parameters) go home.
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """The backward pass ended (or was found interrupted): flush what is left."""
        self.backward.move(Backward.IDLE)
        self.manager.flush_all_grads()
        self.set_sentinels()
        self.fetcher.trace.end_backward()
        self.manager.check_io()  # raised from backward(), not at some later call

    def set_sentinels(self) -> None:
        """Every parameter with a gradient in chunks shows a sentinel in ``.grad``."""
        has_grad = self.chunks.has_grad
        for entry in self.chunks.registry.entries:
            if has_grad[entry.index] and entry.param.grad is None:
                entry.param.grad = GradientInChunks(entry.param.data, self.norms, entry.index)
