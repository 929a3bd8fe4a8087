"""Plans for models whose largest tensor dwarfs a chunk: host staging stays chunk-sized.

The shapes of the issue that reported ``staging buffers alone need 288 MiB``:
a 16-layer ``transformers`` Llama (hidden 768, tied 16384 x 768 embedding) on
128 MiB of device and 256 MiB of host, and GPT-2 124M (tied 50257 x 768) on
512 MiB / 768 MiB. Built on the ``meta`` device: nothing is allocated.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import llama_113m_config

import infinity
from infinity.core.names import NVME
from infinity.runtime.budgets import plan_for
from infinity.runtime.params import ParamRegistry
from infinity.schedule.planner import PlanError

transformers = pytest.importorskip("transformers")
MiB = 1 << 20


def _llama(vocab: int = 16384):
    cfg = llama_113m_config(vocab)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def _plan(model, tmp_path, **budgets):
    config = infinity.Config(device="cpu", dtype="fp32", nvme_path=str(tmp_path), **budgets)
    return plan_for(ParamRegistry.from_model(model), config, torch.device("cpu"))


def _check_bounded(plan) -> None:
    """Every staging slot is at most a normal chunk (an optimizer unit: its two fp32
    parts), and all staging together a small multiple of the chunk size: at most
    6 parameter, 4 gradient and 3 optimizer-unit slots (fp32: 2 parts each)."""
    chunk = plan.layout.chunk_bytes
    largest = max(c.capacity for c in plan.layout.chunks) * plan.element_size
    assert largest > 2 * chunk  # the shape problem: an oversize embedding
    for kind, pool in plan.host_staging.items():
        assert max(pool) <= (2 if kind == "optim" else 1) * chunk, (kind, pool)
    assert plan.staging_bytes <= 16 * chunk


def test_113m_llama_plans_on_256mib_of_host(tmp_path):
    model = _llama()
    plan = _plan(model, tmp_path, device_memory="128MiB", host_memory="256MiB")
    states = 16 * sum(p.numel() for p in model.parameters())
    assert states > plan.budgets.host + plan.budgets.device
    assert plan.host_bytes <= 256 * MiB
    assert NVME in plan.optim_home
    _check_bounded(plan)
    text = plan.describe()
    assert "must be whole on the device" in text
    assert f"host minimum {infinity.utils.sizes.format_size(plan.min_host_bytes)}" in text
    assert plan.min_host_bytes <= 256 * MiB


def test_gpt2_plans_on_768mib_of_host(tmp_path):
    plan = _plan(_gpt2(), tmp_path, device_memory="512MiB", host_memory="768MiB")
    assert plan.host_bytes <= 768 * MiB
    _check_bounded(plan)


def test_host_minimum_does_not_grow_with_the_largest_tensor(tmp_path):
    """Four times the vocabulary: the device minimum grows (the embedding is whole
    there), the host minimum does not."""
    small, large = (
        _plan(
            _llama(vocab), tmp_path, device_memory="1GiB", host_memory="256MiB", chunk_size="8MiB"
        )
        for vocab in (16384, 65536)
    )
    assert large.min_device_bytes > small.min_device_bytes
    assert large.min_host_bytes == small.min_host_bytes
    assert large.host_staging == small.host_staging


def test_tight_host_budget_gets_smaller_chunks(tmp_path):
    roomy = _plan(_llama(), tmp_path, device_memory="128MiB", host_memory="256MiB")
    tight = _plan(_llama(), tmp_path, device_memory="128MiB", host_memory="48MiB")
    assert tight.layout.chunk_bytes < roomy.layout.chunk_bytes
    assert tight.host_bytes <= 48 * MiB


def test_too_small_device_names_the_largest_tensor(tmp_path):
    with pytest.raises(PlanError, match=r"largest tensor's chunk, 48\.00 MiB, must be whole"):
        _plan(_llama(), tmp_path, device_memory="64MiB", host_memory="256MiB", chunk_size="8MiB")


def test_more_host_never_means_more_disk_bytes(tmp_path):
    """GPT-2's 147 MiB embedding staged whole fits from ~900 MiB of host, but its
    slots then crowd every state out to NVMe: spans (or whole slots only where
    they cost nothing) keep the estimated disk bytes falling as the host grows."""
    model = _gpt2()
    disk = []
    for host in ("768MiB", "900MiB", "1GiB", "1536MiB"):
        plan = _plan(model, tmp_path, device_memory="512MiB", host_memory=host)
        disk.append(plan.traffic["nvme_read_bytes"] + plan.traffic["nvme_write_bytes"])
    assert disk == sorted(disk, reverse=True), disk
    assert disk[-1] < disk[0]
