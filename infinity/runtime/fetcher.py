"""The parameter fetcher: every access of an iteration, its trace, and the prefetch.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on the
model's chunks and the update queue. Each access (a forward fetch, a backward
unpack, a gradient arrival) becomes the current moment, is compared with the
trace of the first iteration, lets the queued updates that must come first
run, and (after it) starts fetching the chunks the trace says come next.
"""

from __future__ import annotations

from collections.abc import Hashable

from infinity.chunks.homes import Kind
from infinity.config import Config
from infinity.core.names import Phase
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.update_queue import UpdateQueue
from infinity.schedule.eviction import TraceDrivenPolicy
from infinity.schedule.prefetch import Prefetcher
from infinity.schedule.trace import TraceRecorder


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
        if self.chunks.plan.sharded:
            # NOTE: gathers are collective, so the list must be the same on every
            # rank: the next needs in the trace, whatever each rank has cached.
            self.manager.prefetch_gathers(self.prefetcher.plan(self.manager.moment, _never))
            return
        resident = self.manager.device
        for chunk in self.prefetcher.plan(
            self.manager.moment, lambda c: (Kind.PARAM, c) in resident
        ):
            if self.manager.updates.queued(chunk):
                break  # its update has not run: the home still holds old values
            if not self.manager.prefetch_param(chunk):
                break  # no room without evicting something needed sooner

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


def _never(_chunk: int) -> bool:
    return False
