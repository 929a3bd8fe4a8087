"""``infinity.from_pretrained``: a ``transformers`` checkpoint straight into chunks.

``transformers`` is an optional extra (``pip install 'infinity-offload[hf]'``):
it is imported here, on first use, never by ``import infinity``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from torch import nn

from infinity.config import Config
from infinity.offload import offload
from infinity.pretrained.empty_init import init_empty
from infinity.pretrained.load import load_pretrained


def require_transformers() -> ModuleType:
    """The ``transformers`` module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "this needs the transformers package: pip install 'infinity-offload[hf]'"
        ) from None
    return transformers


def _skip_init(module: nn.Module) -> None:
    """Leave parameters as the zeros they start with: the checkpoint overwrites them all."""


def from_pretrained(
    path: str | os.PathLike[str],
    config: Config | None = None,
    *,
    model_class: Any = None,
    strict: bool = True,
    **model_kwargs: Any,
) -> nn.Module:
    """Build a ``transformers`` model from the local directory ``path``, offload it
    with ``config`` and load its weights, never holding the model whole in RAM.

    ``AutoConfig.from_pretrained(path)`` describes the model; it is built under
    :func:`infinity.init_empty` with ``model_class.from_config`` (default
    ``AutoModelForCausalLM``; ``model_kwargs`` go there, e.g.
    ``attn_implementation="eager"``), offloaded, and filled by
    :func:`infinity.load_pretrained`. With ``strict=False`` parameters absent
    from the checkpoint keep the model's own initialisation
    (``model._init_weights``). Nothing is fetched from the network. As with
    ``transformers``, the model comes back in eval mode: call ``model.train()``
    before fine-tuning (dropout).
    """
    transformers = require_transformers()
    model_class = model_class or transformers.AutoModelForCausalLM
    hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with init_empty():
        model = model_class.from_config(hf_config, **model_kwargs)
    init = _skip_init if strict else getattr(model, "_init_weights", None)
    model = offload(model, config, init=init)
    load_pretrained(model, path, strict=strict)
    return model.eval()
