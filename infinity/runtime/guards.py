"""Guards on an offloaded model against what torch does to a whole model.

An offloaded model's parameters are placeholders (one NaN cell, expanded) and its
values live in the engine's chunks, so torch's whole-model operations would copy
placeholders, not weights: ``model.to`` and ``model._apply`` (under ``half()``,
``float()``, ``cuda()``, ...) would turn each into a full-size tensor (the whole
model in RAM or device memory), ``copy.deepcopy`` would make a model of NaN that
drives this one's engine, and ``DistributedDataParallel`` would broadcast into them.

Training loops move the model to "their" device before training
(``transformers.Trainer`` calls ``model.to(args.device)``, under ``torchrun``
with ``device(type='cpu', index=0)``). For an offloaded model that device is the
engine's, but ``Tensor.to`` treats ``cpu:0`` and ``cpu`` as different. So a move
to the engine's own device and dtype answers the model unchanged; any other move
or conversion is an error that says to choose the device and dtype in ``Config``.

Each guard is an attribute of this one model instance (``model.to``,
``model._apply``, ``model.__deepcopy__``, the names DDP reads first), installed by
``offload`` with the hooks and removed with them; ``nn.Module`` and every library
stay unpatched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are one device (``cpu`` is ``cpu:0``; ``cuda`` is the current GPU)."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current
        )
    return (a.index or 0) == (b.index or 0)


class MoveGuard:
    """Installed as ``model.to`` and ``model._apply`` of an offloaded model; :meth:`remove`
    restores the methods.

    NOTE: ``model.half()``, ``.float()``, ``.cuda()`` and the like run ``_apply``, which
    converted every placeholder (one NaN cell, expanded) into a full tensor: a whole copy
    of the model in RAM or device memory before the next forward refused it, so a model
    beyond RAM was killed instead of told. ``_apply`` first runs its function on a
    one-element tensor like the placeholders; a result other than that tensor itself (a
    conversion or a move) is refused, a no-op (``share_memory()``, a move to where the
    model is) goes on.
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self._model = weakref.ref(model)
        self._device = device
        self._dtype = dtype
        model.__dict__["to"] = self
        model.__dict__["_apply"] = self._apply

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        model = self._model()
        assert model is not None, "the guard lives in its model's __dict__"
        probe = torch.empty(1, dtype=self._dtype, device=self._device)
        if fn(probe) is not probe:
            raise ValueError(
                "converting or moving an offloaded model (model.half(), .float(), .cuda(), "
                "...): its parameters live in infinity's chunks on "
                f"{self._device} as {str(self._dtype).replace('torch.', '')}, and the "
                "conversion would make a full copy of every one. Choose the device and dtype "
                "with infinity.Config(device=..., dtype=...) before offload()"
            )
        return nn.Module._apply(model, fn, recurse)

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module:
        model = self._model()
        assert model is not None, "the guard lives in its model's __dict__"
        device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        moves = device is not None and not same_device(device, self._device)
        converts = dtype is not None and dtype != self._dtype
        if moves or converts:
            wanted = ", ".join(str(x) for x in (device, dtype) if x is not None)
            raise ValueError(
                f"model.to({wanted}) on an offloaded model: its parameters live in infinity's "
                f"chunks on {self._device} as {str(self._dtype).replace('torch.', '')}. Choose "
                "the device and dtype with infinity.Config(device=..., dtype=...) before "
                "offload(), or on a GPU call torch.cuda.set_device(local_rank) first"
            )
        return model  # already there: parameters and buffers stay as they are

    def remove(self) -> None:
        """Give the model its ordinary ``to`` back."""
        model = self._model()
        if model is not None and model.__dict__.get("to") is self:
            del model.__dict__["to"]
            del model.__dict__["_apply"]


class CopyGuard:
    """Refuses the two copies torch makes of a whole model that an offloaded model cannot
    take: ``copy.deepcopy`` (installed as ``model.__deepcopy__``) and the broadcast of
    ``DistributedDataParallel`` (installed as the names DDP is told to skip, which it reads
    first). Each raises, saying what to do instead.

    NOTE: a deep copy would hold the parameters' placeholders (NaN), not the weights, and
    its hooks would drive this model's engine: an EMA (``AveragedModel``) averaged NaN, and
    a frozen reference model copied from it (TRL's ``create_reference_model``) failed in
    its first forward with a KeyError. DDP's constructor broadcast rank 0's values into the
    placeholders and failed in torch ("more than one element of the written-to tensor
    refers to a single memory location"); an offloaded model is data parallel already.
    ``copy.deepcopy`` looks ``__deepcopy__`` up on the instance and DDP reads
    ``module._ddp_params_and_buffers_to_ignore``, so both guards are this model's alone,
    like :class:`MoveGuard` (the engine's own shape-only copy, ``activations/estimate.py``,
    sets the first aside)."""

    _DDP_SKIP = "_ddp_params_and_buffers_to_ignore"
    _PEFT_MERGES = ("merge_and_unload", "merge_adapter")

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        model.__dict__["__deepcopy__"] = self
        model.__dict__[self._DDP_SKIP] = _RefuseDataParallel()
        if type(model).__module__.partition(".")[0] == "peft":
            for name in self._PEFT_MERGES:
                model.__dict__[name] = _RefusePeftMerge(name)

    def __call__(self, memo: dict[int, Any]) -> nn.Module:
        raise TypeError(
            "copy.deepcopy of an offloaded model: its parameters are placeholders and its "
            "values live in infinity's chunks, so a copy would hold no weights. For a second "
            "model with the same weights (an EMA, a frozen reference model), build the model "
            "again, offload it (infinity.offload) if it should not sit in memory whole, and "
            "load the weights with new_model.load_state_dict(model.state_dict()), or save "
            "them with infinity.save_pretrained and load them with infinity.load_pretrained"
        )

    def remove(self) -> None:
        """Let ``copy.deepcopy`` and DDP take the model again."""
        model = self._model()
        if model is None:
            return
        if model.__dict__.get("__deepcopy__") is self:
            del model.__dict__["__deepcopy__"]
        if isinstance(model.__dict__.get(self._DDP_SKIP), _RefuseDataParallel):
            del model.__dict__[self._DDP_SKIP]
        for name in self._PEFT_MERGES:
            if isinstance(model.__dict__.get(name), _RefusePeftMerge):
                del model.__dict__[name]


class _RefusePeftMerge:
    """A ``peft`` model's ``merge_and_unload`` / ``merge_adapter`` on an offloaded model.

    NOTE: peft adds each adapter's product into the base weight in place, and an
    offloaded weight is a placeholder: the add failed inside torch ("more than one
    element of the written-to tensor refers to a single memory location"), or, with
    ``safe_merge``, replaced the weight by a full tensor of NaN.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"peft's {self._name}() on an offloaded model: peft adds the adapters into the "
            "base weights in place, and an offloaded model's weights live in infinity's "
            "chunks (nothing was changed). infinity.save_pretrained(model, path) writes the "
            "merged model, as merge_and_unload().save_pretrained(path) would; "
            "model.save_pretrained(path) writes the adapter alone"
        )


class _RefuseDataParallel:
    """What ``DistributedDataParallel(model)`` reads first of an offloaded model: reading
    it raises (see :class:`CopyGuard`)."""

    def __iter__(self) -> Iterator[str]:
        raise TypeError(
            "DistributedDataParallel over an offloaded model: infinity is data parallel "
            "already (under an initialised process group every chunk is sharded over the "
            "ranks and the engine averages the gradients, as DDP does). Train the offloaded "
            "model itself, without the DDP wrapper: launch with torchrun and call "
            "infinity.offload(model, config) on every rank (docs/design/data-parallel.md)"
        )
