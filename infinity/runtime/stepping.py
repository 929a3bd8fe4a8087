"""The update pipeline: what the optimizer front-ends ask of an offloaded model's engine.

A component of :class:`~infinity.runtime.engine.OffloadEngine`: it plans the
step over chunks and hands the work to the
:class:`~infinity.runtime.update_queue.UpdateQueue` (host-only chunks run at
once, NVMe-bound ones trail into the next forward), queues chunks during
backward with ``overlap_optimizer=True``, owns the step count and the fp16
loss-scale state, and reads and writes the optimizer state as torch's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from infinity.chunks.manager import ChunkManager
from infinity.io.rates import DiskMix, disk_rates
from infinity.optim.loss_scale import LossScaler
from infinity.optim.offloaded import MomentState
from infinity.optim.registry import engine_of_param
from infinity.runtime import optim_state
from infinity.runtime.grad_ledger import GradientLedger
from infinity.runtime.lifecycles import LEGAL_LOSS_SCALE, Lifecycle, LossScale
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.offloaded_step import plan_chunk, plan_works
from infinity.runtime.step_timer import StepTimer
from infinity.runtime.update_queue import UpdateQueue


class UpdatePipeline:
    """Optimizer steps of offloaded parameters (called by the optimizer through the engine).

    Hyper-parameters are the optimizer's own objects (``CPUOptimizer.hyper_of``),
    handed to the chunk optimizer unread: equal ones share a kernel call.
    """

    def __init__(
        self,
        chunks: ModelChunks,
        queue: UpdateQueue,
        ledger: GradientLedger,
        scaler: LossScaler | None,
        prefetch: Callable[[], None],
    ) -> None:
        """``prefetch`` starts fetching the next forward's first chunks (the fetcher's)."""
        self.chunks = chunks
        self.queue = queue
        self.ledger = ledger
        self.scaler = scaler
        self.prefetch = prefetch
        self.manager = chunks.manager
        self.step_count = 0
        self.step_timer = StepTimer(
            self.manager.traffic, self.manager.backend, _disk_of(self.manager)
        )
        self.loss_scale = Lifecycle(LossScale.UNSCALED, LEGAL_LOSS_SCALE, "loss scale")
        # Weak reference to the optimizer holding this model's parameters (it registers).
        self.optimizer: Callable[[], Any] | None = None
        # overlap_optimizer: the hyper-parameters of this backward's early steps.
        self._early_hyper: Mapping[int, object] | None = None

    def note_loss_scaled(self) -> None:
        """The loss of the coming backward was multiplied by the fp16 loss scale."""
        self.loss_scale.move(LossScale.SCALED)

    def step(self, hyper_by_index: Mapping[int, object]) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it.

        Gradients are multiplied by their pending factor (gradient clipping, see
        :mod:`infinity.runtime.grad_norms`) and the inverse fp16 loss scale
        inside the kernel. NVMe-bound chunks are queued, not updated yet (see
        :mod:`infinity.runtime.update_queue`).
        """
        self.queue.settle()  # a step still trailing (two steps without a forward between)
        self.manager.in_use.release()  # sharded: the updates make the held copies stale
        self.ledger.collect_zeroed()
        # NOTE: no global synchronize here: every reader waits for exactly the
        # transfer it needs (a gradient's flush, a staging read), and writes
        # still in flight from the backward keep running behind this step.
        grad_scale = 1.0
        if self.scaler is not None:
            scaled = self.loss_scale.state is LossScale.SCALED
            if not scaled and self.chunks.has_grad.any:
                raise RuntimeError(
                    "fp16 training needs loss scaling: call "
                    "`optimizer.scale_loss(loss).backward()` instead of `loss.backward()` "
                    "(bf16 and fp32 need no scaling)"
                )
            found_inf = self.manager.grad_flow.overflowed()
            grad_scale = 1.0 / self.scaler.scale
            self.scaler.update(found_inf)
            if scaled:
                self.loss_scale.move(LossScale.UNSCALED)
            if found_inf:
                self.step_timer.lap()
                return False
        grad_scale *= self.ledger.step_factor(hyper_by_index.keys())
        # overlap_optimizer: chunks queued during backward whose reads had not landed.
        planned = plan_works(self.chunks, hyper_by_index, skip=self.queue.handled_early())
        works = self.queue.take_early() + planned
        self._early_hyper = None
        self.step_count += 1
        self.queue.start_step(works, grad_scale)
        # The next forward's first chunks can travel while the user loads data.
        self.manager.moment = -1
        self.prefetch()
        self.step_timer.lap()
        self.manager.check_io()  # e.g. a write-back of this step that already failed
        return True

    def step_early(self, chunk: int) -> None:
        """overlap_optimizer: queue the update of a chunk whose gradients are all in."""
        optimizer = self.optimizer() if self.optimizer is not None else None
        if optimizer is None:
            return
        if self._early_hyper is None:
            # NOTE: the optimizer groups hyper-parameters by engine: this model's
            # is found through the registry, never held here.
            engine = engine_of_param(self.chunks.registry.entries[0].param)
            hyper = optimizer.offloaded_hyper()  # a CPUOptimizer (infinity.optim.front_end)
            self._early_hyper = hyper.get(engine, {}) if engine is not None else {}
        self.queue.add_early(chunk, plan_chunk(self.chunks, chunk, self._early_hyper))

    # --- optimizer state, as torch's (optimizer.state_dict / load_state_dict) -----------
    def read_moments(self, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
        """Copies of the moments of the tensors ``indices`` stepped at least once."""
        self.queue.settle()
        return optim_state.read_moments(self.chunks, indices)

    def check_moments(self, values: dict[int, MomentState | None]) -> None:
        """Raise (changing nothing) if a state does not fit its tensor."""
        optim_state.check_moments(self.chunks, values)

    def write_moments(self, values: dict[int, MomentState | None]) -> None:
        """Set moments and step counts by tensor index (``None``: never stepped)."""
        self.queue.settle()
        optim_state.write_moments(self.chunks, values)


def _disk_of(manager: ChunkManager) -> Callable[[], DiskMix | None] | None:
    """The rates of the disk under ``manager``'s swap file, measured when first asked
    (after its transfers in flight land); None without an NVMe tier."""
    swap = manager.homes.swap_file
    if swap is None:
        return None
    directory, config = os.path.dirname(swap.path), swap.engine.config

    def rates() -> DiskMix | None:
        return disk_rates(directory, config, before=manager.synchronize)

    return rates
