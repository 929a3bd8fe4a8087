"""``infinity.optim.CPUAdafactor``: ``torch.optim.Adafactor`` (Shazeer & Stern 2018, as
torch implements it) for CPU tensors and offloaded models.

Adafactor keeps no first moment and a *factored* second moment: for a
parameter of two or more dimensions a row factor (the mean of squared
gradients over its last dimension) and a column factor (over the one before),
``R + C`` numbers for an ``R x C`` matrix; for a vector, a full second moment.
These states are not shaped like the parameter, so they are per-tensor states
kept in host memory beside the units, never in a state slot (see
NOTE [per-tensor optimizer state]): with fp32 compute an offloaded model's
units are empty, and with 16-bit compute only the fp32 master crosses the disk.

The update reads whole tensors (the parameter's RMS, the row and column means,
the update's RMS for clipping), so the chunk optimizer asks for one tensor per
run (``whole_tensors``) and runs torch's single-tensor step, operation for
operation, vectorised over the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews, hyper_value
from infinity.optim.front_end import CPUOptimizer, check_state_shape, step_dtype

__all__ = ["ADAFACTOR", "AdafactorChunks", "AdafactorHyperParams", "CPUAdafactor"]


@dataclass(frozen=True)
class AdafactorHyperParams:
    """The hyper-parameters of one param group, as plain validated floats."""

    lr: float
    beta2_decay: float
    eps1: float | None  # None: the machine epsilon of fp32 (the masters' dtype)
    eps2: float
    d: float
    weight_decay: float
    maximize: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> AdafactorHyperParams:
        """Read and validate a param group; ``ValueError`` naming the key otherwise."""
        eps = group["eps"]
        if len(eps) != 2:
            raise ValueError(f"eps={eps!r} must be a pair (eps1 or None, eps2)")
        beta2_decay = hyper_value("beta2_decay", group["beta2_decay"], low=-math.inf)
        if beta2_decay > 0:
            raise ValueError(f"Invalid beta2_decay: {beta2_decay!r} (must be <= 0)")
        return cls(
            lr=hyper_value("lr", group["lr"], low=0.0),
            beta2_decay=beta2_decay,
            eps1=None if eps[0] is None else hyper_value("eps[0]", eps[0], low=0.0),
            eps2=hyper_value("eps[1]", eps[1], low=0.0),
            d=hyper_value("d", group["d"], low=1.0),
            weight_decay=hyper_value("weight_decay", group["weight_decay"], low=0.0),
            maximize=bool(group["maximize"]),
        )


def factored_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Adafactor's states of a parameter of ``shape``, as ``torch.optim.Adafactor``
    shapes them: ``row_var`` (last dimension 1) and ``col_var`` (the one before 1)
    for two or more dimensions, else a full ``variance``."""
    if len(shape) > 1:
        return {
            "row_var": (*shape[:-1], 1),
            "col_var": (*shape[:-2], 1, shape[-1]),
        }
    return {"variance": tuple(shape)}


def adafactor_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: Mapping[str, torch.Tensor],
    hyper: AdafactorHyperParams,
    *,
    step: int,
) -> None:
    """One Adafactor update of a whole fp32 ``param`` (its shape) in place, from an
    fp32 ``grad`` of the same shape (read only) and its ``states``
    (:func:`factored_shapes`); ``step`` is the count after it (1 first).

    The operations of ``torch.optim.Adafactor``'s single-tensor step, in its order.
    """
    if hyper.maximize:
        grad = -grad
    eps1 = torch.finfo(param.dtype).eps if hyper.eps1 is None else hyper.eps1
    t = float(step)
    one_minus_beta2 = t**hyper.beta2_decay
    rho = min(hyper.lr, 1 / (t**0.5))
    alpha = max(hyper.eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho
    if hyper.weight_decay != 0:
        param.mul_(1 - hyper.lr * hyper.weight_decay)
    if grad.dim() > 1:
        row_var, col_var = states["row_var"], states["col_var"]
        # (g * g).mean(dim) through the norm, as torch: no squared copy of g.
        row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        row_var.lerp_(row_mean, one_minus_beta2)
        col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        col_var.lerp_(col_mean, one_minus_beta2)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance = states["variance"]
        variance.lerp_(grad * grad, one_minus_beta2)
        var_estimate = variance.clone()
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(grad)
    denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * hyper.d))
    param.add_(update, alpha=-alpha / denom)


class AdafactorChunks(ChunkOptimizer[AdafactorHyperParams]):
    """Adafactor over chunks: no state slot; per-tensor factored second moments in
    host memory; one whole tensor per step call."""

    name = "adafactor"
    front_end = "infinity.optim.CPUAdafactor"
    state_slots = ()
    state_dtypes = ("fp32",)
    whole_tensors = True

    def tensor_state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """``row_var`` and ``col_var``, or ``variance`` (see :func:`factored_shapes`)."""
        return factored_shapes(shape)

    def step(
        self, views: StepViews, hyper: AdafactorHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One Adafactor update of the run's one tensor (see :func:`adafactor_update`)."""
        if views.shape is None:
            raise AssertionError("Adafactor steps whole tensors: the run names no shape")
        # NOTE: the gradient chunk is only read: every change makes a new tensor.
        grad = views.grad if views.grad.dtype is torch.float32 else views.grad.float()
        if grad_scale != 1.0:
            grad = grad * grad_scale
        param = views.master.view(views.shape)
        adafactor_update(param, grad.view(views.shape), views.tensor_state, hyper, step=step)
        if views.out16 is not None:
            views.out16.copy_(views.master)


ADAFACTOR = AdafactorChunks()
"""Adafactor's chunk optimizer (its states are fp32, in host memory)."""


class CPUAdafactor(CPUOptimizer[AdafactorHyperParams]):
    """``torch.optim.Adafactor`` for CPU fp32 tensors and offloaded parameters.

    Same signature, defaults, param-group keys and per-parameter state
    (``step``; ``row_var`` and ``col_var`` for parameters of two or more
    dimensions, ``variance`` for vectors) as ``torch.optim.Adafactor``;
    results match its single-tensor path.

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer.
        lr: learning rate, an upper bound on the relative step size (``min(lr,
            1/sqrt(step))``).
        beta2_decay: decay exponent of the second moment's rate, ``step ** beta2_decay``.
        eps: ``(eps1, eps2)``: the floor of the second moment (``None``: fp32's
            machine epsilon) and of the parameter's RMS that scales the step.
        d: clipping threshold of the update's RMS.
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay``.
        foreach: accepted and ignored (the update runs per tensor).
        maximize: follow the gradient up instead of down.

    On an offloaded model the step reads each tensor whole from its chunk (an
    oversize tensor staged in spans is gathered for it), so data parallelism,
    where a tensor may straddle two ranks' shards, is not supported yet:
    constructing it over a sharded model raises a ``ConfigError``.
    """

    hyper_params = AdafactorHyperParams
    chunk_optimizer = ADAFACTOR

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps": tuple(eps),
            "d": d,
            "weight_decay": weight_decay,
            "foreach": foreach,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _step_dense(self, group: dict[str, Any]) -> None:
        """Step the plain CPU tensors of one group, each on its own states (what
        ``state_dict`` shows, shaped as torch's)."""
        todo = self._dense_todo(group)
        if not todo:
            return
        hyper = self.hyper_of(group)
        for p, _grad in todo:  # NOTE: all checked before any tensor changes
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=step_dtype())
            for name, shape in factored_shapes(tuple(p.shape)).items():
                if state.get(name) is None:
                    state[name] = torch.zeros(shape, dtype=p.dtype)
                check_state_shape(name, p, state[name], shape)
        for p, grad in todo:
            state = self.state[p]
            state["step"] += 1
            adafactor_update(p, grad, state, hyper, step=int(state["step"].item()))
