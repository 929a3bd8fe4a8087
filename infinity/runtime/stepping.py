"""The optimizer side of the engine: the step over chunks, stepping during backward,
and the step that trails into the next forward.

A mixin of :class:`~infinity.runtime.engine.OffloadEngine`.

NOTE: ``optimizer.step()`` updates host-homed chunks at once, but a chunk whose
optimizer state (or gradient, or parameters) lives on NVMe is only *queued*: its
update runs at a later hook, at the latest when the next forward (or anything
else) first touches that chunk. The values seen are the same as with an eager
step; what changes is that the disk traffic of the update overlaps compute.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from infinity.chunks.homes import Kind
from infinity.chunks.update_state import UpdateState
from infinity.core.names import HOST, Phase
from infinity.optim.hyper import AdamHyperParams
from infinity.optim.offloaded import MomentState, offloaded_hyper
from infinity.runtime import optim_state
from infinity.runtime.engine_fields import EngineFields
from infinity.runtime.offloaded_step import (
    ChunkWork,
    chunk_ready,
    finish_chunk,
    plan_chunk,
    plan_works,
    prefetch_chunk,
    run_works,
)

_U = UpdateState

# Trailing updates whose reads are in flight at once (the optimizer staging
# slots of the planner hold one more, the unit being updated).
TRAIL_LOOKAHEAD = 2


class OptimizerSteps(EngineFields):
    """Optimizer steps of offloaded parameters (called by ``CPUAdam``)."""

    def optimizer_step(self, hyper_by_index: dict[int, AdamHyperParams]) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it.

        Gradients are multiplied by their pending factor (gradient clipping, see
        :mod:`infinity.runtime.grad_norms`) and the inverse fp16 loss scale
        inside the kernel. NVMe-bound chunks are queued, not updated yet (see
        the module note).
        """
        self.settle_step()  # a step still trailing (two steps without a forward between)
        self.collect_zeroed_grads()
        # NOTE: no global synchronize here: every reader waits for exactly the
        # transfer it needs (a gradient's flush, a staging read), and writes
        # still in flight from the backward keep running behind this step.
        grad_scale = 1.0
        if self.scaler is not None:
            if not self.loss_scaled and any(self.has_grad):
                raise RuntimeError(
                    "fp16 training needs loss scaling: call "
                    "`optimizer.scale_loss(loss).backward()` instead of `loss.backward()` "
                    "(bf16 and fp32 need no scaling)"
                )
            found_inf = self.manager.grad_flow.found_inf
            grad_scale = 1.0 / self.scaler.scale
            self.scaler.update(found_inf)
            self.loss_scaled = False
            if found_inf:
                self.step_timer.lap()
                return False
        grad_scale *= self.step_grad_factor(hyper_by_index.keys())
        # overlap_optimizer: chunks queued during backward whose reads had not landed.
        updates = self.manager.updates
        stepped = updates.chunks_in(_U.STEPPED)
        works = self.early_queue + plan_works(self, hyper_by_index, skip=stepped | self._early())
        self.early_queue = []
        for chunk in stepped:
            updates.set(chunk, _U.IDLE)
        self._early_hyper = None
        self.step_count += 1
        self._start_trailing(works, grad_scale)
        # The next forward's first chunks can travel while the user loads data.
        self.manager.moment = -1
        self.prefetch()
        self.step_timer.lap()
        self.manager.check_io()  # e.g. a write-back of this step that already failed
        return True

    def _step_early(self, chunk: int) -> None:
        """overlap_optimizer: queue the update of a chunk whose gradients are all in.

        Its reads start now; the update runs at a later hook once they have
        landed (:meth:`poll_early`), so backward does not wait on the disk for
        it, unless the queued updates already hold every gradient staging slot:
        then the oldest one is run at once, waiting for its reads.
        """
        assert self.optimizer is not None  # the caller checks
        optimizer = self.optimizer()
        if optimizer is None:
            return
        if self._early_hyper is None:
            self._early_hyper = offloaded_hyper(optimizer.param_groups).get(self, {})
        work = plan_chunk(self, chunk, self._early_hyper)
        self.manager.updates.set(chunk, _U.STEPPED if work is None else _U.EARLY)
        if work is not None:
            # NOTE: its reads start in poll_early, in queue order: prefetched
            # here, it could take the slot an older starved update waits for.
            self.early_queue.append(work)
            self.poll_early()
            while self.early_queue and self._staged_grads_queued() >= self._grad_staging_slots():
                # NOTE: each queued update holds its gradients in a host staging
                # slot; one more would evict them to disk and read them back.
                # Waiting for the oldest update's reads costs less I/O than that.
                self._run_early(self.early_queue.pop(0))

    def poll_early(self, needed: int | None = None) -> None:
        """Run queued early updates whose data is in host memory (never waits on I/O),
        and (waiting for its reads) the one of chunk ``needed``."""
        pending: list[ChunkWork] = []
        starved = False
        for work in self.early_queue:
            # Retry reads that found no free slot, in queue order: once one finds
            # none, later chunks must not take the next free slots before it.
            starved = starved or not prefetch_chunk(self, work, ahead=pending)
            if work.chunk == needed or chunk_ready(self, work):
                self._run_early(work)
            else:
                pending.append(work)
        self.early_queue = pending

    def _early(self) -> set[int]:
        """Chunks whose update was queued during this backward and has not run."""
        return self.manager.updates.chunks_in(_U.EARLY)

    def _run_early(self, work: ChunkWork) -> None:
        self._run(work, 1.0, then=_U.STEPPED)
        self.early_chunk_steps += 1

    def _run(self, work: ChunkWork, grad_scale: float, then: UpdateState) -> None:
        """Run one queued update; its chunk is readable again afterwards."""
        updates = self.manager.updates
        updates.set(work.chunk, _U.RUNNING)
        finish_chunk(self, work, grad_scale)
        updates.set(work.chunk, then)

    def _staged_grads_queued(self) -> int:
        """Queued early updates whose gradients wait in host staging (NVMe-homed)."""
        tier = self.manager.homes.tier
        return sum(tier((Kind.GRAD, w.chunk)) != HOST for w in self.early_queue)

    def _grad_staging_slots(self) -> int:
        return sum(self.plan.host_staging.get(Kind.GRAD.value, {}).values())

    # --- optimizer state, as torch's (CPUAdam.state_dict / load_state_dict) -------------
    def read_moments(self, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
        """Copies of the moments of the tensors ``indices`` stepped at least once."""
        return optim_state.read_moments(self, indices)

    def check_moments(self, values: dict[int, MomentState | None]) -> None:
        """Raise (changing nothing) if a state does not fit its tensor."""
        optim_state.check_moments(self, values)

    def write_moments(self, values: dict[int, MomentState | None]) -> None:
        """Set moments and step counts by tensor index (``None``: never stepped)."""
        optim_state.write_moments(self, values)

    def check_not_stepped_early(self, what: str) -> None:
        """Raise if chunks were already updated in this backward (overlap_optimizer=True)."""
        if self.manager.updates.stepped_in_backward:
            raise RuntimeError(
                f"{what} after a backward whose chunks were already updated "
                "(Config(overlap_optimizer=True) steps each chunk as soon as its gradients are "
                "complete). With gradient clipping or accumulation use overlap_optimizer=False "
                "(transformers.Trainer computes the gradient norm at every step, so it needs "
                "overlap_optimizer=False)."
            )

    # --- the step trailing into the next forward ----------------------------------------
    def _start_trailing(self, works: list[ChunkWork], grad_scale: float) -> None:
        """Update host-only chunks now; queue the rest in the order the forward needs them."""
        has_master = self.plan.has_master
        now: list[ChunkWork] = []
        later: list[ChunkWork] = []
        for work in works:
            on_nvme = any(self.manager.homes.tier(k) != HOST for k in work.keys(has_master))
            (later if on_nvme else now).append(work)
        updates = self.manager.updates
        for work in later:
            updates.set(work.chunk, _U.TRAILING)
        for work in now:
            updates.set(work.chunk, _U.RUNNING)
        run_works(self, now, grad_scale)
        for work in now:
            updates.set(work.chunk, _U.IDLE)
        first_use = self._first_forward_use()
        later.sort(key=lambda w: first_use.get(w.chunk, len(first_use)))
        self.trailing = deque(later)
        self.trailing_scale = grad_scale
        for position, work in enumerate(later[:TRAIL_LOOKAHEAD]):
            # the reads travel while the caller loads data
            prefetch_chunk(self, work, ahead=later[:position])

    def _first_forward_use(self) -> dict[int, int]:
        trace = self.trace.trace
        first: dict[int, int] = {}
        if trace is not None:
            for moment, (phase, chunk) in enumerate(trace.accesses):
                if phase == Phase.FORWARD:
                    first.setdefault(chunk, moment)
        return first

    def poll_trailing(self, needed: int | None = None, *, settle: bool = False) -> None:
        """Run queued updates: those whose data has landed, and (waiting for its reads)
        every one up to chunk ``needed``; all of them if ``settle``."""
        while self.trailing:
            window = list(itertools.islice(self.trailing, TRAIL_LOOKAHEAD))
            for position, work in enumerate(window):
                prefetch_chunk(self, work, ahead=window[:position])  # retried at every poll
            work = self.trailing[0]
            must = settle or (needed is not None and self.is_trailing(needed))
            if not must and not chunk_ready(self, work):
                return
            self.trailing.popleft()
            self._run(work, self.trailing_scale, then=_U.IDLE)
            self.trailing_chunk_steps += 1

    def settle_step(self) -> None:
        """Finish every queued update (before anything reads or changes chunk data).

        Every engine entry point passes here or checks itself: after an I/O
        error it raises instead (see :mod:`infinity.chunks.io_failures`).
        """
        self.manager.check_io()
        if self.trailing:
            self.poll_trailing(settle=True)

    def synchronize(self) -> None:
        """Finish queued updates and wait for every transfer in flight."""
        self.settle_step()
        self.manager.synchronize()

    def is_trailing(self, chunk: int) -> bool:
        """Chunk ``chunk`` has an update queued: its parameters (home and every copy)
        still hold the values from before the step."""
        return self.manager.updates.trailing(chunk)
