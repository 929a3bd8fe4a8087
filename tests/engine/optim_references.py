"""References for the optimizer plug-ins, written here from the papers' update rules:
``ReferenceLion`` (Lion, Chen et al. 2023, as ``lion_pytorch.Lion`` writes it), with
the momentum optionally kept in bf16 between steps."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class ReferenceLion(torch.optim.Optimizer):
    """Lion in plain torch ops: decoupled decay, sign of the interpolation, momentum."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One Lion step of every parameter with a gradient."""
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = state.get("exp_avg", torch.zeros_like(p, dtype=self.state_dtype)).float()
                p.mul_(1 - lr * wd)
                update = m.mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
                state["exp_avg"] = m.to(self.state_dtype)
