"""The chunk-optimizer interface and the unit its state lives in: what the planner,
the offloaded step and the checkpoint format ask of an optimizer instead of assuming Adam.

An optimizer keeps, per trainable chunk, one *unit* of bytes: the fp32 master
copy of the parameters (16-bit compute dtypes only; for fp32 the parameter
chunk is the master) followed by one chunk-long *state slot* per state tensor
(Adam: ``exp_avg`` then ``exp_avg_sq``). Every part starts on the I/O
alignment. The planner sizes a unit from :meth:`ChunkOptimizer.unit_bytes`, the
step views its pieces with :meth:`ChunkOptimizer.piece_views`, the checkpoint
finds a tensor's bytes with :meth:`ChunkOptimizer.tensor_ranges`, and
:meth:`ChunkOptimizer.step` runs the update on one run of tensors. Another
optimizer is a subclass naming its slots and its kernel
(:mod:`infinity.optim.sgd` is the smallest), chosen by the front-end the user
constructs (:mod:`infinity.optim.front_end`).

The slots are stored in the optimizer's :class:`StateFormat`,
``Config(optimizer_state_dtype=...)``. ``"fp32"`` keeps every value exact.
``"bf16"`` stores each in bfloat16 (half the bytes; rounded stochastically on
every store, unbiased, see NOTE [bf16 stochastic rounding] in docs/NOTES.md).
``"int8"`` stores one byte per element plus one fp32 scale per block of
:data:`QBLOCK` elements: 8-bit Adam's block-wise dynamic quantisation (signed
codes for the first moment, unsigned for the second), decoded and re-encoded
inside the fused kernel (``cpp/simd/q8_codec.hpp`` documents the codes, the
rounding and the block size). The update always runs in fp32; master weights
stay fp32. :class:`StateFormat` says how many bytes a stored slot takes and cuts
it into its views (:class:`StoredSlot`). :func:`read_slot`,
:func:`read_moments` and :func:`write_moments` convert between a stored slot
and fp32 values, for state dicts: they use the kernel's own encoder, so a
value written and stepped gives the bytes the kernel would have stored.

:func:`hyper_value` and :func:`betas_value` are the checks every optimizer's
hyper-parameters use.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from infinity._native import native
from infinity._native.adam import QBLOCK, STATE_ELEMENT_BYTES
from infinity._native.io import ALIGNMENT
from infinity.optim.device_state import device_block_scratch, stored_state_temporaries
from infinity.utils.sizes import align_up

H = TypeVar("H", contravariant=True)

STATE_DTYPES: tuple[str, ...] = tuple(STATE_ELEMENT_BYTES)
"""The allowed values of ``Config.optimizer_state_dtype`` (``"fp32"`` first: the default)."""
_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
FP32_BYTES = 4


def _blocks(n: int) -> int:
    return -(-n // QBLOCK)


@dataclass(frozen=True)
class StoredSlot:
    """One stored state tensor (or a span of one): its values and, for int8, block scales."""

    data: torch.Tensor  # fp32, bf16, or uint8 codes
    scale: torch.Tensor | None  # int8: fp32 absmax per QBLOCK elements of ``data``

    def span(self, span: slice) -> StoredSlot:
        """Elements ``span`` (int8: ``span.start`` must be a multiple of QBLOCK)."""
        if self.scale is None:
            return StoredSlot(self.data[span], None)
        start, stop = span.start or 0, span.stop
        if start % QBLOCK:
            raise ValueError(
                f"int8 state spans start on a {QBLOCK}-element block, not at element {start}"
            )
        return StoredSlot(self.data[start:stop], self.scale[start // QBLOCK : _blocks(stop)])


@dataclass(frozen=True)
class StateFormat:
    """The storage of each per-element state slot, by ``optimizer_state_dtype`` name."""

    name: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in STATE_DTYPES:
            raise ValueError(
                f"optimizer_state_dtype={self.name!r} is not supported; use one of "
                f"{', '.join(repr(d) for d in STATE_DTYPES)}"
            )

    @property
    def quantized(self) -> bool:
        """Block-quantised (int8): spans start on QBLOCK boundaries."""
        return self.name == "int8"

    @property
    def element_alignment(self) -> int:
        """Elements a tensor's state must start on inside a chunk (int8: one block;
        see NOTE [int8 block size])."""
        return QBLOCK if self.quantized else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of a slot's stored values (uint8 codes for int8)."""
        return _TORCH_DTYPE[self.name]

    @property
    def span_granule(self) -> int:
        """Elements every span boundary of an oversize chunk is a multiple of, so that
        each part's byte range of a span (values, int8 block scales, and the fp32
        master beside them) stays on the I/O alignment (NOTE [O_DIRECT alignment])."""
        values = ALIGNMENT // STATE_ELEMENT_BYTES[self.name]
        scales = QBLOCK * ALIGNMENT // FP32_BYTES if self.quantized else 1
        return max(values, scales, ALIGNMENT // FP32_BYTES)

    def data_bytes(self, capacity: int) -> int:
        """Bytes of one slot's values for a chunk of ``capacity`` elements."""
        return capacity * STATE_ELEMENT_BYTES[self.name]

    def scale_bytes(self, capacity: int) -> int:
        """Bytes of one slot's block scales (0 unless int8)."""
        return _blocks(capacity) * FP32_BYTES if self.quantized else 0

    def slot_bytes(self, capacity: int) -> int:
        """Bytes of one stored slot, rounded up to the I/O alignment (parts stay aligned)."""
        return align_up(self.data_bytes(capacity) + self.scale_bytes(capacity), ALIGNMENT)

    def tensor_ranges(self, capacity: int, offset: int, numel: int) -> list[tuple[int, int]]:
        """Byte ranges ``(start, length)`` inside one slot holding elements
        ``[offset, offset + numel)``: the values, then (int8) the block scales."""
        size = STATE_ELEMENT_BYTES[self.name]
        ranges = [(offset * size, numel * size)]
        if self.quantized:
            if numel == 0:
                return [*ranges, (0, 0)]
            if offset % QBLOCK:
                raise ValueError(f"int8 state of a tensor at element {offset} is not block-aligned")
            first = self.data_bytes(capacity) + offset // QBLOCK * FP32_BYTES
            ranges.append((first, _blocks(numel) * FP32_BYTES))
        return ranges


def _ptr(t: torch.Tensor) -> int:
    if not (t.is_cpu and t.is_contiguous()):
        raise ValueError("int8 state conversion needs contiguous CPU tensors")
    return t.data_ptr()


def read_slot(slot: StoredSlot, signed: bool) -> torch.Tensor:
    """A new fp32 copy of one stored state tensor (int8: signed or unsigned codes)."""
    if slot.scale is None:
        return slot.data.to(torch.float32, copy=True)
    values = torch.empty(slot.data.numel(), dtype=torch.float32)
    n = slot.data.numel()
    native().adam.q8_decode(_ptr(slot.data), _ptr(slot.scale), _ptr(values), n, signed)
    return values


def read_moments(exp_avg: StoredSlot, exp_avg_sq: StoredSlot) -> tuple[torch.Tensor, torch.Tensor]:
    """New fp32 copies of a pair of stored moments (first, second)."""
    return read_slot(exp_avg, signed=True), read_slot(exp_avg_sq, signed=False)


def write_moments(
    exp_avg: StoredSlot, exp_avg_sq: StoredSlot, m: torch.Tensor, v: torch.Tensor
) -> None:
    """Store fp32 moments ``m``, ``v`` (flat, as long as the slots) as the kernel would."""
    if exp_avg.scale is None or exp_avg_sq.scale is None:
        exp_avg.data.copy_(m)
        exp_avg_sq.data.copy_(v)
        return
    m32 = m.to(torch.float32).contiguous()
    v32 = v.to(torch.float32).contiguous()
    if not (m32.numel() == v32.numel() == exp_avg.data.numel() == exp_avg_sq.data.numel()):
        raise ValueError("moments and their int8 slots must have the same number of elements")
    native().adam.q8_encode_moments(
        _ptr(m32),
        _ptr(v32),
        _ptr(exp_avg.data),
        _ptr(exp_avg.scale),
        _ptr(exp_avg_sq.data),
        _ptr(exp_avg_sq.scale),
        m32.numel(),
    )


@dataclass(frozen=True)
class StepViews:
    """Flat, equally long views of one run of tensors inside a chunk."""

    master: torch.Tensor  # fp32 values updated in place (the parameters, for fp32)
    grad: torch.Tensor  # gradients in the compute dtype
    state: Mapping[str, torch.Tensor]  # one view per state slot, in the stored dtype
    out16: torch.Tensor | None  # 16-bit parameters rewritten from ``master``, if any
    scales: Mapping[str, torch.Tensor] = field(default_factory=dict)  # int8: block scales
    # ``whole_tensors`` optimizers only (one tensor per run): its shape and its
    # per-tensor states (see :meth:`ChunkOptimizer.tensor_state_shapes`).
    shape: tuple[int, ...] | None = None
    tensor_state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # (stream, offset): these elements are elements offset.. of stream (the engine:
    # the chunk index and the run's offset in the chunk, whether the chunk is stepped
    # whole, in spans or as a shard), for the random bits of bf16 state's stochastic
    # rounding (NOTE [bf16 stochastic rounding]).
    rounding: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class UnitViews:
    """One chunk's optimizer unit, cut into its parts (each ``capacity`` elements)."""

    master: torch.Tensor | None  # None for fp32 (the parameter chunk is the master)
    slots: dict[str, StoredSlot]  # slot name -> stored values (and scales), in slot order

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The stored values of every slot, by name."""
        return {name: slot.data for name, slot in self.slots.items()}

    def span(self, span: slice) -> dict[str, torch.Tensor]:
        """The stored values of elements ``span``, by slot name."""
        return {name: slot.span(span).data for name, slot in self.slots.items()}

    def scale_span(self, span: slice) -> dict[str, torch.Tensor]:
        """The block scales covering elements ``span`` (int8; empty otherwise)."""
        spans = {name: slot.span(span).scale for name, slot in self.slots.items()}
        return {name: scale for name, scale in spans.items() if scale is not None}


class ChunkOptimizer(ABC, Generic[H]):
    """An optimizer whose per-element state is tensors shaped like the parameters
    (state slots, in the units), and optionally small per-tensor states kept in host
    memory (:meth:`tensor_state_shapes`, NOTE [per-tensor optimizer state])."""

    name: ClassVar[str]  # unique per kind: what engines and checkpoints compare
    front_end: ClassVar[str] = ""  # the optimizer users construct, named in errors
    state_slots: ClassVar[tuple[str, ...]]  # names of the state tensors, in unit order
    state_dtypes: ClassVar[tuple[str, ...]] = ("fp32",)  # storage formats step() handles
    # The update reads whole tensors (norms, row and column means): step() gets one
    # tensor per run, with its shape and per-tensor states, never a slice of one.
    whole_tensors: ClassVar[bool] = False
    # fp32 temporaries per block of its update on a device (0: it has none there).
    device_temporaries: ClassVar[int] = 0
    # Its bf16 states are rounded stochastically on the device (else to nearest).
    device_rounding: ClassVar[bool] = False
    state_format: StateFormat = StateFormat()

    def tensor_state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The per-tensor states of a parameter of ``shape``, by name: fp32 tensors
        kept in host memory beside the units (Adafactor's row and column factors).
        None by default; see NOTE [per-tensor optimizer state]."""
        del shape
        return {}

    def with_state_dtype(self, name: str) -> ChunkOptimizer[H]:
        """This optimizer with its state slots stored as ``name`` (itself if unchanged).

        Raises ``ValueError`` naming the value, the formats this optimizer stores
        and the fix (the engine raises it as a :class:`~infinity.config.ConfigError`).
        """
        if name == self.state_format.name:
            return self
        if name not in self.state_dtypes:
            who = self.front_end or repr(self.name)
            raise ValueError(
                f"optimizer_state_dtype={name!r} is not supported by {who}: it stores its "
                f"state as {' or '.join(map(repr, self.state_dtypes))}; offload with "
                f"Config(optimizer_state_dtype={self.state_dtypes[0]!r})"
            )
        other = copy.copy(self)
        other.state_format = StateFormat(name)
        return other

    def unit_part_bytes(self, capacity: int, has_master: bool) -> list[int]:
        """Bytes of each part of the unit of a chunk of ``capacity`` elements, in order."""
        master = [capacity * FP32_BYTES] if has_master else []
        return master + [self.state_format.slot_bytes(capacity)] * len(self.state_slots)

    def unit_bytes(self, capacity: int, has_master: bool) -> int:
        """Bytes of the unit of a chunk of ``capacity`` elements."""
        return sum(self.unit_part_bytes(capacity, has_master))

    def tensor_ranges(
        self, capacity: int, has_master: bool, offset: int, numel: int
    ) -> list[tuple[int, int]]:
        """Byte ranges ``(start, length)`` in a unit holding the state of the tensor at
        elements ``[offset, offset + numel)``: master, then each slot's values (and
        int8 scales). The same tensor has ranges of the same lengths in any layout."""
        return unit_ranges(
            self.state_format, len(self.state_slots), capacity, has_master, offset, numel
        )

    @property
    def span_granule(self) -> int:
        """Elements the span boundaries of an oversize chunk are multiples of
        (see :attr:`StateFormat.span_granule`)."""
        return self.state_format.span_granule

    def piece_views(self, pieces: list[torch.Tensor], has_master: bool) -> UnitViews:
        """The unit views of elements ``[a, b)`` held as separate byte *pieces*, in the
        order of :meth:`tensor_ranges` (the span of an oversize chunk, see
        ``chunks/pools.py``)."""
        pieces = [p.view(torch.uint8) for p in pieces]
        master = pieces.pop(0).view(torch.float32) if has_master else None
        per_slot = 2 if self.state_format.quantized else 1
        slots = {}
        for k, name in enumerate(self.state_slots):
            data = pieces[k * per_slot].view(self.state_format.torch_dtype)
            scale = pieces[k * per_slot + 1].view(torch.float32) if per_slot == 2 else None
            slots[name] = StoredSlot(data, scale)
        return UnitViews(master, slots)

    def read_state(self, unit: UnitViews, span: slice) -> dict[str, torch.Tensor]:
        """New fp32 copies of the state of elements ``span``, by slot name."""
        if self.state_format.quantized:
            raise NotImplementedError(f"{self.name} does not decode quantised state")
        return {name: data[span].to(torch.float32, copy=True) for name, data in unit.state.items()}

    def write_state(self, unit: UnitViews, span: slice, values: Mapping[str, torch.Tensor]) -> None:
        """Store fp32 ``values`` (flat, by slot name) as the state of elements ``span``."""
        if self.state_format.quantized:
            raise NotImplementedError(f"{self.name} does not encode quantised state")
        for name, data in unit.state.items():
            data[span].copy_(values[name].reshape(-1))

    @abstractmethod
    def step(self, views: StepViews, hyper: H, *, step: int, grad_scale: float) -> None:
        """Update one run of tensors in place; ``step`` is their step count after it
        (1 on the first update), gradients are divided by ``grad_scale``. The views are
        host tensors, or device tensors where :meth:`steps_on` said yes."""

    def steps_on(self, device: torch.device) -> bool:
        """:meth:`step` takes views on ``device``: chunks may then be homed and stepped
        there (NOTE [chunks homed on the device]). The host's always (never an optimizer
        whose update reads whole tensors: its per-tensor states live on the host); another
        device where the optimizer has a device update (:attr:`device_temporaries`), in
        every state format it stores (:mod:`infinity.optim.device_state`)."""
        if device.type == "cpu":
            return not self.whole_tensors
        return bool(self.device_temporaries)

    def device_step_scratch(self, elems: int, device: torch.device) -> int:
        """Device bytes :meth:`step` allocates beside its views for a run of up to
        ``elems`` elements on ``device`` (none on the host: the kernels make none)."""
        stored = stored_state_temporaries(
            self.state_format.name, len(self.state_slots), stochastic=self.device_rounding
        )
        return device_block_scratch(elems, device, self.device_temporaries + stored)


def betas_value(group: dict[str, Any]) -> tuple[float, float]:
    """A param group's ``betas``: a pair in [0, 1]; ``ValueError`` naming it otherwise."""
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
    return (
        hyper_value("betas[0]", betas[0], low=0.0, high=1.0),
        hyper_value("betas[1]", betas[1], low=0.0, high=1.0),
    )


def hyper_value(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    """``value`` (a number or a 1-element tensor) as a float in ``[low, high)``; a
    ``ValueError`` naming ``name`` and the range otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} as a tensor must have one element, got shape {tuple(value.shape)}"
            )
        value = value.item()
    x = float(value)
    if not math.isfinite(x) or x < low or (high is not None and not x < high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Invalid {name}: {value!r} (must be finite and {bound})")
    return x


def unit_ranges(
    state_format: StateFormat, slots: int, capacity: int, has_master: bool, offset: int, numel: int
) -> list[tuple[int, int]]:
    """Byte ranges ``(start, length)``, in a unit of ``slots`` state slots stored as
    ``state_format`` for a chunk of ``capacity`` elements, of elements
    ``[offset, offset + numel)``: the fp32 master (if any), then each slot's values
    (and int8 block scales). See :meth:`ChunkOptimizer.tensor_ranges`."""
    ranges = [(offset * FP32_BYTES, numel * FP32_BYTES)] if has_master else []
    at = capacity * FP32_BYTES if has_master else 0
    for _slot in range(slots):
        ranges += [
            (at + start, n) for start, n in state_format.tensor_ranges(capacity, offset, numel)
        ]
        at += state_format.slot_bytes(capacity)
    return ranges
