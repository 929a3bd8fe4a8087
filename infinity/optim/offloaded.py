"""What :class:`~infinity.optim.CPUAdam` does with parameters of offloaded models.

A parameter belongs to an offloaded model when ``infinity.offload`` tagged it
with its engine. Such parameters have no ``.grad`` tensor and no values in
RAM: their step runs chunk by chunk inside the engine, their gradient norm is
computed from the gradient chunks, and fp16 loss scaling is the engine's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from infinity.optim.hyper import AdamHyperParams


def engine_of_param(param: torch.Tensor) -> Any | None:
    """The engine holding ``param``, or ``None`` for an ordinary tensor."""
    ref = getattr(param, "_infinity_engine", None)
    return ref() if ref is not None else None


def offloaded_hyper(
    param_groups: Iterable[dict[str, Any]],
) -> dict[Any, dict[int, AdamHyperParams]]:
    """For each engine, the hyper-parameters of every offloaded parameter (by tensor index)."""
    out: dict[Any, dict[int, AdamHyperParams]] = {}
    for group in param_groups:
        hyper = None
        for p in group["params"]:
            engine = engine_of_param(p)
            if engine is None:
                continue
            if hyper is None:
                hyper = AdamHyperParams.from_group(group)
            out.setdefault(engine, {})[p._infinity_index] = hyper
    return out


def engines(param_groups: Iterable[dict[str, Any]]) -> list[Any]:
    """The distinct engines whose parameters the optimizer holds."""
    found: dict[int, Any] = {}
    for group in param_groups:
        for p in group["params"]:
            engine = engine_of_param(p)
            if engine is not None:
                found[id(engine)] = engine
    return list(found.values())


def scale_loss(param_groups: Iterable[dict[str, Any]], loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times the fp16 loss scale (unchanged for bf16/fp32 models)."""
    scales = set()
    for engine in engines(param_groups):
        if engine.scaler is not None:
            engine.loss_scaled = True
            scales.add(engine.scaler.scale)
    if len(scales) > 1:
        raise RuntimeError("the optimizer holds fp16 models with different loss scales")
    return loss * scales.pop() if scales else loss


def clip_grad_norm_(
    param_groups: list[dict[str, Any]],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> tuple[torch.Tensor, dict[Any, float]]:
    """Total gradient norm over every parameter, as ``torch.nn.utils.clip_grad_norm_``.

    Plain gradients are scaled in place; for offloaded ones the clip coefficient
    is returned per engine and folded into the next step's kernel (no extra pass
    over the gradients). Returns ``(total_norm, coefficient per engine)``.
    """
    from infinity.runtime.state_access import grad_norms

    norm_type = float(norm_type)
    norms: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    for group in param_groups:
        for p in group["params"]:
            if engine_of_param(p) is None and p.grad is not None:
                plain.append(p.grad)
    for g in plain:
        norms.append(torch.linalg.vector_norm(g.detach(), norm_type).float())
    per_engine = offloaded_hyper(param_groups)
    for engine in per_engine:
        engine.check_not_stepped_early("clip_grad_norm_")
    for engine, hyper in per_engine.items():
        norms.extend(grad_norms(engine, hyper.keys(), norm_type))
    if not norms:
        return torch.tensor(0.0), {}
    total = torch.linalg.vector_norm(torch.stack([n.reshape(()) for n in norms]), norm_type)
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} for gradients is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in plain:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total, {engine: float(coef) for engine in per_engine}
