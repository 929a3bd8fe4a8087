"""The model family of ``infinity bench scale`` and the pick of its largest member that fits.

The family is the Llama shape of the 2.24B example in the scale issue (hidden
2560, 32 layers, head dimension 128, SwiGLU width 8/3 of hidden) scaled in
steps of 128 in ``hidden`` with the depth growing along (``layers = hidden /
80``), so that each member is a plausible model rather than a deep thin stack.
Parameter counts are computed in closed form (no model is built to choose one).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from infinity.optim.chunk_optimizer import ADAM
from infinity.utils.sizes import format_size

FP32_BYTES = 4
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
HIDDEN_STEP = 128
HEAD_DIM = 128
HIDDEN_PER_LAYER = 80  # 2560 hidden / 32 layers
MAX_HIDDEN = 1 << 16


@dataclass(frozen=True)
class Shape:
    """A bias-free, untied ``transformers`` Llama (multi-head attention)."""

    hidden: int
    layers: int
    vocab: int

    @property
    def intermediate(self) -> int:
        """SwiGLU width: 8/3 of hidden rounded up to a multiple of 256 (as Llama does)."""
        return -(-self.hidden * 8 // 3 // 256) * 256

    @property
    def heads(self) -> int:
        """Attention heads of dimension 128 (one head below 128 hidden)."""
        return max(1, self.hidden // HEAD_DIM)

    @property
    def num_params(self) -> int:
        """Parameters: per layer 4 attention projections, 3 MLP ones and 2 norms;
        the embedding, the output head and the final norm."""
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h

    def llama_config(self, max_positions: int = 4096) -> Any:
        """The ``transformers.LlamaConfig`` of this shape (imports transformers)."""
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
        )

    def describe(self) -> str:
        """One line: size and shape."""
        n = self.num_params
        size = f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"
        return f"Llama {size} (hidden {self.hidden}, {self.layers} layers, vocab {self.vocab})"


def bytes_per_param(dtype: str, state_dtype: str = "fp32") -> float:
    """Bytes of training state per parameter: the parameter and its gradient in the
    compute dtype, plus the optimizer unit (an fp32 master copy unless the compute
    dtype is fp32, and Adam's two moments stored as ``state_dtype``)."""
    element = ELEMENT_BYTES[dtype]
    unit = ADAM.with_state_dtype(state_dtype).unit_bytes(UNIT_SAMPLE, has_master=dtype != "fp32")
    per = 2 * element + unit / UNIT_SAMPLE
    return int(per) if per == int(per) else per


# Elements of a large chunk, to read the per-element bytes of a unit off (int8's
# block scales make them fractional).
UNIT_SAMPLE = 1 << 20


def family(vocab: int) -> Iterator[Shape]:
    """Members in increasing size (hidden 128, 256, ...)."""
    for hidden in range(HIDDEN_STEP, MAX_HIDDEN + 1, HIDDEN_STEP):
        yield Shape(hidden, max(2, round(hidden / HIDDEN_PER_LAYER)), vocab)


def usable_disk(free_bytes: int, margin: float, reserved: int) -> int:
    """Bytes of states the bench lets itself put on a disk with ``free_bytes`` free:
    ``margin`` of it stays free for everyone else, ``reserved`` more for the
    bench's own bandwidth measurement file."""
    return max(0, int(free_bytes * (1 - margin)) - reserved)


def pick_shape(
    *, vocab: int, dtype: str, max_states: int | None = None, max_params: int | None = None
) -> Shape:
    """The largest member whose states fit ``max_states`` bytes and whose
    parameters are at most ``max_params``; :class:`ValueError` naming the smallest
    member's needs if none does."""
    per = bytes_per_param(dtype)
    best = None
    for shape in family(vocab):
        n = shape.num_params
        if (max_states is not None and n * per > max_states) or (
            max_params is not None and n > max_params
        ):
            break
        best = shape
    if best is None:
        smallest = next(family(vocab))
        raise ValueError(
            f"even the smallest model ({smallest.describe()}: {smallest.num_params} parameters, "
            f"{format_size(smallest.num_params * per)} of states) is above the limit "
            f"(states {format_size(max_states) if max_states is not None else 'unlimited'}, "
            f"parameters {max_params if max_params is not None else 'unlimited'}); "
            "free disk space, or use a smaller --vocab"
        )
    return best
