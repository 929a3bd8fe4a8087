"""What :class:`~infinity.optim.CPUAdam` does with parameters of offloaded models.

A parameter belongs to an offloaded model when ``infinity.offload`` tagged it
with its engine. Such parameters have no ``.grad`` tensor and no values in
RAM: their step runs chunk by chunk inside the engine, their ``.grad`` sentinels
answer gradient clipping from the chunks, and fp16 loss scaling is the engine's.
"""

from __future__ import annotations

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
