"""Next-token cross-entropy without the full logits: the output layer, a block of tokens
at a time.

A language model's loss is often its largest working set: ``tokens x vocab`` logits,
their fp32 copy and their gradient (a 4096-token sequence over a 128k vocabulary is
2 GiB of fp32 logits alone). :func:`blockwise_cross_entropy` computes the same loss a
block of tokens at a time, and in backward recomputes each block's logits, so at most
one block of logits and its gradient exist at once.

It is exact, to fp32 rounding, also in 16-bit compute. Each block's logits are computed
as the full loss computes them (the compute dtype's product, then fp32), and each
block's gradient is rounded to the compute dtype before it meets the hidden states or
the weight, as autograd rounds the full one. The weight's gradient is accumulated over
the blocks in fp32 and rounded once. Rounding each block's share would add roundings
the full loss never makes: 2-7x torch's own noise in bf16, measured by the equivalence
sweep. That fp32 accumulator (the head's size in fp32) is why blocks are taken only
where the logits are larger than it (:func:`wants_blocks`).

Plain PyTorch: no engine. The weight is whatever tensor the caller passes: an output
layer's ``weight`` inside its module's forward (:class:`LMHead`), or a
``transformers`` model's output embedding inside the model's forward
(:func:`causal_lm_loss`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

IGNORE_INDEX = -100
# Full fp32 logits above this many bytes: the loss is worth taking a block at a time.
BLOCKWISE_ABOVE_BYTES = 64 << 20


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` over ``targets``, by blocks."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        block: int,
        ignore_index: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for rows in _blocks(hidden.shape[0], block):
            logits = F.linear(hidden[rows], weight, bias).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            total += F.cross_entropy(
                logits, targets[rows], ignore_index=ignore_index, reduction="sum"
            )
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.block, ctx.ignore_index = block, ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        for rows in _blocks(hidden.shape[0], ctx.block):
            h = hidden[rows]
            logits = F.linear(h, weight, bias).float()
            grad = torch.exp(logits - lse[rows, None])  # softmax
            labels = targets[rows]
            kept = labels != ctx.ignore_index
            grad[torch.arange(len(labels), device=grad.device), labels.clamp(min=0)] -= 1.0
            grad *= kept[:, None] * grad_total
            # NOTE: rounded to the compute dtype where autograd rounds the full logits'
            # gradient (the backward of `.float()`), then used as the full loss uses it.
            grad = grad.to(hidden.dtype)
            if grad_h is not None:
                grad_h[rows] = grad @ weight
            if want_w:
                grad_w += grad.float().t() @ h.float()
            if want_b:
                grad_b += grad.float().sum(0)
        return (
            grad_h,
            grad_w.to(weight.dtype) if want_w else None,
            grad_b.to(bias.dtype) if want_b else None,
            None,
            None,
            None,
        )


def _blocks(n: int, block: int) -> list[slice]:
    return [slice(start, min(start + block, n)) for start in range(0, n, block)]


def blockwise_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    block_tokens: int,
    ignore_index: int = IGNORE_INDEX,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``F.linear(hidden, weight, bias)`` (in fp32) against
    ``targets`` over the targets that are not ``ignore_index``, ``block_tokens``
    positions at a time (see the module docstring).

    ``hidden``: ``(..., tokens, width)``, flattened over its leading dimensions;
    ``targets``: the matching ``(..., tokens)``. No target at all gives 0, not NaN.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens} must be a positive number of tokens")
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = targets.reshape(-1)
    if labels.numel() != flat.shape[0]:
        raise ValueError(f"{labels.numel()} targets for {flat.shape[0]} positions of hidden states")
    total = _BlockwiseCrossEntropy.apply(flat, weight, bias, labels, block_tokens, ignore_index)
    return total / (labels != ignore_index).sum().clamp(min=1)


def wants_blocks(tokens: int, vocab: int, width: int, block_tokens: int | None) -> bool:
    """Whether a loss over ``tokens`` positions of a ``vocab``-way output of a
    ``width``-wide model is taken in blocks: always for a positive ``block_tokens``,
    never for 0; by default where the fp32 logits would exceed
    :data:`BLOCKWISE_ABOVE_BYTES` and the head's fp32 gradient (``vocab x width``, the
    accumulator) is smaller than them."""
    if block_tokens is not None:
        return block_tokens > 0
    return tokens * vocab * 4 > BLOCKWISE_ABOVE_BYTES and tokens > width


def default_block_tokens(vocab: int) -> int:
    """Tokens per block whose fp32 logits take a sixteenth of the threshold (4 MiB)."""
    return max(1, (BLOCKWISE_ABOVE_BYTES // 16) // (4 * vocab))


def lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    block_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean next-token loss of an output layer (``weight``, ``bias``) over ``hidden``:
    blockwise where :func:`wants_blocks` says so, else from the full fp32 logits."""
    vocab, width = weight.shape
    if wants_blocks(targets.numel(), vocab, width, block_tokens):
        per_block = block_tokens or default_block_tokens(vocab)
        return blockwise_cross_entropy(hidden, weight, targets, per_block, ignore_index, bias)
    return logits_loss(F.linear(hidden, weight, bias), targets, ignore_index)


def logits_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean cross-entropy of full ``logits`` (in fp32) over the targets that are not
    ``ignore_index`` (none at all: 0, not NaN)."""
    total = F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
        reduction="sum",
    )  # fmt: skip
    return total / (targets != ignore_index).sum().clamp(min=1)


class LMHead(nn.Linear):
    """An output layer that also computes the loss: ``head(x)`` gives logits,
    ``head(x, targets)`` the mean next-token loss (:func:`lm_loss`), inside the module's
    own forward (where an offload engine has its weight bound)."""

    def __init__(self, width: int, vocab: int, bias: bool = False) -> None:
        super().__init__(width, vocab, bias=bias)
        # Tokens per block of the loss: None decides by size (wants_blocks), 0 never.
        self.loss_block_tokens: int | None = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return lm_loss(x, self.weight, targets, self.loss_block_tokens, bias=self.bias)


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
    e.g. a ``peft`` model), blockwise where the logits are large (:func:`lm_loss`).

    ``targets[..., i]`` is the token position ``i`` predicts (``labels`` shifted left by
    one, as ``transformers`` does inside ``model(input_ids, labels=labels)``);
    ``ignore_index`` positions are not trained on. ``kwargs`` go to the model's forward
    (an ``attention_mask``). The loss is computed inside the model's forward, from the
    backbone's last hidden states and the output embedding's weight; the model itself
    computes the logits of the last position only (``logits_to_keep``), which are
    compared with the head's: a model that transforms its logits (scaling,
    soft-capping) is refused, never given another loss. A model without a
    ``transformers`` backbone and linear head is run whole, its loss taken from its
    ``logits`` (full, in fp32).
    """
    # NOTE: the class's prefix, not the instance's: a peft wrapper forwards attribute
    # reads to the model it wraps, and would pass for one.
    hf: Any = next((m for m in model.modules() if getattr(type(m), "base_model_prefix", "")), None)
    head = hf.get_output_embeddings() if hf is not None else None
    backbone = getattr(hf, type(hf).base_model_prefix, None) if hf is not None else None
    if not isinstance(head, nn.Linear) or not isinstance(backbone, nn.Module):
        return logits_loss(model(input_ids=input_ids, **kwargs).logits, targets, ignore_index)
    taken: dict[str, torch.Tensor] = {}

    def loss_from_hidden(_module: nn.Module, _args: Any, output: Any) -> None:
        # NOTE: runs inside the model's forward, where the head's weight is bound.
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        taken["last"] = head(hidden[..., -1:, :]).float().detach()
        taken["loss"] = lm_loss(
            hidden, head.weight, targets, block_tokens, ignore_index, bias=head.bias
        )

    if "logits_to_keep" in inspect.signature(hf.forward).parameters:
        kwargs["logits_to_keep"] = 1
    handle = backbone.register_forward_hook(loss_from_hidden)
    try:
        output = model(input_ids=input_ids, **kwargs)
    finally:
        handle.remove()
    logits = output.logits[..., -1:, :].float()
    # A forecast runs this on fake tensors (infinity.memory_forecast): no values.
    if not is_fake(logits) and not torch.allclose(logits, taken["last"], rtol=1e-3, atol=1e-3):
        raise ValueError(
            f"{type(hf).__name__} transforms its logits after its output embedding (scaling or "
            "soft-capping): causal_lm_loss would compute another loss; use the model's own"
        )
    return taken["loss"]
