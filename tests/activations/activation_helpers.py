"""The small models and budgets the activation tests train."""

from __future__ import annotations

import torch

import infinity

VOCAB, SEQ, BATCH = 128, 32, 4


def tiny_model(kind: str) -> torch.nn.Module:
    """A seeded ``transformers`` Llama or GPT-2 (dropout on) in training mode."""
    torch.manual_seed(0)
    import transformers

    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg).train()
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=SEQ
    )  # dropout 0.1 everywhere
    return transformers.GPT2LMHeadModel(cfg).train()


def activation_config(
    model: torch.nn.Module, dtype: str, policy: str, nvme: str | None
) -> infinity.Config:
    """Room for checkpointed blocks on the device; with NVMe, states and activations spill."""
    n = sum(p.numel() for p in model.parameters())
    return infinity.Config(
        dtype=dtype,
        device_memory=int(2.5 * n * 4),  # a checkpointed block keeps its chunks (README)
        # With NVMe: a third of the states' host bytes, so states and activations spill.
        host_memory=int(n * 16 / 3) if nvme else "1GiB",
        nvme_path=nvme,
        chunk_size="16KiB",
        activations=policy,
        activation_min_bytes=0,
    )
