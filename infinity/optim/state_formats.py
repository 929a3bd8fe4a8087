"""How an optimizer's per-element state is stored: ``Config(optimizer_state_dtype=...)``.

``"fp32"`` keeps every moment exact. ``"bf16"`` stores each moment in bfloat16
(half the bytes; rounded stochastically on every store, unbiased, see
NOTE [bf16 stochastic rounding] in docs/NOTES.md). ``"int8"`` stores one byte per element
plus one fp32 scale per block of :data:`QBLOCK` elements:
8-bit Adam's block-wise dynamic quantisation (signed codes for the first
moment, unsigned for the second), decoded and re-encoded inside the fused
kernel (``cpp/simd/q8_codec.hpp`` documents the codes, the rounding and the
block size). The update always runs in fp32; master weights stay fp32.

:class:`StateFormat` says how many bytes a stored moment takes and cuts a
stored slot into its views (:class:`StoredSlot`). :func:`read_moments` /
:func:`write_moments` convert between a stored slot and fp32 values, for state
dicts: they use the kernel's own encoder, so a value written and stepped
gives the bytes the kernel would have stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity._native import native
from infinity._native.adam import QBLOCK, STATE_ELEMENT_BYTES
from infinity._native.io import ALIGNMENT
from infinity.utils.sizes import align_up

__all__ = [
    "QBLOCK",
    "STATE_DTYPES",
    "StateFormat",
    "StoredSlot",
    "read_moments",
    "read_slot",
    "write_moments",
]

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
