"""The optimizer side of the engine: the step over chunks, and stepping during backward.

A mixin of :class:`~infinity.runtime.engine.OffloadEngine`.
"""

from __future__ import annotations

from infinity.optim.hyper import AdamHyperParams
from infinity.optim.offloaded_step import (
    chunk_ready,
    finish_chunk,
    offloaded_step,
    plan_chunk,
    prefetch_chunk,
    run_works,
)


class OptimizerSteps:
    """Optimizer steps of offloaded parameters (called by ``CPUAdam``)."""

    def optimizer_step(
        self, hyper_by_index: dict[int, AdamHyperParams], clip_coef: float = 1.0
    ) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it."""
        self.collect_zeroed_grads()
        # NOTE: no global synchronize here: every reader waits for exactly the
        # transfer it needs (a gradient's flush, a staging read), and writes
        # still in flight from the backward keep running behind this step.
        grad_scale = clip_coef
        if self.scaler is not None:
            if not self.loss_scaled and any(self.has_grad):
                raise RuntimeError(
                    "fp16 training needs loss scaling: call "
                    "`optimizer.scale_loss(loss).backward()` instead of `loss.backward()` "
                    "(bf16 and fp32 need no scaling)"
                )
            found_inf = self.manager.found_inf
            grad_scale = clip_coef / self.scaler.scale
            self.scaler.update(found_inf)
            self.loss_scaled = False
            if found_inf:
                self.step_timer.lap()
                return False
        # overlap_optimizer: chunks queued during backward whose reads had not landed.
        run_works(self, self.early_queue, grad_scale)
        self.early_queue = []
        offloaded_step(self, hyper_by_index, grad_scale, skip=self.stepped_early)
        self.stepped_early = set()
        self._early_hyper = None
        self.step_count += 1
        # The next forward's first chunks can travel while the user loads data.
        self.manager.moment = -1
        self.prefetch()
        self.step_timer.lap()
        return True

    def _step_early(self, chunk: int) -> None:
        """overlap_optimizer: queue the update of a chunk whose gradients are all in.

        Its reads start now; the update runs at a later hook once they have
        landed (:meth:`poll_early`), so backward never waits on the disk for it.
        """
        from infinity.optim.offloaded import offloaded_hyper

        optimizer = self.optimizer()
        if optimizer is None:
            return
        if self._early_hyper is None:
            self._early_hyper = offloaded_hyper(optimizer.param_groups).get(self, {})
        work = plan_chunk(self, chunk, self._early_hyper)
        self.stepped_early.add(chunk)
        if work is not None:
            prefetch_chunk(self, work)
            self.early_queue.append(work)
            self.poll_early()

    def poll_early(self) -> None:
        """Run queued early updates whose data is in host memory (never waits on I/O)."""
        pending = []
        for work in self.early_queue:
            prefetch_chunk(self, work)  # retries reads that found no free slot
            if chunk_ready(self, work):
                finish_chunk(self, work, grad_scale=1.0)
                self.early_chunk_steps += 1
            else:
                pending.append(work)
        self.early_queue = pending

    def check_not_stepped_early(self, what: str) -> None:
        """Raise if chunks were already updated in this backward (overlap_optimizer=True)."""
        if self.stepped_early:
            raise RuntimeError(
                f"{what} after a backward whose chunks were already updated "
                "(Config(overlap_optimizer=True) steps each chunk as soon as its gradients are "
                "complete). With gradient clipping or accumulation use overlap_optimizer=False."
            )
