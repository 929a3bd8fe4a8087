"""``ModelChunks``: one offloaded model's parameters laid out in chunks.

The base every component of the engine is built on: the parameter registry,
the plan and its layout, the chunk manager, which tensors each chunk holds,
their states (:mod:`infinity.chunks.states`), their optimizer step counts and
gradient states (:class:`TensorGrads`), and the memory timeline. It knows no
other component. Below it, the engine's own small lifecycles, the timeline and
:class:`ChunkIO`, the narrow surface the checkpoints read through.

``has_grad`` is stored here because every component reads it (and the
step plans from it); only the gradient ledger
(:class:`~infinity.runtime.grad_ledger.GradientLedger`) moves it, as only the
update queue moves the manager's update states.

The engine's own small lifecycles (a tensor's gradient, the backward pass, the
loss scale): each was a flag (``has_grad[i]``, ``_backward_active``, ``loss_scaled``) that
several methods set and cleared by hand. Here each is a state with a whitelist
of moves, like the chunk lifecycles of :mod:`infinity.chunks.states`; an
illegal move raises :class:`~infinity.chunks.states.IllegalTransition` (an
engine bug), and every predicate the engine asks is derived from the state::

    tensor gradient:  NONE --arrives--> HELD --arrives again (accumulation)--> HELD
                      HELD --zeroed (zero_grad, a loaded checkpoint)--> NONE
    backward pass:    IDLE --first gradient event--> RUNNING --ended (or found interrupted)--> IDLE
    loss scale:       UNSCALED --scale_loss--> SCALED --scale_loss (accumulation)--> SCALED
                      SCALED --the fp16 step reads it--> UNSCALED

The memory timeline (bytes per tier and resident chunks at every moment of a
step): the engine samples it whenever it records an access; the last complete
iteration is kept for ``infinity.timeline(model)`` (and the ``infinity train``
plot), so a user tuning budgets can see where the peaks are.

``ChunkIO``, the stored bytes of one offloaded model for code outside the engine:
checkpoints and pretrained weights read and write a model's tensors through
this narrow surface (``engine.chunk_io``), never through the engine's chunk
manager, layout or plan: where each tensor sits (:meth:`ChunkIO.slot`), the few
facts of the stored format they record or check, and each chunk's bytes as
:mod:`~infinity.chunks.pieces` windows (whole chunk or spans alike). So the
engine's insides can change without touching them, and the import contract in
``pyproject.toml`` keeps ``infinity.checkpoint`` and ``infinity.pretrained``
from importing ``infinity.chunks``.

The caller settles queued updates first (``engine.synchronize`` /
``queue.settle``): the windows read and write the homes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from infinity.chunks.layout import ChunkLayout
from infinity.chunks.manager import ChunkManager
from infinity.chunks.pieces import Window, home_bytes, windows
from infinity.chunks.states import E, StateArray, StateCounters, TensorState
from infinity.core.names import Kind, Phase
from infinity.core.plan import ChunkSpec, Plan, TensorSlot
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.runtime.params import ParamEntry, ParamRegistry, UnsetParameterError, placeholder


class ModelChunks:
    """Where each parameter of one model lives in the chunks, and its per-tensor state."""

    def __init__(
        self,
        registry: ParamRegistry,
        plan: Plan,
        manager: ChunkManager,
        dtype: torch.dtype,
        device: torch.device,
        chunk_optimizer: ChunkOptimizer[Any],
    ) -> None:
        self.registry = registry
        self.plan = plan
        self.layout: ChunkLayout = plan.layout
        self.manager = manager
        self.dtype = dtype
        self.device = device
        # The per-element optimizer the chunks are laid out for (CPUAdam's Adam), and
        # the one their homes were sized for (a re-cut changes only the first).
        self.chunk_optimizer = chunk_optimizer
        self.home_optimizer = chunk_optimizer
        self.chunk_members: list[list[ParamEntry]] = [[] for _ in range(self.layout.num_chunks)]
        for entry in registry.entries:
            self.chunk_members[self.layout.slots[entry.index].chunk].append(entry)
        # Tensor indices offloaded with init="load" that no load has set yet: any
        # forward or read of them raises (require_set) instead of computing with
        # the zeros their chunks hold.
        self.unset: set[int] = set()
        # Position of each tensor inside its chunk's state counters.
        self.local_index = {
            e.index: pos for members in self.chunk_members for pos, e in enumerate(members)
        }
        self.states = [StateCounters(len(m)) for m in self.chunk_members]
        n = len(registry.entries)
        self.has_grad = TensorGrads(n)  # per tensor: its gradient is in the chunks
        self.tensor_steps = [0] * n  # per tensor: optimizer steps taken
        # Per tensor: the chunk optimizer's small per-tensor states (Adafactor's
        # factors), in host memory beside the units. See NOTE [per-tensor optimizer state].
        self.tensor_states: dict[int, dict[str, torch.Tensor]] = {}
        self.timeline = Timeline()
        # Saved-activation bytes (host, NVMe) for the timeline; set by the engine
        # when activations are offloaded.
        self.activation_bytes: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._resident: tuple[int, tuple[int, ...], tuple[int, ...]] = (-1, (), ())

    def chunk_of(self, index: int) -> int:
        """The chunk holding tensor ``index``."""
        return self.layout.slots[index].chunk

    def tensor_state(self, index: int) -> dict[str, torch.Tensor]:
        """Tensor ``index``'s per-tensor optimizer states, zeros on first use (none
        for an optimizer without them)."""
        states = self.tensor_states.get(index)
        if states is None:
            shapes = self.chunk_optimizer.tensor_state_shapes(tuple(self.layout.slots[index].shape))
            # fp32 host tensors, whatever the user set as default dtype or device
            states = {k: torch.zeros(v, dtype=torch.float, device="cpu") for k, v in shapes.items()}
            self.tensor_states[index] = states
        return states

    def set_state(self, entry: ParamEntry, state: TensorState) -> None:
        """Move one parameter to ``state`` (checked against the whitelist)."""
        chunk = self.layout.slots[entry.index].chunk
        self.states[chunk].set(self.local_index[entry.index], state)

    def state_of(self, entry: ParamEntry) -> TensorState:
        """The state of one parameter."""
        return self.states[self.chunk_of(entry.index)].states[self.local_index[entry.index]]

    def chunk_view(self, chunk_bytes: torch.Tensor, entry: ParamEntry) -> torch.Tensor:
        """``entry``'s tensor inside a chunk's bytes (compute dtype, its shape)."""
        slot = self.layout.slots[entry.index]
        flat = chunk_bytes.view(self.dtype)
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def require_set(self, entries: Iterable[ParamEntry], what: str) -> None:
        """Raise :class:`UnsetParameterError` if any of ``entries`` was never loaded."""
        if not self.unset:
            return
        missing = [e.name for e in entries if e.index in self.unset]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise UnsetParameterError(
                f"{what}: parameter {shown}{more} was offloaded with init='load' and nothing "
                "has loaded it yet. Load it first (infinity.load_pretrained, "
                "infinity.load_checkpoint or model.load_state_dict), or offload with an init "
                "that gives it values"
            )

    def mark_set(self, indices: Iterable[int]) -> None:
        """These tensors now hold loaded values."""
        self.unset.difference_update(indices)

    def release(self, entry: ParamEntry) -> None:
        """Point the parameter back at its placeholder (no chunk memory held)."""
        if entry.placeholder is None:
            entry.placeholder = placeholder(entry.shape, self.dtype, self.device)
        entry.show_placeholder()

    def sample(self, phase: Phase, chunk: int) -> None:
        """Add the tiers' state after an access to the memory timeline."""
        manager = self.manager
        version, params, grads = self._resident
        if version != manager.device.version:
            # Recomputed only when the device's keys changed (this runs at
            # every access); other keys are retired slots still landing.
            # (kind, chunk) keys, and retired slots' keys, whose [0] is not a Kind
            keys = cast(list[tuple[object, int]], manager.device.keys())
            params = tuple(sorted(k[1] for k in keys if k[0] is Kind.PARAM))
            grads = tuple(sorted(k[1] for k in keys if k[0] is Kind.GRAD))
            self._resident = (manager.device.version, params, grads)
        self.timeline.add(
            Moment(
                phase,
                chunk,
                manager.device_account.used,
                manager.host_account.used,
                params,
                grads,
                *self.activation_bytes(),
            )
        )


class Lifecycle(StateArray[E]):
    """One object's state in a machine given by its legal transitions (a
    :class:`~infinity.chunks.states.StateArray` of one item)."""

    __slots__ = ()

    def __init__(self, initial: E, legal: frozenset[tuple[E, E]], what: str) -> None:
        super().__init__(1, initial, legal, what)

    @property
    def state(self) -> E:
        """The current state."""
        return self.states[0]

    def move(self, new: E) -> None:
        """Go to ``new``; raise ``IllegalTransition`` if the whitelist does not allow it."""
        self.set(0, new)


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


class TensorGrads(StateArray[TensorGrad]):
    """The gradient state of every tensor of a model, with a count of held ones.

    ``grads[i]`` is True when tensor ``i`` has a gradient in the chunks (what
    ``param.grad is not None`` means to the user). Every change is checked
    against :data:`LEGAL_TENSOR_GRAD`.
    """

    __slots__ = ()

    def __init__(self, num_tensors: int) -> None:
        super().__init__(num_tensors, TensorGrad.NONE, LEGAL_TENSOR_GRAD, "gradient of tensor")

    def __getitem__(self, index: int) -> bool:  # type: ignore[override]
        return self.states[index] is TensorGrad.HELD

    def __len__(self) -> int:
        return len(self.states)

    @property
    def held(self) -> int:
        """How many tensors have a gradient in the chunks."""
        return self.counts[TensorGrad.HELD]

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
        return self.counts[TensorGrad.HELD] > 0


@dataclass(frozen=True)
class Moment:
    """One access and the tiers right after it."""

    phase: Phase
    chunk: int
    device_bytes: int
    host_bytes: int
    device_chunks: tuple[int, ...]  # parameter chunks resident on the device
    device_grads: tuple[int, ...]  # gradient chunks on the device
    # Saved activations (activations="offload") in host memory and on NVMe.
    activation_host_bytes: int = 0
    activation_nvme_bytes: int = 0


@dataclass
class Timeline:
    """Moments of the running iteration; ``last`` holds the previous complete one."""

    current: list[Moment] = field(default_factory=list)
    last: list[Moment] = field(default_factory=list)

    def add(self, moment: Moment) -> None:
        """Append one sample to the running iteration."""
        self.current.append(moment)

    def finish_iteration(self) -> None:
        """The iteration ended: keep it as ``last`` (a forward-only pass, such as an
        evaluation, does not replace a training step)."""
        trained = any(m.phase != Phase.FORWARD for m in self.current)
        if self.current and (trained or not self.last):
            self.last = self.current
        self.current = []

    def as_dict(self) -> dict[str, list]:
        """Columns of the last complete iteration (or the running one if none)."""
        moments = self.last or self.current
        return {
            "phase": [m.phase.value for m in moments],
            "chunk": [m.chunk for m in moments],
            "device_bytes": [m.device_bytes for m in moments],
            "host_bytes": [m.host_bytes for m in moments],
            "device_chunks": [list(m.device_chunks) for m in moments],
            "device_grads": [list(m.device_grads) for m in moments],
            "activation_host_bytes": [m.activation_host_bytes for m in moments],
            "activation_nvme_bytes": [m.activation_nvme_bytes for m in moments],
        }


class ChunkIO:
    """Read and write the bytes behind one model's tensors, chunk piece by chunk piece."""

    def __init__(self, chunks: ModelChunks) -> None:
        self._chunks = chunks

    # --- facts of the stored format -------------------------------------------------------
    @property
    def chunk_specs(self) -> tuple[ChunkSpec, ...]:
        """Every chunk in order: its capacity in elements, its tensors, trainable or not."""
        return self._chunks.layout.chunks

    def slot(self, index: int) -> TensorSlot:
        """Where tensor ``index`` lives: its chunk and elements."""
        return self._chunks.layout.slots[index]

    @property
    def element_size(self) -> int:
        """Bytes of one parameter (or gradient) element: the compute dtype's."""
        return self._chunks.plan.element_size

    @property
    def has_master(self) -> bool:
        """The optimizer units begin with an fp32 master copy (16-bit compute)."""
        return self._chunks.plan.has_master

    def in_shard(self, index: int) -> bool:
        """Some of tensor ``index``'s elements are kept by this process (always, unsharded)."""
        slot = self.slot(index)
        start, end = self._chunks.plan.home_window(slot.chunk)
        return slot.offset < end and slot.offset + slot.numel > start

    # --- bytes ------------------------------------------------------------------------------
    def windows(
        self, kind: Kind, chunk: int, *, load: bool = True, write: bool = False
    ) -> Generator[Window, None, None]:
        """The windows of ``(kind, chunk)`` (see :func:`infinity.chunks.pieces.windows`).

        Sharded, a window covers the whole chunk: reading gathers it (collective: every
        rank walks the same chunks in the same order), writing stores this rank's
        shard of it (every rank writes the same values)."""
        return windows(self._chunks.manager, kind, chunk, load=load, write=write)

    def home_bytes(self, kind: Kind, chunk: int) -> Generator[torch.Tensor, None, None]:
        """The stored bytes of ``(kind, chunk)`` in home order (uint8; each valid until the
        next is drawn): see :func:`infinity.chunks.pieces.home_bytes`."""
        return home_bytes(self._chunks.manager, kind, chunk)

    def params_written(self, chunk: int) -> None:
        """Chunk ``chunk``'s parameter bytes were written at home: drop its device copy."""
        self._chunks.manager.drop_param(chunk)
