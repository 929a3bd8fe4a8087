"""What the engine knows of each tensor's gradient: held or not, and its pending factor.

A component of :class:`~infinity.runtime.engine.OffloadEngine`, built on
:class:`~infinity.runtime.model_chunks.ModelChunks`. It is the only component
that moves the per-tensor gradient states (``chunks.has_grad``, see
:mod:`infinity.runtime.model_chunks`) and the pending gradient factors.

- ``param.grad`` set to ``None`` (or a sentinel zeroed in place) by the user is
  how the engine learns gradients were zeroed: :meth:`collect_zeroed` turns
  that into states here and in the chunk manager.
- A multiplication of a gradient (clipping) is only recorded, as a pending
  factor per tensor. The step folds a common factor into the fused kernel's
  gradient scale; the factors are written into the chunks only when something
  needs the scaled values in place (see :mod:`infinity.runtime.gradients`).

``version`` changes whenever a gradient as the user sees it may have changed,
so a cache of norms keyed by it never serves stale values.

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
  applied in the optimizer step (or in the chunks when needed).

So ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
``clip_grads_with_norm_`` work unchanged, for any mix of offloaded and ordinary
parameters. Any other computation fails loudly with the fix instead of silently
seeing nothing.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing
from typing import Any, Protocol

import torch

from infinity.chunks.homes import Kind
from infinity.chunks.pieces import windows
from infinity.chunks.states import UpdateState
from infinity.runtime.model_chunks import ModelChunks
from infinity.runtime.params import ModelChangedError, ParamEntry


class GradientLedger:
    """Per-tensor gradient states and pending factors of one model."""

    def __init__(self, chunks: ModelChunks) -> None:
        self.chunks = chunks
        self.manager = chunks.manager
        self.has_grad = chunks.has_grad  # moved only here (see ModelChunks)
        n = len(chunks.registry.entries)
        self.factors = [1.0] * n  # per tensor: the pending clip factor
        self.version = 0

    def changed(self) -> None:
        """The gradients (as the user sees them) may have changed."""
        self.version += 1

    def received(self, index: int) -> None:
        """Tensor ``index``'s gradient arrived in its chunk."""
        self.has_grad.received(index)

    # --- zeroing -------------------------------------------------------------------
    def collect_zeroed(self) -> None:
        """Gradients whose ``param.grad`` the user set to ``None`` (zero_grad) are dropped."""
        chunks = self.chunks
        zeroed_chunks: dict[int, list[ParamEntry]] = {}
        for entry in chunks.registry.entries:
            if not self.has_grad[entry.index]:
                continue
            grad = entry.param.grad
            if grad is not None and not isinstance(grad, GradientInChunks):
                raise ModelChangedError(
                    f"{entry.name}.grad was assigned a tensor; gradients of offloaded parameters "
                    "live in chunks and cannot be set by hand"
                )
            if is_zeroed(grad):
                entry.param.grad = None
                self.has_grad.dropped(entry.index)
                zeroed_chunks.setdefault(chunks.chunk_of(entry.index), []).append(entry)
        if zeroed_chunks:
            self.reset_factors(e.index for es in zeroed_chunks.values() for e in es)
        for chunk, entries in zeroed_chunks.items():
            if not any(self.has_grad[e.index] for e in chunks.chunk_members[chunk]):
                self.manager.grads.zeroed(chunk)
            else:
                self._zero_grad_ranges(chunk, entries)
        if zeroed_chunks and not self.has_grad.any:
            self.manager.grad_flow.found_inf = False

    def reset(self) -> None:
        """Forget every gradient (after loading a checkpoint)."""
        for entry in self.chunks.registry.entries:
            if isinstance(entry.param.grad, GradientInChunks):
                entry.param.grad = None
        self.has_grad.drop_all()
        self.reset_factors()
        self.manager.grad_flow.invalidate_grads()

    def _zero_grad_ranges(self, chunk: int, entries: list[ParamEntry]) -> None:
        """Zero some tensors' gradients inside a chunk whose other gradients stay."""
        if not self.manager.grads.home_valid(chunk):
            return  # nothing kept to zero (a later read or addition raises)
        self._change(chunk, {entry.index: torch.Tensor.zero_ for entry in entries})

    def _change(self, chunk: int, changes: dict[int, Callable[[torch.Tensor], object]]) -> None:
        """Apply ``changes[index]`` in place to tensor ``index``'s gradient in ``chunk``,
        window by window (an oversize chunk is never staged whole).

        Element-wise, so each rank changes its own shard alone (no gather)."""
        # NOTE [gradient norms on the device]: a later clip must not read the norms of
        # the values before this change (a chunk with no new gradient in the next
        # micro-batch keeps them until the step).
        self.manager.grads.changed_in_place(chunk)
        layout = self.chunks.layout
        each = windows(self.manager, Kind.GRAD, chunk, write=True, gather=False)
        with closing(each):
            for window in each:
                grads = window.parts[0].view(self.chunks.dtype)
                for index, change in changes.items():
                    slot = layout.slots[index]
                    where = window.overlap(slot.offset, slot.numel)
                    if where is not None:
                        change(grads[where[1]])

    # --- pending factors -------------------------------------------------------------
    def scale(self, index: int, factor: float) -> None:
        """Record a multiplication of tensor ``index``'s gradient by ``factor``."""
        self.factors[index] *= factor
        self.changed()

    def stored_gradient(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """A stored gradient with its pending factor applied (``view`` itself if none)."""
        factor = self.factors[index]
        return view if factor == 1.0 else view * factor

    def step_factor(self, indices: Iterable[int]) -> float:
        """The factor the step applies to the gradients of ``indices`` (those stepped).

        One factor shared by all folds into the kernel; otherwise the factors
        are first written into the chunks and the step applies none.
        """
        factors = {self.factor_of(i) for i in indices if self.has_grad[i]}
        if len(factors) <= 1:
            return factors.pop() if factors else 1.0
        self.apply_factors()
        return 1.0

    def apply_factors(self) -> None:
        """Write the pending factors into the gradient chunks (then all are 1).

        The caller has settled queued updates (they read these gradients).
        """
        pending = {
            i: self.factor_of(i)
            for i, f in enumerate(self.factors)
            if f != 1.0 and self.has_grad[i]
        }
        self.factors = [1.0] * len(self.factors)
        if not pending:
            return
        updates = self.manager.updates
        queued = (UpdateState.TRAILING, UpdateState.EARLY, UpdateState.COMPUTING)
        if any(updates.count(u) for u in queued):
            raise AssertionError("gradient factors applied while updates are queued")
        for chunk, group in self.chunks.layout.group_by_chunk(pending, int).items():
            self._change(chunk, {i: _times(pending[i]) for i in group})
        self.changed()

    def factor_of(self, index: int) -> float:
        """Tensor ``index``'s pending factor; raises if it is not finite."""
        factor = self.factors[index]
        if not math.isfinite(factor):
            raise RuntimeError(
                f"the gradient of {self.chunks.registry.entries[index].name} was scaled by "
                f"{factor} (a clip coefficient from a non-finite gradient norm); call "
                "optimizer.zero_grad() before the next backward, or clip with "
                "error_if_nonfinite=True to stop at the bad norm"
            )
        return factor

    def reset_factors(self, indices: Iterable[int] | None = None) -> None:
        """Gradients of ``indices`` (all when ``None``) were dropped: no pending factor."""
        for i in range(len(self.factors)) if indices is None else indices:
            self.factors[i] = 1.0
        self.changed()


def _times(factor: float) -> Callable[[torch.Tensor], object]:
    """Multiply a gradient in place by ``factor``."""
    return lambda grads: grads.mul_(factor)


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
    "get_total_norm, clip_grads_with_norm_). Read gradients with `infinity.gradients(model)`."
)


class GradientOwner(Protocol):
    """What a sentinel asks of its model's engine (its gradient-norm component)."""

    def grad_norm(self, index: int, norm_type: float) -> torch.Tensor:
        """The norm of tensor ``index``'s gradient as torch would see it."""
        ...

    def scale_grad(self, index: int, factor: float) -> None:
        """Multiply tensor ``index``'s gradient by ``factor``."""


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


def is_zeroed(grad: torch.Tensor | None) -> bool:
    """True when the user dropped or zeroed a sentinel gradient."""
    if grad is None:
        return True
    return isinstance(grad, GradientInChunks) and grad._zeroed
