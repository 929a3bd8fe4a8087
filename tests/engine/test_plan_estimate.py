"""The plan's per-step traffic estimate against the bytes a training run moves.

``infinity plan`` promises the bytes each link moves per step before anything
is built; here the same configurations are trained and the manager's counters
of the last step are compared with the estimate.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from engine_helpers import batches, config, param_bytes, tiny_gpt, tiny_llama, train

import infinity
from infinity.offload import engine_of
from infinity.optim import CPUAdam
from infinity.schedule.planner import NVME

STEPS = 4


def _run(tmp_path, *, host_factor: float | None, overlap: bool) -> tuple[dict, dict, int]:
    """Train a tiny GPT; the plan's estimate, the traffic of the last steps
    (mean per step), and the number of parameter chunks homed on NVMe."""
    model = tiny_gpt(hidden=64)
    pbytes = param_bytes(model, 4)
    cfg = {"device_memory": pbytes // 2, "chunk_size": "32KiB", "overlap_optimizer": overlap}
    if host_factor is not None:
        cfg.update(host_memory=int(pbytes * host_factor), nvme_path=str(tmp_path))
    model = infinity.offload(model, config(**cfg))
    laps: list[dict] = []

    def record_lap(step: int) -> None:
        if step > 0:
            laps.append(infinity.stats(model)["last_step"])

    train(model, CPUAdam(model.parameters(), lr=1e-3), batches(STEPS), before_step=record_lap)
    engine = engine_of(model)
    engine.synchronize()
    laps.append(infinity.stats(model)["last_step"])
    # NOTE: the median of the last steps, not the last one: whether the next
    # forward's first chunks are prefetched (or a staging copy is still cached)
    # before a step's interval closes depends on timing. A loaded CI machine
    # moved five chunks out of the last interval (overlapped step), and once
    # read 17 chunks more over three intervals (their mean 1.14x the estimate).
    # The median of three leaves one such interval out.
    window = laps[-3:]
    measured = {key: statistics.median(lap[key] for lap in window) for key in window[0]}
    estimate = engine.plan.traffic
    spilled = engine.plan.param_home.count(NVME)
    engine.close()
    return estimate, measured, spilled


@pytest.mark.parametrize("overlap", [False, True])
def test_device_traffic_estimate_matches_a_run_in_host_memory(tmp_path, overlap):
    # Half the parameters fit on the device: backward fetches again only what
    # forward pushed out (before the estimate said every chunk twice).
    estimate, measured, _ = _run(tmp_path, host_factor=None, overlap=overlap)
    assert measured["d2h_bytes"] == estimate["d2h_bytes"]
    assert measured["h2d_bytes"] == pytest.approx(estimate["h2d_bytes"], rel=0.1)


@pytest.mark.parametrize("overlap", [False, True])
def test_nvme_traffic_estimate_is_close_to_a_run_beyond_host_memory(tmp_path, overlap):
    estimate, measured, spilled = _run(tmp_path, host_factor=1.0, overlap=overlap)
    assert spilled > 0
    assert measured["nvme_write_bytes"] == pytest.approx(estimate["nvme_write_bytes"], rel=0.1)
    # Parameters spill too (as in bench case d), so the step reads some of
    # them back. Reads served by a cached host staging copy are not modelled:
    # the estimate may run high by a fair margin, low only by a little.
    reads, guess = measured["nvme_read_bytes"], estimate["nvme_read_bytes"]
    assert guess / 1.35 <= reads <= guess * 1.1, (reads, guess)
    assert measured["h2d_bytes"] == pytest.approx(estimate["h2d_bytes"], rel=0.1)


def test_backward_fetches_no_chunk_twice_when_the_device_has_few_slots():
    """A Llama's layout (large embedding and head chunks, many small layer chunks) on
    a device of four slots: each step fetches a chunk at most once per pass.

    Before NOTE [prefetch within the slots], backward's prefetches filled the slots
    beside the chunk in use, each gradient's first arrival pushed the farthest of
    them out, and it was fetched a third time (1.19x the plan's bytes here).
    """
    vocab, hidden = 4000, 128
    model = tiny_llama(vocab=vocab, hidden=hidden, intermediate=352, layers=12)
    pbytes = param_bytes(model, 2)
    device = max(pbytes // 4, 3 * vocab * hidden * 2)
    model = infinity.offload(model, config(dtype="bf16", device_memory=device))
    engine = engine_of(model)
    opt = CPUAdam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(4):
            ids = torch.randint(0, vocab, (2, 32), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        h2d = infinity.stats(model)["last_step"]["h2d_bytes"]
        assert h2d <= 2 * pbytes, (h2d, pbytes)
        assert h2d <= engine.plan.traffic["h2d_bytes"] * 1.05, (h2d, engine.plan.traffic)
    finally:
        engine.close()
