"""``infinity.init_empty()``: build a model with parameters on ``meta`` and real buffers.

Inside the context, every parameter a module registers is moved to the ``meta``
device as soon as it is registered, so a model larger than host memory can be
constructed; buffers are left alone, so values the constructor *computes*
(rotary frequencies, position ids, causal masks) are real. ``infinity.offload``
then materialises the parameters chunk by chunk. This is what
``accelerate.init_empty_weights(include_buffers=False)`` does, written here so
the core package needs no extra dependency.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_META = torch.device("meta")
_lock = threading.Lock()
_depth = 0
_original_register = nn.Module.register_parameter


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _original_register(module, name, param)
    if param is None or param.is_meta:
        # NOTE: re-registering an existing meta parameter (weight tying:
        # ``lm_head.weight = embed.weight``) must keep the same object.
        return
    moved = nn.Parameter(param.data.to(_META), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)  # attributes libraries attach (e.g. HF flags)
    module._parameters[name] = moved


@contextmanager
def init_empty() -> Iterator[None]:
    """Construct models with parameters on ``meta`` and buffers computed for real.

    ::

        with infinity.init_empty():
            model = MyModel()          # no parameter memory; buffers hold real values
        model = infinity.offload(model, cfg, init=...)   # or infinity.load_pretrained

    Parameters created inside get real memory only for an instant (the
    constructor's ``torch.empty``), then live on ``meta``. Nested use is fine;
    the patch of ``nn.Module.register_parameter`` is removed when the
    outermost context exits, also on an exception.
    """
    global _depth
    with _lock:
        if _depth == 0:
            nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign,assignment]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                nn.Module.register_parameter = _original_register  # type: ignore[method-assign]
