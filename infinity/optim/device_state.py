"""What every optimizer's update on the device shares: blocks, scratch, and its states.

An update of a chunk homed on the device (NOTE [chunks homed on the device]) runs
as torch kernels on the chunk's views, :data:`DEVICE_STEP_ELEMS` elements at a
time, so its fp32 temporaries stay small whatever the chunk. A state kept as bf16
or int8 is loaded into fp32 for the block and stored back as the host kernels
store it (:class:`BlockStates`), in integer tensor ops where they work on bits:

- bf16: Adam's moments and Lion's momentum rounded stochastically with the same
  random bits (NOTE [bf16 stochastic rounding]: the lowbias32 hash of seed, step,
  stream and element index), SGD's buffer to nearest. So a chunk moved between a
  host home and a device home draws the same bits for the same element and step.
- int8: the minifloat codes of ``cpp/simd/q8_codec.hpp``, each block of
  :data:`QBLOCK` elements scaled by its absmax, re-encoded with the block's new
  absmax, and Adam's first moment zeroed where its second codes to zero
  (NOTE [int8 second moment zero]).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch

from infinity._native.adam import QBLOCK
from infinity.utils.process_memory import device_bytes

# Elements an update on the device takes at a time: its temporaries stay this small,
# whatever the chunk (``device_block_scratch``).
DEVICE_STEP_ELEMS = 1 << 18
# fp32-sized temporaries a block's stored states add beside an fp32 copy of each:
# bf16's stochastic rounding (the random bits, kept for every state of the block, and
# the integers of one store), int8's codes (one encode's integers and the blocks'
# scales). Measured on the fence's allocator, which counts every temporary
# (tests/fence/test_fence_device_homes.py).
ROUNDING_TEMPORARIES = 10
CODING_TEMPORARIES = 7

_ROUND_SEED = 0x1F0E2D3C  # kRoundSeed in cpp/simd/stochastic_round.hpp
_M32 = 0xFFFFFFFF


def device_blocks(n: int) -> list[slice]:
    """The blocks of an update of ``n`` elements on the device, in order."""
    return [slice(start, start + DEVICE_STEP_ELEMS) for start in range(0, n, DEVICE_STEP_ELEMS)]


def device_block_scratch(elems: int, device: torch.device, temporaries: int) -> int:
    """Device bytes of ``temporaries`` fp32 tensors of one block of a run of up to
    ``elems`` elements, each as ``device``'s allocator holds it (none on the host)."""
    if device.type == "cpu":
        return 0
    return temporaries * device_bytes(4 * min(elems, DEVICE_STEP_ELEMS), device)


def stored_state_temporaries(state_format: str, states: int, *, stochastic: bool) -> int:
    """fp32-sized temporaries a block adds to store ``states`` states in ``state_format``
    (none for fp32: updated in place): an fp32 copy of each, and what stores them
    (``stochastic``: bf16 rounded stochastically, else to nearest)."""
    if state_format == "fp32":
        return 0
    if state_format == "int8":
        return states + CODING_TEMPORARIES
    return states + (ROUNDING_TEMPORARIES if stochastic else 0)


def _hash32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def round_key(step: int, stream: int) -> int:
    """The key of one call's random bits: seed, step count and stream, 32 bits at a
    time (``round_key`` of cpp/simd/stochastic_round.hpp)."""
    step &= (1 << 64) - 1
    h = _ROUND_SEED
    for word in (step & _M32, step >> 32, stream & _M32, (stream >> 32) & _M32):
        h = _hash32_int(h ^ word)
    return h


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` in place, for 32-bit values in int64 (no product passes 2^48)."""
    high = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_M32)


def random_bits(key: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """The 32 random bits (in int64) of elements ``start .. start + n`` under ``key``:
    ``hash32(key + index mod 2^32)``, the host kernels' bits."""
    x = torch.arange(start, start + n, dtype=torch.int64, device=device)
    x.add_(key).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def store_bf16_stochastic(out: torch.Tensor, x: torch.Tensor, r16: torch.Tensor) -> None:
    """Store fp32 ``x`` into bf16 ``out`` rounded with the 16 random bits ``r16``: added to
    the fp32 bits, then truncated (a carry moves up a binade; infinities stay; NaN
    becomes a quiet NaN with its sign), as ``bf16_stochastic`` of the host kernels."""
    u = x.view(torch.int32).to(torch.int64).bitwise_and_(_M32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    quiet = (u >> 16).bitwise_or_(0x40)
    u.add_(r16).bitwise_and_(_M32).bitwise_right_shift_(16)
    u = torch.where(nan, quiet, u)
    # bits 0..15 as a signed 16-bit value (int16 holds them as they are)
    u.sub_((u >> 15).bitwise_left_shift_(16))
    out.copy_(u.to(torch.int16).view(torch.bfloat16))


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class _Codes:
    """One minifloat code format of the int8 states (``q8_codec.hpp``): 3 fraction
    bits, ``bias``, codes up to ``max_code``, a sign bit above them if ``signed``."""

    def __init__(self, bias: int, max_code: int, signed: bool) -> None:
        self.signed, self.max_code = signed, max_code
        self.min_normal = (128 - bias) << 23  # 2^(1-bias): below, subnormal codes
        self.magic_bits = (148 - bias) << 23  # 2^(21-bias): its ulp is the subnormal step
        self.magic = _bits_to_float(self.magic_bits)
        self.sub_step = _bits_to_float((125 - bias) << 23)
        self.offset = (127 - bias) << 3  # the exponent's re-bias, in code units

    def decode(self, codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """fp32 values of uint8 ``codes`` times ``step`` (the block's absmax / 1.875)."""
        c = codes.to(torch.int32)
        mag = c & 0x7F if self.signed else c
        bits = torch.where(
            mag < 8,
            (mag.float() * self.sub_step).view(torch.int32),
            (mag << 20).add_(self.offset << 20),
        )
        value = bits.view(torch.float32)
        if self.signed:  # the sign bit set: as -value, exactly (zero included)
            value = torch.where(c >= 0x80, -value, value)
        return value.mul_(step)

    def encode(self, x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """int32 codes of fp32 ``x`` times ``inverse`` (1.875 / absmax), rounded to
        nearest (ties to even), as the host kernels encode them."""
        y = x.abs().mul_(inverse)
        # NOTE: at most infinity's bits, so the rounding below stays in int32 (a NaN
        # codes as the largest code either way, as in the host kernels).
        u = y.view(torch.int32).clamp(max=0x7F800000)
        normal = ((u >> 20) & 1).add_(u).add_((1 << 19) - 1).bitwise_right_shift_(20)
        normal.sub_(self.offset)
        sub = y.add_(self.magic).view(torch.int32).sub_(self.magic_bits)
        code = torch.where(u < self.min_normal, sub, normal).clamp_(max=self.max_code)
        if self.signed:
            code.bitwise_or_((x.view(torch.int32) >> 24) & 0x80)
        return code


_SIGNED = _Codes(15, 127, signed=True)  # Adam's and Lion's exp_avg: sign + 7 bits
_UNSIGNED = _Codes(31, 255, signed=False)  # exp_avg_sq
_CODES = {"exp_avg_sq": _UNSIGNED}  # every other int8 state is signed
_Q8_MAX = 1.875  # the largest code's value: a block's absmax maps to it
_FLT_MIN = 1.17549435e-38


def _blockwise(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows of QBLOCK elements, the last padded with zeros."""
    pad = -x.numel() % QBLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, QBLOCK)


class BlockStates:
    """Elements ``part`` of a run's states (a step's ``StepViews.state``) as fp32, each
    stored back in its format by :meth:`store`.

    ``scales``: int8 states' block scales (``StepViews.scales``); ``rounding`` (the
    views' stream and offset) and ``step`` (the update's count) choose bf16's random
    bits, as they do for the host kernels. ``part`` starts on a QBLOCK boundary (the
    blocks of :func:`device_blocks` do), so int8 blocks are whole."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        part: slice,
        *,
        scales: Mapping[str, torch.Tensor] | None = None,
        rounding: tuple[int, int] = (0, 0),
        step: int = 0,
    ) -> None:
        self._state, self._part, self._scales_of = state, part, scales or {}
        self._rounding, self._step = rounding, step
        self._bits: torch.Tensor | None = None

    def _scales(self, name: str) -> torch.Tensor:
        start, n = self._part.start or 0, self._state[name][self._part].numel()
        return self._scales_of[name][start // QBLOCK : (start + n + QBLOCK - 1) // QBLOCK]

    def load(self, name: str) -> torch.Tensor:
        """State ``name`` of the block as fp32: the view itself (updated in place) when
        it is fp32, else a decoded copy."""
        view = self._state[name][self._part]
        if view.dtype == torch.float32:
            return view
        if view.dtype != torch.uint8:
            return view.float()
        step = (self._scales(name) / _Q8_MAX).repeat_interleave(QBLOCK)[: view.numel()]
        return _CODES.get(name, _SIGNED).decode(view, step)

    def store(
        self,
        name: str,
        value: torch.Tensor,
        *,
        stochastic: int | None = None,
        zero_where_zero: str | None = None,
    ) -> None:
        """Store ``value`` into state ``name`` (nothing to do where :meth:`load` gave the
        view). bf16: rounded stochastically with the low (``stochastic=0``) or high
        (``1``) 16 random bits of each element, or to nearest (``None``). int8: encoded
        with each block's new absmax; ``zero_where_zero``: a state stored before in
        this block whose zero codes zero these (Adam's first moment)."""
        view = self._state[name][self._part]
        if view.dtype == torch.float32:
            if value.data_ptr() != view.data_ptr():
                view.copy_(value)
        elif view.dtype == torch.uint8:
            self._store_codes(name, view, value, zero_where_zero)
        elif stochastic is None:
            view.copy_(value)  # round to nearest even
        else:
            if self._bits is None:
                stream, offset = self._rounding
                key = round_key(self._step, stream)
                start = offset + (self._part.start or 0)
                self._bits = random_bits(key, start, view.numel(), view.device)
            bits = self._bits
            store_bf16_stochastic(view, value, bits >> 16 if stochastic else bits & 0xFFFF)

    def _store_codes(
        self, name: str, view: torch.Tensor, value: torch.Tensor, zero_where_zero: str | None
    ) -> None:
        n = view.numel()
        absmax = _blockwise(value).abs().amax(dim=1)
        scales = self._scales(name)
        scales.copy_(absmax)
        inverse = torch.where(absmax >= _FLT_MIN, _Q8_MAX / absmax, torch.zeros_like(absmax))
        codes = _CODES.get(name, _SIGNED).encode(value, inverse.repeat_interleave(QBLOCK)[:n])
        view.copy_(codes)
        del codes
        if zero_where_zero is not None:  # NOTE [int8 second moment zero]
            view.masked_fill_(self._state[zero_where_zero][self._part] == 0, 0)
