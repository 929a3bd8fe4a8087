"""Where each chunk is in its lifecycles: one module, three state machines and a clock.

Every machine is a :class:`StateArray`: a state per item (a tensor, a chunk), a
count of items per state, and its ``LEGAL_*`` whitelist; a move outside it raises.
Tensor states (:class:`StateCounters`): a chunk derives "can be evicted" or
"gradients complete" from its counts, so they cannot go stale. :class:`Clock`: the
current moment, shared by the chunk manager's components.

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

An update of a chunk (its parameters and optimizer state) need not run inside
``optimizer.step()``: with ``overlap_optimizer=True`` it is queued during backward
once the chunk's gradients are complete, and one that would wait (on NVMe, or for
its chunk's next forward) trails into the next forward; while queued, the chunk's
bytes are stale. :class:`~infinity.runtime.update_queue.UpdateQueue` alone moves a
chunk through this machine::

    IDLE   --queued in backward-->  EARLY  --runs--> RUNNING --> STEPPED
    IDLE   --nothing to update, in backward-----------------------> STEPPED
    IDLE / EARLY --queued by optimizer.step()--> TRAILING --runs--> RUNNING --> IDLE
    RUNNING --kernels handed to the worker--> COMPUTING --closed--> RUNNING
    IDLE / EARLY --run by optimizer.step()------------------------> RUNNING --> IDLE
    STEPPED --optimizer.step()--> IDLE

Reading settles by construction: every read path of the chunk manager calls
:meth:`UpdateStates.ensure_readable`, which runs the chunk's queued update through
the ``runner`` the update queue registers, then checks; a read that still finds it
queued (no runner) raises :class:`StaleRead`, not the values from before the step.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch


class TensorState(enum.IntEnum):
    """Life of one parameter within a training step."""

    FREE = 0  # no meaningful data yet (before materialisation)
    HOLD = 1  # has data, not in use
    COMPUTE = 2  # in use by a module's forward (param.data points into a device slot)
    HOLD_AFTER_FWD = 3  # used in this forward, done with for now
    HOLD_AFTER_BWD = 4  # its gradient of this backward is in the grad chunk


_S = TensorState
# COMPUTE is re-entered from HOLD_AFTER_FWD (a tied parameter used by a
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


E = TypeVar("E", bound=enum.IntEnum)


class StateArray(Generic[E]):
    """The state of each of ``n`` items in one machine, with a count per state.

    ``states[i]`` is item ``i``'s state. Every change goes through :meth:`set`, which
    checks the whitelist ``legal`` (raising ``error`` naming ``what i`` and both
    states, nothing changed) and keeps the counts exact.
    """

    __slots__ = ("_error", "_legal", "_what", "counts", "states")

    def __init__(
        self,
        n: int,
        initial: E,
        legal: frozenset[tuple[E, E]],
        what: str,
        error: type[IllegalTransition] = IllegalTransition,
    ) -> None:
        self.states = [initial] * n
        self.counts = [0] * len(type(initial))
        self.counts[initial] = n
        self._legal = legal
        self._what = what
        self._error = error

    def __getitem__(self, i: int) -> E:
        return self.states[i]

    def set(self, i: int, new: E) -> None:
        """Move item ``i`` to ``new``; raise if the whitelist does not allow it."""
        old = self.states[i]
        if (old, new) not in self._legal:
            raise self._error(
                f"{self._what} {i}: {old.name} -> {new.name} is not a legal transition "
                "(an internal error of the engine)"
            )
        self.states[i] = new
        self.counts[old] -= 1
        self.counts[new] += 1

    def count(self, state: E) -> int:
        """How many items are in ``state``."""
        return self.counts[state]

    def indices_in(self, *states: E) -> builtins.set[int]:
        """The items in any of ``states``."""
        # NOTE: builtins.set: ``set`` in this class is the transition method.
        return {i for i, state in enumerate(self.states) if state in states}


class StateCounters(StateArray[TensorState]):
    """Tensor states of one chunk (``states[i]``: its i-th tensor's), with a count per state."""

    __slots__ = ()

    def __init__(self, num_tensors: int, initial: TensorState = TensorState.FREE) -> None:
        super().__init__(num_tensors, initial, LEGAL_TRANSITIONS, "tensor")

    @property
    def in_compute(self) -> bool:
        """Some tensor is in use by a module right now: the chunk may not leave the device."""
        return self.counts[TensorState.COMPUTE] > 0

    def reset_step(self) -> None:
        """Start of a new step: every tensor that has data returns to HOLD."""
        for i, state in enumerate(self.states):
            if state != TensorState.FREE:
                self.set(i, TensorState.HOLD)


class Clock:
    """The position of the current access in the step's access sequence.

    One object the manager and its components (host staging, the
    gradient flow) all read, so eviction policies see one notion of "now";
    the runtime sets it at every access (through ``ChunkManager.moment``).
    """

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0


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


class GradStates(StateArray[GradState]):
    """The gradient state of every chunk, plus the element ranges written into
    each device gradient slot (what the flush need not zero), and the norms of a
    cycle's gradients taken on the device (NOTE [gradient norms on the device]).

    Every change is checked against :data:`LEGAL_GRAD_TRANSITIONS`; the predicates
    are derived from the state.
    """

    __slots__ = ("norms", "norms_wanted", "written")

    def __init__(self, num_chunks: int) -> None:
        super().__init__(
            num_chunks,
            GradState.NONE,
            LEGAL_GRAD_TRANSITIONS,
            "gradients of chunk",
            IllegalGradTransition,
        )
        # Per chunk in RECEIVING / ADDING: element ranges written since its slot was taken.
        self.written: dict[int, list[tuple[int, int]]] = {}
        # Per chunk whose cycle's gradients were flushed once, whole: its tensors'
        # indices and the fp32 2-norms of their gradients, on the device.
        self.norms: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.norms_wanted = False  # the model's gradients are clipped by norm

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

    def changed_in_place(self, chunk: int) -> None:
        """Some of ``chunk``'s stored gradients were changed in place (a clip factor
        written, a clamp, a zeroed tensor): the norms taken at its flush are stale."""
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


class UpdateState(enum.IntEnum):
    """Where one chunk's optimizer update of the current step is."""

    IDLE = 0  # no update pending: the chunk's bytes are current
    EARLY = 1  # queued during backward (overlap_optimizer); its reads may be in flight
    STEPPED = 2  # updated (or found nothing to update) during this backward
    TRAILING = 3  # queued by optimizer.step(): runs when the chunk is next needed
    RUNNING = 4  # the update itself is reading and writing the chunk
    COMPUTING = 5  # its kernels run on the update worker (its host bytes open)


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
        (_U.RUNNING, _U.COMPUTING),
        (_U.COMPUTING, _U.RUNNING),
    }
)
_QUEUED = (_U.EARLY, _U.TRAILING, _U.COMPUTING)


class IllegalUpdateTransition(IllegalTransition):
    """A chunk's update was moved between states in an order the engine never makes
    (an internal error: a bug in the engine, not in the caller's code)."""


class StaleRead(RuntimeError):
    """A chunk's bytes were read while its optimizer update was still queued
    (an internal error: the read path should have run the update first)."""


class UpdateStates(StateArray[UpdateState]):
    """The update state of every chunk, with a count per state.

    Every change is checked against :data:`LEGAL_UPDATE_TRANSITIONS`; the predicates
    are derived from the state.
    """

    __slots__ = ("runner",)

    def __init__(self, num_chunks: int) -> None:
        super().__init__(
            num_chunks,
            UpdateState.IDLE,
            LEGAL_UPDATE_TRANSITIONS,
            "update of chunk",
            IllegalUpdateTransition,
        )
        # Runs a chunk's queued update (set by the runtime's update pipeline, which
        # owns the queue; this layer only knows that one is queued).
        self.runner: Callable[[int], None] | None = None

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
        return state is _U.TRAILING or state is _U.COMPUTING or (early and state is _U.EARLY)

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
