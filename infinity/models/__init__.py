"""Models shipped with the package (used by ``infinity train`` and the tests)."""

from infinity.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
