"""The step's bound in ``infinity.stats(model)["last_step"]`` (runtime/stepping.py).

Each part is checked against a clock or a delay the test controls: copies made slow
by the backend's injected delay are waits, not compute; the host optimizer's seconds
sit inside the wall time of ``optimizer.step()`` measured here; the NVMe seconds are
the step's bytes at the rates this process measured for the folder's disk.
"""

from __future__ import annotations

import time

from engine_helpers import batches, config, param_bytes, tiny_gpt, train

import infinity
from infinity.config import AioConfig
from infinity.io.rates import GB, disk_rates
from infinity.offload import engine_of
from infinity.optim import CPUAdam


def _lap(model) -> dict:
    """The last step's lap, with what bounded it."""
    stats = infinity.stats(model)
    return {**stats["last_step"], "bound_by": stats["last_step_bound_by"]}


def _laps(model, steps: int = 4, timed: list[float] | None = None) -> list[dict]:
    """The laps of every step after the first (which records the trace), in order."""
    laps: list[dict] = []
    opt = CPUAdam(model.parameters(), lr=1e-3)
    real_step = opt.step

    def step(*args, **kwargs):
        start = time.perf_counter()
        out = real_step(*args, **kwargs)
        if timed is not None:
            timed.append(time.perf_counter() - start)
        return out

    opt.step = step  # type: ignore[method-assign]

    def record(index: int) -> None:
        if index > 1:
            laps.append(_lap(model))

    train(model, opt, batches(steps), before_step=record)
    laps.append(_lap(model))
    return laps


def _offloaded(tmp_path=None, copy_delay: float = 0.0, **kw):
    model = tiny_gpt(hidden=64)
    pbytes = param_bytes(model, 4)
    if tmp_path is not None:
        kw |= {"host_memory": pbytes, "nvme_path": str(tmp_path)}
    model = infinity.offload(
        model,
        config(device_memory=pbytes // 2, chunk_size="32KiB", prefetch_depth=0, **kw),
    )
    engine_of(model).backend.copy_delay_s = copy_delay
    return model


def test_the_bound_is_the_slowest_part_and_the_step_is_measured_against_it(tmp_path):
    for lap in _laps(_offloaded(tmp_path)):
        # The CPU backend computes on the host's cores: compute and updates add up.
        parts = {
            "host to device": lap["h2d_seconds"],
            "device to host": lap["d2h_seconds"],
            "host compute and optimizer": lap["device_compute_seconds"]
            + lap["host_optimizer_seconds"],
            "nvme": lap["nvme_seconds"],
        }
        assert lap["bound_by"] == max(parts, key=lambda k: parts[k])
        assert abs(lap["bound_seconds"] - max(parts.values())) < 1e-9
        assert abs(lap["step_over_bound"] - lap["seconds"] / lap["bound_seconds"]) < 1e-9
        # The compute is measured inside the step's interval, its waits left out.
        waits = lap["wait_device_seconds"] + lap["wait_nvme_seconds"]
        assert 0 < lap["device_compute_seconds"] <= lap["seconds"] - waits + 1e-3


def test_slow_copies_are_waits_not_compute():
    """Each copy made 5 ms slower (no prefetch, so every one is waited for): the
    step grows by the waits, the compute does not."""
    fast = _laps(_offloaded())
    slow = _laps(_offloaded(copy_delay=0.005))
    added = min(
        s["wait_device_seconds"] - f["wait_device_seconds"] for f, s in zip(fast, slow, strict=True)
    )
    assert added > 0.1  # the delay was waited for
    for f, s in zip(fast, slow, strict=True):
        assert s["seconds"] > f["seconds"] + 0.8 * added
    # Counted as compute, the waits would add all of ``added`` to every step. NOTE: the
    # least of the steps: a loaded machine slows the longer run's compute too.
    compute = max(f["device_compute_seconds"] for f in fast)
    assert min(s["device_compute_seconds"] for s in slow) < compute + 0.5 * added


def test_host_optimizer_seconds_are_inside_the_optimizer_step():
    """Host-homed chunks update inside ``optimizer.step()`` on the CPU: the seconds
    counted are within its wall time, and most of it for a model of large tensors."""
    model = tiny_gpt(hidden=256, layers=2)
    model = infinity.offload(model, config(device_memory=param_bytes(model, 4)))
    timed: list[float] = []
    laps = _laps(model, timed=timed)
    ratios = []
    for lap, step_wall in zip(laps, timed[1:], strict=True):
        assert 0 < lap["host_optimizer_seconds"] <= step_wall
        ratios.append(lap["host_optimizer_seconds"] / step_wall)
    assert max(ratios) > 0.2, ratios  # most of a step, at least once


def test_nvme_seconds_are_the_bytes_at_the_disks_rates(tmp_path):
    laps = _laps(_offloaded(tmp_path))
    rates = disk_rates(str(tmp_path), AioConfig())  # this process's measurement of the disk
    assert rates is not None
    for lap in laps:
        assert lap["nvme_read_bytes"] > 0 and lap["nvme_write_bytes"] > 0
        read = lap["nvme_read_bytes"] / (rates.read_gbps * GB)
        write = lap["nvme_write_bytes"] / (rates.write_gbps * GB)
        assert abs(lap["nvme_read_seconds"] - read) < 1e-9
        assert abs(lap["nvme_write_seconds"] - write) < 1e-9
        # both at once at best, one after the other at worst, never above the busy time
        at_rates = lap["nvme_seconds"] if lap["nvme_seconds"] < lap["nvme_busy_seconds"] else None
        if at_rates is not None:
            assert max(read, write) * 0.999 <= at_rates <= (read + write) * 1.001
        assert lap["nvme_seconds"] <= lap["nvme_busy_seconds"]


def test_no_nvme_no_nvme_seconds():
    for lap in _laps(_offloaded()):
        assert "nvme_seconds" not in lap
        assert lap["bound_by"] != "nvme"


def test_an_unpacks_host_work_is_the_hooks_not_compute(monkeypatch):
    """Each unpack of a saved tensor made 2 ms slower: the hooks' seconds grow by the
    delay (NOTE [the step's bound]: the device may idle through it), compute does not."""
    from infinity.runtime.engine import OffloadEngine

    fast = _laps(_offloaded())
    real_unpack = OffloadEngine.unpack
    calls = [0]

    def slow_unpack(self, packed):
        calls[0] += 1
        time.sleep(0.002)
        return real_unpack(self, packed)

    monkeypatch.setattr(OffloadEngine, "unpack", slow_unpack)
    slow = _laps(_offloaded())
    per_step = calls[0] / 4 * 0.002  # four backward passes, one lap each after the first
    assert per_step > 0.02, calls  # the delay is large against the step
    for f, s in zip(fast, slow, strict=True):
        assert s["hook_seconds"] > f["hook_seconds"] + 0.8 * per_step
    compute = max(f["device_compute_seconds"] for f in fast)
    assert min(s["device_compute_seconds"] for s in slow) < compute + 0.5 * per_step
