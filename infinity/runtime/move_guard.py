"""``model.to(...)`` on an offloaded model: a no-op where it already is, a clear error elsewhere.

Training loops move the model to "their" device before training
(``transformers.Trainer`` calls ``model.to(args.device)``, under ``torchrun``
with ``device(type='cpu', index=0)``). For an offloaded model that device is
the engine's, but ``Tensor.to`` treats ``cpu:0`` and ``cpu`` as different and
would copy every parameter placeholder into a full-size tensor (the whole
model in RAM) that the engine must then refuse. The guard answers a move to
the engine's own device and dtype with the model unchanged, and any other
move with an error that says to choose the device and dtype in ``Config``.

NOTE: the guard is an attribute of this one model instance (``model.to``),
installed by ``offload`` and removed with the other hooks; ``nn.Module`` and
every library stay unpatched.
"""

from __future__ import annotations

import weakref
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
    """Installed as ``model.to`` of an offloaded model; :meth:`remove` restores the method."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self._model = weakref.ref(model)
        self._device = device
        self._dtype = dtype
        model.__dict__["to"] = self

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
