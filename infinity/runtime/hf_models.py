"""Recognising a ``transformers`` model without importing ``transformers``."""

from __future__ import annotations

import sys

from torch import nn


def is_pretrained_model(module: nn.Module) -> bool:
    """``module`` is a ``transformers.PreTrainedModel``.

    NOTE: looked up in ``sys.modules``, never imported: a module can only be a
    PreTrainedModel if ``transformers`` is already loaded, and the core package
    does not depend on it.
    """
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return pretrained is not None and isinstance(module, pretrained)
