"""Shared helpers for engine tests: tiny models, batches, and a plain-PyTorch reference."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import infinity
from infinity.models.gpt import GPT, GPTConfig, init_weights

VOCAB = 96
SEQ = 32


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A small GPT with GPT-2 style init (tied embeddings, root parameter)."""
    torch.manual_seed(seed)
    fields = {"vocab_size": VOCAB, "seq_len": SEQ, "layers": 4, "hidden": 32, "heads": 4}
    fields.update(overrides)
    model = GPT(GPTConfig(**fields))
    model.apply(init_weights)
    return model


def tiny_llama(
    vocab: int = VOCAB,
    hidden: int = 32,
    intermediate: int | None = None,
    tie: bool = False,
    seed: int = 0,
    layers: int = 2,
) -> nn.Module:
    """A ``transformers`` Llama of ``layers`` layers (grouped-query attention: 4 heads,
    2 KV heads); ``intermediate`` defaults to twice ``hidden``. Skips without transformers."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def llama_113m_config(vocab: int = 16384):
    """The 16-layer Llama of issue 18 (hidden 768, tied ``vocab`` x 768 embedding):
    its embedding is far larger than any chunk. Skips without transformers."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=True,
    )


def batches(n: int, seed: int = 1, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB):
    """``n`` random (input, target) batches."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g),
        )
        for _ in range(n)
    ]


def param_bytes(model: nn.Module, element_size: int) -> int:
    """Bytes of the model's parameters in a dtype of ``element_size`` bytes."""
    return sum(p.numel() for p in model.parameters()) * element_size


LossFn = Callable[[nn.Module, tuple], torch.Tensor]


def gpt_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Mean cross-entropy of a GPT on one batch."""
    x, y = batch
    return model(x, y)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Sequence[tuple],
    *,
    accum: int = 1,
    loss_fn: LossFn = gpt_loss,
    before_step: Callable[[int], None] | None = None,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """The plain loop: ``accum`` micro-batches per step; returns the mean loss per step."""
    losses = []
    for step in range(len(data) // accum):
        total = 0.0
        for micro in data[step * accum : (step + 1) * accum]:
            loss = loss_fn(model, micro) / accum
            (scale(loss) if scale else loss).backward()
            total += loss.item()
        if before_step is not None:
            before_step(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def reference_pair(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1):
    """A deep copy of ``model`` with ``torch.optim.AdamW`` (single-tensor path)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    return ref, opt


def global_rel_error(model: nn.Module, ref: nn.Module) -> float:
    """||theta - theta_ref|| / ||theta_ref|| over all parameters (from state dicts)."""
    ours, theirs = model.state_dict(), ref.state_dict()
    num = sum(float((ours[k].double() - v.double()).pow(2).sum()) for k, v in theirs.items())
    den = sum(float(v.double().pow(2).sum()) for v in theirs.values())
    return (num / den) ** 0.5


def per_tensor_rel_errors(model: nn.Module, ref: nn.Module) -> dict[str, float]:
    """||p - p_ref|| / ||p_ref|| per parameter."""
    ours, theirs = model.state_dict(), ref.state_dict()
    out = {}
    for k, v in theirs.items():
        den = float(v.double().norm()) or 1.0
        out[k] = float((ours[k].double() - v.double()).norm()) / den
    return out


def config(**kw) -> infinity.Config:
    """A CPU-backend config with test-sized defaults."""
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "fp32")
    return infinity.Config(**kw)


def learnable_batches(n: int, seed: int = 1, batch: int = 4, seq: int = SEQ, vocab: int = VOCAB):
    """Batches whose target is ``(token + 1) % vocab``: a tiny model learns it in a few steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((x, (x + 1) % vocab))
    return out


def offload_on_nvme(model: nn.Module, tmp_path, host_factor: float, **overrides) -> nn.Module:
    """``model`` offloaded with a host budget of ``host_factor`` x its fp32 parameter
    bytes (the rest on NVMe in ``tmp_path``), 0.6x of them on the device, 24 KiB
    chunks; ``overrides``: other ``Config`` fields."""
    pbytes = param_bytes(model, 4)
    cfg = {
        "device_memory": pbytes * 6 // 10,
        "host_memory": int(pbytes * host_factor),
        "chunk_size": "24KiB",
        "nvme_path": str(tmp_path),
        **overrides,
    }
    return infinity.offload(model, config(**cfg))


def nvme_pair(tmp_path, host_factor: float = 2.0, **overrides):
    """A tiny GPT offloaded with its optimizer states on NVMe (host budget
    ``host_factor`` x the parameter bytes), its CPUAdam, and the torch reference
    pair: ``(model, optimizer, ref, ref_optimizer)``."""
    from infinity.optim import CPUAdam

    model = tiny_gpt()
    ref, ref_opt = reference_pair(model)
    model = offload_on_nvme(model, tmp_path, host_factor, **overrides)
    return model, CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1), ref, ref_opt


def train_pair_error(model, opt, ref, ref_opt, steps: int) -> float:
    """Train both for ``steps`` batches; the global relative error of ``model`` after."""
    data = batches(steps)
    train(model, opt, data)
    train(ref, ref_opt, data)
    return global_rel_error(model, ref)


def resume_equals_uninterrupted(tmp_path, checkpoint, data, start: int) -> nn.Module:
    """Load ``checkpoint`` (saved after ``data[:start]``) into a fresh NVMe model, train
    it on ``data[start:]``, and require every tensor of its state bit-identical to a
    fault-free run over all of ``data``; the resumed model (still open) is returned."""
    from infinity.offload import engine_of

    resumed, resumed_opt, _r, _o = nvme_pair(tmp_path / "resumed", host_factor=1.0)
    infinity.load_checkpoint(checkpoint, resumed, resumed_opt)
    train(resumed, resumed_opt, data[start:])
    clean, clean_opt, _r, _o = nvme_pair(tmp_path / "clean", host_factor=1.0)
    train(clean, clean_opt, data)
    got, want = resumed.state_dict(), clean.state_dict()
    engine_of(clean).close()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    return resumed


def clipping_pair(**cfg) -> tuple[nn.Module, nn.Module]:
    """A tiny GPT offloaded in 16 KiB chunks (device below the parameters) and a plain
    copy, for comparing gradient clipping on both."""
    model = tiny_gpt()
    ref = copy.deepcopy(model)
    cfg.setdefault("device_memory", "256KiB")
    cfg.setdefault("chunk_size", "16KiB")
    return infinity.offload(model, config(**cfg)), ref


def backward_both(model: nn.Module, ref: nn.Module, batch_index: int = 0) -> None:
    """The same batch's loss backpropagated through both models."""
    batch = batches(batch_index + 1)[batch_index]
    gpt_loss(model, batch).backward()
    gpt_loss(ref, batch).backward()
