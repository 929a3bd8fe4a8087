"""Optimizer parameter groups in a checkpoint: saved as JSON, checked before they are restored.

A group is saved as its JSON-able hyper-parameters and the names of its
parameters. On load every saved value must have the type of the value it
replaces (a number for ``lr``, a pair of numbers for ``betas``, ...) and, for
an infinity optimizer (:class:`~infinity.optim.CPUOptimizer`), the range its constructor accepts, so
``lr: "fast"`` is refused at load rather than failing at the next step.
"""

from __future__ import annotations

from typing import Any

import torch

from infinity.checkpoint.format import META, CheckpointError
from infinity.checkpoint.schema import SavedGroup, finite_number
from infinity.optim.front_end import CPUOptimizer
from infinity.optim.offloaded import param_slot
from infinity.runtime.engine import OffloadEngine

_ABSENT = object()


def _param_names(engine: OffloadEngine, group: dict[str, Any], error: type[Exception]) -> list[str]:
    """The names of a param group's parameters; ``error`` if one is not in this model."""
    names = []
    for p in group["params"]:
        slot = param_slot(p)
        if slot is None or slot.engine is not engine:
            raise error("the optimizer holds parameters that are not in this model")
        names.append(engine.registry.entries[slot.tensor_index].name)
    return names


def optimizer_groups(
    engine: OffloadEngine, optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """Each group's JSON-able hyper-parameters and the names of its parameters."""
    groups = []
    for group in optimizer.param_groups:
        names = _param_names(engine, group, ValueError)
        hyper = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
        }
        groups.append({"hyper": hyper, "params": names})
    return groups


def _value(what: str, saved: Any, current: Any) -> Any:
    """``saved`` converted to the kind of ``current``; CheckpointError if it is not one."""
    if isinstance(current, bool):
        ok = type(saved) is bool
    elif isinstance(current, (int, float)) or torch.is_tensor(current):
        ok = finite_number(saved)
    elif isinstance(current, tuple):
        # An item may be null (Adafactor's eps=(None, 1e-3)); the optimizer's
        # own check (hyper_of, below) says whether it may be.
        ok = (
            isinstance(saved, list)
            and len(saved) == len(current)
            and all(x is None or finite_number(x) for x in saved)
        )
        saved = tuple(saved) if ok else saved
    elif isinstance(current, str):
        ok = isinstance(saved, str)
    elif current is None:
        ok = saved is None or type(saved) is bool
    else:  # a key the group lacks (e.g. a scheduler's initial_lr): plain JSON only
        ok = (
            saved is None
            or isinstance(saved, (bool, str))
            or finite_number(saved)
            or (isinstance(saved, list) and all(finite_number(x) for x in saved))
        )
        saved = tuple(saved) if isinstance(saved, list) else saved
    if not ok:
        kind = "absent" if current is _ABSENT else f"{type(current).__name__} {current!r}"
        raise CheckpointError(
            f"{META} is invalid: optimizer {what} is {saved!r}; the optimizer's value is {kind}"
        )
    return saved


def hyper_updates(
    engine: OffloadEngine, optimizer: torch.optim.Optimizer, saved: list[SavedGroup]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(group, new values)`` for each of ``optimizer``'s groups, all checked; nothing is set."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved)} optimizer parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    updates = []
    for g, (entry, group) in enumerate(zip(saved, optimizer.param_groups, strict=True)):
        names = _param_names(engine, group, CheckpointError)
        if names != entry.params:
            raise CheckpointError(
                "optimizer parameter groups hold different parameters than in the checkpoint"
            )
        values = {
            key: _value(f"group {g} {key!r}", value, group.get(key, _ABSENT))
            for key, value in entry.hyper.items()
            if key != "params"
        }
        if isinstance(optimizer, CPUOptimizer):
            try:
                optimizer.hyper_of({**group, **values})
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{META}: optimizer group {g}: {exc}") from None
        updates.append((group, values))
    return updates
