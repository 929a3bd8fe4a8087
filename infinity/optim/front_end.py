"""The generic optimizer front-end: one ``torch.optim.Optimizer`` base for every
chunk optimizer (:class:`~infinity.optim.CPUAdam`, :class:`~infinity.optim.CPUSGD`,
:class:`~infinity.optim.CPULion`, :class:`~infinity.optim.CPUAdafactor`).

A concrete optimizer says two things (see "Adding an optimizer" in
docs/design/optimizer.md):

- :meth:`CPUOptimizer.hyper_of`: the validated hyper-parameters of one param
  group, a frozen dataclass compared by value (tensors whose hyper-parameters
  and step count are equal run through one kernel call);
- :meth:`CPUOptimizer.make_chunk_optimizer`: the per-element update and the
  state slots (:class:`~infinity.optim.chunk_optimizer.ChunkOptimizer`).

Everything else is here, once: parameters of offloaded models step inside
their engines, which learn the chunk optimizer from the optimizer constructed
over them (``ChunkStepper.use_optimizer``); plain CPU tensors step through the
same chunk optimizer on their own fp32 state (a concrete optimizer may
override :meth:`CPUOptimizer._step_dense` with something faster, as CPUAdam
does, or with states not shaped like the parameters, as CPUAdafactor does);
state dicts carry the slots by name, as torch's do; fp16 loss scaling and
gradient clipping work on offloaded parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import torch
from torch.optim import Optimizer

from infinity.optim import offloaded
from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews
from infinity.optim.dense import check_dense_param, check_grad, flat_buffers, step_dtype
from infinity.optim.offloaded import ChunkStepper

H = TypeVar("H")


def check_state_shape(
    name: str, param: torch.Tensor, value: torch.Tensor, want: tuple[int, ...]
) -> None:
    """Raise if a loaded state ``value`` of ``param`` does not have the shape ``want``."""
    if tuple(value.shape) != want:
        raise ValueError(
            f"optimizer state {name!r} of a parameter of shape {tuple(param.shape)} "
            f"has shape {tuple(value.shape)}: the state dict is from another model"
        )


class CPUOptimizer(Optimizer, Generic[H]):
    """A torch optimizer for CPU fp32 tensors and offloaded parameters, over one
    :class:`~infinity.optim.chunk_optimizer.ChunkOptimizer`.

    Subclasses implement :meth:`hyper_of` and :meth:`make_chunk_optimizer` and
    call ``super().__init__(params, defaults)`` with torch's group keys.
    """

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]
    ) -> None:
        self.hyper_of(defaults)  # fail before touching any parameter
        super().__init__(params, defaults)

    # --- what a concrete optimizer says ---------------------------------------------------
    def hyper_of(self, group: dict[str, Any]) -> H:
        """The validated hyper-parameters of one param group (``ValueError`` naming the
        bad key and value)."""
        raise NotImplementedError

    def make_chunk_optimizer(self) -> ChunkOptimizer[H]:
        """The per-element update and state slots of this optimizer."""
        raise NotImplementedError

    # --- torch's Optimizer interface ------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch does), validating its hyper-parameters and
        parameters; the engines of offloaded parameters learn this optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owner = type(self).__name__
        try:
            self.hyper_of(group)
            for p in group["params"]:
                if offloaded.engine_of_param(p) is None:
                    check_dense_param(owner, p)
            # The engine lays its optimizer units out for the optimizer
            # constructed over it (the last one, until one has stepped it), and
            # steps its chunks early (overlap_optimizer) with this one's groups.
            for engine in offloaded.engines([group]):
                engine.use_optimizer(self.make_chunk_optimizer(), owner, weakref.ref(self))
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state dict; offloaded parameters' state slots (and ``step``)
        are copied out of their chunks (RAM for all of them, as torch's;
        ``infinity.save_checkpoint`` streams instead)."""
        sd = super().state_dict()
        offloaded.add_offloaded_state(self.param_groups, sd)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's; the state of offloaded parameters goes into their chunks.

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
        for engine, hyper in self.offloaded_hyper().items():
            self._check_bound(engine)
            engine.optimizer_step(hyper)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients of offloaded parameters are always dropped (set to None)."""
        for group in self.param_groups:
            for p in group["params"]:
                if offloaded.engine_of_param(p) is not None:
                    p.grad = None
        super().zero_grad(set_to_none=set_to_none)

    # --- offloaded models -----------------------------------------------------------------
    def offloaded_hyper(self) -> dict[ChunkStepper, dict[int, H]]:
        """For each engine, the hyper-parameters of every offloaded parameter (by tensor
        index); what the engine's early steps (``overlap_optimizer``) read too."""
        return offloaded.offloaded_hyper(self.param_groups, self.hyper_of)

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

    def _check_bound(self, engine: ChunkStepper) -> None:
        """Raise if ``engine``'s chunks were laid out for another optimizer since."""
        if engine.chunk_optimizer.name != self.make_chunk_optimizer().name:
            raise RuntimeError(
                f"this {type(self).__name__} cannot step its offloaded model: the model's "
                f"optimizer state is now laid out for {engine.chunk_optimizer.front_end} "
                "(constructed over the same parameters after this one). Step with that "
                "optimizer, or construct this one again."
            )

    # --- plain CPU tensors ----------------------------------------------------------------
    def _dense_todo(self, group: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The plain CPU tensors of ``group`` with a gradient, and their gradients, every
        one checked (before any tensor changes)."""
        owner = type(self).__name__
        todo = []
        for p in group["params"]:
            grad = p.grad
            if grad is None or offloaded.engine_of_param(p) is not None:
                continue
            check_dense_param(owner, p)
            check_grad(owner, p, grad)
            todo.append((p, grad))
        return todo

    def _step_dense(self, group: dict[str, Any]) -> None:
        """Step the plain CPU tensors of one param group through the chunk optimizer,
        each on fp32 state tensors shaped like it (what ``state_dict`` shows)."""
        todo = self._dense_todo(group)
        if not todo:
            return
        hyper = self.hyper_of(group)
        update = self.make_chunk_optimizer()
        slots = update.state_slots
        for p, _grad in todo:
            state = self.state[p]
            if "step" not in state:
                # torch.optim.SGD keeps no step count (and None for a momentum
                # buffer it never needed): a state it wrote has taken a step.
                state["step"] = torch.tensor(float(bool(state)), dtype=step_dtype())
            for name in slots:
                if state.get(name) is None:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for name in slots:  # NOTE: all checked before any tensor changes
                check_state_shape(name, p, state[name], tuple(p.shape))
        for p, grad in todo:
            state = self.state[p]
            tensors = [p, grad, *(state[name] for name in slots)]
            flats = flat_buffers(*tensors)
            work = flats if flats is not None else [t.contiguous().view(-1) for t in tensors]
            views = StepViews(work[0], work[1], dict(zip(slots, work[2:], strict=True)), None)
            update.step(views, hyper, step=int(state["step"].item()) + 1, grad_scale=1.0)
            if flats is None:
                # Rare (views with gaps, gradients with other strides): stepped
                # on contiguous copies, copied back.
                for k, (dst, src) in enumerate(zip(tensors, work, strict=True)):
                    if k != 1 and dst.data_ptr() != src.data_ptr():  # 1: the gradient
                        dst.copy_(src.view(dst.shape))
            state["step"] += 1
