"""The chunk-optimizer interface: what the planner, the offloaded step and the
checkpoint format ask of an optimizer instead of assuming Adam.

An optimizer keeps, per trainable chunk, one *unit* of bytes: the fp32 master
copy of the parameters (16-bit compute dtypes only; for fp32 the parameter
chunk is the master) followed by one chunk-long *state slot* per state tensor
(Adam: ``exp_avg`` then ``exp_avg_sq``), stored in the optimizer's
:class:`~infinity.optim.state_formats.StateFormat` (``Config.optimizer_state_dtype``:
fp32, bf16, or int8 codes followed by their block scales). Every part starts
on the I/O alignment. The planner sizes a unit from
:meth:`ChunkOptimizer.unit_bytes`, the step views its pieces with
:meth:`ChunkOptimizer.piece_views`, the checkpoint finds a tensor's bytes with
:meth:`ChunkOptimizer.tensor_ranges`, and :meth:`ChunkOptimizer.step` runs the
update on one run of tensors. Another optimizer is a subclass naming its slots
and its kernel (:mod:`infinity.optim.sgd` is the smallest), chosen by the
front-end the user constructs (:mod:`infinity.optim.front_end`).

Adam's own chunk optimizer (:data:`ADAM`) and hyper-parameters
(:class:`AdamHyperParams`, validated once per step) are here too, with
:func:`hyper_value`, the check every optimizer's hyper-parameters use.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from infinity.optim import kernels
from infinity.optim.state_formats import (
    FP32_BYTES,
    StateFormat,
    StoredSlot,
    read_moments,
    write_moments,
)

H = TypeVar("H", contravariant=True)


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

    def unit_parts(self, has_master: bool) -> int:
        """Parts of one unit: the master (if any) plus one per slot."""
        return len(self.state_slots) + int(has_master)

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
        (1 on the first update), gradients are divided by ``grad_scale``."""


# Keys torch.optim.Adam/AdamW keep in every param group. CPUAdam stores them
# with torch's defaults so its state_dict loads into torch unchanged.
_TORCH_GROUP_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
# Group flags torch supports and CPUAdam does not: flag -> what to use instead.
_UNSUPPORTED_FLAGS = {
    "amsgrad": "torch.optim.AdamW(amsgrad=True)",
    "maximize": "minimising the negated loss",
    "capturable": "torch.optim.AdamW(capturable=True) on the GPU",
    "differentiable": "torch.optim.AdamW(differentiable=True)",
}


@dataclass(frozen=True)
class AdamHyperParams:
    """The hyper-parameters of one param group, as plain validated floats.

    ``adamw=True`` means decoupled weight decay (AdamW: ``p -= lr * wd * p``
    before the Adam update); ``adamw=False`` means classic L2 regularisation
    (Adam: ``wd * p`` is added to the gradient, so it also flows through the
    moments).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> AdamHyperParams:
        """Read and validate a param group (values may be floats or 1-element tensors).

        Raises ``ValueError`` naming the key for out-of-range values and for
        torch flags CPUAdam does not implement (``amsgrad``, ``maximize``, ...).
        """
        for flag, instead in _UNSUPPORTED_FLAGS.items():
            if group.get(flag, False):
                raise ValueError(f"CPUAdam does not implement {flag}=True; use {instead}")
        beta1, beta2 = betas_value(group)
        return cls(
            lr=hyper_value("lr", group["lr"], low=0.0),
            beta1=beta1,
            beta2=beta2,
            eps=hyper_value("eps", group["eps"], low=0.0),
            weight_decay=hyper_value("weight_decay", group["weight_decay"], low=0.0),
            adamw=bool(group["adamw"]),
        )

    def kernel_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`kernels.adam_step` for these hyper-parameters."""
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "adamw": self.adamw,
        }


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


class AdamChunks(ChunkOptimizer[AdamHyperParams]):
    """Adam / AdamW over chunks, on the fused CPU-Adam kernel (:func:`.kernels.adam_step`)."""

    name = "adam"
    front_end = "infinity.optim.CPUAdam"
    state_slots = ("exp_avg", "exp_avg_sq")
    state_dtypes = ("fp32", "bf16", "int8")

    def read_state(self, unit: UnitViews, span: slice) -> dict[str, torch.Tensor]:
        """New fp32 copies of both moments of elements ``span`` (int8: decoded)."""
        m, v = read_moments(unit.slots["exp_avg"].span(span), unit.slots["exp_avg_sq"].span(span))
        return {"exp_avg": m, "exp_avg_sq": v}

    def write_state(self, unit: UnitViews, span: slice, values: Mapping[str, torch.Tensor]) -> None:
        """Store fp32 moments as the kernel would (int8: encoded block by block from
        ``span.start``, which is a block boundary: tensors start on one)."""
        write_moments(
            unit.slots["exp_avg"].span(span),
            unit.slots["exp_avg_sq"].span(span),
            values["exp_avg"].reshape(-1),
            values["exp_avg_sq"].reshape(-1),
        )

    def step(
        self, views: StepViews, hyper: AdamHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One Adam update of the run (see :class:`ChunkOptimizer`)."""
        kernels.adam_step(
            views.master,
            views.grad,
            views.state["exp_avg"],
            views.state["exp_avg_sq"],
            step=step,
            grad_scale=grad_scale,
            out16=views.out16,
            exp_avg_scale=views.scales.get("exp_avg"),
            exp_avg_sq_scale=views.scales.get("exp_avg_sq"),
            round_stream=views.rounding[0],
            round_offset=views.rounding[1],
            **hyper.kernel_kwargs(),
        )


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


ADAM = AdamChunks()
"""Adam with exact fp32 moments; ``ADAM.with_state_dtype(...)`` for bf16 or int8."""
