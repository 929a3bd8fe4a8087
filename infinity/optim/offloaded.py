"""What :class:`~infinity.optim.CPUAdam` does with parameters of offloaded models.

A parameter belongs to an offloaded model when ``infinity.offload`` registered
it with its engine (:mod:`infinity.optim.registry`). Such parameters have no
``.grad`` tensor and no values in RAM: their step runs chunk by chunk inside
the engine, their ``.grad`` sentinels answer gradient clipping from the chunks,
and fp16 loss scaling is the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from infinity.optim.hyper import AdamHyperParams
from infinity.optim.registry import engine_of_param, param_slot
from infinity.optim.stepper import ChunkStepper, MomentState

__all__ = ["ChunkStepper", "MomentState", "engine_of_param"]


def offloaded_hyper(
    param_groups: Iterable[dict[str, Any]],
) -> dict[ChunkStepper, dict[int, AdamHyperParams]]:
    """For each engine, the hyper-parameters of every offloaded parameter (by tensor index)."""
    out: dict[ChunkStepper, dict[int, AdamHyperParams]] = {}
    for group in param_groups:
        hyper = None
        for p in group["params"]:
            slot = param_slot(p)
            if slot is None:
                continue
            if hyper is None:
                hyper = AdamHyperParams.from_group(group)
            out.setdefault(slot.engine, {})[slot.tensor_index] = hyper
    return out


def engines(param_groups: Iterable[dict[str, Any]]) -> list[ChunkStepper]:
    """The distinct engines whose parameters the optimizer holds."""
    found: dict[int, ChunkStepper] = {}
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
            engine.note_loss_scaled()
            scales.add(engine.scaler.scale)
    if len(scales) > 1:
        raise RuntimeError("the optimizer holds fp16 models with different loss scales")
    return loss * scales.pop() if scales else loss


def add_offloaded_state(param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Add the moments of offloaded parameters to ``state_dict`` (torch's format,
    keyed by the parameter's index in ``state_dict["param_groups"]``)."""
    index_of: dict[ChunkStepper, dict[int, int]] = {}
    for group, saved in zip(param_groups, state_dict["param_groups"], strict=True):
        for p, key in zip(group["params"], saved["params"], strict=True):
            slot = param_slot(p)
            if slot is not None:
                index_of.setdefault(slot.engine, {})[slot.tensor_index] = key
    for engine, keys in index_of.items():
        for index, (step, states) in engine.read_moments(keys):
            state_dict["state"][keys[index]] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                **states,
            }


def take_offloaded_state(
    param_groups: list[dict[str, Any]], state_dict: dict[str, Any]
) -> dict[ChunkStepper, dict[int, MomentState | None]]:
    """Remove the states of offloaded parameters from ``state_dict`` (a copy is
    changed); returns, per engine, the moments to write by tensor index (``None``:
    the state dict has none for it, as a tensor never stepped)."""
    state = dict(state_dict["state"])
    state_dict["state"] = state
    taken: dict[ChunkStepper, dict[int, MomentState | None]] = {}
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        return taken  # torch's load_state_dict names the mismatch
    for group, saved in zip(param_groups, saved_groups, strict=True):
        if len(group["params"]) != len(saved["params"]):
            return {}
        for p, key in zip(group["params"], saved["params"], strict=True):
            slot = param_slot(p)
            if slot is None:
                continue
            value = state.pop(key, None)
            if value is not None:
                slots = slot.engine.chunk_optimizer.state_slots
                value = (int(value["step"]), {name: value[name] for name in slots})
            taken.setdefault(slot.engine, {})[slot.tensor_index] = value
    for engine, values in taken.items():
        engine.check_moments(values)
    return taken


def put_offloaded_state(taken: dict[ChunkStepper, dict[int, MomentState | None]]) -> None:
    """Write what :func:`take_offloaded_state` took into the engines' chunks."""
    for engine, values in taken.items():
        engine.write_moments(values)
