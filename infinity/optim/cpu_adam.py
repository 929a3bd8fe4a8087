"""``infinity.optim.CPUAdam``: a drop-in, faster ``torch.optim.AdamW`` / ``Adam`` for CPU tensors.

Each parameter is updated by one call of the fused native kernel
(:func:`infinity.optim.kernels.adam_step`): one pass over parameter, gradient
and both moments instead of the dozen tensor passes of torch's reference
implementation. The per-parameter state (``step``, ``exp_avg``,
``exp_avg_sq``) and the parameter groups are those of ``torch.optim.AdamW``,
so checkpoints move between the two optimizers in both directions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from infinity.optim import kernels, offloaded
from infinity.optim.hyper import _TORCH_GROUP_DEFAULTS, AdamHyperParams

__all__ = ["AdamHyperParams", "CPUAdam"]


def _check_dense_param(p: torch.Tensor) -> None:
    """Raise a clear error if CPUAdam cannot step ``p`` as a plain CPU tensor."""
    if p.is_cpu is True and p.dtype is torch.float32 and p.layout is torch.strided:
        return  # the common case, tested with the cheapest attributes
    where = f"a parameter of shape {tuple(p.shape)}"
    if p.device.type != "cpu":
        raise ValueError(
            f"CPUAdam updates parameters in CPU memory, but {where} is on '{p.device}'. "
            "Keep the parameters on the CPU, or use infinity.offload(model, config), whose "
            "chunks hold fp32 master copies in CPU memory."
        )
    if p.layout != torch.strided:
        raise ValueError(f"CPUAdam needs dense parameters; {where} has layout {p.layout}")
    if p.dtype in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"CPUAdam keeps fp32 master parameters, but {where} is {str(p.dtype)[6:]}: updating "
            "16-bit weights in place loses most small updates to rounding. Give CPUAdam fp32 "
            "parameters (keep a 16-bit copy for compute), or use infinity.offload(model, "
            "Config(dtype='bf16')), which keeps fp32 masters and writes 16-bit copies in the step."
        )
    if p.dtype != torch.float32:
        raise TypeError(f"CPUAdam supports fp32 parameters only; {where} is {str(p.dtype)[6:]}")


def _flat_memory(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``t``'s elements in memory order, if they fill a gap-free block.

    True for contiguous tensors and for permuted ones such as channels_last
    weights; ``None`` for views with gaps, overlaps or negative strides.
    """
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda ss: ss[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class CPUAdam(Optimizer):
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
        AdamHyperParams.from_group(defaults)  # fail before touching any parameter
        super().__init__(params, defaults)
        for engine in offloaded.engines(self.param_groups):
            # overlap_optimizer=True steps chunks during backward with these groups.
            engine.optimizer = weakref.ref(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch does), validating its hyper-parameters and parameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            AdamHyperParams.from_group(group)
            for p in group["params"]:
                if offloaded.engine_of_param(p) is None:
                    _check_dense_param(p)
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

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
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=_step_dtype())

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
        offloaded.add_offloaded_state(self.param_groups, sd)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's; the moments of offloaded parameters go into their chunks.

        A state dict that does not fit (another model's shapes, other groups)
        raises and changes nothing.
        """
        state_dict = dict(state_dict)
        taken = offloaded.take_offloaded_state(self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        offloaded.put_offloaded_state(taken)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient; return ``closure()``'s loss if given.

        ``closure`` (optional) re-evaluates the model and returns the loss; it
        runs with gradients enabled before the update, as in torch.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_dense(group)
        for engine, hyper in offloaded.offloaded_hyper(self.param_groups).items():
            engine.optimizer_step(hyper)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients of offloaded parameters are always dropped (set to None)."""
        for group in self.param_groups:
            for p in group["params"]:
                if offloaded.engine_of_param(p) is not None:
                    p.grad = None
        super().zero_grad(set_to_none=set_to_none)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on: times the fp16 loss scale of offloaded models.

        ``optimizer.scale_loss(loss).backward()`` works for every dtype (bf16 and
        fp32 models return ``loss`` unchanged); fp16 models need it. ``step()``
        removes the scale again and skips the step (halving the scale) when a
        gradient overflowed.
        """
        return offloaded.scale_loss(self.param_groups, loss)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of all this optimizer's parameters by their total norm;
        returns the norm (before clipping).

        An alias of ``torch.nn.utils.clip_grad_norm_(params, max_norm, ...)`` over
        every parameter of every group, which works on offloaded parameters too:
        their norms come from the gradient chunks and the clip factor is applied
        inside the next step's fused kernel.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def _step_dense(self, group: dict[str, Any]) -> None:
        """Step the plain CPU tensors of one param group in one native multi-tensor call."""
        kwargs = AdamHyperParams.from_group(group).kernel_kwargs()
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
            _check_dense_param(p)
            if grad.shape != p.shape:
                raise ValueError(
                    f"gradient of shape {tuple(grad.shape)} does not match its parameter "
                    f"of shape {tuple(p.shape)}"
                )
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=_step_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            flats = _flat_buffers(p, grad, state["exp_avg"], state["exp_avg_sq"])
            if flats is None:
                others.append((p, grad, state))
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
        for p, grad, state in others:
            _step_copies(p, grad, state, int(state["step"].item()) + 1, kwargs)
            state["step"] += 1


def _step_dtype() -> torch.dtype:
    # NOTE: torch keeps `step` as a CPU float tensor (float64 under a float64
    # default dtype); matching it keeps state dicts interchangeable.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _flat_buffers(
    p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
) -> list[torch.Tensor] | None:
    """The tensors as flat views of their memory, if the kernel can update them in place.

    True when all are contiguous, or all share one gap-free layout (e.g.
    channels_last): then element i of each view is the same logical element.
    """
    if (
        p.is_contiguous()
        and grad.is_contiguous()
        and exp_avg.is_contiguous()
        and exp_avg_sq.is_contiguous()
    ):
        return [p, grad, exp_avg, exp_avg_sq]
    tensors = (p, grad, exp_avg, exp_avg_sq)
    first = tensors[0].stride()
    if any(t.stride() != first for t in tensors):
        return None
    flats = [_flat_memory(t) for t in tensors]
    return None if any(f is None for f in flats) else flats  # type: ignore[return-value]


def _step_copies(
    p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], step: int, kwargs: dict[str, Any]
) -> None:
    """Step a parameter with an unusual layout on contiguous copies, then copy back.

    NOTE: rare (views with gaps, gradients with other strides than their
    parameter); same result as in place, two extra passes over memory.
    """
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    pc, mc, vc = p.contiguous(), exp_avg.contiguous(), exp_avg_sq.contiguous()
    kernels.adam_step(pc, grad.contiguous(), mc, vc, step=step, **kwargs)
    for dst, src in ((p, pc), (exp_avg, mc), (exp_avg_sq, vc)):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
