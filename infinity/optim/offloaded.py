"""What the optimizer front-ends (:mod:`infinity.optim.front_end`) do with parameters
of offloaded models.

A parameter belongs to an offloaded model when ``infinity.offload`` registered
it with its engine (:mod:`infinity.optim.registry`). Such parameters have no
``.grad`` tensor and no values in RAM: their step runs chunk by chunk inside
the engine, their ``.grad`` sentinels answer gradient clipping from the chunks,
and fp16 loss scaling is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from infinity.optim.registry import engine_of_param, param_slot
from infinity.optim.stepper import ChunkStepper, MomentState

__all__ = ["ChunkStepper", "MomentState", "engine_of_param"]

H = TypeVar("H")


def offloaded_hyper(
    param_groups: Iterable[dict[str, Any]], hyper_of: Callable[[dict[str, Any]], H]
) -> dict[ChunkStepper, dict[int, H]]:
    """For each engine, the hyper-parameters (``hyper_of(group)``, validated once per
    group) of every offloaded parameter, by tensor index."""
    out: dict[ChunkStepper, dict[int, H]] = {}
    for group in param_groups:
        hyper = None
        for p in group["params"]:
            slot = param_slot(p)
            if slot is None:
                continue
            if hyper is None:
                hyper = hyper_of(group)
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
                value = _moment_state(value, slot.engine.chunk_optimizer.state_slots, key)
            taken.setdefault(slot.engine, {})[slot.tensor_index] = value
    for engine, values in taken.items():
        engine.check_moments(values)
    return taken


def put_offloaded_state(taken: dict[ChunkStepper, dict[int, MomentState | None]]) -> None:
    """Write what :func:`take_offloaded_state` took into the engines' chunks."""
    for engine, values in taken.items():
        engine.write_moments(values)


def _moment_state(value: dict[str, Any], slots: tuple[str, ...], key: object) -> MomentState:
    """One parameter's entry of a torch state dict as ``(step, {slot: tensor})``.

    NOTE: ``torch.optim.SGD`` keeps no ``step`` (its momentum buffer exists from
    the first step on: a step count of 1 means the same), and ``None`` for the
    buffer when ``momentum=0``: a missing value is zeros, as a fresh state.
    """
    missing = [name for name in slots if name not in value]
    if missing:
        raise ValueError(
            f"optimizer state of parameter {key} has no {missing[0]!r} (it has "
            f"{sorted(value)}): the state dict is from another optimizer"
        )
    step = int(value["step"]) if "step" in value else 1
    # NOTE: the other tensors are per-tensor states (Adafactor's factors), which the
    # engine checks by the parameter's shape.
    return step, {
        name: tensor
        for name, tensor in value.items()
        if name != "step" and isinstance(tensor, torch.Tensor)
    }
