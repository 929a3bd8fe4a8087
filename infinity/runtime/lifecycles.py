"""The engine's own small lifecycles: a tensor's gradient, the backward pass, the loss scale.

Each was a flag (``has_grad[i]``, ``_backward_active``, ``loss_scaled``) that
several methods set and cleared by hand. Here each is a state with a whitelist
of moves, like the chunk lifecycles of :mod:`infinity.chunks.states`; an
illegal move raises :class:`~infinity.chunks.states.IllegalTransition` (an
engine bug), and every predicate the engine asks is derived from the state::

    tensor gradient:  NONE --arrives--> HELD --arrives again (accumulation)--> HELD
                      HELD --zeroed (zero_grad, a loaded checkpoint)--> NONE
    backward pass:    IDLE --first gradient event--> RUNNING --ended (or found interrupted)--> IDLE
    loss scale:       UNSCALED --scale_loss--> SCALED --scale_loss (accumulation)--> SCALED
                      SCALED --the fp16 step reads it--> UNSCALED
"""

from __future__ import annotations

import enum
from typing import Generic

from infinity.chunks.states import E, check_transition


class Lifecycle(Generic[E]):
    """One object's state in a machine given by its legal transitions."""

    __slots__ = ("_legal", "state", "what")

    def __init__(self, initial: E, legal: frozenset[tuple[E, E]], what: str) -> None:
        self.state = initial
        self._legal = legal
        self.what = what

    def move(self, new: E) -> None:
        """Go to ``new``; raise ``IllegalTransition`` if the whitelist does not allow it."""
        check_transition(self._legal, self.state, new, self.what, 0)
        self.state = new


class Backward(enum.IntEnum):
    """Whether a backward pass of the model is running."""

    IDLE = 0
    RUNNING = 1


LEGAL_BACKWARD: frozenset[tuple[Backward, Backward]] = frozenset(
    {(Backward.IDLE, Backward.RUNNING), (Backward.RUNNING, Backward.IDLE)}
)


class LossScale(enum.IntEnum):
    """fp16: whether the loss of the gradients now held was multiplied by the loss scale."""

    UNSCALED = 0
    SCALED = 1


LEGAL_LOSS_SCALE: frozenset[tuple[LossScale, LossScale]] = frozenset(
    {
        (LossScale.UNSCALED, LossScale.SCALED),
        (LossScale.SCALED, LossScale.SCALED),
        (LossScale.SCALED, LossScale.UNSCALED),
    }
)


class TensorGrad(enum.IntEnum):
    """Whether a tensor's gradient of this accumulation cycle is in the chunks."""

    NONE = 0
    HELD = 1


LEGAL_TENSOR_GRAD: frozenset[tuple[TensorGrad, TensorGrad]] = frozenset(
    {
        (TensorGrad.NONE, TensorGrad.HELD),
        (TensorGrad.HELD, TensorGrad.HELD),
        (TensorGrad.HELD, TensorGrad.NONE),
    }
)


class TensorGrads:
    """The gradient state of every tensor of a model, with a count of held ones.

    ``grads[i]`` is True when tensor ``i`` has a gradient in the chunks (what
    ``param.grad is not None`` means to the user). Every change goes through
    :meth:`set`.
    """

    __slots__ = ("held", "states")

    def __init__(self, num_tensors: int) -> None:
        self.states = [TensorGrad.NONE] * num_tensors
        self.held = 0

    def __getitem__(self, index: int) -> bool:
        return self.states[index] is TensorGrad.HELD

    def __len__(self) -> int:
        return len(self.states)

    def set(self, index: int, new: TensorGrad) -> None:
        """Move tensor ``index`` to ``new``; raise ``IllegalTransition`` if not allowed."""
        old = self.states[index]
        check_transition(LEGAL_TENSOR_GRAD, old, new, "gradient of tensor", index)
        self.states[index] = new
        self.held += (new is TensorGrad.HELD) - (old is TensorGrad.HELD)

    def received(self, index: int) -> None:
        """Tensor ``index``'s gradient arrived in its chunk."""
        self.set(index, TensorGrad.HELD)

    def dropped(self, index: int) -> None:
        """Tensor ``index``'s gradient was zeroed."""
        self.set(index, TensorGrad.NONE)

    def drop_all(self) -> None:
        """Every held gradient was zeroed."""
        for index, state in enumerate(self.states):
            if state is TensorGrad.HELD:
                self.dropped(index)

    @property
    def any(self) -> bool:
        """Some tensor has a gradient in the chunks."""
        return self.held > 0
