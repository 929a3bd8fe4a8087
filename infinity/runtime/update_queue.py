"""The queue of chunk updates that have not run yet: early ones and trailing ones.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on
:class:`~infinity.runtime.model_chunks.ModelChunks` and the access trace. It is
the only component that moves the manager's update states
(:mod:`infinity.chunks.states`), and the one every reader of chunk
bytes settles through (:meth:`UpdateQueue.settle`).

``optimizer.step()`` updates host-homed chunks at once; a chunk with a key
on NVMe is only *queued*, and its update runs at the latest when the next forward
(or anything else) first touches it: the same values, the disk traffic overlapped
with compute. With ``overlap_optimizer=True`` an update is also queued *early*,
during backward, once its gradients are complete.

:class:`ParamFetcher`, the other component here, owns every access of an
iteration, its trace, and the prefetch. Each access (a forward fetch, a backward
unpack, a gradient arrival) becomes the current moment, is compared with the
trace of the first iteration, lets the queued updates that must come first
run, and (after it) starts fetching the chunks the trace says come next.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.states import UpdateState
from infinity.chunks.updates import gathers_from_ranks, opens_once
from infinity.config import Config
from infinity.core.names import DEVICE, NVME, Phase
from infinity.io import NVMeIOError
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.offloaded_step import (
    ChunkWork,
    OpenedChunk,
    chunk_ready,
    count_update,
    finish_chunk,
    prefetch_chunk,
    run_works,
)
from infinity.schedule.trace import Prefetcher, TraceDrivenPolicy, TraceRecorder

_U = UpdateState

# Trailing updates whose reads are in flight at once (the optimizer staging
# slots of the planner hold one more, the unit being updated).
TRAIL_LOOKAHEAD = 2
# Host-homed updates deferred into the forward run this many chunks (in forward
# order) ahead of the one needed, so the prefetcher can fetch their chunks.
HOST_LOOKAHEAD = 2


def _timed(compute: Callable[[], None]) -> float:
    """Run ``compute`` (on the update worker); its seconds."""
    start = time.perf_counter()
    with torch.no_grad():
        compute()
    return time.perf_counter() - start


class TrailingUpdates(deque[ChunkWork]):
    """Updates queued by ``optimizer.step()``, in the order the forward needs their
    chunks, with the gradient scale of the step that queued them (one per step)."""

    def __init__(self, works: Iterable[ChunkWork] = (), grad_scale: float = 1.0) -> None:
        super().__init__(works)
        self.grad_scale = grad_scale


class UpdateQueue:
    """Queued chunk updates: run when their data has landed or their chunk is needed."""

    def __init__(self, chunks: ModelChunks, trace: TraceRecorder) -> None:
        self.chunks = chunks
        self.manager = chunks.manager
        self.trace = trace
        # Chunks queued during backward (overlap_optimizer), oldest first.
        self.early: list[ChunkWork] = []
        self.early_chunk_steps = 0  # updates run during a backward
        self.trailing = TrailingUpdates()
        self.trailing_chunk_steps = 0  # updates that ran after optimizer.step() returned
        # NOTE [host updates behind the forward]: with a device that computes apart
        # from the host, host-homed updates trail too, each run just ahead of its
        # chunk's forward; ``_forward_rank`` orders chunks by first forward use.
        self.defer_host = chunks.manager.backend.computes_apart
        self._host_only: set[int] = set()
        self._forward_rank: dict[int, int] = {}
        # NOTE [host updates on a worker]: a deferred host-only update's kernels run on
        # one worker thread while this thread goes on launching the forward.
        self.on_worker = self.defer_host
        self._worker: ThreadPoolExecutor | None = None
        self._computing: dict[int, tuple[ChunkWork, OpenedChunk, Future[float]]] = {}
        self.worker_chunk_steps = 0  # updates whose kernels ran on the worker
        # The first error raised inside an update: some chunks may be updated and
        # others not, so the engine refuses to go on (see check_failed).
        self.failure: BaseException | None = None
        # Reading settles by construction: a read of a queued chunk runs its update.
        # NOTE: through a weak reference, so the manager keeps no cycle to the queue.
        queue = weakref.ref(self)

        def run_queued(chunk: int) -> None:
            owner = queue()
            if owner is not None:
                owner.run_queued(chunk)

        self.manager.updates.runner = run_queued

    def check_failed(self) -> None:
        """Raise if an update failed earlier, naming that first error and the fix."""
        if self.failure is not None:
            raise RuntimeError(
                "this offloaded model stopped after an error inside an optimizer update "
                f"({type(self.failure).__name__}: {self.failure}); some chunks may be updated "
                "and others not: load the last checkpoint into a freshly offloaded model "
                "(infinity.load_checkpoint) and continue from there"
            ) from self.failure

    def _failed(self, error: BaseException) -> None:
        # An I/O error is already sticky in the manager's IOFailures, which
        # every entry point checks (and whose message names the failed transfer).
        if self.failure is None and not isinstance(error, NVMeIOError):
            self.failure = error

    # --- early updates (during backward) -------------------------------------------
    def add_early(self, chunk: int, work: ChunkWork | None) -> None:
        """Queue the update of ``chunk``, whose gradients are all in (reads start now);
        ``work`` is ``None`` if none of its tensors has a gradient (nothing to run).

        The update runs at a later hook once its reads have landed
        (:meth:`poll_early`), so backward does not wait on the disk for it,
        unless the queued updates already hold every gradient staging slot:
        then the oldest one is run at once, waiting for its reads.
        """
        self.manager.updates.set(chunk, _U.STEPPED if work is None else _U.EARLY)
        if work is None:
            return
        # NOTE: its reads start in poll_early, in queue order: prefetched
        # here, it could take the slot an older starved update waits for.
        self.early.append(work)
        self.poll_early()
        while self.early and self._staged_grads_queued() >= self._grad_staging_slots():
            # Each queued update holds its gradients in a host staging
            # slot; one more would evict them to disk and read them back.
            # Waiting for the oldest update's reads costs less I/O than that.
            self._run_early(self.early.pop(0))

    def poll_early(self, needed: int | None = None) -> None:
        """Run queued early updates whose data is in host memory (never waits on I/O),
        and (waiting for its reads) the one of chunk ``needed``."""
        pending: list[ChunkWork] = []
        starved = False
        for work in self.early:
            # Retry reads that found no free slot, in queue order: once one finds
            # none, later chunks must not take the next free slots before it.
            starved = starved or not prefetch_chunk(self.chunks, work, ahead=pending)
            if work.chunk == needed or chunk_ready(self.chunks, work):
                self._run_early(work)
            else:
                pending.append(work)
        self.early = pending

    def take_early(self) -> list[ChunkWork]:
        """``optimizer.step()``: the early updates not run yet, to run with the step;
        chunks stepped during backward become idle."""
        works, self.early = self.early, []
        updates = self.manager.updates
        for chunk in updates.indices_in(_U.STEPPED):
            updates.set(chunk, _U.IDLE)
        return works

    def handled_early(self) -> set[int]:
        """Chunks stepped or queued during this backward (the step skips planning them)."""
        return self.manager.updates.indices_in(_U.STEPPED, _U.EARLY)

    def _run_early(self, work: ChunkWork) -> None:
        self._run(work, 1.0, then=_U.STEPPED)
        self.early_chunk_steps += 1

    def _run(self, work: ChunkWork, grad_scale: float, then: UpdateState) -> None:
        """Run one queued update; its chunk is readable again afterwards."""
        self.drain()  # NOTE: one update's kernels at a time (they share scratch)
        updates = self.manager.updates
        updates.set(work.chunk, _U.RUNNING)
        try:
            finish_chunk(self.chunks, work, grad_scale)
        except BaseException as error:
            self._failed(error)
            raise
        updates.set(work.chunk, then)

    def _staged_grads_queued(self) -> int:
        """Queued early updates whose gradients wait in host staging (NVMe-homed)."""
        tier = self.manager.homes.tier
        return sum(tier((Kind.GRAD, w.chunk)) == NVME for w in self.early)

    def _grad_staging_slots(self) -> int:
        return sum(self.chunks.plan.host_staging.get(Kind.GRAD.value, {}).values())

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
    def start_step(self, works: list[ChunkWork], grad_scale: float) -> None:
        """Update host-only chunks now (or, with ``defer_host``, queue them to run just
        ahead of their forward); queue the rest in the order the forward needs them."""
        has_master = self.chunks.plan.has_master
        first_use = self._first_forward_use()
        defer_host = self.defer_host and bool(first_use)
        now: list[ChunkWork] = []
        later: list[ChunkWork] = []
        self._host_only = set()
        for work in works:
            tiers = {self.manager.homes.tier(k) for k in work.keys(has_master)}
            on_nvme = NVME in tiers
            # NOTE [chunks homed on the device]: their updates are device kernels, queued
            # at once behind the backward; only host work is worth deferring.
            if not on_nvme and defer_host and DEVICE not in tiers and work.chunk in first_use:
                self._host_only.add(work.chunk)
                on_nvme = True
            (later if on_nvme else now).append(work)
        updates = self.manager.updates
        self.drain()
        for work in later:
            updates.set(work.chunk, _U.TRAILING)
        for work in now:
            updates.set(work.chunk, _U.RUNNING)
        try:
            run_works(self.chunks, now, grad_scale)
        except BaseException as error:
            self._failed(error)
            raise
        for work in now:
            updates.set(work.chunk, _U.IDLE)
        later.sort(key=lambda w: first_use.get(w.chunk, len(first_use)))
        self._forward_rank = {w.chunk: rank for rank, w in enumerate(later)}
        self.trailing = TrailingUpdates(later, grad_scale)
        for position, work in enumerate(later[:TRAIL_LOOKAHEAD]):
            # the reads travel while the caller loads data
            prefetch_chunk(self.chunks, work, ahead=later[:position])

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
        self._reap()
        self._poll_trailing(needed, settle)
        if settle:
            self.drain()
        elif needed in self._computing:
            self._finish(needed)

    def _poll_trailing(self, needed: int | None, settle: bool) -> None:
        trailing = self.trailing
        while trailing:
            window = list(itertools.islice(trailing, TRAIL_LOOKAHEAD))
            for position, work in enumerate(window):
                prefetch_chunk(self.chunks, work, ahead=window[:position])  # retried at every poll
            work = trailing[0]
            must = settle or (needed is not None and self.is_trailing(needed))
            if not must and not self._due(work, needed):
                return
            trailing.popleft()
            if self._on_worker(work):
                self._start(work, trailing.grad_scale)
            else:
                self._run(work, trailing.grad_scale, then=_U.IDLE)
                self.trailing_chunk_steps += 1

    # --- host updates on a worker --------------------------------------------------------
    def _on_worker(self, work: ChunkWork) -> bool:
        """A deferred host-only update of a whole chunk (its bytes wait on nothing)."""
        return (
            self.on_worker
            and work.chunk in self._host_only
            and opens_once(self.chunks.plan, work.chunk)
        )

    def _start(self, work: ChunkWork, grad_scale: float) -> None:
        """Open ``work``'s host bytes here and hand its kernels to the worker: its chunk
        stays unreadable (``COMPUTING``) until :meth:`_finish` closes it."""
        updates = self.manager.updates
        updates.set(work.chunk, _U.RUNNING)
        try:
            # NOTE: the worker runs outside the caller's modes (they are per thread): views
            # made here under an inference_mode() forward could not be written there.
            with torch.inference_mode(False):
                opened = OpenedChunk.open(
                    self.chunks, work.chunk, list(work.runs), work.covered, grad_scale
                )
        except BaseException as error:
            self._failed(error)
            raise
        updates.set(work.chunk, _U.COMPUTING)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="infinity-update")
        future = self._worker.submit(_timed, opened.compute)
        self._computing[work.chunk] = (work, opened, future)

    def _finish(self, chunk: int) -> None:
        """Wait for ``chunk``'s kernels and close its update (as :meth:`_run` ends)."""
        work, opened, future = self._computing.pop(chunk)
        updates = self.manager.updates
        updates.set(chunk, _U.RUNNING)
        traffic = self.manager.traffic
        try:
            if future.done():
                seconds = future.result()
            else:
                with traffic.stall():  # the device may idle while this thread waits
                    seconds = future.result()
        except BaseException as error:
            opened.close(succeeded=False)
            self._failed(error)
            raise
        traffic.host_optimizer_seconds += seconds
        opened.close(succeeded=True)
        count_update(self.chunks, work)
        updates.set(chunk, _U.IDLE)
        self.trailing_chunk_steps += 1
        self.worker_chunk_steps += 1

    def _reap(self) -> None:
        """Close the updates whose kernels are done (never waits)."""
        for chunk in [c for c, (_, _, future) in self._computing.items() if future.done()]:
            self._finish(chunk)

    def drain(self) -> None:
        """Wait for every update on the worker and close it."""
        for chunk in list(self._computing):
            self._finish(chunk)

    def close(self) -> None:
        """Wait for the worker's updates (their bytes must outlive them), then stop it."""
        try:
            for chunk in list(self._computing):
                try:
                    self._finish(chunk)
                except BaseException:  # recorded in self.failure
                    pass
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None

    def _due(self, work: ChunkWork, needed: int | None) -> bool:
        """A trailing update may run now without waiting: its reads have landed, and
        a deferred host-homed one's chunk is at most ``HOST_LOOKAHEAD`` chunks past
        the one needed (earlier it would take the host from the forward's launches)."""
        if work.chunk not in self._host_only:
            # NOTE [collective updates run in a fixed order]: whether a read has
            # landed differs between ranks; an update that gathers must run at
            # the same access on every rank, so it waits until its chunk is needed.
            return not self._collective_updates() and chunk_ready(self.chunks, work)
        rank = self._forward_rank
        return needed in rank and rank[work.chunk] <= rank[needed] + HOST_LOOKAHEAD

    def _collective_updates(self) -> bool:
        """Each chunk update is collective (:func:`~infinity.chunks.updates.gathers_from_ranks`)."""
        return gathers_from_ranks(self.chunks.plan, whole=self.chunks.chunk_optimizer.whole_tensors)

    def before_access(self, phase: Phase, chunk: int) -> None:
        """An access of ``chunk`` is about to read it: run what must run first."""
        self.check_failed()
        if self.trailing:
            self.poll_trailing(needed=chunk)
        if self.early:
            # A gradient arriving needs no parameter bytes; every other
            # access reads them, so the chunk's queued update runs first.
            self.poll_early(needed=None if phase == Phase.GRAD else chunk)

    def run_queued(self, chunk: int) -> None:
        """A read reached ``chunk`` while its update is queued: run it (and, for a
        trailing update, those queued before it) so the read sees the step's values."""
        self.check_failed()
        if chunk in self._computing:
            self._finish(chunk)
        elif self.manager.updates.trailing(chunk):
            self.poll_trailing(needed=chunk)
        elif self.manager.updates[chunk] is _U.EARLY:
            self.poll_early(needed=chunk)

    def settle(self) -> None:
        """Finish every queued update (before anything reads or changes chunk data).

        Every engine entry point passes here or checks itself: after an I/O
        error it raises instead (see :mod:`infinity.chunks.homes`).
        """
        self.manager.failures.check()
        self.check_failed()
        if self.trailing or self._computing:
            self.poll_trailing(settle=True)

    def synchronize(self) -> None:
        """Finish queued updates and wait for every transfer in flight."""
        self.settle()
        self.manager.synchronize()

    def is_trailing(self, chunk: int) -> bool:
        """Chunk ``chunk`` has an update queued: its parameters (home and every copy)
        still hold the values from before the step."""
        return self.manager.updates.trailing(chunk)


class ParamFetcher:
    """Records accesses, keeps the eviction policy on the trace, and prefetches."""

    def __init__(
        self,
        chunks: ModelChunks,
        queue: UpdateQueue,
        trace: TraceRecorder,
        policy: TraceDrivenPolicy,
        config: Config,
    ) -> None:
        """``policy`` is the device cache's eviction policy (given to the manager too)."""
        self.chunks = chunks
        self.manager = chunks.manager
        self.queue = queue
        self.trace = trace
        self.policy = policy
        self.config = config
        self.prefetcher: Prefetcher | None = None

    def access(self, phase: Phase, chunk: int) -> None:
        """Record one access: it becomes the current moment of the iteration."""
        self.manager.moment = self.trace.moment
        self.trace.record(phase, chunk)
        self.policy.active = self.trace.on_track
        self.manager.poll()
        self.queue.before_access(phase, chunk)

    def prefetch(self) -> None:
        """Start fetching the chunks the trace says come next (never blocks)."""
        if self.prefetcher is None or not self.trace.on_track:
            return
        prefetcher, moment = self.prefetcher, self.manager.moment
        self.manager.prefetch_params(lambda resident: prefetcher.plan(moment, resident))

    def start_iteration(self) -> None:
        """A forward starts a new iteration: the last one may have become the trace."""
        previous = self.trace.trace
        self.manager.in_use.next_iteration()
        self.trace.start_iteration()
        if self.trace.trace is not previous:
            self._new_trace()

    def _new_trace(self) -> None:
        """A finished iteration became the trace: rebuild Belady's uses and the prefetcher."""
        trace = self.trace.trace
        if trace is None:
            return
        uses: dict[Hashable, list[int]] = {}
        for position, (phase, chunk) in enumerate(trace.accesses):
            kind = Kind.GRAD if phase == Phase.GRAD else Kind.PARAM
            uses.setdefault((kind, chunk), []).append(position)
        self.policy.set_trace(uses, len(trace))
        depth = self.config.prefetch_depth
        budget = self.config.prefetch_bytes
        if budget == "auto":
            budget = depth * self.chunks.layout.chunk_bytes
        plan = self.chunks.plan
        self.prefetcher = (
            Prefetcher(
                trace,
                depth,
                int(budget),
                plan.device_param_bytes,
                # NOTE [prefetch within the slots]
                slots=plan.device_slots,
                grad_bytes=lambda c: (
                    plan.device_param_bytes(c) if plan.grad_home[c] is not None else 0
                ),
            )
            if depth
            else None
        )
