"""The optimizers ``infinity train --optimizer`` offers, with their defaults.

Each optimizer keeps the run's learning-rate schedule (warmup, then cosine);
what differs is the peak LR it is given by default, relative to the preset's
(which is tuned for AdamW), its weight decay and its momentum:

- ``adamw``: ``CPUAdam`` (AdamW), betas (0.9, 0.95), weight decay 0.1.
- ``lion``: ``CPULion``, betas (0.9, 0.99). Lion's update is a sign, so
  every element moves by the full LR: the Lion paper uses an LR 3-10x smaller
  than AdamW's and a weight decay 3-10x larger, keeping LR x decay (the decay
  per step) the same. Here: LR / 3, decay x 3 (on the tiny preset's first
  dozen steps LR / 3 reached AdamW's loss sooner than LR / 10).
- ``sgd``: ``CPUSGD`` with momentum 0.9, no weight decay. Its step is the
  gradient itself, far smaller than Adam's normalised one on a transformer,
  so the LR is 30x the preset's; torch's (coupled, L2) weight decay would act
  at that LR, so it is off.
- ``adafactor``: ``CPUAdafactor`` (torch's defaults: beta2_decay -0.8, eps
  (None, 1e-3), d 1). Its LR is *relative*: a step moves a tensor by
  about LR x its RMS (and at most 1/sqrt(step) of it), where AdamW moves
  every element by about its LR, so the LR is 30x the preset's (0.09 on the
  tiny preset: within a dozen steps it reached AdamW's loss; 10x lagged far
  behind, 100x spiked). Its weight decay is decoupled (``p *= 1 - LR x
  decay``), so it is 0.1 / 30: the decay per step stays AdamW's. Its states
  (a row and a column factor of the second moment per matrix) are fp32, per
  tensor, in host memory inside the host budget (no state in the chunks); with
  ``--nproc`` every process keeps them whole and gathers each chunk for its
  update (its update reads whole tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from infinity.optim import CPUSGD, CPUAdafactor, CPUAdam, CPULion
from infinity.optim.front_end import CPUOptimizer


@dataclass(frozen=True)
class OptimizerChoice:
    """One ``--optimizer`` value: how it is built and what it defaults to."""

    label: str  # in the run's header and summary
    lr_scale: float  # default peak LR = the preset's x this
    weight_decay: float
    state_slots: int  # state tensors per parameter (the demo budgets count them)
    state_dtypes: tuple[str, ...]  # --optimizer-state-dtype values it supports
    states: str = "its states"  # what its states are, in errors

    def default_lr(self, preset_lr: float) -> float:
        """The peak LR when ``--lr`` is not given."""
        return preset_lr * self.lr_scale


CHOICES: dict[str, OptimizerChoice] = {
    "adamw": OptimizerChoice("AdamW", 1.0, 0.1, 2, ("fp32", "bf16", "int8")),
    "lion": OptimizerChoice("Lion", 1 / 3, 0.3, 1, ("fp32", "bf16", "int8")),
    "sgd": OptimizerChoice("SGD (momentum 0.9)", 30.0, 0.0, 1, ("fp32", "bf16")),
    "adafactor": OptimizerChoice(
        "Adafactor", 30.0, 0.1 / 30, 0, ("fp32",), "its factored second moments"
    ),
}
DEFAULT_OPTIMIZER = "adamw"
HELP = (
    "the optimizer: adamw (the default; betas 0.9/0.95, weight decay 0.1), lion (betas "
    "0.9/0.99, default LR a third of the preset's and weight decay 0.3: Lion's sign "
    "update wants a smaller LR and a larger decay), sgd (momentum 0.9, default LR 30x "
    "the preset's, no weight decay) or adafactor (torch's defaults, default LR 30x the "
    "preset's: its LR is relative to each tensor's RMS; weight decay 0.1/30; fp32 factored "
    "states in host memory). A resumed run keeps its own"
)


def tensor_state_bytes(optimizer: CPUOptimizer[Any], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the per-tensor (fp32) states ``optimizer`` will keep in host memory for
    ``params``, which the plan reserves in the host budget: Adafactor's factors; 0 for
    the others."""
    update = optimizer.make_chunk_optimizer()
    return 4 * sum(
        math.prod(shape)
        for p in params
        if p.requires_grad
        for shape in update.tensor_state_shapes(tuple(p.shape)).values()
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
    if name == "adafactor":
        return CPUAdafactor(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(CHOICES)}")
