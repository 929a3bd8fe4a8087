"""The plan's data types, from the chunk layout up.

The layout (:class:`ChunkLayout`): which tensor lives in which chunk at which
offset; built by :func:`infinity.chunks.layout.build_layout`.

The plan (:class:`Plan`): where each kind of state lives, how many slots each
tier gets, and the bytes each link moves per step; made by
:func:`infinity.schedule.planner.make_plan`. Both are read by every layer: the
chunk manager, stats and ``infinity plan``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from infinity.core.names import DEVICE, HOST, NVME, Tier
from infinity.utils.sizes import format_size

T = TypeVar("T")


@dataclass(frozen=True)
class TensorInfo:
    """What the layout needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    group: int = -1  # tensors of one module share a group; kept in one chunk when possible

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives: chunk ``chunk``, elements ``[offset, offset + numel)``."""

    index: int  # position in the layout's tensor list
    chunk: int
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: its capacity in elements and the tensors packed in it."""

    index: int
    capacity: int  # elements; a multiple of chunk_alignment_elems
    slots: tuple[TensorSlot, ...]
    trainable: bool
    oversize: bool

    @property
    def used(self) -> int:
        """Elements up to the end of the last tensor."""
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    def nbytes(self, element_size: int) -> int:
        """Bytes of this chunk for a kind whose elements have ``element_size`` bytes."""
        return self.capacity * element_size


@dataclass(frozen=True)
class ChunkLayout:
    """The packing of all tensors into chunks, for one compute element size."""

    chunk_elems: int
    element_size: int
    chunks: tuple[ChunkSpec, ...]
    slots: tuple[TensorSlot, ...]  # indexed like the input tensors

    @property
    def num_chunks(self) -> int:
        """Number of chunks (normal and oversize)."""
        return len(self.chunks)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a normal chunk in the compute dtype."""
        return self.chunk_elems * self.element_size

    def wasted_elems(self) -> int:
        """Capacity not covered by tensors (alignment gaps and chunk tails)."""
        used = sum(s.numel for s in self.slots)
        return sum(c.capacity for c in self.chunks) - used

    def group_by_chunk(
        self, items: Iterable[T], tensor_index: Callable[[T], int]
    ) -> dict[int, list[T]]:
        """``items`` grouped by the chunk holding their tensor (``tensor_index(item)``
        is its position in :attr:`slots`), chunks and items in first-seen order."""
        grouped: dict[int, list[T]] = {}
        for item in items:
            grouped.setdefault(self.slots[tensor_index(item)].chunk, []).append(item)
        return grouped


FP32_BYTES = 4
# Sharded: at most this many of the last parameter chunks demanded stay pinned on
# every rank's device (``InUse`` in chunks/shards.py), room permitting.
IN_USE_CHUNKS = 2


class PlanError(ValueError):
    """The budgets cannot hold the model; the message says what each tier needs
    (``needed``: the bytes the tier that failed would need, 0 if not known)."""

    def __init__(self, message: str, *, needed: int = 0) -> None:
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class Budgets:
    """Bytes allowed per tier; ``nvme=None`` means no NVMe tier.

    ``activations``: the share of ``host`` kept for saved activations (their host share
    and the windows that move them to and from NVMe): the states plan within the rest
    (:attr:`states_host`).
    """

    device: int
    host: int
    nvme: int | None
    activations: float = 0.0

    @property
    def states_host(self) -> int:
        """Host bytes the states' homes and staging may take."""
        return self.host - int(self.host * self.activations)

    def host_for_states(self, states: int) -> int:
        """The ``host_memory`` whose states' part holds ``states`` bytes."""
        return states if not self.activations else int(-(-states // (1 - self.activations))) + 1


@dataclass(frozen=True)
class Plan:
    """Homes per chunk and kind, slot counts per tier, bytes and traffic per step."""

    layout: ChunkLayout
    element_size: int
    has_master: bool
    state_slots: tuple[str, ...]  # the optimizer's fp32 per-element state tensors, in unit order
    param_home: tuple[Tier, ...]
    grad_home: tuple[Tier | None, ...]  # None: frozen chunk
    optim_home: tuple[Tier | None, ...]
    device_slots: dict[int, int]  # slot bytes -> count
    host_staging: dict[str, dict[int, int]]  # "param" | "grad" | "optim" -> slot bytes -> count
    budgets: Budgets
    traffic: dict[str, int] = field(default_factory=dict)
    # Bytes of each chunk's optimizer unit, from the optimizer and its state format
    # (``Config.optimizer_state_dtype``); empty: fp32 parts, ``len(state_slots) + has_master``.
    optim_unit_bytes: tuple[int, ...] = ()
    state_dtype: str = "fp32"  # how the state slots are stored
    # Chunks larger than this many elements go through host staging in spans of
    # it (chunks/pools.py); 0 means the layout's normal chunk capacity.
    span_elems: int = 0
    # The smallest budgets this layout plans with: the device's is set by the
    # largest module (its tensors whole), the host's with every state on NVMe
    # (0: no NVMe tier, or not computed).
    min_device_bytes: int = 0
    min_host_bytes: int = 0
    # Data parallel (``infinity.distributed``): every chunk is split into
    # ``shard_count`` equal shards and this process keeps shard ``shard_rank`` of
    # each kind in its homes and staging; the device holds whole chunks.
    shard_count: int = 1
    shard_rank: int = 0
    # Slots of the largest device size beyond the minimum: what a sharded plan may
    # keep pinned for the chunks used last and prefetched ones (chunks/shards.py).
    spare_device_slots: int = 0
    # Host bytes of the optimizer's per-tensor states (Adafactor's factors), kept in
    # host memory beside the homes and reserved in the host budget (0 for the others).
    tensor_state_bytes: int = 0
    # Blocks of the model are recomputed in backward (activation checkpointing), each
    # holding all of its chunks through its backward: a chunk then never borrows a
    # device slot larger than its own (chunks/cache.py, TierCache._take_own_size).
    recomputes_blocks: bool = False
    # Device bytes a chunk's update on the device takes beside its home (its temporaries),
    # reserved where chunks are homed there (NOTE [chunks homed on the device]).
    device_scratch_bytes: int = 0

    def __post_init__(self) -> None:
        if self.span_elems == 0:
            object.__setattr__(self, "span_elems", self.layout.chunk_elems)

    # --- sizes -------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Chunks are split over more than one process."""
        return self.shard_count > 1

    def home_elems(self, i: int) -> int:
        """Elements of chunk ``i`` this process keeps (its shard; the whole chunk alone)."""
        return self.layout.chunks[i].capacity // self.shard_count

    def home_window(self, i: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of chunk ``i`` this process's shard holds."""
        size = self.home_elems(i)
        return self.shard_rank * size, (self.shard_rank + 1) * size

    def param_bytes(self, i: int) -> int:
        """Bytes of this process's home of parameter (and gradient) chunk ``i`` in the
        compute dtype: the whole chunk, or its shard when sharded."""
        return self.home_elems(i) * self.element_size

    def device_param_bytes(self, i: int) -> int:
        """Bytes of parameter (or gradient) chunk ``i`` whole, as the device holds it."""
        return self.layout.chunks[i].capacity * self.element_size

    def optim_bytes(self, i: int) -> int:
        """Bytes of optimizer-state unit ``i`` (master if any, then each state slot) of
        this process's shard."""
        if self.optim_unit_bytes:
            return self.optim_unit_bytes[i]
        parts = len(self.state_slots) + int(self.has_master)
        return self.home_elems(i) * FP32_BYTES * parts

    def home_bytes(self, tier: Tier) -> int:
        """Bytes of authoritative copies kept on ``tier``."""
        n = self.layout.num_chunks
        total = sum(self.param_bytes(i) for i in range(n) if self.param_home[i] == tier)
        total += sum(self.param_bytes(i) for i in range(n) if self.grad_home[i] == tier)
        total += sum(self.optim_bytes(i) for i in range(n) if self.optim_home[i] == tier)
        return total

    @property
    def device_bytes(self) -> int:
        """Bytes of the device's slots (the cache of chunk copies)."""
        return sum(size * count for size, count in self.device_slots.items())

    @property
    def device_reserved_bytes(self) -> int:
        """Bytes reserved on the device: its slots, the chunks homed there and their
        update's temporaries."""
        return self.device_bytes + self.home_bytes(DEVICE) + self.device_scratch_bytes

    @property
    def staging_bytes(self) -> int:
        """Bytes of host staging slots."""
        return sum(s * c for pools in self.host_staging.values() for s, c in pools.items())

    @property
    def host_bytes(self) -> int:
        """Bytes reserved on the host: homes, staging and the optimizer's per-tensor
        states."""
        return self.home_bytes(HOST) + self.staging_bytes + self.tensor_state_bytes

    @property
    def nvme_bytes(self) -> int:
        """Bytes of swap space."""
        return self.home_bytes(NVME)

    def _minimum_lines(self) -> list[str]:
        """What the budgets could shrink to, and why the device cannot go lower."""
        largest = max((c.capacity for c in self.layout.chunks), default=0) * self.element_size
        lines = [
            f"host staging {format_size(self.staging_bytes)} (slots of at most "
            f"{format_size(self.span_elems * self.element_size)} of parameters: oversize chunks "
            + (
                "move in spans of the chunk size)"
                if self.span_elems < largest // self.element_size and not self.sharded
                else "staged whole)"
            )
        ]
        if self.min_device_bytes:
            lines.append(
                f"device minimum {format_size(self.min_device_bytes)}: the largest module's "
                f"chunks plus a gradient chunk; the largest tensor's chunk "
                f"({format_size(largest)}) must be whole on the device while it computes"
            )
        if self.min_host_bytes:
            lines.append(
                f"host minimum {format_size(self.min_host_bytes)}: every state on NVMe, "
                "staging in chunk-size spans (independent of the largest tensor)"
            )
        if self.budgets.activations:
            kept = self.budgets.host - self.budgets.states_host
            lines.append(
                f"saved activations: {format_size(kept)} of host_memory kept for them "
                f"({self.budgets.activations:.1%}: their host share and the windows that move "
                "them to NVMe and back), besides what the states leave"
            )
        return lines

    def describe(self) -> str:
        """A human-readable table of the plan."""
        n = self.layout.num_chunks
        lines = [
            f"chunks: {n} x {format_size(self.layout.chunk_bytes)} "
            f"({sum(c.oversize for c in self.layout.chunks)} oversize, "
            f"{sum(not c.trainable for c in self.layout.chunks)} frozen)",
            f"{'kind':<16}{'on device':>12}{'on host':>12}{'on nvme':>12}",
        ]
        for kind, homes in (
            ("parameters", self.param_home),
            ("gradients", self.grad_home),
            ("optimizer", self.optim_home),
        ):
            lines.append(
                f"{kind:<16}{sum(h == DEVICE for h in homes):>12}"
                f"{sum(h == HOST for h in homes):>12}{sum(h == NVME for h in homes):>12}"
            )
        trainable = [i for i in range(n) if self.optim_home[i] is not None]
        lines.append(
            f"optimizer states: {self.state_dtype}, "
            f"{format_size(sum(self.optim_bytes(i) for i in trainable))} in "
            f"{len(trainable)} units"
            + (
                f", {format_size(self.tensor_state_bytes)} per tensor on the host"
                if self.tensor_state_bytes
                else ""
            )
        )
        for tier, used, budget in (
            ("device", self.device_reserved_bytes, self.budgets.device),
            ("host", self.host_bytes, self.budgets.host),
            ("nvme", self.nvme_bytes, self.budgets.nvme),
        ):
            cap = "no tier" if budget is None else format_size(budget)
            lines.append(f"{tier:<8} uses {format_size(used):>12} of {cap}")
        lines += self._minimum_lines()
        lines.append("bytes moved per step (estimate; host staging caches lower the NVMe reads):")
        sent = ("allgather_bytes", "reduce_scatter_bytes")
        for key, value in self.traffic.items():
            if key not in sent:
                lines.append(f"  {key:<18}{format_size(value):>12}")
        if self.sharded:
            lines.insert(
                0,
                f"per rank (1 of {self.shard_count} processes): homes, staging and budgets hold "
                f"this rank's 1/{self.shard_count} shard of every chunk; the device holds whole "
                "chunks",
            )
            lines.append(
                "sent per step by each rank (estimate; gradients are reduce-scattered once per "
                "micro-batch):"
            )
            for key in sent:
                lines.append(f"  {key:<22}{format_size(self.traffic.get(key, 0)):>12}")
        return "\n".join(lines)
