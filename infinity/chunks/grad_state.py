"""The gradient lifecycle of each chunk, the legal transitions, and its record.

A chunk's gradients are in exactly one place at a time, and that place is a
state, not a set of flags: the manager's gradient side
(:class:`~infinity.chunks.grad_flow.GradientFlow`) owns one :class:`GradStates`
record for all chunks and moves each chunk through this machine::

    NONE    --device slot taken--> RECEIVING --flush (copy home)--> FLUSHED
    FLUSHED --device slot taken--> ADDING    --flush (add home)---> FLUSHED
    FLUSHED --an overlapped step uses the staged bytes, drops them--> CONSUMED
    zeroed: FLUSHED, CONSUMED --> NONE;  ADDING --> RECEIVING (the slot's part stays)

"Has gradients", "may be read", "was dropped" are derived from the state, so
they cannot disagree with each other, and a move the engine never makes (a
flush without a device slot, consuming what is still being added to) raises
:class:`IllegalGradTransition` instead of silently corrupting gradients.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from infinity.chunks.states import IllegalTransition, check_transition

if TYPE_CHECKING:
    import torch


class GradState(enum.IntEnum):
    """Where the gradients of one chunk's current accumulation cycle are."""

    NONE = 0  # no gradient of this cycle anywhere: the home holds stale bytes
    RECEIVING = 1  # the cycle's first gradients arrive in a device slot (its flush copies)
    FLUSHED = 2  # the cycle's gradients are in the home (or its host staging copy)
    ADDING = 3  # FLUSHED, and a device slot receives more (its flush adds them in)
    CONSUMED = 4  # an overlapped step used the staged gradients and dropped them


_G = GradState
LEGAL_GRAD_TRANSITIONS: frozenset[tuple[GradState, GradState]] = frozenset(
    {
        (_G.NONE, _G.RECEIVING),
        (_G.RECEIVING, _G.FLUSHED),
        (_G.FLUSHED, _G.ADDING),
        (_G.ADDING, _G.FLUSHED),
        (_G.FLUSHED, _G.CONSUMED),
        # zero_grad / a loaded checkpoint: the home's gradients are forgotten.
        (_G.FLUSHED, _G.NONE),
        (_G.CONSUMED, _G.NONE),
        # NOTE: what a device slot already holds survives (an interrupted
        # backward flushed later): it becomes the cycle's first gradients.
        (_G.ADDING, _G.RECEIVING),
    }
)

# What zeroing leaves of each state (see the NOTE on ADDING -> RECEIVING).
_ZEROED = {
    _G.NONE: _G.NONE,
    _G.RECEIVING: _G.RECEIVING,
    _G.FLUSHED: _G.NONE,
    _G.ADDING: _G.RECEIVING,
    _G.CONSUMED: _G.NONE,
}
_ON_DEVICE = (_G.RECEIVING, _G.ADDING)


class IllegalGradTransition(IllegalTransition):
    """A chunk's gradients were moved between states in an order the engine never makes
    (an internal error: a bug in the engine, not in the caller's code)."""


class GradStates:
    """The gradient state of every chunk, plus the element ranges written into
    each device gradient slot (what the flush need not zero), and the norms of a
    cycle's gradients taken on the device (NOTE [gradient norms on the device]).

    Every change goes through :meth:`set` (checked against
    :data:`LEGAL_GRAD_TRANSITIONS`); the predicates are derived from the state.
    """

    __slots__ = ("norms", "norms_wanted", "states", "written")

    def __init__(self, num_chunks: int) -> None:
        self.states = [GradState.NONE] * num_chunks
        # Per chunk in RECEIVING / ADDING: element ranges written since its slot was taken.
        self.written: dict[int, list[tuple[int, int]]] = {}
        # Per chunk whose cycle's gradients were flushed once, whole: its tensors'
        # indices and the fp32 2-norms of their gradients, on the device.
        self.norms: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.norms_wanted = False  # the model's gradients are clipped by norm

    def __getitem__(self, chunk: int) -> GradState:
        return self.states[chunk]

    def set(self, chunk: int, new: GradState) -> None:
        """Move ``chunk`` to ``new``; raise :class:`IllegalGradTransition` if not allowed."""
        old = self.states[chunk]
        check_transition(
            LEGAL_GRAD_TRANSITIONS, old, new, "gradients of chunk", chunk, IllegalGradTransition
        )
        self.states[chunk] = new

    # --- the engine's moves ----------------------------------------------------------
    def slot_taken(self, chunk: int) -> None:
        """A device slot starts receiving gradients for ``chunk``."""
        self.set(chunk, _G.ADDING if self.states[chunk] is _G.FLUSHED else _G.RECEIVING)
        self.written[chunk] = []
        self.norms.pop(chunk, None)  # more gradients come: the norms are of a part

    def flushed(self, chunk: int) -> None:
        """The device slot went home (its gradients copied or added in)."""
        self.set(chunk, _G.FLUSHED)
        del self.written[chunk]

    def consumed(self, chunk: int) -> None:
        """An overlapped step used the staged gradients and dropped them."""
        self.set(chunk, _G.CONSUMED)

    def zeroed(self, chunk: int) -> None:
        """``chunk``'s gradients were zeroed: the next flush copies instead of adding."""
        new = _ZEROED[self.states[chunk]]
        if new is not self.states[chunk]:
            self.set(chunk, new)
        self.norms.pop(chunk, None)

    def zero_all(self) -> None:
        """Every chunk's gradients were zeroed."""
        for chunk in range(len(self.states)):
            self.zeroed(chunk)

    # --- derived predicates ------------------------------------------------------------
    def has_grads(self, chunk: int) -> bool:
        """The home holds (or held, if dropped) gradients of this accumulation cycle."""
        return self.states[chunk] >= _G.FLUSHED

    def home_valid(self, chunk: int) -> bool:
        """The home (or its staging copy) holds this cycle's gradients: readable, addable."""
        state = self.states[chunk]
        return state is _G.FLUSHED or state is _G.ADDING

    def dropped(self, chunk: int) -> bool:
        """A step consumed and dropped ``chunk``'s gradients of this cycle."""
        return self.states[chunk] is _G.CONSUMED

    def on_device(self, chunk: int) -> bool:
        """A device slot is receiving gradients of ``chunk``."""
        return self.states[chunk] in _ON_DEVICE
