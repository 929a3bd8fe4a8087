"""What the optimizer layer needs of an offloaded model's engine: the chunk-stepper protocol."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.hyper import AdamHyperParams
from infinity.optim.loss_scale import LossScaler

# A tensor's step count and its optimizer state by slot name (Adam: exp_avg, exp_avg_sq).
MomentState = tuple[int, dict[str, torch.Tensor]]


class ChunkStepper(Protocol):
    """What the optimizer needs of an offloaded model's engine.

    Declared here so the optimizer layer depends on this protocol, not on the
    runtime that implements it (:class:`infinity.runtime.engine.OffloadEngine`).
    """

    scaler: LossScaler | None  # fp16 only
    optimizer: Callable[[], Any] | None  # weak reference to the optimizer holding the model
    chunk_optimizer: ChunkOptimizer[Any]  # the per-element optimizer its chunks are laid out for

    def note_loss_scaled(self) -> None:
        """The loss of the coming backward was multiplied by the fp16 loss scale."""

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
