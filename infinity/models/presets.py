"""Named GPT shapes (GPT-2 and LLaMA-like sizes) for ``infinity plan`` and ``infinity train``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from infinity.models.gpt import GPTConfig

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=128, layers=2, hidden=128, heads=4),
    "small": GPTConfig(vocab_size=50304, seq_len=1024, layers=12, hidden=768, heads=12),
    "medium": GPTConfig(vocab_size=50304, seq_len=1024, layers=24, hidden=1024, heads=16),
    "large": GPTConfig(vocab_size=50304, seq_len=1024, layers=36, hidden=1280, heads=20),
    "xl": GPTConfig(vocab_size=50304, seq_len=1024, layers=48, hidden=1600, heads=25),
    "7b": GPTConfig(vocab_size=32000, seq_len=2048, layers=32, hidden=4096, heads=32),
    "13b": GPTConfig(vocab_size=32000, seq_len=2048, layers=40, hidden=5120, heads=40),
    "70b": GPTConfig(vocab_size=32000, seq_len=2048, layers=80, hidden=8192, heads=64),
}


def preset(name: str, **overrides: int) -> GPTConfig:
    """The preset ``name`` with some fields replaced; ``KeyError`` names the valid presets."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[name], **changes)
