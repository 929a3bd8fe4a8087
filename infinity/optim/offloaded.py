"""The optimizer layer's side of an offloaded model: which engine holds a
parameter, what it needs of that engine, and what the front-ends
(:mod:`infinity.optim.front_end`) do with such parameters.

Which engine: one weak registry, not attributes on models or parameters.
``infinity.offload`` registers a model and each of its parameters here; the
optimizer, the checkpoint and the public ``infinity.engine_of`` look them up.
See NOTE [weak registry]: both maps are weak on both sides. Keys are weak (a
dropped model or parameter leaves by itself) and compared by identity
(``torch.utils.weak.WeakIdKeyDictionary``: a tensor's ``==`` is elementwise, so
:class:`weakref.WeakKeyDictionary` would compare parameter values). Values hold
the engine through a weak reference: the registry never keeps an engine, hence
its threads and swap file, alive. The model owns its engine through the
forward hooks the engine installed on it (their closures hold the engine), so
the engine lives exactly as long as the model.

What of the engine: :class:`ChunkStepper`, a protocol, so that this layer does
not depend on the runtime that implements it.

What the front-ends do: a registered parameter has no ``.grad`` tensor and no
values in RAM. Its step runs chunk by chunk inside the engine, its ``.grad``
sentinel answers gradient clipping from the chunks, and fp16 loss scaling is
the engine's, with the policy of :class:`LossScaler` (here, as every engine
and the front-ends read it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from infinity.optim.chunk_optimizer import ChunkOptimizer

__all__ = ["ChunkStepper", "LossScaler", "MomentState", "engine_of_param"]


# A tensor's step count and its optimizer state by slot name (Adam: exp_avg, exp_avg_sq;
# a slot left out is zeros).
MomentState = tuple[int, dict[str, torch.Tensor]]


@dataclass
class LossScaler:
    """The scale fp16 losses are multiplied by before backward.

    On a step whose gradients hold inf/NaN the step is skipped and the scale
    halves (not below ``min_scale``); after ``window`` good steps in a row it
    doubles. The same policy as ``torch.amp.GradScaler``.
    """

    scale: float
    window: int
    min_scale: float
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        """Account for one step; ``found_inf`` means it was skipped."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers, for checkpoints."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore from :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


class ChunkStepper(Protocol):
    """What the optimizer needs of an offloaded model's engine.

    Declared here so the optimizer layer depends on this protocol, not on the
    runtime that implements it (:class:`infinity.runtime.engine.OffloadEngine`).
    """

    scaler: LossScaler | None  # fp16 only

    @property
    def chunk_optimizer(self) -> ChunkOptimizer[Any]:
        """The per-element optimizer its optimizer units are laid out for."""
        ...

    def use_optimizer(
        self, chunk_optimizer: ChunkOptimizer[Any], owner: str, ref: Callable[[], Any]
    ) -> None:
        """Lay the optimizer units out for ``chunk_optimizer`` (of the optimizer
        ``owner``, held weakly by ``ref``: the one whose groups early steps use);
        raises naming both if the model already holds another optimizer's state."""

    def note_loss_scaled(self) -> None:
        """The loss of the coming backward was multiplied by the fp16 loss scale."""

    def optimizer_step(self, hyper_by_index: Mapping[int, object], stepper: object) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it
        (``stepper``: the optimizer stepping)."""
        ...

    def read_moments(self, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
        """Copies of the moments of the tensors ``indices`` stepped at least once."""
        ...

    def check_moments(self, values: dict[int, MomentState | None]) -> None:
        """Raise (changing nothing) if a state does not fit its tensor."""

    def write_moments(self, values: dict[int, MomentState | None]) -> None:
        """Set moments and step counts by tensor index (``None``: never stepped)."""


class ParamSlot(NamedTuple):
    """Where an offloaded parameter lives: its engine and its tensor index there."""

    engine: ChunkStepper
    tensor_index: int


_models = WeakIdKeyDictionary()  # nn.Module -> weakref.ref[ChunkStepper]
_params = WeakIdKeyDictionary()  # Parameter -> (weakref.ref[ChunkStepper], tensor index)


def register(
    model: nn.Module, engine: ChunkStepper, params: Iterable[tuple[torch.Tensor, int]]
) -> None:
    """Record that ``engine`` holds ``model`` and each ``(parameter, tensor index)``."""
    global _foreign_optimizers
    ref = weakref.ref(engine)
    _models[model] = ref
    for param, index in params:
        _params[param] = (ref, index)
    if _foreign_optimizers is None:
        _foreign_optimizers = register_optimizer_step_pre_hook(_refuse_foreign_optimizer)


# NOTE: torch's own optimizers (AdamW from a user's loop or a Trainer built without
# ours) wrote into the placeholders at their first step and failed in torch ("more
# than one element of the written-to tensor refers to a single memory location").
# A global step pre-hook, registered at the first offload, names the fix instead. Only
# offloaded parameters with a gradient are refused: torch skips the others, so a torch
# optimizer over a frozen offloaded base and ordinary adapters (peft) steps as before.
# An optimizer's parameters are looked up once (again when their number changes).
_foreign_optimizers: RemovableHandle | None = None
_offloaded_in = weakref.WeakKeyDictionary[Optimizer, tuple[int, list[torch.Tensor]]]()
_OURS = {
    "Adam": "CPUAdam(adamw=False)",
    "AdamW": "CPUAdam",
    "SGD": "CPUSGD",
    "Adafactor": "CPUAdafactor",
}


def _refuse_foreign_optimizer(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    inner: Any = optimizer
    for _ in range(4):  # wrappers that delegate (Accelerate's) hold ours as `.optimizer`
        if isinstance(getattr(type(inner), "chunk_optimizer", None), ChunkOptimizer):
            return
        inner = getattr(inner, "optimizer", None)
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    known = _offloaded_in.get(optimizer)
    if known is None or known[0] != count:
        params = (p for group in optimizer.param_groups for p in group["params"])
        known = (count, [p for p in params if p in _params])
        _offloaded_in[optimizer] = known
    if not any(p.grad is not None for p in known[1]):
        return
    name = type(optimizer).__name__
    ours = _OURS.get(name, "CPUAdam, CPUAdafactor, CPULion or CPUSGD")
    raise TypeError(
        f"{type(optimizer).__module__}.{name} cannot step an offloaded model's parameters: "
        "their values live in infinity's chunks (the parameters are placeholders), and "
        "only infinity's optimizers update them there. Use infinity.optim." + ours + " with "
        "the same hyper-parameters (for transformers.Trainer, pass it as "
        "optimizers=(optimizer, scheduler), or use infinity.integrations.hf_trainer.Trainer, "
        "which makes CPUAdam from the TrainingArguments)"
    )


def model_engine(model: nn.Module) -> ChunkStepper | None:
    """The engine holding ``model``, or ``None`` if it was not offloaded."""
    ref = _models.get(model)
    return ref() if ref is not None else None


def param_slot(param: torch.Tensor) -> ParamSlot | None:
    """The engine and tensor index of ``param``, or ``None`` for an ordinary tensor;
    raises ``ReferenceError`` if ``param``'s offloaded model was dropped."""
    found = _params.get(param)
    if found is None:
        return None
    engine = found[0]()
    if engine is None:
        # NOTE [the model owns its engine]: the model was dropped and its chunks freed,
        # while an optimizer (or other holder) kept its parameters.
        raise ReferenceError(
            "this parameter belongs to an offloaded model that was dropped: its values "
            "and optimizer states were freed with it. Keep a reference to the model (the "
            "module infinity.offload returned) for as long as its optimizer is used"
        )
    return ParamSlot(engine, found[1])


def engine_of_param(param: torch.Tensor) -> ChunkStepper | None:
    """The engine holding ``param``, or ``None`` for an ordinary tensor."""
    slot = param_slot(param)
    return slot.engine if slot is not None else None


def engines(param_groups: Iterable[dict[str, Any]]) -> list[ChunkStepper]:
    """The distinct engines whose parameters the optimizer holds."""
    found: dict[int, ChunkStepper] = {}
    for group in param_groups:
        for p in group["params"]:
            engine = engine_of_param(p)
            if engine is not None:
                found[id(engine)] = engine
    return list(found.values())


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
    the state dict has none for it, as a tensor never stepped), after checking them
    all (the front-end writes them with ``engine.write_moments`` once torch's own
    load has passed)."""
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


def _moment_state(value: dict[str, Any], slots: tuple[str, ...], key: object) -> MomentState:
    """One parameter's entry of a torch state dict as ``(step, {slot: tensor})``.

    ``torch.optim.SGD`` keeps no ``step`` (its momentum buffer exists from
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
    # The other tensors are per-tensor states (Adafactor's factors), which the
    # engine checks by the parameter's shape.
    return step, {
        name: tensor
        for name, tensor in value.items()
        if name != "step" and isinstance(tensor, torch.Tensor)
    }
