"""What each forward saved for backward, measured while it runs.

Every policy's forward counts the bytes autograd saves (tensors on the compute
device that are not parameter views), in all and per block, with the forward's
tokens. From the largest forward measured, :meth:`ActivationTrace.predict`
says what a forward with more tokens will save (linearly: an underestimate for
attention whose saves grow faster, so a check built on it never refuses a step
that would fit), and ``activations="auto"`` chooses per block from the sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class ForwardSaves:
    """Bytes one forward saved for backward (``tokens``: its batch x sequence)."""

    tokens: int
    total: int = 0
    per_block: list[int] = field(default_factory=list)
    on_device: int = 0  # of total, what stayed on the compute device (not moved)

    @property
    def outside_blocks(self) -> int:
        """Saved outside every block (embeddings, final norm, logits, loss)."""
        return self.total - sum(self.per_block)

    def scaled(self, tokens: int) -> ForwardSaves:
        """The same forward at ``tokens`` (every saved tensor grows with the tokens)."""
        ratio = tokens / max(1, self.tokens)
        return ForwardSaves(
            tokens, round(self.total * ratio), [round(b * ratio) for b in self.per_block]
        )


def batch_shape(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """(batch, sequence) of a forward's input: ``input_ids`` (or ``inputs_embeds``), else
    the first tensor argument; a 1-D one is one sequence."""
    first = kwargs.get("input_ids")
    if first is None:
        first = kwargs.get("inputs_embeds")
    if first is None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return None
    if first.dim() == 1:
        return 1, int(first.shape[0])
    return int(first.shape[0]), int(first.shape[1])


class ActivationTrace:
    """Saved bytes per forward, per block (``blocks``: the model's repeated blocks)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self._index = {id(m): i for i, m in enumerate(blocks)}
        self.block_count = len(blocks)
        self._stack: list[int] = []  # blocks running (recomputations in backward too)
        self._forward: ForwardSaves | None = None  # the forward being measured
        self.last: ForwardSaves | None = None
        self.largest: ForwardSaves | None = None  # the most tokens measured

    @property
    def current_block(self) -> int | None:
        """Index of the innermost block running, or ``None``."""
        return self._stack[-1] if self._stack else None

    def enter(self, module: nn.Module) -> None:
        """A block's forward starts (its forward pre-hook)."""
        self._stack.append(self._index[id(module)])

    def leave(self, module: nn.Module) -> None:
        """A block's forward ended, or raised (its forward hook, ``always_call``)."""
        if self._stack:
            self._stack.pop()

    def begin(self, tokens: int | None) -> None:
        """A root forward starts; ``None``: not measured (no tokens, or no grad)."""
        self._stack.clear()
        self._forward = (
            None if tokens is None else ForwardSaves(tokens, per_block=[0] * self.block_count)
        )

    def saved(self, tensor: torch.Tensor, moved: bool) -> None:
        """Autograd saved ``tensor`` during the forward being measured (``moved``: it
        left the device)."""
        forward = self._forward
        if forward is None:
            return
        nbytes = tensor.numel() * tensor.element_size()
        forward.total += nbytes
        if not moved and tensor.device.type != "meta":
            forward.on_device += nbytes
        if self._stack:
            forward.per_block[self._stack[-1]] += nbytes

    def end(self) -> None:
        """The root forward ended: its measurement becomes ``last``."""
        forward, self._forward = self._forward, None
        if forward is None or forward.total == 0:
            return
        self.last = forward
        if self.largest is None or forward.tokens >= self.largest.tokens:
            self.largest = forward

    def predict(self, tokens: int | None) -> ForwardSaves | None:
        """What a forward of ``tokens`` will save, when it has more tokens than any
        measured (``None`` otherwise: one at least as large has run already)."""
        if tokens is None or self.largest is None or tokens <= self.largest.tokens:
            return None
        return self.largest.scaled(tokens)

    def per_token(self) -> float:
        """Bytes saved per token by the largest forward measured (0: none yet)."""
        largest = self.largest
        return 0.0 if largest is None else largest.total / max(1, largest.tokens)
