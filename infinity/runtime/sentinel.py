"""``param.grad`` of an offloaded parameter after backward: a sentinel, not data.

Gradients live in chunks (possibly on NVMe), so there is no tensor to hand out.
The sentinel says "this parameter has a gradient" (``p.grad is not None``
keeps its meaning, and setting it to ``None`` — ``optimizer.zero_grad()`` —
is how the engine learns gradients were zeroed), while any computation on it
fails loudly with the fix instead of silently seeing nothing: notably
``torch.nn.utils.clip_grad_norm_`` would otherwise clip nothing.
"""

from __future__ import annotations

import torch

_HELP = (
    "the gradient of an offloaded parameter lives in infinity's chunks, not in param.grad. "
    "Clip with `optimizer.clip_grad_norm_(max_norm)` (infinity.optim.CPUAdam) instead of "
    "torch.nn.utils.clip_grad_norm_, and read gradients with `infinity.gradients(model)`."
)


class GradientInChunks(torch.Tensor):
    """Stands in ``param.grad`` for a gradient held in chunk memory."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> GradientInChunks:
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # zero_grad(set_to_none=False) zeroes in place: accept it as "zeroed".
        if func is torch.ops.aten.zero_.default:
            args[0]._zeroed = True
            return args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]
        raise RuntimeError(f"{func}: {_HELP}")

    def __repr__(self) -> str:  # printing must not dispatch
        return f"GradientInChunks(shape={tuple(self.shape)}, dtype={self.dtype})"


def is_zeroed(grad: torch.Tensor | None) -> bool:
    """True when the user dropped or zeroed a sentinel gradient."""
    if grad is None:
        return True
    return isinstance(grad, GradientInChunks) and getattr(grad, "_zeroed", False)
