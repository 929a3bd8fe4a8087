"""The optimizer of a sweep case, offloaded and in plain PyTorch.

``Case.optimizer`` picks the infinity optimizer (``CPUAdam``, ``CPULion``,
``CPUSGD``, ``CPUAdafactor``) and its reference: ``torch.optim.AdamW`` (or the
quantised AdamW of :mod:`sweep_reference` for bf16/int8 moments), the Lion of
:mod:`sweep_reference`, ``torch.optim.SGD``, ``torch.optim.Adafactor``. Each
reference also has a *noise*
variant that differs from it only in arithmetic (torch's fused or multi-tensor
path, or float64 math), which sizes the tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lion_reference import ReferenceLion
from sweep_cases import Case
from sweep_reference import QuantisedAdamW

from infinity.optim import CPUSGD, CPUAdafactor, CPUAdam, CPULion

WEIGHT_DECAY = 0.1
# NOTE: Lion moves every weight by lr a step: a third of AdamW's rate, as the paper
# advises. Plain SGD needs a larger rate than Adam to move a small model visibly.
LION_LR_SCALE = 1 / 3
SGD_LR_SCALE = 30.0
# NOTE: Adafactor's lr is relative (a step moves a weight by about lr x the tensor's
# RMS): 3% a step moves a small model visibly.
ADAFACTOR_LR_SCALE = 10.0
SGD_MOMENTUM = 0.9
# A recipe's second group (1-D tensors: the norms) steps at this multiple of the rate,
# without weight decay; every rate warms up linearly from WARMUP_START of it.
FLAT_LR_SCALE = 2.0
WARMUP_START = 0.5


def step_size(case: Case) -> float:
    """The learning rate the case's optimizer runs with."""
    scales = {"lion": LION_LR_SCALE, "sgd": SGD_LR_SCALE, "adafactor": ADAFACTOR_LR_SCALE}
    scale = scales.get(case.optimizer, 1.0)
    return case.lr * scale


def param_groups(case: Case, model: torch.nn.Module) -> list[dict[str, Any]]:
    """What the case hands its optimizer: every parameter (frozen ones too, as users
    do) in one group, or with ``case.recipe`` the usual two (matrices with weight
    decay; the norms without it, at :data:`FLAT_LR_SCALE` times the rate)."""
    named = list(model.named_parameters())
    if not case.recipe:
        return [{"params": [p for _, p in named]}]
    return [
        {"params": [p for _, p in named if p.ndim >= 2]},
        {
            "params": [p for _, p in named if p.ndim < 2],
            "weight_decay": 0.0,
            "lr": step_size(case) * FLAT_LR_SCALE,
        },
    ]


def warmup(case: Case, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A recipe's schedule: every group's rate from :data:`WARMUP_START` of it to all
    of it over the case's steps (``None`` without ``case.recipe``)."""
    if not case.recipe:
        return None
    steps = case.steps
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: WARMUP_START + (1 - WARMUP_START) * min(s, steps) / steps
    )


def offloaded_optimizer(case: Case, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The infinity optimizer of ``case``."""
    lr = step_size(case)
    if case.optimizer == "lion":
        return CPULion(params, lr=lr, betas=case.betas, weight_decay=WEIGHT_DECAY)
    if case.optimizer == "sgd":
        return CPUSGD(params, lr=lr, momentum=SGD_MOMENTUM, nesterov=True, weight_decay=1e-3)
    if case.optimizer == "adafactor":
        return CPUAdafactor(params, lr=lr, weight_decay=1e-3)
    return CPUAdam(params, lr=lr, betas=case.betas, weight_decay=WEIGHT_DECAY)


def reference_optimizer(
    case: Case, params: list[dict[str, Any]], *, noise: bool = False
) -> torch.optim.Optimizer:
    """The plain-PyTorch optimizer ``case`` is judged against (``noise``: its variant
    that differs only in arithmetic)."""
    lr = step_size(case)
    math = torch.float64 if noise else torch.float32
    if case.optimizer == "lion":
        return ReferenceLion(
            params, case.state_dtype, lr=lr, betas=case.betas, weight_decay=WEIGHT_DECAY, math=math
        )
    if case.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=SGD_MOMENTUM, nesterov=True, weight_decay=1e-3, foreach=noise
        )
    if case.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=1e-3, foreach=noise)
    if case.state_dtype == "fp32":
        return torch.optim.AdamW(
            params,
            lr=lr,
            betas=case.betas,
            weight_decay=WEIGHT_DECAY,
            foreach=False,
            fused=True if noise else None,
        )
    return QuantisedAdamW(
        params, case.state_dtype, lr=lr, betas=case.betas, weight_decay=WEIGHT_DECAY, math=math
    )
