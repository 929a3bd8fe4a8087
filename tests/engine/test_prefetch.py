"""Prefetching, Belady eviction and the pipelined optimizer change timing, never numbers."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import batches, config, param_bytes, reference_pair, tiny_gpt, train

import infinity
from infinity.chunks.homes import Kind
from infinity.offload import engine_of
from infinity.optim import CPUAdam


def _run(tmp_path, *, depth, dtype="bf16", nvme=True, delay_us=0, copy_delay=0.0, steps=5):
    model = tiny_gpt(seed=0)
    pbytes = param_bytes(model, 2)
    kw = {"host_memory": pbytes * 3, "nvme_path": str(tmp_path)} if nvme else {}
    model = infinity.offload(
        model,
        config(
            dtype=dtype,
            device_memory=pbytes * 6 // 10,
            chunk_size="8KiB",
            prefetch_depth=depth,
            **kw,
        ),
    )
    engine = engine_of(model)
    if delay_us:
        engine.swap.engine.inject_delay(delay_us)
    engine.backend.copy_delay_s = copy_delay
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = train(model, opt, batches(steps, seed=4))
    return losses, model.state_dict(), infinity.stats(model)


@pytest.mark.parametrize("nvme", [False, True])
def test_prefetch_and_pipeline_are_bitwise_equal_to_synchronous(tmp_path, nvme):
    sync_losses, sync_state, _ = _run(tmp_path, depth=0, nvme=nvme)
    losses, state, stats = _run(tmp_path, depth=3, nvme=nvme)
    assert losses == sync_losses
    for k, v in sync_state.items():
        assert torch.equal(state[k], v), k
    if nvme:
        assert stats["nvme_read_bytes"] > 0


def test_slow_disk_and_slow_copies_change_timing_only(tmp_path):
    fast_losses, fast_state, fast = _run(tmp_path, depth=2, steps=3)
    slow_losses, slow_state, slow = _run(
        tmp_path, depth=2, steps=3, delay_us=3000, copy_delay=0.002
    )
    assert slow_losses == fast_losses
    for k, v in fast_state.items():
        assert torch.equal(slow_state[k], v), k
    waited = slow["wait_nvme_seconds"] + slow["wait_device_seconds"]
    assert waited > fast["wait_nvme_seconds"] + fast["wait_device_seconds"]


class Shuffled(torch.nn.Module):
    """Layers applied in a different random order each step: no trace holds for long."""

    def __init__(self, n=12, width=48):
        super().__init__()
        torch.manual_seed(7)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))
        self.order = list(range(n))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


def _occupied(cache):
    return sum(c.slot.nbytes for c in cache)


def test_eviction_stress_random_orders_tiny_budget(tmp_path):
    model = Shuffled()
    ref, ref_opt = reference_pair(model)
    budget = 3 * 12 * 1024  # three 12 KiB slots: one layer + its gradient + one spare
    model = infinity.offload(
        model, config(device_memory=budget, chunk_size="12KiB", prefetch_depth=2)
    )
    engine = engine_of(model)
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(1)
    for step in range(25):
        order = list(range(12))
        if step % 3:  # sometimes repeat the previous order so the trace (and prefetch) is used
            rng.shuffle(order)
        model.order = ref.order = order
        x = torch.randn(8, 48, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        manager = engine.manager
        assert manager.device_account.used == _occupied(manager.device)
        assert manager.device_account.peak <= budget
        assert not any(c.pins for c in manager.device)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    assert engine.trace.retraces > 0


def test_belady_is_used_once_a_trace_exists(tmp_path):
    model = infinity.offload(
        tiny_gpt(),
        config(device_memory=param_bytes(tiny_gpt(), 4) // 2, chunk_size="8KiB", prefetch_depth=2),
    )
    opt = CPUAdam(model.parameters(), lr=1e-3)
    engine = engine_of(model)
    train(model, opt, batches(3))
    assert engine.trace.trace is not None and engine.trace.retraces == 0
    assert engine.policy.active  # following the trace
    resident = {c.key for c in engine.manager.device}
    assert any(key[0] is Kind.PARAM for key in resident)  # the next forward was prefetched


def _overlap_run(tmp_path, overlap, *, clip=False, accumulate=False):
    model = tiny_gpt(seed=0)
    pbytes = param_bytes(model, 2)
    model = infinity.offload(
        model,
        config(
            dtype="bf16",
            device_memory=pbytes * 6 // 10,
            host_memory=pbytes * 3,
            nvme_path=str(tmp_path),
            chunk_size="8KiB",
            overlap_optimizer=overlap,
        ),
    )
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    before = (lambda _s: opt.clip_grad_norm_(1.0)) if clip else None
    losses = train(model, opt, batches(4, seed=4), accum=2 if accumulate else 1, before_step=before)
    return losses, model.state_dict(), engine_of(model)


def test_overlapped_optimizer_step_is_bitwise_equal(tmp_path):
    plain_losses, plain_state, _ = _overlap_run(tmp_path, False)
    losses, state, engine = _overlap_run(tmp_path, True)
    assert losses == plain_losses
    for k, v in plain_state.items():
        assert torch.equal(state[k], v), k
    assert engine.pipeline.step_count == 4
    assert engine.queue.early_chunk_steps > 4  # chunks were really stepped during backward


def test_overlap_refuses_clipping_and_accumulation(tmp_path):
    with pytest.raises(RuntimeError, match="clip_grad_norm_ after a backward"):
        _overlap_run(tmp_path, True, clip=True)
    with pytest.raises(RuntimeError, match="second backward before optimizer.step"):
        _overlap_run(tmp_path, True, accumulate=True)
    with pytest.raises(infinity.ConfigError, match="fp16"):
        infinity.Config(dtype="fp16", overlap_optimizer=True)


def test_evaluation_passes_leave_the_training_trace_alone():
    model = infinity.offload(
        tiny_gpt(),
        config(device_memory=param_bytes(tiny_gpt(), 4) // 2, chunk_size="8KiB", prefetch_depth=2),
    )
    opt = CPUAdam(model.parameters(), lr=1e-3)
    engine = engine_of(model)
    data = batches(4)
    train(model, opt, data[:2])
    trace = engine.trace.trace
    with torch.no_grad():
        model(*data[2])
        model(*data[3])
    train(model, opt, data[2:])
    assert engine.trace.trace is trace and engine.trace.retraces == 0
    assert {"forward", "backward", "grad", "optimizer"} <= set(infinity.timeline(model)["phase"])


def test_a_view_kept_across_the_step_keeps_its_slot_and_old_values():
    model = infinity.offload(tiny_gpt(), config(device_memory="1MiB", chunk_size="8KiB"))
    opt = CPUAdam(model.parameters(), lr=1e-2)
    engine = engine_of(model)
    x, y = batches(1)[0]
    model(x, y).backward()
    held = engine.manager.param_alias(0)  # e.g. a user kept a weight view from forward
    before = held.clone()
    opt.step()
    assert torch.equal(held, before)  # the stale copy was retired, not overwritten
    fresh = engine.manager.param_alias(0)
    assert not torch.equal(fresh, before)  # the next use sees the update
    retired = [c for c in engine.manager.device if c.key[0] == "retired"]
    assert retired
    del held, fresh
    model(x, y)  # needs slots again: the retired one is freed once unused
    assert engine.manager.device_account.used <= engine.plan.device_reserved_bytes
