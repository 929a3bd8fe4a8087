"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") written
here in torch ops from the paper's update, as ``lion_pytorch.Lion`` writes it: the
reference of ``CPULion`` in tests/optim, tests/engine and the equivalence sweep.

Per step: ``p *= 1 - lr * wd``; ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``;
``m = beta2 * m + (1 - beta2) * g``. Between steps the momentum ``exp_avg`` is
kept in ``state_dtype``: fp32, bf16 (stochastic rounding with its own random bits,
``bf16_reference.py``) or int8 (the signed codes of the independent NumPy codec,
``q8_reference.encode_signed``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import q8_reference as q8
import torch
from bf16_reference import round_stochastic


class ReferenceLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) in torch ops, its momentum kept in ``state_dtype``
    ("fp32", "bf16", or "int8": the NumPy codec's signed codes) between steps, the
    update in ``math`` precision."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        state_dtype: str = "fp32",
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        math: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.math = math
        self.generator = torch.Generator().manual_seed(0)  # bf16's rounding bits

    def _load(self, stored: object, p: torch.Tensor) -> torch.Tensor:
        if stored is None:
            return torch.zeros_like(p, dtype=self.math)
        if self.state_dtype == "int8":
            code, scale = stored  # type: ignore[misc]
            m = q8.decode(code, scale, signed=True)
            return torch.from_numpy(np.ascontiguousarray(m)).reshape(p.shape).to(self.math)
        return stored.to(self.math)  # type: ignore[attr-defined]

    def _store(self, m: torch.Tensor) -> object:
        if self.state_dtype == "int8":
            return q8.encode_signed(m.float().flatten().numpy())
        if self.state_dtype == "bf16":
            return round_stochastic(m, self.generator)
        return m.to(torch.float32)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One Lion step of every parameter with a gradient."""
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = self._load(state.get("exp_avg"), p)
                g, w = p.grad.to(self.math), p.to(self.math)
                w.mul_(1 - lr * wd)
                w.add_(m.mul(b1).add(g, alpha=1 - b1).sign_(), alpha=-lr)
                m.mul_(b2).add_(g, alpha=1 - b2)
                p.copy_(w)
                state["exp_avg"] = self._store(m)
