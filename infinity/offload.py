"""``infinity.offload``: the one public entry point that puts a model into chunks."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from infinity.config import Config
from infinity.devices.choice import resolved
from infinity.distributed import Collectives, resolve_world
from infinity.distributed.agreement import check_agreement
from infinity.optim import offloaded
from infinity.runtime.engine import OffloadEngine
from infinity.runtime.hooks import HookSet, install_state_dict_hooks
from infinity.runtime.materialize import (
    Init,
    PendingBuffer,
    check_initialisable,
    fill_chunks,
    fill_parameterless_buffers,
    materialize_buffers,
    native_init,
    take_values,
)
from infinity.runtime.params import is_placeholder


def offload(model: nn.Module, config: Config | None = None, init: Init | None = None) -> nn.Module:
    """Lay ``model``'s parameters out in chunks across the tiers and hook the model.

    Returns the same module, ready for a plain training loop with
    :class:`infinity.optim.CPUAdam`. If the budgets cannot hold the model this
    raises :class:`infinity.PlanError` before anything is allocated, with the
    bytes each tier needs. Parameters on the ``meta`` device are materialised
    chunk by chunk and initialised with ``init(module)`` (default: a
    ``transformers`` model's own ``_init_weights``, any other module's
    ``reset_parameters()``). ``init="load"`` initialises nothing: the
    parameters stay *unset* until :func:`infinity.load_pretrained`,
    :func:`infinity.load_checkpoint` or ``model.load_state_dict`` writes them,
    and a forward or read of one still unset raises
    :class:`~infinity.runtime.params.UnsetParameterError` naming it. Build large models under
    :func:`infinity.init_empty` so buffers the constructor computes are real;
    a buffer left on ``meta`` that ``init`` does not fill is an error, never
    uninitialised memory.

    Nothing is allocated here (NOTE [the layout is decided once, late]): the
    homes are planned for the first optimizer constructed over the model (so
    construct it next), or for Adam's state at the first forward or read of the
    model; then the initial values are written. Outside a forward pass,
    parameters hold zero-byte placeholders on the engine's device: their shape,
    dtype and ``numel()`` are right, their values are in the chunks (read them
    with ``model.state_dict()``). Under data parallel laying out is collective: every
    rank must construct the same optimizer (checked).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload() needs an nn.Module, got {type(model).__name__}")
    if find_engine(model) is not None:
        raise ValueError("this model is already offloaded; call infinity.offload() once per model")
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be an infinity.Config, got {type(config).__name__}")
    init = init if init is not None else native_init(model)
    check_initialisable(model, init)
    _check_parameters(model)
    # See NOTE [dtype auto]: decided once, here, so the ranks agree on what was chosen
    # and the engine (its stats, plans and checkpoints) never sees "auto".
    config = resolved(config)
    world = resolve_world(config.process_group)
    if world.sharded:
        check_agreement(Collectives(world), config, model)
    engine = OffloadEngine(model, config)
    try:
        pending = materialize_buffers(model, engine.device)
        _move_buffers(model, engine.device)
        pending = fill_parameterless_buffers(pending, init)
        on_meta, kept = take_values(engine.registry, engine.dtype, engine.device)
        engine.fill = _filler(model, init, pending, on_meta, kept)
        hooks = HookSet(model, engine)
        hooks.handles.extend(install_state_dict_hooks(engine))
    except BaseException:
        engine.close()
        raise
    # NOTE [the model owns its engine]: the root's hooks hold the hook set, which holds
    # the engine; the engine holds it weakly, and the registry below holds the engine
    # weakly (NOTE [weak registry]).
    engine.hooks_ref = weakref.ref(hooks)
    offloaded.register(model, engine, ((e.param, e.index) for e in engine.registry.entries))
    if world.sharded:
        _decline_data_parallel_wrappers(model)
    return model


def _filler(
    model: nn.Module,
    init: Init | None,
    pending: list[PendingBuffer],
    on_meta: set[int],
    kept: dict[int, torch.Tensor],
) -> Callable[[OffloadEngine], None]:
    """What writes ``model``'s initial values into the engine's homes once they are laid
    out (holding the model weakly: its hooks hold the engine)."""
    ref = weakref.ref(model)

    def fill(engine: OffloadEngine) -> None:
        target = ref()
        if target is None:
            raise ReferenceError("the offloaded model was dropped before its chunks were laid out")
        with torch.no_grad():
            fill_chunks(engine, target, init, pending, on_meta, kept)

    return fill


def _check_parameters(model: nn.Module) -> None:
    """Raise naming a parameter the chunks cannot hold as it is: one offloaded already
    (in a model around or inside this one, or shared with another), one that is not a
    floating-point tensor, or a trainable embedding's with sparse gradients.

    NOTE: the chunks hold every parameter in the compute dtype: a complex one lost its
    imaginary part at offload (torch's copy only warned) and an integer one came back
    as floats; a sparse gradient failed in the middle of backward, inside torch
    ("copy_() between dense and sparse Tensors").
    """
    for name, param in model.named_parameters():
        if offloaded.engine_of_param(param) is not None or is_placeholder(param.data):
            raise ValueError(
                f"parameter {name!r} belongs to a model offloaded already: its values live "
                "in that model's chunks (here it shows a NaN placeholder). Offload each model "
                "once, over all of its parameters: not a module of an offloaded model, nor a "
                "model holding one, nor one sharing a parameter with one"
            )
        if not param.dtype.is_floating_point:
            raise ValueError(
                f"parameter {name!r} is {param.dtype}: infinity's chunks hold parameters in "
                "the compute dtype (a floating-point one), so it would not stay as it is. "
                "Register it as a buffer (module.register_buffer): buffers keep their dtype, "
                "or keep it outside the offloaded model"
            )
    for name, module in model.named_modules():
        sparse = isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse
        if sparse and module.weight.requires_grad:
            target = f"model.{name}" if name else "model"
            raise ValueError(
                f"{name or '<root>'} ({type(module).__name__}) has sparse=True: its gradients "
                "would be sparse, and infinity's gradient chunks hold them dense. Set "
                f"{target}.sparse = False before infinity.offload() (CPUAdam then updates "
                "it as torch's AdamW does a dense embedding), or freeze it"
            )


def _decline_data_parallel_wrappers(model: nn.Module) -> None:
    """Keep Accelerate (and so ``transformers.Trainer``) from wrapping a sharded model in DDP.

    An offloaded model is already data parallel: its chunks are sharded
    over the ranks and its gradients averaged by the engine. DDP on top would
    broadcast into the parameter placeholders and average every gradient a
    second time. ``Accelerator.prepare_model`` returns a model it has prepared
    before unchanged (no DDP, no device move); this marks ours so. Nothing of
    Accelerate is patched; without Accelerate the attribute is inert.
    """
    model._is_accelerate_prepared = True  # type: ignore[assignment]


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def engine_of(model: nn.Module) -> OffloadEngine:
    """The engine of an offloaded model; a clear error if it was not offloaded."""
    engine = find_engine(model)
    if engine is None:
        raise ValueError("this model was not offloaded; call infinity.offload(model, config) first")
    return engine


def find_engine(model: nn.Module) -> OffloadEngine | None:
    """The engine of an offloaded model, or ``None`` if it was not offloaded; also
    through ``torch.compile``'s wrapper of one."""
    engine = offloaded.model_engine(model)
    # NOTE: torch.compile(model) returns a new module holding the model as
    # `_orig_mod`; users pass that wrapper to infinity.stats, save_checkpoint and
    # the rest, which then said the model was not offloaded.
    wrapped = getattr(model, "_orig_mod", None)
    while engine is None and isinstance(wrapped, nn.Module):
        engine = offloaded.model_engine(wrapped)
        wrapped = getattr(wrapped, "_orig_mod", None)
    return engine if isinstance(engine, OffloadEngine) else None
