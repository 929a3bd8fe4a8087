"""A compact GPT-style causal language model in plain PyTorch.

Nothing here knows about offloading: it is the kind of model users bring.
Every module that owns parameters has ``reset_parameters()``, so the model can
be built on the ``meta`` device and initialised chunk by chunk by ``offload``.
The token embedding is tied to the output projection, and the positional
embedding is a parameter of the root module, two cases the engine must handle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity.models.losses import LMHead


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 256
    seq_len: int = 256
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")

    @property
    def num_params(self) -> int:
        """Number of parameters (tied embedding counted once)."""
        h, v = self.hidden, self.vocab_size
        block = 4 * h * h + 4 * h + 2 * self.mlp_ratio * h * h + (self.mlp_ratio + 1) * h + 4 * h
        head = 0 if self.tie_embeddings else v * h
        return v * h + self.seq_len * h + self.layers * block + 2 * h + head


class Attention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = LMHead(cfg.hidden, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the root's own parameter (the positional embedding)."""
        nn.init.normal_(self.wpe, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx`` (batch, time), or the mean cross-entropy if ``targets`` is
        given (blockwise where the logits are large: ``head.loss_block_tokens``)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.wte(idx) + self.wpe[:t]
        for block in self.blocks:
            if self.cfg.checkpoint_activations and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        # The loss is the head's (losses.py): blockwise where the full logits
        # would be the largest working set (head.loss_block_tokens).
        return self.head(self.ln_f(x), targets)


def init_weights(module: nn.Module) -> None:
    """GPT-2 style init for a module whose parameters now have memory."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()
    elif isinstance(module, GPT):
        module.reset_parameters()


def describe(cfg: GPTConfig) -> str:
    """One line: layers, width and parameter count."""
    n = cfg.num_params
    scale = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return f"GPT {cfg.layers}x{cfg.hidden} ({scale} parameters, {cfg.heads} heads)"


__all__ = ["GPT", "GPTConfig", "describe", "init_weights"]
