"""Which engine holds a model or a parameter: one weak registry, not attributes on them.

``infinity.offload`` registers a model and each of its parameters here; the
optimizer, the checkpoint and the public ``infinity.engine_of`` look them up.

See NOTE [weak registry]: both maps are weak on both sides. Keys are weak (a dropped
model or parameter leaves by itself) and compared by identity
(``torch.utils.weak.WeakIdKeyDictionary``: a tensor's ``==`` is elementwise, so
:class:`weakref.WeakKeyDictionary` would compare parameter values). Values hold
the engine through a weak reference: the registry never keeps an engine, hence
its threads and swap file, alive. The model owns its engine through the
forward hooks the engine installed on it (their closures hold the engine), so
the engine lives exactly as long as the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from infinity.optim.stepper import ChunkStepper


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
    ref = weakref.ref(engine)
    _models[model] = ref
    for param, index in params:
        _params[param] = (ref, index)


def model_engine(model: nn.Module) -> ChunkStepper | None:
    """The engine holding ``model``, or ``None`` if it was not offloaded."""
    ref = _models.get(model)
    return ref() if ref is not None else None


def param_slot(param: torch.Tensor) -> ParamSlot | None:
    """The engine and tensor index of ``param``, or ``None`` for an ordinary tensor."""
    found = _params.get(param)
    if found is None:
        return None
    engine = found[0]()
    return ParamSlot(engine, found[1]) if engine is not None else None


def engine_of_param(param: torch.Tensor) -> ChunkStepper | None:
    """The engine holding ``param``, or ``None`` for an ordinary tensor."""
    slot = param_slot(param)
    return slot.engine if slot is not None else None
