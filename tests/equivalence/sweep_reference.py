"""AdamW with quantised moments, written here as the sweep's reference for
``Config(optimizer_state_dtype="bf16" | "int8")``.

The update is torch's single-tensor AdamW (decoupled decay, ``lerp`` for the
first moment, bias corrections as in ``torch.optim.AdamW``). Between steps the
moments are kept only in their stored form: bf16 by stochastic rounding with the
reference's own random bits (``tests/optim/bf16_reference.py``; the kernel's are a
hash of chunk and offset, so every element may round differently), int8 by the
independent NumPy model of the format in ``tests/optim/q8_reference.py`` (blocks of
256 from each tensor's first element, as the layout aligns every tensor to a
block). A step decodes them, updates in ``math`` precision, uses the unrounded
moments for the parameter update (as the fused kernel does) and stores the
rounded ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import q8_reference as q8
import torch
from bf16_reference import round_stochastic


def _store(m: torch.Tensor, v: torch.Tensor, state_dtype: str, gen: torch.Generator) -> tuple:
    if state_dtype == "bf16":
        return round_stochastic(m, gen), round_stochastic(v, gen)
    m_code, m_scale, v_code, v_scale = q8.encode(
        m.float().flatten().numpy(), v.float().flatten().numpy()
    )
    return (m_code, m_scale, v_code, v_scale)


def _load(stored: tuple, state_dtype: str, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    if state_dtype == "bf16":
        return stored[0].float(), stored[1].float()
    m_code, m_scale, v_code, v_scale = stored
    m = q8.decode(m_code, m_scale, signed=True)
    v = q8.decode(v_code, v_scale, signed=False)
    return (
        torch.from_numpy(np.ascontiguousarray(m)).reshape(shape),
        torch.from_numpy(np.ascontiguousarray(v)).reshape(shape),
    )


class QuantisedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` whose moments live in ``state_dtype`` between steps."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        state_dtype: str,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float = 1e-8,
        math: torch.dtype = torch.float32,
    ) -> None:
        if state_dtype not in ("bf16", "int8"):
            raise ValueError(f"state_dtype={state_dtype!r}: the reference quantises bf16 or int8")
        super().__init__(
            params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps}
        )
        self.state_dtype = state_dtype
        self.math = math
        self.generator = torch.Generator().manual_seed(0)  # bf16's rounding bits

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One AdamW step of every parameter with a gradient."""
        for group in self.param_groups:
            lr, (b1, b2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state["step"] = state.get("step", 0) + 1
                if "moments" in state:
                    m, v = _load(state["moments"], self.state_dtype, p.shape)
                else:
                    m, v = torch.zeros_like(p), torch.zeros_like(p)
                g = p.grad.to(self.math)
                m, v, w = m.to(self.math), v.to(self.math), p.to(self.math)
                w.mul_(1 - lr * group["weight_decay"])
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                den = (v.sqrt() / (1 - b2**t) ** 0.5).add_(group["eps"])
                w.addcdiv_(m, den, value=-lr / (1 - b1**t))
                p.copy_(w)
                state["moments"] = _store(m, v, self.state_dtype, self.generator)
