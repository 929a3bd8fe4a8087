"""Which modules of a model are its repeated blocks (the unit of checkpointing), and,
under ``activations="checkpoint"``, how each block recomputes its forward in backward
(:class:`CheckpointedBlocks`).

The block's ``forward`` is replaced, on the instance only, by one that runs the
original under ``torch.utils.checkpoint`` (non-reentrant: it works with inputs
that do not require grad, keyword arguments and nested calls, and it checks
that the recomputation saves what the first pass saved). Removing restores
the class's ``forward``. The engine's hooks on the modules inside a block run
again during the recomputation and fetch their chunks then
(``OffloadEngine.begin_module`` binds a view for it).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity.config import Config, ConfigError


def find_blocks(
    model: nn.Module, names: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model``, outermost first in registration order, as (name, module).

    ``names`` (``Config.activation_blocks``) selects modules by qualified name or
    class name. Without it: a ``transformers`` model's ``_no_split_modules``
    classes (its decoder layers), else the ``nn.ModuleList`` with the most
    children that all share one class. A module inside a chosen block is never
    a block itself (recomputing it twice would gain nothing).
    """
    modules = list(model.named_modules())
    if names is not None:
        wanted = set(names)
        missing = [w for w in names if not any(w in (n, type(m).__name__) for n, m in modules)]
        if missing:
            raise ConfigError(
                f"activation_blocks={list(names)!r}: no module is named or of class "
                f"{', '.join(map(repr, missing))}; name modules as model.named_modules() "
                f"does (e.g. {_example(modules)!r}) or by class name"
            )
        return _outermost([(n, m) for n, m in modules if n in wanted or type(m).__name__ in wanted])
    classes = getattr(model, "_no_split_modules", None) or ()
    found = _outermost([(n, m) for n, m in modules if type(m).__name__ in classes])
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    uniform = [m for m in lists if len({type(child) for child in m}) == 1]
    if not uniform:
        raise ConfigError(
            "activations='checkpoint' found no repeated blocks in this model (no "
            "nn.ModuleList of one class); name them: Config(activation_blocks=[...]) with "
            f"module names (e.g. {_example(modules)!r}) or a class name"
        )
    best = max(uniform, key=len)
    ids = {id(child) for child in best}
    return [(n, m) for n, m in modules if id(m) in ids]


def blocks_for(
    model: nn.Module, names: Sequence[str] | None, required: bool
) -> list[tuple[str, nn.Module]]:
    """:func:`find_blocks`, or none when the model has no repeated blocks and they are
    neither named nor ``required`` (measuring then gives totals only)."""
    try:
        return find_blocks(model, names)
    except ConfigError:
        if required or names is not None:
            raise
        return []


def recomputed_blocks(model: nn.Module, config: Config) -> list[nn.Module]:
    """The blocks whose forward may run again in backward: every block with
    ``activations="checkpoint"``, or with ``"auto"`` and no NVMe tier; a
    ``transformers`` model's decoder layers when its gradient checkpointing is on
    (``gradient_checkpointing_enable()`` before offload).

    NOTE: ``"auto"`` checkpoints the blocks whose saved tensors fit nowhere, chosen
    after its first forward, once the bytes are measured. With an NVMe tier that is
    none (activations spill there without limit); without one it can be any block,
    so the plan reserves the device room a recomputed block holds for all of them,
    as for ``"checkpoint"``. It did not once: auto, no NVMe and a small host budget
    ran out of device slots in backward at budgets the plan had accepted.
    """
    if config.activations == "checkpoint":
        return [module for _, module in find_blocks(model, config.activation_blocks)]
    if config.activations == "auto" and config.nvme_path is None:
        # A model without repeated blocks has nothing auto could checkpoint.
        return [module for _, module in blocks_for(model, config.activation_blocks, False)]
    if transformers_checkpointing(model):
        return [module for _, module in blocks_for(model, config.activation_blocks, False)]
    return []


def transformers_checkpointing(model: nn.Module) -> bool:
    """A ``transformers`` model's gradient checkpointing is on (``model`` or the first
    module inside it that has the flag: a ``peft`` wrapper does not)."""
    for module in model.modules():
        # transformers 5 renamed the flag (the old name warns, and goes in 6)
        for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(module), flag):
                return bool(getattr(module, flag))
    return False


def _outermost(pairs: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The pairs (in order) whose name is not inside an earlier one's."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in pairs:
        if not any(prefix == "" or name.startswith(prefix + ".") for prefix, _ in out):
            out.append((name, module))
    return out


def _example(modules: list[tuple[str, nn.Module]]) -> str:
    names = [name for name, _ in modules if name]
    return names[len(names) // 2] if names else "layers.0"


# Key-value cache arguments of transformers' decoder layers, by version (5.x: cache).
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(name: str, value: Any) -> bool:
    """A key-value cache argument: by name, or anything with a cache's interface."""
    if value is None:
        return False
    return name in _CACHE_ARGS or (hasattr(value, "update") and hasattr(value, "get_seq_length"))


def _checkpointed(module: nn.Module) -> Callable[..., Any]:
    """``module``'s forward, recomputed in backward, to set as its ``forward``.

    NOTE [the model owns its engine]: it holds the module weakly (calling its class's
    forward), as the module holds it: a bound ``module.forward`` in it was a cycle that
    kept each block, and the model's memory with it, until a garbage collection. A
    forward set on the instance already (another wrapper) is called as it is.
    """
    signature = inspect.signature(module.forward)
    own = module.__dict__.get("forward")
    if own is not None:
        original: Callable[..., Any] = own
    else:
        unbound, target = type(module).forward, weakref.ref(module)

        def original(*args: Any, **kwargs: Any) -> Any:
            return unbound(target(), *args, **kwargs)

    @functools.wraps(type(module).forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference, generation: nothing to save
            return original(*args, **kwargs)
        # NOTE: a recomputation would append this step's keys and values to the
        # cache a second time (and the check of saved shapes would fail), and keys
        # and values recomputed in backward would keep the autograd graph that made
        # them, with views of the block's parameter chunks, for as long as the cache
        # lives: two chunks pinned on the device per block until backward ends.
        # Training does not read the cache, so the checkpointed block fills none.
        # Llama hands it by keyword, GPT-2 by position (transformers 5).
        args = tuple(None if _is_cache("", value) else value for value in args)
        for name, value in list(kwargs.items()):
            if _is_cache(name, value):
                kwargs[name] = None
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    forward.__infinity_checkpoint__ = True  # type: ignore[attr-defined]
    forward.__signature__ = signature  # type: ignore[attr-defined]  # the bound one's
    return forward


class CheckpointedBlocks:
    """The blocks whose forward recomputes in backward; :meth:`remove` undoes it."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]) -> None:
        self.names = [name for name, _ in blocks]
        self._modules = [module for _, module in blocks]
        for module in self._modules:
            if getattr(module.forward, "__infinity_checkpoint__", False):
                continue  # already wrapped (a block listed twice)
            module.forward = _checkpointed(module)

    def remove(self) -> None:
        """Give every block its class's ``forward`` back (idempotent)."""
        for module in self._modules:
            if getattr(module.__dict__.get("forward"), "__infinity_checkpoint__", False):
                del module.forward
        self._modules.clear()
