"""Stochastic rounding of fp32 to bf16 in torch ops, for the references of optimizers
whose bf16 state the kernels round stochastically (NOTE [bf16 stochastic rounding]).

The references draw their own random bits (a seeded ``torch.Generator``), not the
kernels' hash of chunk and offset: they round the same way in distribution, not in
bytes (``tests/optim/test_bf16_stochastic_rounding.py`` checks the bytes), so a
comparison with them allows every element to round differently.
"""

from __future__ import annotations

import torch


def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` as bf16: 16 random bits added to its fp32 bits, then truncated (rounds up
    with probability of the dropped fraction: unbiased). Finite values only."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int64)
    # NOTE: int64 keeps the sum of a negative value's bits and the noise exact; the
    # shift then keeps bits 16..31, the bf16 bits, which int16 holds as they are.
    top = ((bits & 0xFFFFFFFF) + noise) >> 16
    return (top - ((top >> 15) << 16)).to(torch.int16).view(torch.bfloat16)
