"""What :class:`~infinity.optim.CPUAdam` does with parameters of offloaded models.

A parameter belongs to an offloaded model when ``infinity.offload`` tagged it
with its engine. Such parameters have no ``.grad`` tensor and no values in
RAM: their step runs chunk by chunk inside the engine, their ``.grad`` sentinels
answer gradient clipping from the chunks, and fp16 loss scaling is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from infinity.optim.hyper import AdamHyperParams
from infinity.optim.loss_scale import LossScaler

MomentState = tuple[int, torch.Tensor, torch.Tensor]  # step, exp_avg, exp_avg_sq


class ChunkStepper(Protocol):
    """What the optimizer needs of an offloaded model's engine.

    Declared here so the optimizer layer depends on this protocol, not on the
    runtime that implements it (:class:`infinity.runtime.engine.OffloadEngine`).
    """

    scaler: LossScaler | None  # fp16 only
    loss_scaled: bool  # the loss of this backward was multiplied by the scale
    optimizer: Callable[[], Any] | None  # weak reference to the optimizer holding the model

    def optimizer_step(self, hyper_by_index: dict[int, AdamHyperParams]) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it."""
        ...

    def read_moments(self, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
        """Copies of the moments of the tensors ``indices`` stepped at least once."""
        ...

    def check_moments(self, values: dict[int, MomentState | None]) -> None:
        """Raise (changing nothing) if a state does not fit its tensor."""

    def write_moments(self, values: dict[int, MomentState | None]) -> None:
        """Set moments and step counts by tensor index (``None``: never stepped)."""


def engine_of_param(param: torch.Tensor) -> ChunkStepper | None:
    """The engine holding ``param``, or ``None`` for an ordinary tensor."""
    ref = getattr(param, "_infinity_engine", None)
    return ref() if ref is not None else None


def offloaded_hyper(
    param_groups: Iterable[dict[str, Any]],
) -> dict[ChunkStepper, dict[int, AdamHyperParams]]:
    """For each engine, the hyper-parameters of every offloaded parameter (by tensor index)."""
    out: dict[ChunkStepper, dict[int, AdamHyperParams]] = {}
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
            engine.loss_scaled = True
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
            engine = engine_of_param(p)
            if engine is not None:
                index_of.setdefault(engine, {})[p._infinity_index] = key
    for engine, keys in index_of.items():
        for index, (step, exp_avg, exp_avg_sq) in engine.read_moments(keys):
            state_dict["state"][keys[index]] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
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
            engine = engine_of_param(p)
            if engine is None:
                continue
            value = state.pop(key, None)
            if value is not None:
                value = (int(value["step"]), value["exp_avg"], value["exp_avg_sq"])
            taken.setdefault(engine, {})[p._infinity_index] = value
    for engine, values in taken.items():
        engine.check_moments(values)
    return taken


def put_offloaded_state(taken: dict[ChunkStepper, dict[int, MomentState | None]]) -> None:
    """Write what :func:`take_offloaded_state` took into the engines' chunks."""
    for engine, values in taken.items():
        engine.write_moments(values)
