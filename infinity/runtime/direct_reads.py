"""Parameters that a model's own forward reads without calling their module.

Fused losses — TRL's ``SFTTrainer`` (its fused LM head), Liger,
cut-cross-entropy — run the backbone, then take ``lm_head.weight`` and
multiply by it in their own kernel, in tiles, so the head module's forward,
and with it the engine's fetch, never runs. The weight would then be the
parameter's placeholder (NaN). For a ``transformers`` model the engine
therefore keeps the output embedding's parameters bound from the end of the
backbone's forward to the end of the root's (where the head is used in
either case), exactly as if the head's forward had been running.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from infinity.runtime.hf_models import is_pretrained_model
from infinity.runtime.params import ParamRegistry


@dataclass(frozen=True)
class DirectRead:
    """Bind ``owner``'s parameters once ``backbone``'s forward has ended, until the
    root's forward ends (``owner``: the head, or whichever module owns its weight)."""

    backbone: nn.Module
    owner: nn.Module


def head_read_directly(model: nn.Module, registry: ParamRegistry) -> DirectRead | None:
    """The :class:`DirectRead` of ``model``'s output embedding, if ``model`` is (or
    wraps, like a ``peft`` model) a ``transformers`` model whose head is offloaded."""
    hf = next((m for m in model.modules() if is_pretrained_model(m)), None)
    if hf is None:
        return None
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    backbone = getattr(hf, getattr(hf, "base_model_prefix", ""), None)
    weight = getattr(head, "weight", None)
    if not isinstance(backbone, nn.Module) or not isinstance(weight, nn.Parameter):
        return None
    if head in registry.owners:
        # NOTE: with tied weights the head owns the weight too: its own forward
        # (when a loop does call it) then nests inside the direct read's binding.
        return DirectRead(backbone, head)
    for module, entries in registry.owners.items():
        if any(e.param is weight for e in entries):
            return DirectRead(backbone, module)
    return None
