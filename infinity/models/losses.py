"""Next-token cross-entropy without the full logits: the output layer, a block of tokens
at a time.

A language model's loss is often its largest working set: ``tokens x vocab`` logits,
their fp32 copy and their gradient (a 4096-token sequence over a 128k vocabulary is
2 GiB of fp32 logits alone). :func:`blockwise_cross_entropy` computes the same loss
a block of tokens at a time. Each block's logits are recomputed in backward
(``torch.utils.checkpoint``), so at most one block of logits and its gradient exist at
once. The loss is exact: the sum of the blocks' summed losses over the count of
targets, the full loss's arithmetic in another summation order (equal to fp32
rounding; tests/engine/test_blockwise_loss.py).

Plain PyTorch: the output layer is called as a module for every block (and again in
backward), so an offload engine's hooks bind its weight each time.
:func:`causal_lm_loss` does the same for a ``transformers`` causal LM.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
# Full fp32 logits above this many bytes: the loss is worth taking a block at a time.
BLOCKWISE_ABOVE_BYTES = 64 << 20


def _block_loss(
    head: Callable[[torch.Tensor], torch.Tensor], ignore_index: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).float()
        return F.cross_entropy(
            logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum"
        )

    return loss


def blockwise_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    block_tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` (computed in fp32) against ``targets``,
    over the targets that are not ``ignore_index``, ``block_tokens`` positions at a time.

    ``hidden``: ``(..., tokens, width)``, flattened over its leading dimensions;
    ``targets``: the matching ``(..., tokens)``. No target at all gives 0, not NaN.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens} must be a positive number of tokens")
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = targets.reshape(-1)
    if labels.numel() != flat.shape[0]:
        raise ValueError(f"{labels.numel()} targets for {flat.shape[0]} positions of hidden states")
    loss = _block_loss(head, ignore_index)
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], block_tokens):
        rows = slice(start, start + block_tokens)
        if flat.requires_grad or torch.is_grad_enabled():
            total = total + checkpoint(loss, flat[rows], labels[rows], use_reentrant=False)
        else:
            total = total + loss(flat[rows], labels[rows])
    count = (labels != ignore_index).sum().clamp(min=1)
    return total / count


def wants_blocks(tokens: int, vocab: int, block_tokens: int | None) -> bool:
    """Whether a loss over ``tokens`` positions of a ``vocab``-way output is taken in
    blocks: always for an explicit ``block_tokens``; by default when the fp32 logits
    would exceed :data:`BLOCKWISE_ABOVE_BYTES`."""
    if block_tokens is not None:
        return block_tokens > 0
    return tokens * vocab * 4 > BLOCKWISE_ABOVE_BYTES


def default_block_tokens(vocab: int) -> int:
    """Tokens per block whose fp32 logits take a sixteenth of the threshold (4 MiB)."""
    return max(1, (BLOCKWISE_ABOVE_BYTES // 16) // (4 * vocab))


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    block_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    **kwargs: Any,
) -> torch.Tensor:
    """Mean next-token cross-entropy of a ``transformers`` causal LM (or a wrapper of one,
    e.g. a ``peft`` model), blockwise where the logits are large (:func:`wants_blocks`).

    ``targets[..., i]`` is the token position ``i`` predicts (``labels`` shifted left by
    one, as ``transformers`` does inside ``model(input_ids, labels=labels)``);
    ``ignore_index`` positions are not trained on. ``kwargs`` go to the model's forward
    (an ``attention_mask``). The loss is computed inside the model's forward, from the
    backbone's last hidden states, by calling its output embedding a block at a time;
    the model itself computes the logits of the last position only (``logits_to_keep``),
    which are compared with the head's: a model that transforms its logits (scaling,
    soft-capping) is refused, never given another loss.
    """
    # NOTE: the class's prefix, not the instance's: a peft wrapper forwards attribute
    # reads to the model it wraps, and would pass for one.
    hf: Any = next((m for m in model.modules() if getattr(type(m), "base_model_prefix", "")), None)
    head = hf.get_output_embeddings() if hf is not None else None
    backbone = getattr(hf, type(hf).base_model_prefix, None) if hf is not None else None
    if not isinstance(head, nn.Module) or not isinstance(backbone, nn.Module):
        raise ValueError(
            f"{type(model).__name__} is not a transformers causal LM (no output embedding and "
            "backbone found); compute its loss from its logits"
        )
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    vocab = int(weight.shape[0])
    taken: dict[str, torch.Tensor] = {}

    def loss_from_hidden(_module: nn.Module, _args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        taken["last"] = head(hidden[..., -1:, :]).float()
        if wants_blocks(targets.numel(), vocab, block_tokens):
            block = block_tokens or default_block_tokens(vocab)
            taken["loss"] = blockwise_cross_entropy(hidden, head, targets, block, ignore_index)
        else:
            taken["loss"] = _block_loss(head, ignore_index)(hidden, targets) / (
                (targets != ignore_index).sum().clamp(min=1)
            )

    forward_args = inspect.signature(hf.forward).parameters
    if "logits_to_keep" in forward_args:
        kwargs["logits_to_keep"] = 1
    handle = backbone.register_forward_hook(loss_from_hidden)
    try:
        output = model(input_ids=input_ids, **kwargs)
    finally:
        handle.remove()
    logits = output.logits[..., -1:, :].float()
    if not torch.allclose(logits, taken["last"], rtol=1e-3, atol=1e-3):
        raise ValueError(
            f"{type(hf).__name__} transforms its logits after its output embedding (scaling or "
            "soft-capping): causal_lm_loss would compute another loss; use the model's own"
        )
    return taken["loss"]
