"""Adam hyper-parameters of one param group, validated once per step (and
:func:`hyper_value`, the check every optimizer's hyper-parameters use)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

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
