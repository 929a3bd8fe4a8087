"""``param.grad`` of an offloaded parameter: a sentinel that answers gradient clipping.

``param.grad`` of an offloaded parameter after backward is a sentinel
(:class:`GradientInChunks`), not data. Gradients live in chunks (possibly on NVMe),
so there is no tensor to hand out. The sentinel says "this parameter has a gradient"
(``p.grad is not None`` keeps its meaning, and setting it to ``None`` —
``optimizer.zero_grad()`` — is how the engine learns gradients were zeroed). It
answers exactly the ops gradient clipping uses, from the chunks:

- ``torch.linalg.vector_norm(grad, p)`` (and ``torch._foreach_norm``): the
  gradient's norm, as a real fp32 tensor on the parameter's device (see
  :mod:`infinity.runtime.gradients`);
- ``grad.mul_(c)`` (and ``torch._foreach_mul_``) with a scalar ``c``: recorded,
  applied in the optimizer step (or in the chunks when needed);
- ``grad.clamp_(lo, hi)``, ``clamp_min_``/``clamp_max_`` (and their ``_foreach_``
  forms) with scalar bounds: recorded, applied before the gradients are read.

So ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``,
``clip_grads_with_norm_`` and ``clip_grad_value_`` work unchanged, for any mix of
offloaded and ordinary parameters. Any other computation fails loudly with the fix
instead of silently seeing nothing.

The sentinel hands each operation to its model's :class:`GradientOwner`
(:class:`~infinity.runtime.gradients.GradientNorms`), which records factors and
clamps in the :class:`~infinity.runtime.grad_ledger.GradientLedger`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

_aten = torch.ops.aten

# torch.amp.GradScaler's unscale_ (and step) reach the gradients through this op.
_GRAD_SCALER = (
    "torch.amp.GradScaler cannot unscale an offloaded model's gradients: they live in "
    "infinity's chunks, and infinity scales the loss itself. With Config(dtype='fp16') "
    "backpropagate optimizer.scale_loss(loss) and call optimizer.step() (the engine skips "
    "an overflowed step and adapts the scale, as GradScaler does); with bf16 or fp32 no "
    "loss scaling is needed. Drop the GradScaler."
)
_HELP = (
    "the gradient of an offloaded parameter lives in infinity's chunks, not in param.grad: "
    "param.grad supports only gradient clipping (torch.nn.utils.clip_grad_norm_, "
    "get_total_norm, clip_grads_with_norm_, clip_grad_value_). Read gradients with "
    "`infinity.gradients(model)`."
)


class GradientOwner(Protocol):
    """What a sentinel asks of its model's engine (its gradient-norm component)."""

    def grad_norm(self, index: int, norm_type: float) -> torch.Tensor:
        """The norm of tensor ``index``'s gradient as torch would see it."""
        ...

    def scale_grad(self, index: int, factor: float) -> None:
        """Multiply tensor ``index``'s gradient by ``factor``."""

    def clamp_grad(self, index: int, lower: float | None, upper: float | None) -> None:
        """Clamp tensor ``index``'s gradient (as the user sees it) to the bounds."""


class GradientInChunks(torch.Tensor):
    """Stands in ``param.grad`` for a gradient held in chunk memory."""

    _engine: weakref.ReferenceType[GradientOwner] | None
    _index: int
    _zeroed: bool

    @staticmethod
    def __new__(
        cls, like: torch.Tensor, engine: GradientOwner | None = None, index: int = -1
    ) -> GradientInChunks:
        grad = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device
        )
        grad._engine = weakref.ref(engine) if engine is not None else None
        grad._index = index
        grad._zeroed = False
        return grad

    # torch declares __torch_dispatch__ as a plain function attribute;
    # subclasses override it with a classmethod, as torch's docs show.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # zero_grad(set_to_none=False) zeroes in place: accept it as "zeroed".
        if func is _aten.zero_.default:
            args[0]._zeroed = True
            return args[0]
        if func in (_aten.detach.default, _aten.alias.default):
            return args[0]
        if func is _aten.linalg_vector_norm.default:
            return _vector_norm(*args, **kwargs)
        if func in (_aten.mul_.Tensor, _aten.mul_.Scalar):
            args[0]._scale(_scalar(args[1], func))
            return args[0]
        if func is _aten._foreach_norm.Scalar:
            return _foreach_norm(*args, **kwargs)
        if func in (_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar):
            _foreach_mul_(args[0], _scalar(args[1], func))
            return None
        if func in _CLAMPS:
            bounds = _CLAMPS[func](*args[1:], **kwargs)
            grads = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            _foreach_clamp_(grads, *(None if b is None else _scalar(b, func) for b in bounds))
            return None if grads is args[0] else args[0]
        if func is _aten._amp_foreach_non_finite_check_and_unscale_.default:
            raise RuntimeError(_GRAD_SCALER)
        raise RuntimeError(f"{func}: {_HELP}")

    # NOTE: printing must not dispatch; torch's __repr__ takes an extra keyword.
    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradientInChunks(shape={tuple(self.shape)}, dtype={self.dtype})"

    def _owner(self) -> GradientOwner:
        engine = self._engine() if self._engine is not None else None
        if engine is None:
            raise RuntimeError(f"this gradient's offloaded model is gone: {_HELP}")
        return engine

    def _norm(self, norm_type: float) -> torch.Tensor:
        if self._zeroed:
            return torch.zeros((), device=self.device)
        return self._owner().grad_norm(self._index, norm_type).to(self.device)

    def _scale(self, factor: float) -> None:
        if not self._zeroed:
            self._owner().scale_grad(self._index, factor)

    def _clamp(self, lower: float | None, upper: float | None) -> None:
        if not self._zeroed:
            self._owner().clamp_grad(self._index, lower, upper)
        elif (lower is not None and lower > 0) or (upper is not None and upper < 0):
            raise RuntimeError(
                f"clamping a zeroed gradient to [{lower}, {upper}] would make it non-zero: "
                "zero it with optimizer.zero_grad() (set_to_none=True) instead"
            )


def _scalar(value: Any, func: Any) -> float:
    """A multiplier given as a number or a one-element tensor, as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or isinstance(value, GradientInChunks):
            raise RuntimeError(f"{func} by a tensor of shape {tuple(value.shape)}: {_HELP}")
        # The value torch would multiply by: the factor in the gradient's dtype.
        return float(value.item())
    return float(value)


def _vector_norm(
    grad: GradientInChunks,
    ord: float = 2,
    dim: Sequence[int] | None = None,
    keepdim: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if dim is not None and len(dim) not in (0, grad.dim()):
        raise RuntimeError(f"vector_norm over dims {dim}: {_HELP}")
    norm = grad._norm(float(ord))
    if keepdim:
        norm = norm.reshape([1] * grad.dim())
    return norm if dtype is None else norm.to(dtype)


def _foreach_norm(
    tensors: Sequence[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Norms of a list mixing sentinels and ordinary tensors (in order)."""
    plain = [t for t in tensors if not isinstance(t, GradientInChunks)]
    plain_norms = iter(torch._foreach_norm(plain, ord, dtype=dtype) if plain else [])
    return [
        _vector_norm(t, ord, dtype=dtype) if isinstance(t, GradientInChunks) else next(plain_norms)
        for t in tensors
    ]


def _foreach_mul_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    plain = [t for t in tensors if not isinstance(t, GradientInChunks)]
    if plain:
        torch._foreach_mul_(plain, factor)
    for t in tensors:
        if isinstance(t, GradientInChunks):
            t._scale(factor)


# The clamps torch.nn.utils.clip_grad_value_ calls (by tensor, or in foreach form):
# each op's (lower, upper) from its arguments after the tensor(s).
_CLAMPS: dict[Any, Callable[..., tuple[Any, Any]]] = {
    _aten.clamp_.default: lambda min=None, max=None: (min, max),
    _aten.clamp_.Tensor: lambda min=None, max=None: (min, max),
    _aten.clamp_min_.default: lambda min: (min, None),
    _aten.clamp_max_.default: lambda max: (None, max),
    _aten._foreach_clamp_min_.Scalar: lambda scalar: (scalar, None),
    _aten._foreach_clamp_max_.Scalar: lambda scalar: (None, scalar),
}


def _foreach_clamp_(
    tensors: Sequence[torch.Tensor], lower: float | None, upper: float | None
) -> None:
    """Clamp a list mixing sentinels and ordinary tensors in place."""
    plain = [t for t in tensors if not isinstance(t, GradientInChunks)]
    for t in plain:
        t.clamp_(min=lower, max=upper)
    for t in tensors:
        if isinstance(t, GradientInChunks):
            t._clamp(lower, upper)


def is_zeroed(grad: torch.Tensor | None) -> bool:
    """True when the user dropped or zeroed a sentinel gradient."""
    if grad is None:
        return True
    return isinstance(grad, GradientInChunks) and grad._zeroed
