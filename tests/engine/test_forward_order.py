"""Chunks are packed in the order the forward uses the parameters (issue 43 part 4).

A ``transformers`` decoder layer registers its norms after its attention and MLP but
runs each norm first. Packed in registration order, a chunk's gradients arrived out of
order in backward (up to three half-filled gradient chunks at once), and their
evictions moved 1.44x the plan's bytes to the device and 1.89x back at a quarter of
the parameters (8 layers). The references: a real forward's module order recorded
with hooks, and the bytes the engine's copies moved against the plan's estimate.
"""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch

import infinity
from infinity.activations.forward_trace import forward_order
from infinity.core.names import Phase
from infinity.offload import engine_of
from infinity.optim import CPUAdam

transformers = pytest.importorskip("transformers")


def _llama(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_forward_order_is_the_order_a_real_forward_calls_the_modules() -> None:
    model = _llama(2)
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    names = {id(m): n for n, m in model.named_modules()}
    called: dict[str, None] = {}
    handles = [
        m.register_forward_pre_hook(lambda m, a: called.setdefault(names[id(m)])) for m in owners
    ]
    model(input_ids=torch.zeros((1, 8), dtype=torch.long))
    for handle in handles:
        handle.remove()
    order = forward_order(model)
    assert order == list(called)
    assert order.index("model.layers.0.input_layernorm") < order.index(
        "model.layers.0.self_attn.q_proj"
    )


def test_a_model_forward_order_cannot_run_keeps_registration_order() -> None:
    # an embedding, but a forward that fails on token ids (the shapes do not chain)
    broken = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(3, 3))
    assert forward_order(broken) is None
    # no embedding: takes no token ids, not run at all
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    assert forward_order(model) is None
    offloaded = infinity.offload(model, infinity.Config(device="cpu", dtype="fp32"))
    names = [e.name for e in engine_of(offloaded).registry.entries]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_gradients_arrive_chunk_after_chunk_and_the_bytes_are_the_plans() -> None:
    model = _llama(8)
    params = sum(p.numel() for p in model.parameters())
    model = infinity.offload(
        model, infinity.Config(device="cpu", dtype="bf16", device_memory=params * 2 // 4)
    )
    opt = CPUAdam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    laps = []
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        laps.append(infinity.stats(model)["last_step"])
    engine = engine_of(model)
    grads = [chunk for phase, chunk in engine.trace.trace.accesses if phase == Phase.GRAD]
    # each chunk's gradients together: once a chunk is left, it is not seen again
    left = [a for a, b in itertools.pairwise(grads) if a != b]
    assert len(left) == len(set(left)), grads
    plan = engine.plan.traffic
    h2d = statistics.median(lap["h2d_bytes"] for lap in laps[2:])
    d2h = statistics.median(lap["d2h_bytes"] for lap in laps[2:])
    assert h2d <= 1.05 * plan["h2d_bytes"], (h2d, plan["h2d_bytes"])
    assert d2h <= 1.05 * plan["d2h_bytes"], (d2h, plan["d2h_bytes"])
