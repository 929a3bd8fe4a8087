"""The optimizer-update lifecycle of each chunk, the legal transitions, and its record.

An update of a chunk (its parameters and optimizer state) need not run inside
``optimizer.step()``: with ``overlap_optimizer=True`` it is queued during
backward as soon as the chunk's gradients are complete, and an update that
would wait on NVMe is queued to trail into the next forward. While queued, the
chunk's parameter and optimizer bytes are stale. The engine's update pipeline
(:class:`~infinity.runtime.stepping.OptimizerSteps`) is the only component that
moves a chunk through this machine::

    IDLE   --queued in backward-->  EARLY  --runs--> RUNNING --> STEPPED
    IDLE   --nothing to update, in backward-----------------------> STEPPED
    IDLE / EARLY --queued by optimizer.step()--> TRAILING --runs--> RUNNING --> IDLE
    IDLE / EARLY --run by optimizer.step()------------------------> RUNNING --> IDLE
    STEPPED --optimizer.step()--> IDLE

Reading settles by construction: every read path of the chunk manager calls
:meth:`UpdateStates.ensure_readable`, which runs the chunk's queued update
through the ``runner`` the update pipeline registers, then checks; a read that
still finds it queued (no runner) raises :class:`StaleRead` instead of
returning the values from before the step.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Callable

from infinity.chunks.states import IllegalTransition, check_transition


class UpdateState(enum.IntEnum):
    """Where one chunk's optimizer update of the current step is."""

    IDLE = 0  # no update pending: the chunk's bytes are current
    EARLY = 1  # queued during backward (overlap_optimizer); its reads may be in flight
    STEPPED = 2  # updated (or found nothing to update) during this backward
    TRAILING = 3  # queued by optimizer.step(): runs when the chunk is next needed
    RUNNING = 4  # the update itself is reading and writing the chunk


_U = UpdateState
LEGAL_UPDATE_TRANSITIONS: frozenset[tuple[UpdateState, UpdateState]] = frozenset(
    {
        (_U.IDLE, _U.EARLY),
        (_U.IDLE, _U.STEPPED),
        (_U.EARLY, _U.RUNNING),
        (_U.RUNNING, _U.STEPPED),
        (_U.STEPPED, _U.IDLE),
        (_U.IDLE, _U.TRAILING),
        (_U.EARLY, _U.TRAILING),
        (_U.IDLE, _U.RUNNING),
        (_U.TRAILING, _U.RUNNING),
        (_U.RUNNING, _U.IDLE),
    }
)
_QUEUED = (_U.EARLY, _U.TRAILING)


class IllegalUpdateTransition(IllegalTransition):
    """A chunk's update was moved between states in an order the engine never makes
    (an internal error: a bug in the engine, not in the caller's code)."""


class StaleRead(RuntimeError):
    """A chunk's bytes were read while its optimizer update was still queued
    (an internal error: the read path should have run the update first)."""


class UpdateStates:
    """The update state of every chunk, with a count per state.

    Every change goes through :meth:`set` (checked against
    :data:`LEGAL_UPDATE_TRANSITIONS`); the predicates are derived from the state.
    """

    __slots__ = ("counts", "runner", "states")

    def __init__(self, num_chunks: int) -> None:
        self.states = [UpdateState.IDLE] * num_chunks
        self.counts = [0] * len(UpdateState)
        self.counts[UpdateState.IDLE] = num_chunks
        # Runs a chunk's queued update (set by the runtime's update pipeline, which
        # owns the queue; this layer only knows that one is queued).
        self.runner: Callable[[int], None] | None = None

    def __getitem__(self, chunk: int) -> UpdateState:
        return self.states[chunk]

    def set(self, chunk: int, new: UpdateState) -> None:
        """Move ``chunk`` to ``new``; raise :class:`IllegalUpdateTransition` if not allowed."""
        old = self.states[chunk]
        check_transition(
            LEGAL_UPDATE_TRANSITIONS, old, new, "update of chunk", chunk, IllegalUpdateTransition
        )
        self.states[chunk] = new
        self.counts[old] -= 1
        self.counts[new] += 1

    def count(self, state: UpdateState) -> int:
        """How many chunks are in ``state``."""
        return self.counts[state]

    def chunks_in(self, *states: UpdateState) -> builtins.set[int]:
        """The chunks in any of ``states``."""
        # NOTE: builtins.set: ``set`` in this class is the transition method.
        return {chunk for chunk, state in enumerate(self.states) if state in states}

    # --- derived predicates ------------------------------------------------------------
    def queued(self, chunk: int) -> bool:
        """``chunk``'s update is queued: its parameter and optimizer bytes are stale."""
        return self.states[chunk] in _QUEUED

    def trailing(self, chunk: int) -> bool:
        """``chunk``'s update was queued by ``optimizer.step()`` and has not run."""
        return self.states[chunk] is _U.TRAILING

    @property
    def stepped_in_backward(self) -> bool:
        """Some chunk was updated (or queued) during the current backward."""
        return self.counts[_U.EARLY] + self.counts[_U.STEPPED] > 0

    def ensure_readable(self, chunk: int, *, early: bool = True) -> None:
        """Run ``chunk``'s queued update first if it has one (through :attr:`runner`),
        then :meth:`check_readable`: a read never sees the values from before a step."""
        if self.runner is not None and self._blocks_read(chunk, early):
            self.runner(chunk)
        self.check_readable(chunk, early=early)

    def _blocks_read(self, chunk: int, early: bool) -> bool:
        state = self.states[chunk]
        return state is _U.TRAILING or (early and state is _U.EARLY)

    def check_readable(self, chunk: int, *, early: bool = True) -> None:
        """Raise :class:`StaleRead` if ``chunk``'s update is queued (it must run first).

        ``early=False`` lets a chunk queued during backward pass (see the NOTE
        at :meth:`~infinity.chunks.manager.ChunkManager.open_host`).
        """
        state = self.states[chunk]
        if self._blocks_read(chunk, early):
            raise StaleRead(
                f"chunk {chunk} was read while its optimizer update is queued ({state.name}); "
                "the engine must run the update first (an internal error of the engine)"
            )
