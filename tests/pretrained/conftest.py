"""Tiny ``transformers`` models built locally (no network) and offload configs for them."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 300


def _llama_config(tied: bool):
    """A two-layer Llama: rotary buffers, grouped-query attention, tied or untied head."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip


def _gpt2_config():
    """A two-layer GPT-2 (tied head, Conv1D weights, learned positions)."""
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


@pytest.fixture
def make_model():
    """``make_model(kind, seed)``: a freshly initialised plain model of ``kind``."""

    def make(kind: str, seed: int = 0):
        torch.manual_seed(seed)
        config = {
            "llama-tied": lambda: _llama_config(True),
            "llama-untied": lambda: _llama_config(False),
            "gpt2": _gpt2_config,
        }[kind]()
        model = transformers.AutoModelForCausalLM.from_config(config)
        return model.eval()

    return make


@pytest.fixture
def offload_config():
    """``offload_config(dtype)``: small CPU budgets, no NVMe."""
    import infinity

    def make(dtype: str = "fp32", **overrides):
        fields = {"device": "cpu", "dtype": dtype, "device_memory": "1MiB",
                  "host_memory": "64MiB", "nvme_path": None}  # fmt: skip
        fields.update(overrides)
        return infinity.Config(**fields)

    return make


@pytest.fixture
def llama_config():
    """``llama_config(tied)``: the tiny Llama's config."""
    return _llama_config
