"""The safetensors loader's read buffer is counted beside the host budget (issue 41).

The reference is ``tracemalloc``, which sees the buffer's allocation independently of
the engine's count: the loader's Python-side peak is its one block, which the memory
report shows as ``pretrained_read_block``, freed once the load ends.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch

import infinity
from infinity.utils.process_memory import PRETRAINED_READS

transformers = pytest.importorskip("transformers")


def test_the_read_block_is_the_loaders_memory_and_its_line_says_so(tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with infinity.init_empty():
        model = transformers.LlamaForCausalLM(config)
    model = infinity.offload(model, infinity.Config(device="cpu", dtype="fp32"), init="load")
    tracemalloc.start()
    try:
        infinity.load_pretrained(model, tmp_path)
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    line = infinity.stats(model)["memory"]["host"]["pretrained_read_block"]
    assert line["peak"] == line["limit"] == PRETRAINED_READS.limit
    # what Python allocated while loading is the block, and little beside it
    assert line["peak"] <= traced_peak <= line["peak"] + (1 << 20)
    assert PRETRAINED_READS.live == 0  # freed with the reader
