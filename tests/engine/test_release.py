"""The last reference to an offloaded model frees it at once: NOTE [the model owns its engine].

Each test switches the garbage collector off before it offloads: CPython then frees by
reference counts alone, so any reference cycle between the model, its hooks, the engine
and the engine's chunk memory keeps them all alive. With the collector on they would go
at its next full pass, which in a long training process (many objects, few new ones) can
be long after a notebook cell replaced the model: two models' states in memory at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch._dynamo
import transformers

import infinity
from infinity.models.gpt import GPT, GPTConfig
from infinity.offload import engine_of
from infinity.optim import CPUAdam


def engine_threads() -> list[str]:
    """This process's native threads that belong to an engine (``inf-copy``, ``inf-io``;
    not the one process-wide kernel pool, ``inf-compute``)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # the thread ended while we listed
            names.append(comm.read_text().strip())
    return sorted(n for n in names if n.startswith("inf-") and n != "inf-compute")


@contextlib.contextmanager
def no_collector() -> Iterator[None]:
    """The garbage collector off (a cycle is never freed while it is)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _gpt() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    # The root owns a parameter (wpe), and the head is tied to the embedding.
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, layers=3, hidden=64, heads=4))
    ids = torch.randint(0, 256, (2, 32))

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())

    return model, loss


def _llama(checkpointing: bool = False) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 16))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


# (model, Config overrides, clip, host updates deferred to the update worker)
CASES: dict[str, tuple[Callable[[], Any], dict[str, Any], bool, bool]] = {
    "gpt-nvme-clip": (_gpt, {}, True, False),
    "llama-offload-activations": (_llama, {"activations": "offload"}, True, False),
    "llama-checkpoint-blocks": (_llama, {"activations": "checkpoint"}, True, False),
    "llama-transformers-checkpointing": (lambda: _llama(True), {}, True, False),
    "llama-overlap": (_llama, {"overlap_optimizer": True}, False, False),
    "gpt-worker-updates": (_gpt, {"host_memory": 500_000}, True, True),
    "gpt-spans": (_gpt, {"chunk_size": "16KiB", "host_memory": 400_000}, True, False),
    "llama-fp16": (_llama, {"dtype": "fp16"}, True, False),
    "llama-int8-states": (_llama, {"dtype": "bf16", "optimizer_state_dtype": "int8"}, True, False),
}


def _trained(tmp_path, case: str) -> tuple[torch.nn.Module, CPUAdam]:
    build, overrides, clip, worker = CASES[case]
    torch.manual_seed(0)
    model, loss_of = build()
    settings = dict(
        device="cpu", dtype="fp32", device_memory=600_000, host_memory=2_000_000,
        nvme_path=str(tmp_path),
    )  # fmt: skip
    model = infinity.offload(model, infinity.Config(**{**settings, **overrides}))
    optimizer = CPUAdam(model.parameters(), lr=1e-3)
    if worker:  # a GPU backend's defaults: NOTE [host updates on a worker]
        queue = engine_of(model).queue
        queue.defer_host = queue.on_worker = True
    for _ in range(2):
        optimizer.scale_loss(loss_of(model)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    model.state_dict()
    return model, optimizer


@pytest.mark.parametrize("case", list(CASES))
def test_the_last_reference_frees_model_engine_and_swap_file_without_a_collection(tmp_path, case):
    before = engine_threads()
    with no_collector():
        model, optimizer = _trained(tmp_path, case)
        assert len(engine_threads()) > len(before)
        engine = weakref.ref(engine_of(model))
        dropped = weakref.ref(model)
        assert os.listdir(tmp_path), "the case should use the NVMe tier"
        del model, optimizer
        assert dropped() is None, "a reference cycle keeps the model"
        assert engine() is None, "a reference cycle keeps the engine"
        assert os.listdir(tmp_path) == [], "the swap file outlived the model"
        assert engine_threads() == before, "the engine's threads outlived the model"


def test_host_memory_returns_when_the_model_is_dropped():
    """The process's resident set (the kernel's count, not the engine's) falls by most of
    the model's states as soon as the model is dropped."""
    process = psutil.Process()
    with no_collector():
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
        states = sum(p.numel() for p in model.parameters()) * 16  # fp32 params, grads, Adam
        model = infinity.offload(
            model, infinity.Config(device="cpu", dtype="fp32", device_memory="16MiB")
        )
        optimizer = CPUAdam(model.parameters(), lr=1e-3)
        model(torch.randn(2, 1024)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        held = process.memory_info().rss
        del model, optimizer
        freed = held - process.memory_info().rss
    assert freed > 0.6 * states, f"{freed >> 20} MiB freed of {states >> 20} MiB of states"


def test_a_module_or_optimizer_kept_after_the_model_is_dropped_says_what_to_keep(tmp_path):
    with no_collector():
        model, optimizer = _trained(tmp_path, "gpt-nvme-clip")
        block = model.blocks[0]
        del model
        with pytest.raises(ReferenceError, match="Keep a reference to the model"):
            block(torch.randn(2, 32, 64))
        with pytest.raises(ReferenceError, match="Keep a reference to the model"):
            block.state_dict()
        with pytest.raises(ReferenceError, match="for as long as its optimizer is used"):
            optimizer.step()
    assert os.listdir(tmp_path) == []


def test_a_graph_kept_after_its_model_is_dropped_keeps_neither_model_nor_engine(tmp_path):
    # Autograd keeps the engine's saved-tensor hooks in every saved tensor of a graph (in
    # C++, out of the collector's sight); torch's fake tensors keep a graph of their own
    # in cycles, so a shape estimate's graph outlived its model (sweep seed 5804).
    with no_collector():
        model, optimizer = _trained(tmp_path, "gpt-nvme-clip")
        ids = torch.randint(0, 256, (2, 32))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        engine = weakref.ref(engine_of(model))
        dropped = weakref.ref(model)
        del model, optimizer
        assert dropped() is None and engine() is None, "the graph keeps them"
        with pytest.raises(ReferenceError, match="Keep a reference to the model"):
            loss.backward()
