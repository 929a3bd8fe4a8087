"""Tensor states inside a chunk, the legal transitions, and per-chunk counters.

A chunk never stores "can be evicted" or "gradients complete": it keeps a count
of its tensors in each state and derives those predicates from the counts, so
they cannot go stale.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class TensorState(enum.IntEnum):
    """Life of one parameter within a training step."""

    FREE = 0  # no meaningful data yet (before materialisation)
    HOLD = 1  # has data, not in use
    COMPUTE = 2  # in use by a module's forward (param.data points into a device slot)
    HOLD_AFTER_FWD = 3  # used in this forward, done with for now
    HOLD_AFTER_BWD = 4  # its gradient of this backward is in the grad chunk


_S = TensorState
# NOTE: COMPUTE is re-entered from HOLD_AFTER_FWD (a tied parameter used by a
# second module, activation-checkpoint recomputation) and from HOLD_AFTER_BWD
# (a module run again after its gradient arrived, e.g. recompute of a later
# segment). Everything returns to HOLD when a new step starts.
LEGAL_TRANSITIONS: frozenset[tuple[TensorState, TensorState]] = frozenset(
    {
        (_S.FREE, _S.HOLD),
        (_S.HOLD, _S.COMPUTE),
        (_S.COMPUTE, _S.HOLD_AFTER_FWD),
        (_S.HOLD_AFTER_FWD, _S.COMPUTE),
        (_S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD),
        (_S.HOLD, _S.HOLD_AFTER_BWD),
        (_S.COMPUTE, _S.HOLD_AFTER_BWD),
        (_S.HOLD_AFTER_BWD, _S.COMPUTE),
        (_S.HOLD_AFTER_BWD, _S.HOLD_AFTER_BWD),
        (_S.HOLD_AFTER_FWD, _S.HOLD),
        (_S.HOLD_AFTER_BWD, _S.HOLD),
        (_S.COMPUTE, _S.HOLD),
        (_S.HOLD, _S.HOLD),
    }
)


class IllegalTransition(RuntimeError):
    """A tensor (or a chunk's gradients or update, see ``grad_state`` and
    ``update_state``) was moved between states in an order the engine does not allow."""


E = TypeVar("E", bound=enum.Enum)


def check_transition(
    legal: frozenset[tuple[E, E]],
    old: E,
    new: E,
    what: str,
    index: int,
    error: type[IllegalTransition] = IllegalTransition,
) -> None:
    """Raise ``error`` naming ``what index``, ``old`` and ``new`` unless the move is ``legal``."""
    if (old, new) not in legal:
        raise error(
            f"{what} {index}: {old.name} -> {new.name} is not a legal transition "
            "(an internal error of the engine)"
        )


class StateCounters:
    """Tensor states of one chunk, with a count per state.

    ``states[i]`` is the state of the chunk's i-th tensor. Every change goes
    through :meth:`set`, which checks the whitelist and keeps the counts exact.
    """

    __slots__ = ("counts", "states")

    def __init__(self, num_tensors: int, initial: TensorState = TensorState.FREE) -> None:
        self.states = [initial] * num_tensors
        self.counts = [0] * len(TensorState)
        self.counts[initial] = num_tensors

    def set(self, i: int, new: TensorState) -> None:
        """Move tensor ``i`` to ``new``; raise :class:`IllegalTransition` if not allowed."""
        old = self.states[i]
        check_transition(LEGAL_TRANSITIONS, old, new, "tensor", i)
        self.states[i] = new
        self.counts[old] -= 1
        self.counts[new] += 1

    def count(self, state: TensorState) -> int:
        """How many tensors are in ``state``."""
        return self.counts[state]

    @property
    def in_compute(self) -> bool:
        """Some tensor is in use by a module right now: the chunk may not leave the device."""
        return self.counts[TensorState.COMPUTE] > 0

    def reset_step(self) -> None:
        """Start of a new step: every tensor that has data returns to HOLD."""
        for i, state in enumerate(self.states):
            if state != TensorState.FREE:
                self.set(i, TensorState.HOLD)
