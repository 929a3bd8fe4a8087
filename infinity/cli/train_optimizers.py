"""The optimizers ``infinity train --optimizer`` offers, with their defaults.

Each optimizer keeps the run's learning-rate schedule (warmup, then cosine);
what differs is the peak LR it is given by default, relative to the preset's
(which is tuned for AdamW), its weight decay and its momentum:

- ``adamw``: ``CPUAdam`` (AdamW), betas (0.9, 0.95), weight decay 0.1.
- ``lion``: ``CPULion``, betas (0.9, 0.99). NOTE: Lion's update is a sign, so
  every element moves by the full LR: the Lion paper uses an LR 3-10x smaller
  than AdamW's and a weight decay 3-10x larger, keeping LR x decay (the decay
  per step) the same. Here: LR / 3, decay x 3 (on the tiny preset's first
  dozen steps LR / 3 reached AdamW's loss sooner than LR / 10).
- ``sgd``: ``CPUSGD`` with momentum 0.9, no weight decay. NOTE: its step is the
  gradient itself, far smaller than Adam's normalised one on a transformer,
  so the LR is 30x the preset's; torch's (coupled, L2) weight decay would act
  at that LR, so it is off.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from infinity.optim import CPUSGD, CPUAdam, CPULion
from infinity.optim.front_end import CPUOptimizer


@dataclass(frozen=True)
class OptimizerChoice:
    """One ``--optimizer`` value: how it is built and what it defaults to."""

    label: str  # in the run's header and summary
    lr_scale: float  # default peak LR = the preset's x this
    weight_decay: float
    state_slots: int  # state tensors per parameter (the demo budgets count them)
    state_dtypes: tuple[str, ...]  # --optimizer-state-dtype values it supports

    def default_lr(self, preset_lr: float) -> float:
        """The peak LR when ``--lr`` is not given."""
        return preset_lr * self.lr_scale


CHOICES: dict[str, OptimizerChoice] = {
    "adamw": OptimizerChoice("AdamW", 1.0, 0.1, 2, ("fp32", "bf16", "int8")),
    "lion": OptimizerChoice("Lion", 1 / 3, 0.3, 1, ("fp32", "bf16", "int8")),
    "sgd": OptimizerChoice("SGD (momentum 0.9)", 30.0, 0.0, 1, ("fp32", "bf16")),
}
DEFAULT_OPTIMIZER = "adamw"
HELP = (
    "the optimizer: adamw (the default; betas 0.9/0.95, weight decay 0.1), lion (betas "
    "0.9/0.99, default LR a third of the preset's and weight decay 0.3: Lion's sign "
    "update wants a smaller LR and a larger decay) or sgd (momentum 0.9, default LR 30x "
    "the preset's, no weight decay). A resumed run keeps its own"
)


def build(
    name: str, params: Iterable[torch.Tensor], *, lr: float, weight_decay: float
) -> CPUOptimizer[Any]:
    """The CPU optimizer ``name`` over ``params``."""
    if name == "adamw":
        return CPUAdam(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    if name == "lion":
        return CPULion(params, lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)
    if name == "sgd":
        return CPUSGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(CHOICES)}")
