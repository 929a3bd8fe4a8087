"""The generic optimizer front-end: one ``torch.optim.Optimizer`` base for every
chunk optimizer (:class:`~infinity.optim.CPUAdam`, :class:`~infinity.optim.CPUSGD`,
:class:`~infinity.optim.CPULion`, :class:`~infinity.optim.CPUAdafactor`).

A concrete optimizer names two things (see "Adding an optimizer" in
docs/design/optimizer.md):

- :attr:`CPUOptimizer.hyper_params`: the validated hyper-parameters of one
  param group (:meth:`CPUOptimizer.hyper_of`), a frozen dataclass compared by
  value (tensors whose hyper-parameters and step count are equal run through
  one kernel call);
- :attr:`CPUOptimizer.chunk_optimizer`: the per-element update and the state
  slots (:class:`~infinity.optim.chunk_optimizer.ChunkOptimizer`,
  :meth:`CPUOptimizer.make_chunk_optimizer`).

Everything else is here, once: parameters of offloaded models step inside
their engines, which learn the chunk optimizer from the optimizer constructed
over them (``ChunkStepper.use_optimizer``); plain CPU tensors step through the
same chunk optimizer on their own fp32 state (a concrete optimizer may
override :meth:`CPUOptimizer._step_dense` with something faster, as CPUAdam
does, or with states not shaped like the parameters, as CPUAdafactor does);
state dicts carry the slots by name, as torch's do; fp16 loss scaling and
gradient clipping work on offloaded parameters. The checks and flat views of
parameters that were not offloaded (:func:`check_dense_param`,
:func:`flat_buffers`) are here too, for every front-end.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch.optim import Optimizer

from infinity.optim import offloaded
from infinity.optim.chunk_optimizer import ChunkOptimizer, StepViews
from infinity.optim.offloaded import ChunkStepper

H = TypeVar("H")


def check_dense_param(owner: str, p: torch.Tensor) -> None:
    """Raise a clear error if optimizer ``owner`` (its class name) cannot step ``p``
    as a plain CPU tensor."""
    if p.is_cpu is True and p.dtype is torch.float32 and p.layout is torch.strided:
        return  # the common case, tested with the cheapest attributes
    where = f"a parameter of shape {tuple(p.shape)}"
    if p.device.type != "cpu":
        raise ValueError(
            f"{owner} updates parameters in CPU memory, but {where} is on '{p.device}'. "
            "Keep the parameters on the CPU, or use infinity.offload(model, config), whose "
            "chunks hold fp32 master copies in CPU memory."
        )
    if p.layout != torch.strided:
        raise ValueError(f"{owner} needs dense parameters; {where} has layout {p.layout}")
    if p.dtype in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"{owner} keeps fp32 master parameters, but {where} is {str(p.dtype)[6:]}: updating "
            "16-bit weights in place loses most small updates to rounding. Give "
            f"{owner} fp32 parameters (keep a 16-bit copy for compute), or use "
            "infinity.offload(model, Config(dtype='bf16')), which keeps fp32 masters and writes "
            "16-bit copies in the step."
        )
    if p.dtype != torch.float32:
        raise TypeError(f"{owner} supports fp32 parameters only; {where} is {str(p.dtype)[6:]}")


def check_grad(owner: str, p: torch.Tensor, grad: torch.Tensor) -> None:
    """Raise if ``grad`` cannot update ``p`` (sparse, or another shape)."""
    if grad.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients; use torch.optim.SparseAdam")
    if grad.shape != p.shape:
        raise ValueError(
            f"gradient of shape {tuple(grad.shape)} does not match its parameter "
            f"of shape {tuple(p.shape)}"
        )


def flat_memory(t: torch.Tensor) -> torch.Tensor | None:
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


def flat_buffers(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors as flat views of their memory, if a kernel can update them in place.

    True when all are contiguous, or all share one gap-free layout (e.g.
    channels_last): then element i of each view is the same logical element.
    """
    if all(t.is_contiguous() for t in tensors):
        return [t.view(-1) for t in tensors]
    first = tensors[0].stride()
    if any(t.stride() != first for t in tensors):
        return None
    flats = [flat_memory(t) for t in tensors]
    return None if any(f is None for f in flats) else flats  # type: ignore[return-value]


def step_dtype() -> torch.dtype:
    """The dtype of a parameter's ``step`` state, as torch keeps it."""
    # torch keeps `step` as a CPU float tensor (float64 under a float64
    # default dtype); matching it keeps state dicts interchangeable.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


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

    Subclasses name their :attr:`hyper_params` and :attr:`chunk_optimizer` and
    call ``super().__init__(params, defaults)`` with torch's group keys.
    """

    hyper_params: ClassVar[type[Any]]
    """The hyper-parameters: a frozen dataclass whose ``from_group(group)`` reads and
    validates one param group (``ValueError`` naming the bad key and value)."""
    chunk_optimizer: ClassVar[ChunkOptimizer[Any]]
    """The per-element update and state slots of this optimizer."""

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]
    ) -> None:
        self.hyper_of(defaults)  # fail before touching any parameter
        super().__init__(params, defaults)

    # --- what a concrete optimizer says ---------------------------------------------------
    def hyper_of(self, group: dict[str, Any]) -> H:
        """The validated hyper-parameters of one param group (``ValueError`` naming the
        bad key and value)."""
        return self.hyper_params.from_group(group)

    def make_chunk_optimizer(self) -> ChunkOptimizer[H]:
        """The per-element update and state slots of this optimizer."""
        return self.chunk_optimizer

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
        for engine, values in taken.items():
            engine.write_moments(values)

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
            engine.optimizer_step(hyper, self)
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
        index, validated once per group); what the engine's early steps
        (``overlap_optimizer``) read too."""
        out: dict[ChunkStepper, dict[int, H]] = {}
        for group in self.param_groups:
            hyper = None
            for p in group["params"]:
                slot = offloaded.param_slot(p)
                if slot is None:
                    continue
                if hyper is None:
                    hyper = self.hyper_of(group)
                out.setdefault(slot.engine, {})[slot.tensor_index] = hyper
        return out

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on: times the fp16 loss scale of offloaded models.

        ``optimizer.scale_loss(loss).backward()`` works for every dtype (bf16 and
        fp32 models return ``loss`` unchanged); fp16 models need it. ``step()``
        removes the scale again and skips the step (halving the scale) when a
        gradient overflowed.
        """
        scales = set()
        for engine in offloaded.engines(self.param_groups):
            if engine.scaler is not None:
                engine.note_loss_scaled()
                scales.add(engine.scaler.scale)
        if len(scales) > 1:
            raise RuntimeError("the optimizer holds fp16 models with different loss scales")
        return loss * scales.pop() if scales else loss

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
            self._step_tensor(update, hyper, p, grad)

    def _step_tensor(
        self, update: ChunkOptimizer[H], hyper: H, p: torch.Tensor, grad: torch.Tensor
    ) -> None:
        """Step one plain CPU tensor on its state slots (checked, and created) and count
        the step."""
        state = self.state[p]
        slots = update.state_slots
        tensors = [p, grad, *(state[name] for name in slots)]
        flats = flat_buffers(*tensors)
        work = flats if flats is not None else [t.contiguous().view(-1) for t in tensors]
        views = StepViews(work[0], work[1], dict(zip(slots, work[2:], strict=True)), None)
        update.step(views, hyper, step=int(state["step"].item()) + 1, grad_scale=1.0)
        if flats is None:
            # Rare (views with gaps, gradients with other strides than their
            # parameter): stepped on contiguous copies, copied back; same result
            # as in place, two extra passes over memory.
            for k, (dst, src) in enumerate(zip(tensors, work, strict=True)):
                if k != 1 and dst.data_ptr() != src.data_ptr():  # 1: the gradient
                    dst.copy_(src.view(dst.shape))
        state["step"] += 1
