"""``infinity.from_pretrained``: a ``transformers`` checkpoint straight into chunks.

``transformers`` is an optional extra (``pip install 'infinity-offload[hf]'``):
it is imported here, on first use, never by ``import infinity``.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from torch import nn

from infinity.config import Config
from infinity.pretrained.empty_init import init_empty
from infinity.pretrained.load import offload_pretrained
from infinity.pretrained.safetensors_io import PretrainedError
from infinity.runtime.materialize import InitFn

log = logging.getLogger("infinity")


def require_transformers() -> ModuleType:
    """The ``transformers`` module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "this needs the transformers package: pip install 'infinity-offload[hf]'"
        ) from None
    return transformers


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
    ``attn_implementation="eager"``), and offloaded with the checkpoint as its
    initialisation (each chunk written once, straight from the file; keys
    matched as :func:`infinity.load_pretrained` does). With ``strict=False``
    parameters absent from the checkpoint get the model's own initialisation
    (``model._init_weights``). Nothing is fetched from the network. As with
    ``transformers``, the model comes back in eval mode: call ``model.train()``
    before fine-tuning (dropout). Under a process group (data parallel) every
    rank calls it with the same ``path``, on a filesystem every rank sees.
    """
    transformers = require_transformers()
    model_class = model_class or transformers.AutoModelForCausalLM

    def build() -> tuple[nn.Module, InitFn | None]:
        if not os.path.isfile(os.path.join(path, "config.json")):
            # NOTE: else transformers answers a missing folder with its hub check ("Repo
            # id must use alphanumeric chars ..."): nothing is fetched from the network.
            # Raised in build, which every rank of a sharded model agrees on.
            what = "has no config.json" if os.path.isdir(path) else "is not a directory"
            raise PretrainedError(
                f"'{os.fspath(path)}' {what}: from_pretrained reads a local transformers "
                "model directory (config.json and safetensors weights, as save_pretrained "
                "writes them)"
            )
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with init_empty():
            model = model_class.from_config(hf_config, **model_kwargs)
        return model, None if strict else getattr(model, "_init_weights", None)

    model, result = offload_pretrained(build, path, config, strict=strict)
    if any(result):
        log.warning("infinity.from_pretrained(%s, strict=False): %s", path, result)
    return model.eval()
