"""What every optimizer's update on the device shares: blocks, scratch, and its states.

An update of a chunk homed on the device (NOTE [chunks homed on the device]) runs
as torch kernels on the chunk's views, :data:`DEVICE_STEP_ELEMS` elements at a
time, so its fp32 temporaries stay small whatever the chunk. A state kept as bf16
is loaded into fp32 for the block and stored back as the host kernels store it:
Adam's moments and Lion's momentum rounded stochastically with the same random
bits (NOTE [bf16 stochastic rounding]: the lowbias32 hash of seed, step, stream
and element index, ported here to 64-bit integer tensor ops), SGD's buffer to
nearest. So a chunk moved between a host home and a device home (a checkpoint
resumed with other budgets) draws the same bits for the same element and step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from infinity.utils.process_memory import device_bytes

# Elements an update on the device takes at a time: its temporaries stay this small,
# whatever the chunk (``device_block_scratch``).
DEVICE_STEP_ELEMS = 1 << 18
# fp32-sized temporaries the stochastic rounding of bf16 states adds to a block (the
# random bits, kept for every state of the block, and the integer tensors of one
# store), beside an fp32 copy of each state: measured on the fence's allocator
# (tests/fence/test_fence_device_homes.py), which counts every temporary.
ROUNDING_TEMPORARIES = 10

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


class BlockStates:
    """One block of an update on the device: each state of the views as fp32, stored
    back in its format by :meth:`store`.

    ``rounding`` is the views' (stream, offset) and ``step`` the update's count: with
    bf16 states they choose the random bits, as they do for the host kernels."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        part: slice,
        *,
        rounding: tuple[int, int],
        step: int,
    ) -> None:
        self._state, self._part = state, part
        self._bits: torch.Tensor | None = None
        self._rounding, self._step = rounding, step

    def load(self, name: str) -> torch.Tensor:
        """State ``name`` of the block as fp32: the view itself (updated in place) when
        it is fp32, else a copy."""
        view = self._state[name][self._part]
        return view if view.dtype == torch.float32 else view.float()

    def store(self, name: str, value: torch.Tensor, *, stochastic: int | None = None) -> None:
        """Store ``value`` into state ``name`` (nothing to do where :meth:`load` gave the
        view); bf16: rounded stochastically with the low (``stochastic=0``) or high
        (``1``) 16 random bits of each element, or to nearest (``None``)."""
        view = self._state[name][self._part]
        if view.dtype == torch.float32:
            if value.data_ptr() != view.data_ptr():
                view.copy_(value)
            return
        if stochastic is None:
            view.copy_(value)  # round to nearest even
            return
        if self._bits is None:
            stream, offset = self._rounding
            key = round_key(self._step, stream)
            start = offset + (self._part.start or 0)
            self._bits = random_bits(key, start, view.numel(), view.device)
        bits = self._bits
        store_bf16_stochastic(view, value, bits >> 16 if stochastic else bits & 0xFFFF)
