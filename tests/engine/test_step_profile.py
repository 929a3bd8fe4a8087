"""The step-time instruments of ``infinity bench train --gpt2`` (infinity.bench.step_profile)."""

from __future__ import annotations

import time

from engine_helpers import batches, gpt_loss, nvme_pair

from infinity.bench.step_profile import EngineProfile, cpu_delta, thread_cpu
from infinity.runtime.engine import OffloadEngine


def test_thread_cpu_sees_the_main_thread_and_the_engines_named_threads(tmp_path):
    _model, _opt, _ref, _ref_opt = nvme_pair(tmp_path)  # kept alive: its threads are measured
    before = thread_cpu()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn CPU on the main thread
        pass
    delta = cpu_delta(before, thread_cpu())
    assert delta["main"] > 0.1  # 0.3 s of CPU in 10 ms ticks, other threads excluded
    # The engine's native threads are told apart by their names (pthread_setname_np).
    assert {"inf-copy", "inf-io"} <= set(delta)
    assert all(v >= 0 for v in delta.values())


def test_engine_profile_times_exclusive_categories_within_the_wall_time(tmp_path):
    original = OffloadEngine.__dict__["begin_module"]
    profile = EngineProfile()
    profile.install()
    try:
        assert OffloadEngine.__dict__["begin_module"] is not original
        model, opt, _ref, _ref_opt = nvme_pair(tmp_path, host_factor=1.0)
        data = batches(2)
        gpt_loss(model, data[0]).backward()
        opt.step()
        opt.zero_grad()
        profile.take()
        start = time.perf_counter()
        gpt_loss(model, data[1]).backward()
        opt.step()
        opt.zero_grad()
        wall = time.perf_counter() - start
        seconds = profile.take()
    finally:
        profile.uninstall()
    assert OffloadEngine.__dict__["begin_module"] is original  # patches undone
    assert seconds["hooks"] > 0 and seconds["adam kernel"] > 0
    # Exclusive times of one thread never add up to more than the wall time.
    assert sum(seconds.values()) <= wall
    assert profile.take() == {}
