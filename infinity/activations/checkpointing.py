"""``activations="checkpoint"``: each block recomputes its forward in backward.

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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Key-value cache arguments of transformers' decoder layers, by version (5.x: cache).
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(name: str, value: Any) -> bool:
    """A key-value cache argument: by name, or anything with a cache's interface."""
    if value is None:
        return False
    return name in _CACHE_ARGS or (hasattr(value, "update") and hasattr(value, "get_seq_length"))


def _checkpointed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
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
    return forward


class CheckpointedBlocks:
    """The blocks whose forward recomputes in backward; :meth:`remove` undoes it."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]) -> None:
        self.names = [name for name, _ in blocks]
        self._modules = [module for _, module in blocks]
        for module in self._modules:
            if getattr(module.forward, "__infinity_checkpoint__", False):
                continue  # already wrapped (a block listed twice)
            module.forward = _checkpointed(module.forward)

    def remove(self) -> None:
        """Give every block its class's ``forward`` back (idempotent)."""
        for module in self._modules:
            if getattr(module.__dict__.get("forward"), "__infinity_checkpoint__", False):
                del module.forward
        self._modules.clear()
