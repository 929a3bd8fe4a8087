"""What the optimizer layer needs of an offloaded model's engine: the chunk-stepper protocol."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from infinity.optim.chunk_optimizer import ChunkOptimizer
from infinity.optim.loss_scale import LossScaler

# A tensor's step count and its optimizer state by slot name (Adam: exp_avg, exp_avg_sq;
# a slot left out is zeros).
MomentState = tuple[int, dict[str, torch.Tensor]]


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

    def optimizer_step(self, hyper_by_index: Mapping[int, object]) -> bool:
        """Update every parameter that has a gradient; False if fp16 overflow skipped it."""
        ...

    def read_moments(self, indices: Iterable[int]) -> Iterator[tuple[int, MomentState]]:
        """Copies of the moments of the tensors ``indices`` stepped at least once."""
        ...

    def check_moments(self, values: dict[int, MomentState | None]) -> None:
        """Raise (changing nothing) if a state does not fit its tensor."""

    def write_moments(self, values: dict[int, MomentState | None]) -> None:
        """Set moments and step counts by tensor index (``None``: never stepped)."""
