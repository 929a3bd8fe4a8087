"""``ModelChunks``: one offloaded model's parameters laid out in chunks.

The base every component of the engine is built on: the parameter registry,
the plan and its layout, the chunk manager, which tensors each chunk holds,
their states (:mod:`infinity.chunks.states`), their optimizer step counts and
gradient states (:class:`~infinity.runtime.lifecycles.TensorGrads`), and the
memory timeline. It knows no other component.

NOTE: ``has_grad`` is stored here because every component reads it (and the
step plans from it); only the gradient ledger
(:class:`~infinity.runtime.grad_ledger.GradientLedger`) moves it, as only the
update queue moves the manager's update states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.layout import ChunkLayout
from infinity.chunks.manager import ChunkManager, typed
from infinity.chunks.states import StateCounters, TensorState
from infinity.core.names import Phase
from infinity.core.plan import Plan
from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.runtime.errors import UnsetParameterError
from infinity.runtime.lifecycles import TensorGrads
from infinity.runtime.params import ParamEntry, ParamRegistry, placeholder
from infinity.runtime.timeline import Moment, Timeline


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
            shape = self.layout.slots[index].shape
            shapes = self.chunk_optimizer.tensor_state_shapes(tuple(shape))
            states = {name: torch.zeros(size) for name, size in shapes.items()}
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
        flat = typed(chunk_bytes, self.dtype)
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
        entry.param.data = entry.placeholder

    def sample(self, phase: Phase, chunk: int) -> None:
        """Add the tiers' state after an access to the memory timeline."""
        manager = self.manager
        version, params, grads = self._resident
        if version != manager.device.version:
            # NOTE: recomputed only when the device's keys changed (this runs at
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
