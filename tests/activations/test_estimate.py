"""The activation estimate (fake tensors, no compute) against the bytes a real step saves.

The reference is the engine's own count of what it moved in a real
``activations="offload"`` step with every saved tensor offloaded
(``activation_min_bytes=0``): the sum of the tensors' sizes at pack time.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from activation_helpers import BATCH, SEQ, VOCAB, activation_config, tiny_model

import infinity
from infinity.activations.estimate import estimate

pytest.importorskip("transformers")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_estimate_equals_what_a_real_step_saves(kind: str, dtype: str) -> None:
    model = tiny_model(kind)
    est = estimate(model, BATCH, SEQ, DTYPES[dtype])
    assert len(est.per_block) == 3 and all(b > 0 for b in est.per_block)
    assert est.checkpoint < est.total
    model = infinity.offload(model, activation_config(model, dtype, "offload", None))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    assert infinity.stats(model)["activations"]["packed_bytes"] == est.total


def test_attention_is_estimated_with_the_device_kernel_not_the_quadratic_one() -> None:
    """At 8x the tokens a flash-attention model saves ~8x the bytes (not ~64x)."""
    model = tiny_model("llama")
    short = estimate(model, 1, 64, torch.float32).total
    long = estimate(model, 1, 512, torch.float32).total
    assert long < 9 * short


def test_plan_prints_activations_and_what_fits(tmp_path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
                "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 4096,
            }
        )
    )  # fmt: skip
    cmd = [
        sys.executable, "-m", "infinity", "plan", "--model", str(cfg), "--device-memory",
        "64MiB", "--host-memory", "256MiB", "--seq-len", "2048", "--batch-size", "2", "--json",
    ]  # fmt: skip
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    act = out["activations"]
    assert act["batch_size"] == 2 and act["seq_len"] == 2048
    dev = act["device_bytes"]
    assert dev["offload"] < dev["checkpoint"] < dev["keep"] == act["saved_bytes"]
    fits = act["tokens_that_fit"]
    assert fits["keep"] < fits["checkpoint"]
    assert sum(act["auto"].values()) == act["blocks"] == 4
