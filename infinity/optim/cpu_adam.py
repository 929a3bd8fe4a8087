"""``infinity.optim.CPUAdam``: Adam / AdamW for CPU tensors and offloaded models, a
drop-in, faster ``torch.optim.AdamW`` / ``Adam``.

Adam's pieces, as every optimizer's (docs/design/optimizer.md, "Adding an
optimizer"): its hyper-parameters (:class:`AdamHyperParams`, validated once per
step), its chunk optimizer over the ``exp_avg`` and ``exp_avg_sq`` slots
(:data:`ADAM`, in any state format), and the front-end users construct
(:class:`CPUAdam`). Each update is a call of the fused native kernel
(:func:`infinity.optim.kernels.adam_step`; plain CPU tensors of a param group
go through :func:`~infinity.optim.kernels.adam_step_many` in one call): one
pass over parameter, gradient and both moments instead of the dozen tensor
passes of torch's reference implementation. The per-parameter state
(``step``, ``exp_avg``, ``exp_avg_sq``) and the parameter groups are those of
``torch.optim.AdamW``, so checkpoints move between the two optimizers in both
directions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infinity.optim import kernels, offloaded
from infinity.optim.chunk_optimizer import (
    ChunkOptimizer,
    StepViews,
    UnitViews,
    betas_value,
    hyper_value,
    read_moments,
    write_moments,
)
from infinity.optim.device_state import BlockStates, device_blocks
from infinity.optim.front_end import CPUOptimizer, check_dense_param, flat_buffers, step_dtype

__all__ = ["ADAM", "AdamChunks", "AdamHyperParams", "CPUAdam", "adam_on_device"]

# Keys torch.optim.Adam/AdamW keep in every param group. CPUAdam stores them
# with torch's defaults so its state_dict loads into torch unchanged.
_TORCH_GROUP_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
# Group flags torch supports and CPUAdam does not: flag -> what to use instead.
_UNSUPPORTED_FLAGS = {
    "amsgrad": "torch.optim.AdamW(amsgrad=True)",
    "maximize": "minimising the negated loss",
    "capturable": "torch.optim.AdamW(capturable=True) on the GPU",
    "differentiable": "torch.optim.AdamW(differentiable=True)",
}


@dataclass(frozen=True)
class AdamHyperParams:
    """The hyper-parameters of one param group, as plain validated floats.

    ``adamw=True`` means decoupled weight decay (AdamW: ``p -= lr * wd * p``
    before the Adam update); ``adamw=False`` means classic L2 regularisation
    (Adam: ``wd * p`` is added to the gradient, so it also flows through the
    moments).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> AdamHyperParams:
        """Read and validate a param group (values may be floats or 1-element tensors).

        Raises ``ValueError`` naming the key for out-of-range values and for
        torch flags CPUAdam does not implement (``amsgrad``, ``maximize``, ...).
        """
        for flag, instead in _UNSUPPORTED_FLAGS.items():
            if group.get(flag, False):
                raise ValueError(f"CPUAdam does not implement {flag}=True; use {instead}")
        beta1, beta2 = betas_value(group)
        return cls(
            lr=hyper_value("lr", group["lr"], low=0.0),
            beta1=beta1,
            beta2=beta2,
            eps=hyper_value("eps", group["eps"], low=0.0),
            weight_decay=hyper_value("weight_decay", group["weight_decay"], low=0.0),
            adamw=bool(group["adamw"]),
        )

    def kernel_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`kernels.adam_step` for these hyper-parameters."""
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "adamw": self.adamw,
        }


class AdamChunks(ChunkOptimizer[AdamHyperParams]):
    """Adam / AdamW over chunks, on the fused CPU-Adam kernel (:func:`.kernels.adam_step`)."""

    name = "adam"
    front_end = "infinity.optim.CPUAdam"
    state_slots = ("exp_avg", "exp_avg_sq")
    state_dtypes = ("fp32", "bf16", "int8")
    # adam_on_device: a scaled gradient, a denominator and addcdiv_'s quotient (measured)
    device_temporaries = 3
    device_rounding = True

    def read_state(self, unit: UnitViews, span: slice) -> dict[str, torch.Tensor]:
        """New fp32 copies of both moments of elements ``span`` (int8: decoded)."""
        m, v = read_moments(unit.slots["exp_avg"].span(span), unit.slots["exp_avg_sq"].span(span))
        return {"exp_avg": m, "exp_avg_sq": v}

    def write_state(self, unit: UnitViews, span: slice, values: Mapping[str, torch.Tensor]) -> None:
        """Store fp32 moments as the kernel would (int8: encoded block by block from
        ``span.start``, which is a block boundary: tensors start on one)."""
        write_moments(
            unit.slots["exp_avg"].span(span),
            unit.slots["exp_avg_sq"].span(span),
            values["exp_avg"].reshape(-1),
            values["exp_avg_sq"].reshape(-1),
        )

    def step(
        self, views: StepViews, hyper: AdamHyperParams, *, step: int, grad_scale: float
    ) -> None:
        """One Adam update of the run (see :class:`ChunkOptimizer`)."""
        if views.master.device.type != "cpu":
            adam_on_device(views, hyper, step=step, grad_scale=grad_scale)
            return
        kernels.adam_step(
            views.master,
            views.grad,
            views.state["exp_avg"],
            views.state["exp_avg_sq"],
            step=step,
            grad_scale=grad_scale,
            out16=views.out16,
            exp_avg_scale=views.scales.get("exp_avg"),
            exp_avg_sq_scale=views.scales.get("exp_avg_sq"),
            round_stream=views.rounding[0],
            round_offset=views.rounding[1],
            **hyper.kernel_kwargs(),
        )


def adam_on_device(
    views: StepViews, hyper: AdamHyperParams, *, step: int, grad_scale: float
) -> None:
    """:func:`kernels.adam_step`'s update as device kernels, on views in device memory:
    the same operations in the same order, so results match torch's AdamW to a few
    ulps, as the host kernel's do; bf16 and int8 moments are stored as the host kernel
    stores them (NOTE [chunks homed on the device])."""
    bias1 = 1.0 - hyper.beta1**step
    bias2_sqrt = (1.0 - hyper.beta2**step) ** 0.5
    master, grad = views.master, views.grad
    for part in device_blocks(master.numel()):
        states = BlockStates(
            views.state, part, scales=views.scales, rounding=views.rounding, step=step
        )
        m, v = states.load("exp_avg"), states.load("exp_avg_sq")
        p, g = master[part], grad[part].to(torch.float32, copy=True)
        if grad_scale != 1.0:
            g.mul_(grad_scale)
        if hyper.weight_decay:
            if hyper.adamw:
                p.mul_(1.0 - hyper.lr * hyper.weight_decay)
            else:
                g.add_(p, alpha=hyper.weight_decay)
        m.mul_(hyper.beta1).add_(g, alpha=1.0 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
        denom = v.sqrt().div_(bias2_sqrt).add_(hyper.eps)
        p.addcdiv_(m, denom, value=-hyper.lr / bias1)
        states.store("exp_avg_sq", v, stochastic=1)
        states.store("exp_avg", m, stochastic=0, zero_where_zero="exp_avg_sq")
        if views.out16 is not None:
            views.out16[part].copy_(p)


ADAM = AdamChunks()
"""Adam with exact fp32 moments; ``ADAM.with_state_dtype(...)`` for bf16 or int8."""


class CPUAdam(CPUOptimizer[AdamHyperParams]):
    """Adam/AdamW for CPU fp32 parameters, fused and vectorized (AVX-512/AVX2).

    A drop-in replacement for ``torch.optim.AdamW`` (default, ``adamw=True``)
    and ``torch.optim.Adam`` (``adamw=False``) with ``amsgrad=False`` and
    ``maximize=False``; results match torch's to a few float ulps per step.

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer.
        lr: learning rate (a float or a 1-element tensor); schedulers may change it.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator for numerical stability.
        weight_decay: with ``adamw=True``, decoupled decay ``p -= lr * wd * p``
            applied before the Adam update (AdamW, Loshchilov & Hutter); with
            ``adamw=False``, L2 regularisation ``grad += wd * p`` (classic Adam).
            Default: torch's for the chosen optimizer, 0.01 for AdamW and 0
            for Adam, so swapping either for this one changes nothing.
        adamw: choose between the two meanings of ``weight_decay`` above.
        amsgrad, maximize, capturable, differentiable: accepted for signature
            compatibility with torch; ``True`` raises ``ValueError``.

    Parameters must be fp32 CPU tensors: 16-bit parameters raise ``TypeError``
    (keep fp32 master weights, or use ``infinity.offload``), other devices
    ``ValueError``. Parameters whose ``grad`` is ``None`` are skipped; sparse
    gradients raise ``RuntimeError``. Hyper-parameters can change between
    steps (LR schedulers work). ``state_dict()`` has exactly the per-parameter
    state of ``torch.optim.AdamW`` (``step`` as a scalar tensor, ``exp_avg``,
    ``exp_avg_sq``), and the param groups carry torch's keys, so checkpoints
    load into either optimizer.

    The number of threads is set with :func:`infinity.optim.kernels.set_num_threads`.
    """

    hyper_params = AdamHyperParams
    chunk_optimizer = ADAM

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        adamw: bool = True,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults: dict[str, Any] = {
            **_TORCH_GROUP_DEFAULTS,
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": (0.01 if adamw else 0.0) if weight_decay is None else weight_decay,
            "adamw": adamw,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "capturable": capturable,
            "differentiable": differentiable,
        }
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore from ``load_state_dict``, accepting torch Adam/AdamW checkpoints too."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _TORCH_GROUP_DEFAULTS.items():
                group.setdefault(key, value)
            # A torch checkpoint says AdamW vs Adam with decoupled_weight_decay;
            # CPUAdam's own key is `adamw` (written back by state_dict()).
            decoupled = group.pop("decoupled_weight_decay", None)
            if "adamw" not in group:
                group["adamw"] = True if decoupled is None else bool(decoupled)
            for p in group["params"]:
                p_state = self.state.get(p)
                if p_state and not torch.is_tensor(p_state.get("step")):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=step_dtype())

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state dict, plus ``decoupled_weight_decay`` in each group.

        The extra key tells ``torch.optim.Adam``/``AdamW`` which weight decay
        this group used, so the checkpoint means the same thing there. Offloaded
        parameters' moments are copied out of their chunks (RAM for all of them,
        as torch's; ``infinity.save_checkpoint`` streams instead), so loops that
        save the optimizer themselves (``transformers.Trainer``) resume exactly.
        """
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["decoupled_weight_decay"] = bool(group["adamw"])
        return sd

    def _step_dense(self, group: dict[str, Any]) -> None:
        """Step the plain CPU tensors of one param group in one native multi-tensor call."""
        hyper = AdamHyperParams.from_group(group)
        kwargs = hyper.kernel_kwargs()
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        batch_steps: list[torch.Tensor] = []
        others = []  # layouts the kernel cannot step in place
        for p in group["params"]:
            grad = p.grad
            if grad is None or offloaded.engine_of_param(p) is not None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    "CPUAdam does not support sparse gradients; use torch.optim.SparseAdam"
                )
            check_dense_param("CPUAdam", p)
            if grad.shape != p.shape:
                raise ValueError(
                    f"gradient of shape {tuple(grad.shape)} does not match its parameter "
                    f"of shape {tuple(p.shape)}"
                )
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=step_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            flats = flat_buffers(p, grad, state["exp_avg"], state["exp_avg_sq"])
            if flats is None:
                others.append((p, grad))
                continue
            params.append(flats[0])
            grads.append(flats[1])
            exp_avgs.append(flats[2])
            exp_avg_sqs.append(flats[3])
            batch_steps.append(state["step"])
        # NOTE: the step counters advance only after the kernel ran, so a step
        # rejected by validation (e.g. a checkpoint with mis-sized moments)
        # leaves parameters, moments and counters all as they were.
        if batch_steps:
            steps = [int(s) + 1 for s in torch.stack(batch_steps).tolist()]
            kernels.adam_step_many(params, grads, exp_avgs, exp_avg_sqs, steps=steps, **kwargs)
            torch._foreach_add_(batch_steps, 1)  # one op for all, as torch's multi-tensor Adam
        for p, grad in others:
            self._step_tensor(ADAM, hyper, p, grad)
